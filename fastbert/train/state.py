"""What a checkpoint holds, how it is written without stalling the loop, and resuming from it.

    step_N/run.json     the step and the run's fingerprint (fingerprint.py), read first on resume
    step_N/trainer.pt   loss scaler, RNG states of every rank, data position, counters, the metrics line
                        in progress, the options; and the optimizer's state, unless sharded/ holds it
    step_N/model/       the weights in HF format (from_pretrained and transformers load it); under FSDP2
                        only in the last checkpoint of a run
    step_N/sharded/     under FSDP2: model and optimizer as torch.distributed.checkpoint writes them, one
                        file per rank, loadable on any number of ranks or in one process

Saving costs the loop the copy of the state to host memory (pinned buffers reused from save to save
on a GPU; DCP's staging under FSDP2); the files are written by a background thread (DCP's async_save
under FSDP2), one checkpoint at a time, and committed by checkpoint.save_checkpoint (fsync, rename,
retention). Resuming builds the model on the meta device (no random initialisation to overwrite),
loads the weights and optimizer, and rebuilds the LR schedule from the options at the resume step.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fastbert.data.examples import MLM_NSP
from fastbert.hf import choose_layer_norm_backward
from fastbert.train import checkpoint, distributed
from fastbert.train.checkpoint import MODEL_DIR, RUN_FILE
from fastbert.train.optim import param_group_names
from fastbert.train.run import Run, checkpoint_objective

# the weights BertForPreTraining has and the masked-LM model has not: what a resume across objectives
# (--accept-changes) drops from an mlm+nsp checkpoint, or initialises anew from an mlm one
NSP_ONLY_PREFIXES = ("bert.pooler.", "cls.seq_relationship.")

TRAINER_FILE = "trainer.pt"
SHARDED_DIR = "sharded"


@dataclass
class Progress:
    """Where the run is: what the loop advances and a checkpoint records."""
    step: int = 0  # optimizer steps done
    position: int = 0  # examples of the current phase's stream consumed
    skipped: int = 0  # steps whose update was skipped (non-finite, or fp16 overflow)
    bad_in_row: int = 0  # consecutive steps with a non-finite loss or gradient, up to now
    window: dict = dataclasses.field(default_factory=dict)  # the metrics line in progress (metrics.Window.carry)


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class HostCopy:
    """Host buffers mirroring device tensors, reused from save to save (pinned for a GPU's tensors, so the
    copies are queued at once and waited for together)."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []

    def __call__(self, tree):
        """tree (nested dicts / lists of tensors and other values) with every tensor copied to the host."""
        leaves, spec = tree_flatten(tree)
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if len(self.buffers) != len(tensors) or any(
                b.shape != leaves[i].shape or b.dtype != leaves[i].dtype for b, i in zip(self.buffers, tensors)):
            self.buffers = [torch.empty(leaves[i].shape, dtype=leaves[i].dtype, pin_memory=leaves[i].is_cuda)
                            for i in tensors]
        for buffer, i in zip(self.buffers, tensors):
            buffer.copy_(leaves[i].detach(), non_blocking=True)
            leaves[i] = buffer
        if any(b.is_pinned() for b in self.buffers):
            torch.cuda.current_stream().synchronize()
        return tree_unflatten(leaves, spec)


