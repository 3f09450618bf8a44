"""`fastbert pretrain`: BERT pretraining (masked LM + next sentence prediction), one process or many.

    fastbert pretrain                                   # built-in demo: tiny model, stdlib docstrings, CPU
    fastbert pretrain --data data/ --model base --steps 1000000 --batch-size 256
    torchrun --nproc_per_node=8 -m fastbert.cli pretrain --data data/ --model large --distributed fsdp
    fastbert pretrain --config run.json --lr 2e-4 --model.hidden_dropout_prob 0.0

Options are the fields of PretrainConfig (--config FILE reads them from JSON; later flags win);
--model.<field> VALUE overrides a BertConfig field. Outputs go to ./runs/<run name>/ (or --out):
metrics.jsonl (one JSON object per logged step), config.json (the run's options) and
checkpoints/step_N/ (see fastbert.train.checkpoint). Running the same command again resumes from
the newest complete checkpoint, exactly: the losses are those of the uninterrupted run.

Loss normalisation: the MLM loss is the mean over all masked tokens of the global batch and the NSP
loss the mean over its sequences, whatever the number of ranks and micro-batches: each micro-batch
contributes its sums divided by the global counts, so a run on N ranks with accumulation computes
the gradient of a 1-rank run on the same global batch.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from fastbert.data.corpus import STDLIB
from fastbert.data.loader import PretrainingLoader, prefetch
from fastbert.data.masking import IGNORE_INDEX, MaskingCollator
from fastbert.data.shards import INDEX_FILE, ShardedDataset
from fastbert.train import checkpoint, distributed
from fastbert.train.metrics import MetricsLog, measure_peak_flops, training_flops
from fastbert.train.optim import build_optimizer, linear_warmup_decay

PRESETS = ("tiny", "base", "large")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass
class PretrainConfig:
    run_name: str = ""  # directory name under ./runs/; "" = "<model>-<data>"
    out: str = ""  # output directory; "" = ./runs/<run_name>
    data: str = STDLIB  # `fastbert prepare-data` output (holding seq128/, seq512/, ...) or "stdlib" (built in)
    model: str = "tiny"  # preset tiny | base | large, or an HF config.json (file or directory)
    steps: int = 400  # optimizer steps in all (the paper: 1,000,000)
    batch_size: int = 32  # global batch: sequences per optimizer step, all ranks together (the paper: 256)
    micro_batch_size: str = ""  # sequences per rank per forward, one value or one per phase; "" = no accumulation
    seq_lengths: str = ""  # sequence length of each phase; "" = 128,512 (max_position_embeddings/2 and /1 if less)
    phase_fractions: str = "0.9,0.1"  # share of the steps of each phase (the paper: 90% at 128, 10% at 512)
    optimizer: str = "adamw"  # adamw (the paper's Adam with weight decay) | lamb (large batches)
    lr: float = 1e-4  # peak learning rate (the paper: 1e-4)
    warmup: float = 0.01  # warm-up steps, or a fraction of the steps when < 1 (the paper: 10k of 1M)
    weight_decay: float = 0.01  # decoupled weight decay on weight matrices (not biases, not LayerNorm)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0 = no clipping
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp16 (with loss scaling)
    activation_checkpointing: bool = False  # recompute each encoder layer in the backward to save memory
    distributed: str = "ddp"  # under torchrun: ddp | fsdp (FSDP2 fully_shard, per layer)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 12345
    mask_prob: float = 0.15  # fraction of tokens predicted
    whole_word_masking: bool = False  # mask whole words (a token and its "##" pieces)
    log_every: int = 10  # steps per metrics line and progress-bar update
    save_every: int = 1000  # steps between checkpoints (one is always written at the end)
    keep_checkpoints: int = 2  # newest complete checkpoints kept (>= 2)
    max_bad_steps: int = 20  # consecutive steps with a non-finite loss or gradient that stop the run
    resume: str = "auto"  # auto (newest checkpoint of the output directory, if any) | never | a checkpoint path
    stop_at: int = 0  # stop after this step with a checkpoint, to be resumed later; 0 = run to the end
    peak_tflops: float = 0.0  # device peak for MFU in TFLOP/s; 0 = measure a matmul at start
    prefetch: int = 2  # batches prepared ahead in a background thread
    progress: bool = True  # progress bar on rank 0

    def validate(self) -> None:
        checks = [("steps", self.steps >= 1, ">= 1"), ("batch_size", self.batch_size >= 1, ">= 1"),
                  ("lr", self.lr > 0, "> 0"), ("warmup", self.warmup >= 0, ">= 0"),
                  ("weight_decay", self.weight_decay >= 0, ">= 0"), ("eps", self.eps > 0, "> 0"),
                  ("beta1", 0 <= self.beta1 < 1, "in [0, 1)"), ("beta2", 0 <= self.beta2 < 1, "in [0, 1)"),
                  ("max_grad_norm", self.max_grad_norm >= 0, ">= 0"),
                  ("log_every", self.log_every >= 1, ">= 1"), ("save_every", self.save_every >= 1, ">= 1"),
                  ("keep_checkpoints", self.keep_checkpoints >= 2, ">= 2"),
                  ("max_bad_steps", self.max_bad_steps >= 1, ">= 1"), ("stop_at", self.stop_at >= 0, ">= 0"),
                  ("peak_tflops", self.peak_tflops >= 0, ">= 0"), ("prefetch", self.prefetch >= 1, ">= 1"),
                  ("optimizer", self.optimizer in ("adamw", "lamb"), "adamw or lamb"),
                  ("precision", self.precision in PRECISIONS, f"one of {PRECISIONS}"),
                  ("distributed", self.distributed in distributed.STRATEGIES, f"one of {distributed.STRATEGIES}")]
        for name, ok, limit in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {limit}, got {getattr(self, name)!r}")


@dataclass
class Phase:
    seq_length: int
    start: int  # first step (0-based)
    end: int  # one past the last step
    micro_batch_size: int
    dataset: ShardedDataset | None = None


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row); the message says why."""


