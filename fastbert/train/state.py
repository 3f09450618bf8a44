"""A checkpoint's contents besides the directory mechanics (checkpoint.py): writing the training state
and resuming from it.

step_N/model/ holds the weights in HF format; step_N/trainer.pt the optimizer, LR scheduler, loss
scaler, the RNG states of every rank, the data position and the counters of Progress, and the run's
options.
"""
from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from fastbert.train import checkpoint, distributed
from fastbert.train.run import Run


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


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict() with FSDP2's sharded state gathered whole (a collective on every rank)."""
    state = optimizer.state_dict()
    state["state"] = {k: {n: distributed.full_tensor(v) if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                      for k, s in state["state"].items()}
    return state


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


def _save_model(model: torch.nn.Module, sharded: bool, path: str, is_main: bool) -> None:
    """HF-format weights. Under FSDP2 the shards are gathered and written from a CPU copy on rank 0."""
    if not sharded:
        if is_main:
            model.save_pretrained(path)
        return
    from fastbert import BertForPreTraining
    whole = {name: distributed.full_tensor(p.detach()).cpu() for name, p in model.named_parameters()}
    if is_main:
        with torch.random.fork_rng(devices=[]):  # building the copy must not move the run's RNG
            copy = BertForPreTraining(model.config)
        copy.load_state_dict(whole, strict=False)
        copy.save_pretrained(path)


def save(run: Run, progress: Progress) -> str:
    """Write the checkpoint of progress.step (every rank calls this); returns its path on rank 0."""
    env = run.env
    rngs = [None] * env.world_size
    if env.distributed:
        torch.distributed.all_gather_object(rngs, rng_state(env.device))
    else:
        rngs = [rng_state(env.device)]
    optimizer_state = _optimizer_state(run.optimizer)
    phase_index = run.phase_of(max(progress.step - 1, 0))  # the phase `position` counts examples of

    def write(tmp: str) -> None:
        _save_model(run.model, run.sharded, os.path.join(tmp, "model"), env.is_main)
        if env.is_main:
            torch.save({"step": progress.step, "optimizer": optimizer_state, "scheduler": run.scheduler.state_dict(),
                        "scaler": run.scaler.state_dict(), "rng": rngs, "skipped_steps": progress.skipped,
                        "bad_steps_in_row": progress.bad_in_row, "metrics_window": progress.window,
                        "world_size": env.world_size,
                        "data": {"phase": phase_index, "position": progress.position,
                                 "seq_length": run.phases[phase_index].seq_length},
                        "config": dataclasses.asdict(run.cfg)}, os.path.join(tmp, "trainer.pt"))

    if env.is_main:
        path = checkpoint.save_checkpoint(run.checkpoints, progress.step, write, run.cfg.keep_checkpoints)
    else:
        write("")
        path = ""
    if env.distributed:
        torch.distributed.barrier()
    return path


def start(run: Run) -> Progress:
    """A fresh run: the same weights on every rank (seeded in build_run), different dropout per rank."""
    torch.manual_seed(run.cfg.seed + run.env.rank)
    return Progress()


def restore(run: Run) -> Progress:
    """Load the optimizer, schedule, scaler, RNG states and counters of run.resume (whose weights
    build_run loaded) and return where the run stands."""
    env = run.env
    saved = torch.load(os.path.join(run.resume, "trainer.pt"), map_location="cpu", weights_only=False)
    _load_optimizer_state(run.optimizer, saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    run.scaler.load_state_dict(saved["scaler"])
    progress = Progress(saved["step"], saved["data"]["position"], saved["skipped_steps"], saved["bad_steps_in_row"],
                        saved.get("metrics_window", {}))
    if run.phase_of(progress.step) != saved["data"]["phase"]:  # saved at a phase boundary
        progress.position = 0
    states = saved["rng"]
    if len(states) == env.world_size:
        set_rng_state(states[env.rank], env.device)
    else:
        run.warning(f"the checkpoint has RNG states of {len(states)} ranks, this run has {env.world_size}; "
                 "dropout draws new random numbers (data order and masks are unaffected)")
        torch.manual_seed(run.cfg.seed + 7919 * progress.step + env.rank)
    run.info(f"resumed from {run.resume} at step {progress.step}")
    return progress