class Saver:
    """Writes the run's checkpoints; every rank calls save() at the same steps."""

    def __init__(self, run: Run):
        self.run = run
        self.writer = checkpoint.BackgroundWriter()
        self.model_copy, self.optimizer_copy = HostCopy(), HostCopy()
        # DCP's background collectives get a group of their own, apart from the loop's
        self.group = torch.distributed.new_group(backend="gloo") if run.sharded else None

    def save(self, progress: Progress, last: bool = False) -> str:
        """Start the checkpoint of progress.step and return its path (complete once wait() returns).
        last: the checkpoint of the run's last step (under FSDP2 it alone also gets model/)."""
        run, env = self.run, self.run.env
        self.writer.wait()  # one checkpoint at a time: its buffers are about to be reused
        rngs = [rng_state(env.device)]
        if env.distributed:
            rngs = [None] * env.world_size
            torch.distributed.all_gather_object(rngs, rng_state(env.device))
        tmp = checkpoint.temporary_path(run.checkpoints, progress.step)
        pending, weights, optimizer_state = None, None, None
        if run.sharded:
            from torch.distributed.checkpoint import async_save
            pending = async_save(_sharded_state(run), checkpoint_id=os.path.join(tmp, SHARDED_DIR),
                                 process_group=self.group)
            if last:
                weights = _gathered_weights(run.model, env)
        elif env.is_main:
            weights = self.model_copy(_weights(run.model))
            optimizer_state = self.optimizer_copy(run.optimizer.state_dict())
        trainer = {"step": progress.step, "optimizer": optimizer_state, "scaler": run.scaler.state_dict(),
                   "rng": rngs, "skipped_steps": progress.skipped, "bad_steps_in_row": progress.bad_in_row,
                   "metrics_window": progress.window, "world_size": env.world_size,
                   "data": {"position": progress.position, "phase": run.phase_of(max(progress.step - 1, 0))},
                   "config": dataclasses.asdict(run.cfg), "parameter_names": param_group_names(run.model)}
        record = {"step": progress.step, "fingerprint": run.fingerprint, "options": dataclasses.asdict(run.cfg),
                  "model_overrides": run.model_overrides}

        def write(directory: str) -> None:
            if pending is not None:
                pending.result()
            if weights is not None:
                _save_weights(run, weights, os.path.join(directory, MODEL_DIR))
            # through a Python file: a failed write is then an OSError with its errno behind torch's RuntimeError
            with open(os.path.join(directory, TRAINER_FILE), "wb") as f:
                torch.save(trainer, f)
            with open(os.path.join(directory, RUN_FILE), "w", encoding="utf-8") as f:
                json.dump(record, f, indent=2)

        if env.is_main:
            need = None if run.sharded else tensor_bytes([weights, trainer])
            self.writer.submit(lambda: checkpoint.save_checkpoint(run.checkpoints, progress.step, write,
                                                                  run.cfg.keep_checkpoints, run.pinned, need))
        elif pending is not None:
            self.writer.submit(pending.result)
        return os.path.join(run.checkpoints, checkpoint.checkpoint_name(progress.step))

    def check(self) -> None:
        """Raise the error of a background write that failed (a full disk, ...)."""
        self.writer.check()

    def wait(self) -> None:
        """Wait until the last checkpoint is complete, on every rank."""
        self.writer.wait()
        if self.run.env.distributed:
            torch.distributed.barrier()

    def close(self) -> None:
        """Let a write in progress finish (after an error elsewhere: its own error is not raised)."""
        self.writer.join()


def tensor_bytes(tree) -> int:
    """Bytes of the tensors in `tree` (nested dicts / lists): about what a checkpoint of them takes on disk."""
    return sum(leaf.numel() * leaf.element_size() for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor))


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters by name (a tied matrix once)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def _gathered_weights(model: torch.nn.Module, env: distributed.Dist) -> dict[str, torch.Tensor] | None:
    """FSDP2's shards gathered whole into rank 0's host memory (a collective); None on the other ranks."""
    whole = {name: distributed.full_tensor(p).cpu() for name, p in _weights(model).items()}
    return whole if env.is_main else None


def _sharded_state(run: Run) -> dict:
    """What sharded/ holds: the parameters and the optimizer's state, by parameter name, as they are
    (FSDP2's DTensor shards when saving; this run's layout when loading, which DCP reshards into)."""
    weights = _weights(run.model)
    optimizer = {f"{name}/{key}": value for name, p in run.model.named_parameters()
                 for key, value in run.optimizer.state[p].items() if isinstance(value, torch.Tensor)}
    return {"model": weights, "optimizer": optimizer}


def _save_weights(run: Run, weights: dict[str, torch.Tensor], path: str) -> None:
    """HF-format weights from host tensors, through a copy of the model built on the meta device."""
    with torch.device("meta"):
        shell = type(run.model)(run.config)
    shell.load_state_dict(weights, strict=False, assign=True)
    shell.tie_weights()
    shell.save_pretrained(path)


def start(run: Run) -> Progress:
    """A fresh run: the same weights on every rank (seeded in build_run), different dropout per rank."""
    torch.manual_seed(run.cfg.seed + run.env.rank)
    return Progress()