# SIGTERM / SIGINT ask for a checkpoint at the next step boundary; a second SIGINT interrupts at once.
STOP = threading.Event()


def _request_stop(signum, frame):
    if STOP.is_set() and signum == signal.SIGINT:
        raise KeyboardInterrupt
    STOP.set()


@contextlib.contextmanager
def stop_signals():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _parse_list(name: str, text: str, kind) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name.replace('_', '-')} must be a comma-separated list of {kind.__name__}, "
                         f"got {text!r}") from None
    if not values:
        raise ValueError(f"--{name.replace('_', '-')} is empty")
    return values


def plan_phases(cfg: PretrainConfig, max_positions: int, world_size: int) -> list[Phase]:
    """The run's phases: sequence length, step range and micro-batch size of each."""
    if cfg.seq_lengths:
        lengths = _parse_list("seq_lengths", cfg.seq_lengths, int)
    else:
        lengths = [128, 512] if max_positions >= 512 else [max_positions // 2, max_positions]
    fractions = _parse_list("phase_fractions", cfg.phase_fractions, float)
    if len(fractions) != len(lengths) or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"--phase-fractions {cfg.phase_fractions!r} must be {len(lengths)} non-negative numbers "
                         f"summing to 1, one per phase of --seq-lengths {lengths}")
    for length in lengths:
        if not 5 <= length <= max_positions:
            raise ValueError(f"sequence length {length} must be in [5, max_position_embeddings={max_positions}]")
    if cfg.batch_size % world_size:
        raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of the world size {world_size}")
    micro = (_parse_list("micro_batch_size", cfg.micro_batch_size, int) if cfg.micro_batch_size
             else [cfg.batch_size // world_size])
    if len(micro) == 1:
        micro *= len(lengths)
    if len(micro) != len(lengths):
        raise ValueError(f"--micro-batch-size needs 1 or {len(lengths)} values, got {cfg.micro_batch_size!r}")
    for size in micro:
        if size < 1 or (cfg.batch_size // world_size) % size:
            raise ValueError(f"micro-batch size {size} must divide the per-rank batch "
                             f"{cfg.batch_size // world_size} (--batch-size {cfg.batch_size} / {world_size} ranks)")
    ends = [round(cfg.steps * f) for f in np.cumsum(fractions)]
    ends[-1] = cfg.steps
    starts = [0] + ends[:-1]
    return [Phase(n, s, e, m) for n, s, e, m in zip(lengths, starts, ends, micro) if e > s]


def _cache_dir() -> str:
    base = os.environ.get("FASTBERT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastbert")
    return base


def stdlib_data(vocab_size: int, seq_lengths: list[int], env: distributed.Dist, log) -> str:
    """The built-in corpus (Python's docstrings) prepared once into the cache; rank 0 builds, others wait."""
    from fastbert.data.prepare import dataset_dir, prepare_dataset

    root = os.path.join(_cache_dir(), f"stdlib-py{sys.version_info[0]}.{sys.version_info[1]}-vocab{vocab_size}")
    missing = [n for n in seq_lengths if not os.path.isfile(os.path.join(dataset_dir(root, n), INDEX_FILE))]
    if missing and env.is_main:
        tokenizer = os.path.join(root, "tokenizer.json")
        log(f"preparing the built-in corpus (Python standard-library docstrings) in {root}")
        prepare_dataset([STDLIB], root, tokenizer if os.path.isfile(tokenizer) else None, vocab_size,
                        max_seq_lengths=tuple(missing), overwrite=True, log=log)
    if env.distributed:
        torch.distributed.barrier()
    return root


def phase_dataset(data: str, seq_length: int) -> ShardedDataset:
    for candidate in (os.path.join(data, f"seq{seq_length}"), data):
        path = os.path.join(candidate, INDEX_FILE)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                if json.load(f).get("max_seq_length") == seq_length:
                    return ShardedDataset(candidate)
    raise ValueError(f"no dataset with max_seq_length {seq_length} in {data!r} (looked for {data}/seq{seq_length}/); "
                     f"create it with `fastbert prepare-data --max-seq-length {seq_length} --out {data} ...`")


def model_config(cfg: PretrainConfig, overrides: dict):
    from fastbert import BertConfig
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(BertConfig)})
    if unknown:
        raise ValueError(f"--model.{unknown[0]}: BertConfig has no field {unknown[0]!r}")
    if cfg.model in PRESETS:
        return getattr(BertConfig, cfg.model)(**overrides)
    if not os.path.exists(cfg.model):
        raise ValueError(f"--model must be one of {PRESETS} or an HF config.json, got {cfg.model!r}")
    return BertConfig.from_json(cfg.model, **overrides)


def default_run_name(cfg: PretrainConfig) -> str:
    model = cfg.model if cfg.model in PRESETS else os.path.basename(os.path.normpath(cfg.model)).removesuffix(".json")
    data = STDLIB if cfg.data == STDLIB else os.path.basename(os.path.normpath(cfg.data))
    return f"{model}-{data}"


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


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


def train(cfg: PretrainConfig, model_overrides: dict | None = None, log=print) -> dict:
    """Run (or resume) pretraining; returns {"step", "out", "checkpoint", "stopped", "skipped_steps", "model"}
    (model: the trained BertForPreTraining, its parameters sharded under FSDP2).

    Raises ValueError for bad options or data, TrainingError when the run cannot go on.
    """
    from fastbert import BertForPreTraining
    from fastbert.hf import load_state, read_state_dict

    cfg.validate()
    env = distributed.init(cfg.device)
    log = log if env.is_main else (lambda *a, **k: None)
    config = model_config(cfg, dict(model_overrides or {}))
    phases = plan_phases(cfg, config.max_position_embeddings, env.world_size)
    sharded = env.distributed and cfg.distributed == "fsdp"
    dtype = compute_dtype(cfg.precision, env.device)
    if sharded and dtype == torch.float16:
        raise ValueError("--precision fp16 is not supported with --distributed fsdp; use bf16")

    data = cfg.data
    if data == STDLIB:
        data = stdlib_data(config.vocab_size, [p.seq_length for p in phases], env, log)
    elif not os.path.isdir(data):
        raise ValueError(f"--data {data!r} is not a directory; create it with `fastbert prepare-data`")
    for phase in phases:
        phase.dataset = phase_dataset(data, phase.seq_length)
    vocab_size = phases[0].dataset.vocab_size
    if cfg.model in PRESETS and "vocab_size" not in (model_overrides or {}):
        config = config.replace(vocab_size=vocab_size)
    if config.vocab_size < vocab_size:
        raise ValueError(f"the model's vocab_size {config.vocab_size} is smaller than the data's {vocab_size}")
    if config.pad_token_id != phases[0].dataset.special_ids["pad"]:
        raise ValueError(f"the model's pad_token_id {config.pad_token_id} differs from the data's "
                         f"[PAD] id {phases[0].dataset.special_ids['pad']}")
    collators = [MaskingCollator(p.dataset.vocabulary(), cfg.mask_prob, cfg.whole_word_masking) for p in phases]

    out = cfg.out or os.path.join("runs", cfg.run_name or default_run_name(cfg))
    root = os.path.join(out, checkpoint.CHECKPOINT_DIR)
    resume = None
    if cfg.resume == "auto":
        resume = checkpoint.latest_checkpoint(root)
    elif cfg.resume != "never":
        if not os.path.isfile(os.path.join(cfg.resume, "trainer.pt")):
            raise ValueError(f"--resume {cfg.resume!r} is not a complete checkpoint directory")
        resume = cfg.resume
    if env.is_main:
        os.makedirs(out, exist_ok=True)
        checkpoint.remove_incomplete(root)
        with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
            json.dump({**dataclasses.asdict(cfg), "model_overrides": model_overrides or {}}, f, indent=2)

    torch.manual_seed(cfg.seed)
    model = BertForPreTraining(config)
    trainer_state = None
    if resume:
        load_state(model, read_state_dict(os.path.join(resume, "model")))
        trainer_state = torch.load(os.path.join(resume, "trainer.pt"), map_location="cpu", weights_only=False)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable()
    model.to(env.device)
    wrapped = distributed.wrap(model, cfg.distributed, env, dtype if dtype != torch.float32 else None)
    optimizer = build_optimizer(model, cfg.optimizer, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay,
                                sharded)
    warmup = int(cfg.warmup) if cfg.warmup >= 1 else round(cfg.warmup * cfg.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(max(warmup, 1), cfg.steps))
    scaler = torch.amp.GradScaler(env.device.type, enabled=dtype == torch.float16)

    def phase_of(at_step: int) -> int:
        return next(i for i, p in enumerate(phases) if at_step < p.end or p is phases[-1])

    step, position, skipped, bad_in_row = 0, 0, 0, 0
    if trainer_state is not None:
        _load_optimizer_state(optimizer, trainer_state["optimizer"])
        scheduler.load_state_dict(trainer_state["scheduler"])
        scaler.load_state_dict(trainer_state["scaler"])
        step, position = trainer_state["step"], trainer_state["data"]["position"]
        if phase_of(step) != trainer_state["data"]["phase"]:  # saved at a phase boundary
            position = 0
        skipped, bad_in_row = trainer_state["skipped_steps"], trainer_state["bad_steps_in_row"]
        states = trainer_state["rng"]
        if len(states) == env.world_size:
            set_rng_state(states[env.rank], env.device)
        else:
            log(f"warning: the checkpoint has RNG states of {len(states)} ranks, this run has {env.world_size}; "
                "dropout draws new random numbers (data order and masks are unaffected)")
            torch.manual_seed(cfg.seed + 7919 * step + env.rank)
        log(f"resumed from {resume} at step {step}")
    else:
        torch.manual_seed(cfg.seed + env.rank)  # the same weights everywhere, different dropout per rank
    metrics = MetricsLog(os.path.join(out, "metrics.jsonl"), env.is_main, step if resume else None)

    def save(at_step: int) -> str:
        rngs = [None] * env.world_size
        if env.distributed:
            torch.distributed.all_gather_object(rngs, rng_state(env.device))
        else:
            rngs = [rng_state(env.device)]
        optimizer_state = _optimizer_state(optimizer)
        phase_index = phase_of(max(at_step - 1, 0))  # the phase `position` counts examples of

        def write(tmp: str) -> None:
            _save_model(model, sharded, os.path.join(tmp, "model"), env.is_main)
            if env.is_main:
                torch.save({"step": at_step, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                            "scaler": scaler.state_dict(), "rng": rngs, "skipped_steps": skipped,
                            "bad_steps_in_row": bad_in_row, "world_size": env.world_size,
                            "data": {"phase": phase_index, "position": position,
                                     "seq_length": phases[phase_index].seq_length},
                            "config": dataclasses.asdict(cfg)}, os.path.join(tmp, "trainer.pt"))

        if env.is_main:
            path = checkpoint.save_checkpoint(root, at_step, write, cfg.keep_checkpoints)
        else:
            write("")
            path = ""
        if env.distributed:
            torch.distributed.barrier()
        return path

    if step >= cfg.steps:
        log(f"the run in {out} is already complete at step {step}; use --run-name or --out to start a new one")
        return {"step": step, "out": out, "checkpoint": resume, "stopped": False, "skipped_steps": skipped,
                "model": model}

    peak = cfg.peak_tflops * 1e12 or measure_peak_flops(env.device, dtype)
    log(f"pretraining BERT ({config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
        f"{config.vocab_size}) on {env.world_size} x {env.device.type}, {dtype}, {cfg.steps} steps of "
        f"{cfg.batch_size} sequences, phases {[(p.seq_length, p.end - p.start) for p in phases]}")
    log(f"output: {os.path.abspath(out)} (metrics.jsonl, checkpoints/)")
    from tqdm import tqdm
    bar = tqdm(total=cfg.steps, initial=step, disable=not (env.is_main and cfg.progress), dynamic_ncols=True)
    window = torch.zeros(8, dtype=torch.float64, device=env.device)  # see the stats layout below
    window_start = time.perf_counter()
    last_saved = step if resume else -1
    stopped = False
    batches = None
    current_phase = None
    grad_norm = 0.0
    autocast = torch.autocast(env.device.type, dtype=dtype, enabled=dtype != torch.float32)
    with stop_signals():
        try:
            while step < cfg.steps:
                phase_index = phase_of(step)
                phase = phases[phase_index]
                if phase_index != current_phase:
                    if current_phase is not None:  # a new phase starts reading its own data from the start
                        position = 0
                        batches.close()
                    current_phase = phase_index
                    loader = PretrainingLoader(phase.dataset, collators[phase_index], cfg.batch_size,
                                               phase.micro_batch_size, env.rank, env.world_size, cfg.seed,
                                               phase_index)
                    batches = prefetch(loader.steps(position), cfg.prefetch, env.device.type == "cuda")
                micro_batches = next(batches)
                counts = [int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches]
                agreed = distributed.all_reduce_sum(torch.tensor(
                    [sum(counts), float(STOP.is_set() or (cfg.stop_at and step >= cfg.stop_at))],
                    dtype=torch.float64, device=env.device), env).tolist()
                if agreed[1]:
                    stopped = True
                    break
                masked_global = agreed[0]
                # stats: mlm loss sum, nsp loss sum, mlm correct, nsp correct, masked tokens, sequences,
                # real tokens, model FLOPs
                stats = torch.zeros(8, dtype=torch.float64, device=env.device)
                for i, (mb, count) in enumerate(zip(micro_batches, counts)):
                    flops = training_flops(config, mb["attention_mask"].sum(1), count)
                    rows = mb["input_ids"].shape[0]
                    tokens = int(mb["attention_mask"].sum())
                    mb = {k: v.to(env.device, non_blocking=True) for k, v in mb.items()}
                    with distributed.gradient_sync(wrapped, i == len(micro_batches) - 1):
                        with autocast:
                            output = wrapped(**mb, return_logits=False, validate=False)
                        mlm_sum = output.mlm_loss.float() * count
                        nsp_sum = output.nsp_loss.float() * rows
                        loss = (mlm_sum / masked_global + nsp_sum / cfg.batch_size) * env.world_size
                        scaler.scale(loss).backward()
                    stats += torch.stack([mlm_sum.detach().double(), nsp_sum.detach().double(),
                                          output.mlm_accuracy.detach().double() * count,
                                          output.nsp_accuracy.detach().double() * rows,
                                          *torch.tensor([count, rows, tokens, flops], dtype=torch.float64,
                                                        device=env.device)])
                stats = distributed.all_reduce_sum(stats, env)  # sums over the global batch
                scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or math.inf)
                grad_norm = float(distributed.full_tensor(norm))
                loss_finite = bool(torch.isfinite(stats).all())
                if scaler.is_enabled():  # fp16: the scaler skips an update whose gradients overflowed
                    scale = scaler.get_scale()
                    scaler.step(optimizer)
                    scaler.update()
                    updated = scaler.get_scale() >= scale  # it lowers the scale exactly when it skips
                    bad = not loss_finite
                else:
                    bad = not (loss_finite and math.isfinite(grad_norm))
                    updated = not bad
                    if updated:
                        optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                with warnings.catch_warnings():  # a skipped first update makes torch warn about the order
                    warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                    scheduler.step()
                step += 1
                position += cfg.batch_size
                if not loss_finite:
                    stats[:6] = 0  # the loss terms stay out of the averages; tokens and FLOPs were spent
                window += stats
                skipped += not updated
                bad_in_row = bad_in_row + 1 if bad else 0
                if bad:
                    log(f"step {step}: non-finite loss or gradient norm ({grad_norm}); update skipped "
                        f"({bad_in_row} in a row, {skipped} skipped in all)")
                    if bad_in_row >= cfg.max_bad_steps:
                        raise TrainingError(
                            f"{bad_in_row} consecutive steps had a non-finite loss or gradient (last at step "
                            f"{step}); stopping. The last good checkpoint is {checkpoint.latest_checkpoint(root)}; "
                            "lower --lr, use --precision bf16/fp32, or check the data")
                bar.update(1)
                if step % cfg.log_every == 0 or step == cfg.steps:
                    totals = window.tolist()
                    elapsed = time.perf_counter() - window_start
                    record = {"step": step, "phase": phase_index, "seq_length": phase.seq_length}
                    if totals[4] > 0:
                        mlm_loss, nsp_loss = totals[0] / totals[4], totals[1] / totals[5]
                        record.update(loss=mlm_loss + nsp_loss, mlm_loss=mlm_loss, nsp_loss=nsp_loss,
                                      mlm_accuracy=totals[2] / totals[4], nsp_accuracy=totals[3] / totals[5])
                    else:
                        record["loss"] = None  # every step of the window was skipped
                    record.update(lr=scheduler.get_last_lr()[0], grad_norm=grad_norm if math.isfinite(grad_norm) else None,
                                  tokens_per_s=totals[6] / elapsed, mfu=totals[7] / elapsed / (peak * env.world_size),
                                  skipped_steps=skipped)
                    metrics.write(record)
                    if record["loss"] is not None:
                        bar.set_postfix_str(f"loss {record['loss']:.3f} mlm_acc {record['mlm_accuracy']:.3f} "
                                            f"nsp_acc {record['nsp_accuracy']:.3f} tok/s {record['tokens_per_s']:.0f} "
                                            f"MFU {record['mfu']:.1%}", refresh=False)
                    window.zero_()
                    window_start = time.perf_counter()
                if step % cfg.save_every == 0 and step < cfg.steps:
                    save(step)
                    last_saved = step
        finally:
            bar.close()
            if batches is not None:
                batches.close()
    path = save(step) if last_saved != step else checkpoint.latest_checkpoint(root)
    if stopped:
        log(f"stopped at step {step} ({'signal' if STOP.is_set() else '--stop-at'}); checkpoint {path}; "
            "run the same command again to resume")
    else:
        log(f"done: {step} steps; model and checkpoint in {path}; metrics in {os.path.join(out, 'metrics.jsonl')}")
    return {"step": step, "out": out, "checkpoint": path, "stopped": stopped, "skipped_steps": skipped,
            "model": model}


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_args(argv: list[str]) -> tuple[PretrainConfig, dict]:
    """PretrainConfig from defaults < --config JSON < flags; and the --model.<field> overrides."""
    parser = argparse.ArgumentParser(prog="fastbert pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", help="JSON file of options (the keys below, and model.<field> keys)")
    comments = _field_comments()
    for field in dataclasses.fields(PretrainConfig):
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{comments.get(field.name, '')} (default: {field.default!r})".replace("%", "%%")
        if field.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            kind = {"int": int, "float": float}.get(field.type, str)
            parser.add_argument(flag, type=kind, help=help_text)
    args, rest = parser.parse_known_args(argv)
    overrides: dict = {}
    values: dict = {}
    if "config" in args:
        try:
            with open(args.config, encoding="utf-8") as f:
                from_file = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--config {args.config!r}: {exc}") from None
        names = {f.name for f in dataclasses.fields(PretrainConfig)}
        for key, value in from_file.items():
            if key.startswith("model."):
                overrides[key[len("model."):]] = value
            elif key.replace("-", "_") in names:
                values[key.replace("-", "_")] = value
            else:
                raise ValueError(f"--config {args.config!r}: unknown option {key!r}")
    values.update({k: v for k, v in vars(args).items() if k != "config"})
    while rest:
        flag = rest.pop(0)
        if not flag.startswith("--model.") or not rest:
            parser.error(f"unrecognized argument {flag!r} (model fields are set with --model.<field> VALUE)")
        overrides[flag[len("--model."):]] = _parse_value(rest.pop(0))
    return PretrainConfig(**values), overrides


def _field_comments() -> dict[str, str]:
    """The comment after each PretrainConfig field, used as its --help text."""
    import inspect
    comments = {}
    for line in inspect.getsource(PretrainConfig).splitlines():
        name, _, rest = line.strip().partition(":")
        if "#" in rest and name.isidentifier():
            comments[name] = rest.split("#", 1)[1].strip()
    return comments


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        train(cfg, overrides)
    except (ValueError, TrainingError, ImportError) as exc:
        print(f"fastbert pretrain: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, TrainingError) else 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