def restore(run: Run) -> Progress:
    """Load run.resume into the run (the weights, the optimizer unless its kind changed, the loss scaler,
    the RNG states) and return where it stood; the LR schedule continues from its step with the options
    of this run (a changed --lr or --steps is honoured)."""
    env, cfg = run.env, run.cfg
    file = os.path.join(run.resume, TRAINER_FILE)
    try:
        saved = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated, overwritten: whatever torch's reader or pickle raises
        raise checkpoint.damaged(run.resume, file, exc) from exc
    objective = checkpoint_objective(run.resume)
    heads_change = objective != cfg.objective  # accepted by check_resume (--accept-changes)
    same_optimizer = saved["config"]["optimizer"] == cfg.optimizer and not heads_change
    if heads_change:
        run.warning(f"the checkpoint's run trained --objective {objective}: its encoder and masked-LM head go on "
                    f"under --objective {cfg.objective}, the next-sentence head and pooler are "
                    f"{'dropped' if objective == MLM_NSP else 'initialised anew'}, and {cfg.optimizer} starts "
                    "from fresh moments")
    elif not same_optimizer:
        run.warning(f"the checkpoint's optimizer state is {saved['config']['optimizer']}'s: {cfg.optimizer} "
                    "starts from fresh moments")
    if os.path.isdir(os.path.join(run.resume, SHARDED_DIR)):
        if heads_change:
            raise ValueError(f"{run.resume} is a sharded (--distributed fsdp) checkpoint of --objective {objective}: "
                             f"it resumes only with that objective; its model/ (written at the end of a run) "
                             f"starts an --objective {cfg.objective} run with --resume never and --model")
        _load_sharded(run, os.path.join(run.resume, SHARDED_DIR), same_optimizer)
    else:
        _load_weights(run, os.path.join(run.resume, MODEL_DIR), heads_change)
        if same_optimizer:
            names = param_group_names(run.model)
            _load_optimizer_state(run.optimizer, _by_name(saved["optimizer"], _saved_names(saved, names), names,
                                                          run))
    if "layer_norm_backward" not in run.model_overrides:  # --model.layer_norm_backward wins
        choose_layer_norm_backward(run.model, run.model.config, log=run.env.is_main)
    run.scaler.load_state_dict(saved["scaler"])
    step = saved["step"]
    for group in run.optimizer.param_groups:
        group["initial_lr"] = cfg.lr
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, run.scheduler.lr_lambdas[0], last_epoch=step - 1)
    progress = Progress(step, saved["data"]["position"], saved["skipped_steps"], saved["bad_steps_in_row"],
                        saved.get("metrics_window", {}))
    phase, saved_phase = run.phase_of(step), saved["data"]["phase"]
    if phase < saved_phase:  # a longer --steps (or other --phase-fractions) moves the phase ends later
        raise ValueError(
            f"cannot resume from {run.resume} with --steps {cfg.steps} and --phase-fractions {cfg.phase_fractions!r}: "
            f"step {step + 1} would fall in phase {phase + 1} (length {run.phases[phase].seq_length}), which the "
            f"checkpoint's run has finished (it is in phase {saved_phase + 1}), so phase {phase + 1}'s examples would "
            f"be read again from the start; keep that phase's end at step {step} or earlier with --phase-fractions")
    if phase != saved_phase:  # saved at a phase boundary (or the phases end sooner now): the next phase's start
        progress.position = 0
    states = saved["rng"]
    if len(states) == env.world_size:
        set_rng_state(states[env.rank], env.device)
    else:
        run.warning(f"the checkpoint has RNG states of {len(states)} ranks, this run has {env.world_size}; "
                    "dropout draws new random numbers (data order and masks are unaffected)")
        torch.manual_seed(cfg.seed + 7919 * step + env.rank)
    run.info(f"resumed from {run.resume} at step {step}")
    return progress


def _load_weights(run: Run, path: str, heads_change: bool = False) -> None:
    """HF-format weights into the model (sharded like it under FSDP2); every weight must be there, but for
    the NSP-only ones (NSP_ONLY_PREFIXES) when the checkpoint was written for the other objective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from fastbert.hf import CheckpointError, read_state_dict, tied_keys
    try:
        weights = read_state_dict(path)
    except CheckpointError as exc:
        raise checkpoint.damaged(run.resume, getattr(exc, "file", path), exc.__cause__ or exc) from exc
    try:
        result = set_model_state_dict(run.model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    except RuntimeError as exc:
        raise ValueError(f"the weights in {path} do not fit the model: {exc}") from None
    missing = [k for k in result.missing_keys if k not in tied_keys(run.model)]
    unexpected = result.unexpected_keys
    if heads_change:
        missing, unexpected = ([k for k in keys if not k.startswith(NSP_ONLY_PREFIXES)]
                               for keys in (missing, unexpected))
    if missing or unexpected:
        raise ValueError(f"the weights in {path} do not fit the model: missing {missing}, unexpected {unexpected}")


def _load_sharded(run: Run, path: str, with_optimizer: bool) -> None:
    """A sharded/ checkpoint (torch.distributed.checkpoint) into this run's layout, whatever the number
    of ranks that wrote it."""
    import torch.distributed.checkpoint as dcp
    if with_optimizer:
        _create_optimizer_state(run.optimizer)
    state = _sharded_state(run)
    if not with_optimizer:
        del state["optimizer"]
    with warnings.catch_warnings():  # DCP warns that one process loads alone, which is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=not run.env.distributed)  # in place


@torch.no_grad()
def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer create its (lazy) state, for a checkpoint to be loaded into: a step at learning
    rate 0 on zero gradients, which leaves the weights as they are."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate


DECODER_BIAS = ".decoder.bias"  # an MLM decoder's own bias (cls.predictions.decoder.bias, lm_head.decoder.bias)


def _saved_names(saved: dict, names: list[list[str]]) -> list[list[str]]:
    """The names of the parameters in the saved optimizer state, group by group (`names`: this run's). A
    checkpoint records them; one written before it did has this run's parameters, but where its MLM decoder was
    untied and had no bias of its own (fastbert before 336e7d0)."""
    if "parameter_names" in saved:
        return saved["parameter_names"]
    sizes = [len(group["params"]) for group in saved["optimizer"]["param_groups"]]
    if sizes == [len(group) for group in names]:
        return names
    return [[name for name in group if not name.endswith(DECODER_BIAS)] for group in names]


def _by_name(state: dict, saved_names: list[list[str]], names: list[list[str]], run: Run) -> dict:
    """The optimizer state `state` (indexed by the saved parameters' positions) indexed by this run's. An MLM
    decoder's bias the checkpoint lacks takes the moments of the head's bias, which the logits added then as the
    decoder's bias does now; any other parameter the checkpoint has no moments for starts from fresh ones, with
    a warning. ValueError where the groups do not line up at all."""
    if saved_names == names:
        return state
    sizes = [len(group["params"]) for group in state["param_groups"]]
    if sizes != [len(group) for group in saved_names] or len(saved_names) != len(names):
        raise ValueError(f"the optimizer state in {run.resume} does not fit this model (parameter groups of "
                         f"{sizes} parameters, this model's of {[len(group) for group in names]}): resume with "
                         "another --optimizer and --accept-changes to start fresh moments, or start a new run")
    saved_ids = dict(zip((name for group in saved_names for name in group),
                         (i for group in state["param_groups"] for i in group["params"])))
    moments, groups, fresh, index = {}, [], [], 0
    for group, group_names in zip(state["param_groups"], names):
        groups.append({**group, "params": list(range(index, index + len(group_names)))})
        for name in group_names:
            source = name if name in saved_ids else name.replace(DECODER_BIAS, ".bias")
            if source not in saved_ids:
                fresh.append(name)
            elif saved_ids[source] in state["state"]:  # a copy: the head's bias keeps its own
                moments[index] = {key: value.clone() if isinstance(value, torch.Tensor) else value
                                  for key, value in state["state"][saved_ids[source]].items()}
            index += 1
    if fresh:
        run.warning(f"the checkpoint {run.resume} holds no optimizer state for {', '.join(fresh)}: "
                    "they start from fresh moments")
    return {"state": moments, "param_groups": groups}


def _load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a whole-tensor optimizer state, re-sharding it like each parameter when that is a DTensor."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in state["param_groups"] for i in group["params"]]
    for i, p in zip(ids, params):
        if hasattr(p, "device_mesh") and i in state["state"]:
            from torch.distributed.tensor import distribute_tensor
            state["state"][i] = {n: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                                 if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                                 for n, v in state["state"][i].items()}
    optimizer.load_state_dict(state)

