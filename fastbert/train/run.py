"""Set-up of a pretraining run: the process group, the phases and their data, the model, optimizer,
LR schedule and loss scaler, and the output directory. `build_run` returns them as one Run."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from fastbert import ops
from fastbert.data.corpus import STDLIB
from fastbert.data.examples import MLM, MLM_NSP
from fastbert.data.masking import MaskingCollator
from fastbert.data.shards import INDEX_FILE, ShardedDataset
from fastbert.files import output_lock, write_text
from fastbert.train import checkpoint, distributed
from fastbert.train.optim import build_optimizer, linear_warmup_decay
from fastbert.train.options import AUTO_MICRO_BATCH, PRESETS, PretrainConfig, parse_list

logger = logging.getLogger("fastbert.train")
METRICS_FILE = "metrics.jsonl"
RUN_CONFIG_FILE = "config.json"  # the run's options (write_run_config)


@dataclass
class Phase:
    seq_length: int
    start: int  # first step (0-based)
    end: int  # one past the last step
    micro_batch_size: int
    dataset: ShardedDataset | None = None
    collator: MaskingCollator | None = None
    label_budget: int = 1  # labelled tokens per sequence the MLM loss reads (BertConfig.max_predictions_per_seq)


def plan_phases(cfg: PretrainConfig, max_positions: int, world_size: int) -> list[Phase]:
    """The run's phases: sequence length, step range and micro-batch size of each. max_positions: the longest
    sequence the model's position table holds (BertConfig.max_sequence_length)."""
    if cfg.seq_lengths:
        lengths = parse_list("seq_lengths", cfg.seq_lengths, int)
    else:
        lengths = [128, 512] if max_positions >= 512 else [max_positions // 2, max_positions]
    if cfg.phase_fractions:
        fractions = parse_list("phase_fractions", cfg.phase_fractions, float)
    elif len(lengths) <= 2:
        fractions = [0.9, 0.1] if len(lengths) == 2 else [1.0]
    else:
        raise ValueError(f"--phase-fractions is needed for {len(lengths)} phases ({lengths}): one share per phase")
    if len(fractions) != len(lengths) or not all(0 <= f <= 1 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"--phase-fractions {cfg.phase_fractions!r} must be {len(lengths)} non-negative numbers "
                         f"summing to 1, one per phase of --seq-lengths {lengths}")
    for length in lengths:
        if not 5 <= length <= max_positions:
            raise ValueError(f"sequence length {length} must be in [5, {max_positions}], the longest sequence the "
                             "model's max_position_embeddings hold")
    if cfg.batch_size % world_size:
        raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of the world size {world_size}")
    # "auto": the whole per-rank batch until auto_micro_batches plans each phase's on the GPU
    micro = (parse_list("micro_batch_size", cfg.micro_batch_size, int)
             if cfg.micro_batch_size not in ("", AUTO_MICRO_BATCH) else [cfg.batch_size // world_size])
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


def auto_micro_batches(cfg: PretrainConfig, config, phases: list[Phase], env: distributed.Dist, dtype: torch.dtype,
                       resume: str | None, free_bytes: int | None = None) -> None:
    """--micro-batch-size auto: set each phase's micro-batch to the largest divisor of the per-rank batch whose
    step the memory plan (fastbert.simulated.device_fit.choose_micro_batch) fits into the GPU's free memory
    (free_bytes, default torch.cuda.mem_get_info's) with the plan's reserve kept; gradient accumulation makes
    up the rest of the batch. The ranks take the smallest of their choices. A resume keeps the micro-batches
    its checkpoint's run used where they still fit: another split draws other dropout masks and sums the
    gradient in another order, so the resumed run would not be the checkpoint's run continued exactly.
    Raises ValueError when one sequence does not fit (build_run refuses the option off a GPU)."""
    from fastbert.simulated.device_fit import RESERVE, GiB, choose_micro_batch

    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(env.device)[0]
    kept = _recorded_micro_batches(resume)
    rank_batch = cfg.batch_size // env.world_size
    fsdp_world = env.world_size if env.distributed and cfg.distributed == "fsdp" else 1
    model = config.replace(activation_checkpointing=cfg.activation_checkpointing)
    choices = [choose_micro_batch(model, phase.seq_length, rank_batch, cfg.optimizer,
                                  "fp32" if dtype == torch.float32 else "bf16", free_bytes, fsdp_world)
               for phase in phases]
    sizes = [kept[p.seq_length] if p.seq_length in kept and kept[p.seq_length] <= c.largest_batch
             and rank_batch % kept[p.seq_length] == 0 else c.micro_batch_size for p, c in zip(phases, choices)]
    if env.distributed:
        agreed = torch.tensor(sizes, dtype=torch.float64)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=env.host_group)
        sizes = [int(v) for v in agreed.tolist()]
    for phase, choice, size in zip(phases, choices, sizes):
        phase.micro_batch_size = size
        reason = "as the checkpoint's run" if kept.get(phase.seq_length) == size != choice.micro_batch_size else \
            f"the largest divisor of {rank_batch} up to {choice.largest_batch}, the largest batch that fits"
        if env.is_main:
            logger.info(f"--micro-batch-size auto, length {phase.seq_length}: {size} sequences x "
                        f"{rank_batch // size} accumulation steps per rank ({reason}); the plan of a step at "
                        f"{choice.micro_batch_size}: peak {choice.peak_bytes / GiB:.2f} GiB, "
                        f"{choice.saved_for_backward_bytes / GiB:.2f} GiB saved for the backward; the GPU has "
                        f"{free_bytes / GiB:.2f} GiB free, {RESERVE.text()} kept")


def _recorded_micro_batches(resume: str | None) -> dict[int, int]:
    """{sequence length: micro-batch size} of the checkpoint's run, where its fingerprint records sizes."""
    saved = checkpoint.read_run_file(resume) if resume else None
    options = saved["fingerprint"]["options"] if saved and "fingerprint" in saved else {}
    text = options.get("micro_batch_size") or ""
    if not text.replace(",", "").isdigit():  # "" (no accumulation) or "auto" (an unresolved record)
        return {}
    sizes = parse_list("micro_batch_size", text, int)
    lengths = options["seq_lengths"]
    return dict(zip(lengths, sizes * len(lengths) if len(sizes) == 1 else sizes))


def stdlib_data(vocab_size: int, seq_lengths: list[int], env: distributed.Dist, objective: str = MLM_NSP) -> str:
    """The built-in corpus (Python's docstrings) prepared for `objective`, once into the cache by rank 0 (under
    the cache's lock: fastbert.data.prepare.builtin_dataset); the other ranks wait."""
    from fastbert.data.prepare import builtin_dataset, builtin_dir

    if env.is_main:
        builtin_dataset(vocab_size, seq_lengths, objective)
    if env.distributed:
        torch.distributed.barrier()
    return builtin_dir(vocab_size, objective)


def phase_dataset(data: str, seq_length: int, objective: str = MLM_NSP) -> ShardedDataset:
    """The dataset of length seq_length in `data`; ValueError when there is none, or when it was prepared for
    another objective (NSP pairs and packed full sentences are different examples)."""
    for candidate in (os.path.join(data, f"seq{seq_length}"), data):
        path = os.path.join(candidate, INDEX_FILE)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                if json.load(f).get("max_seq_length") != seq_length:
                    continue
            dataset = ShardedDataset(candidate)
            if dataset.objective != objective:
                raise ValueError(f"the dataset {candidate} was prepared for --objective {dataset.objective}, this "
                                 f"run's --objective is {objective}: prepare one for it with `fastbert prepare-data "
                                 f"--objective {objective} --max-seq-length {seq_length} --out DIR ...` (another "
                                 f"--out), or run --objective {dataset.objective}")
            return dataset
    raise ValueError(f"no dataset with max_seq_length {seq_length} in {data!r} (looked for {data}/seq{seq_length}/); "
                     f"create it with `fastbert prepare-data --max-seq-length {seq_length} --out {data} ...`")


def model_config(cfg: PretrainConfig, overrides: dict):
    """The --model preset (BERT's tiny / base / large, ModernBERT's modernbert-base / -large) or config.json,
    with the --model.<field> overrides, each a field that config has."""
    from fastbert.architectures import load_config
    from fastbert.config import BertConfig
    from fastbert.family_config import ModernBertConfig

    if cfg.model in PRESETS:
        family, size = (ModernBertConfig, cfg.model.removeprefix("modernbert-")) if cfg.model.startswith(
            "modernbert-") else (BertConfig, cfg.model)
        config = getattr(family, size)()
    elif os.path.exists(cfg.model):
        config = load_config(cfg.model)  # the config class of its model_type (bert, roberta, ...)
    else:
        raise ValueError(f"--model must be one of {PRESETS} or an HF config.json, got {cfg.model!r}")
    unknown = sorted(name for name in overrides if not hasattr(config, name))
    if unknown:
        raise ValueError(f"--model.{unknown[0]}: {type(config).__name__} has no field {unknown[0]!r}")
    return config.replace(**overrides)


def model_class(config, objective: str) -> type:
    """What a run trains: the masked-LM model of the config's architecture for mlm (BertForMaskedLM,
    RobertaForMaskedLM, ...), BERT's pretraining model (masked LM and next sentence prediction heads) for
    mlm+nsp. ValueError for mlm+nsp with a model that is not BERT's, or an architecture without a masked LM."""
    from fastbert.architectures import model_class as architecture_class

    model_type = config.model_type
    if objective == MLM:
        return architecture_class(config, "ForMaskedLM")
    if model_type != "bert":
        raise ValueError(f"--objective {MLM_NSP} needs a BERT --model (model_type 'bert'), got model_type "
                         f"{model_type!r}: next sentence prediction is BERT's pooler and NSP head over two segments "
                         f"of token types 0 and 1, which a {model_type} model does not have; use --objective {MLM} "
                         "(and data from `fastbert prepare-data --objective mlm`)")
    return architecture_class(config, "ForPreTraining")


def default_run_name(cfg: PretrainConfig) -> str:
    model = cfg.model if cfg.model in PRESETS else os.path.basename(os.path.normpath(cfg.model)).removesuffix(".json")
    data = STDLIB if cfg.data == STDLIB else os.path.basename(os.path.normpath(cfg.data))
    return f"{model}-{data}"


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


@dataclass
class Run:
    """What the training loop works with. `model` is the model_class one (sharded in place under FSDP2);
    `wrapped` is what runs the forward (DDP's wrapper, or the model itself)."""
    cfg: PretrainConfig
    model_overrides: dict
    env: distributed.Dist
    config: object  # BertConfig
    phases: list[Phase]
    dtype: torch.dtype
    sharded: bool
    out: str
    resume: str | None  # the checkpoint to resume from
    model: torch.nn.Module
    wrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    fingerprint: dict  # fingerprint.fingerprint(): what a checkpoint of this run must match to be resumed
    pinned: str | None  # a checkpoint retention must keep: the one an explicit --resume started from
    lock: contextlib.ExitStack  # holds the run directory's lock (rank 0)

    def close(self) -> None:
        self.lock.close()

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.out, checkpoint.CHECKPOINT_DIR)

    @property
    def metrics_file(self) -> str:
        return os.path.join(self.out, METRICS_FILE)

    def phase_of(self, step: int) -> int:
        """Index of the phase that step (0-based) belongs to."""
        return next(i for i, p in enumerate(self.phases) if step < p.end or p is self.phases[-1])

    def info(self, message: str) -> None:
        if self.env.is_main:
            logger.info(message)

    def warning(self, message: str) -> None:
        if self.env.is_main:
            logger.warning(message)


def _find_data(cfg: PretrainConfig, config, phases: list[Phase], env: distributed.Dist):
    """Attach each phase's dataset and masking collator; return the config with the data's vocab size."""
    data = cfg.data
    if data == STDLIB:
        data = stdlib_data(config.vocab_size, [p.seq_length for p in phases], env, cfg.objective)
    elif not os.path.isdir(data):
        raise ValueError(f"--data {data!r} is not a directory; create it with `fastbert prepare-data`")
    for phase in phases:
        phase.dataset = phase_dataset(data, phase.seq_length, cfg.objective)
        phase.collator = MaskingCollator(phase.dataset.vocabulary(), cfg.mask_prob, cfg.whole_word_masking,
                                         next_sentence=cfg.objective == MLM_NSP)
        # the collator labels about mask_prob of a sequence's tokens (Google's max_predictions_per_seq: 20 at 128)
        phase.label_budget = math.ceil(phase.seq_length * cfg.mask_prob)
    return phases[0].dataset


def checkpoint_objective(path: str) -> str:
    """The objective of the run that wrote the checkpoint at `path` (mlm+nsp for one older than the option)."""
    from fastbert.train.fingerprint import RECORDED_LATER
    saved = checkpoint.read_run_file(path) or {}
    return saved.get("fingerprint", {}).get("options", {}).get("objective", RECORDED_LATER["objective"])


def _resume_point(cfg: PretrainConfig, root: str) -> str | None:
    if cfg.resume == "auto":
        return checkpoint.latest_checkpoint(root)
    if cfg.resume == "never":
        return None
    if not os.path.isfile(os.path.join(cfg.resume, "trainer.pt")):
        raise ValueError(f"--resume {cfg.resume!r} is not a complete checkpoint directory")
    return cfg.resume


def _lock(out: str, env: distributed.Dist) -> contextlib.ExitStack:
    """Rank 0 holds the run directory's lock (fastbert.files.output_lock) until the stack closes; every
    rank raises when it could not be taken."""
    lock, error = contextlib.ExitStack(), None
    if env.is_main:
        try:
            lock.enter_context(output_lock(out))
        except OSError as exc:
            error = exc
    if distributed.host_sum([float(error is not None)], env)[0]:
        raise error or OSError(f"rank 0 could not lock the run directory {out}")
    return lock


def _prepare_directory(cfg: PretrainConfig, model_overrides: dict, out: str, resume: str | None,
                       current: dict, env: distributed.Dist) -> None:
    """Refuse a resume that would not continue its run (fingerprint.check_resume); move aside what belongs
    to another run line."""
    from fastbert.train.fingerprint import check_resume
    if resume:
        checkpoint.verify_digests(resume)  # before anything reads it, or is moved aside for it
    saved = checkpoint.read_run_file(resume) if resume else None
    if saved is not None:
        recorded = saved["fingerprint"]
        recorded = {**recorded, "model": {**_recorded_later(resume, saved), **recorded["model"]}}
        check_resume(recorded, current, resume, cfg.accept_changes)
    elif resume and env.is_main:
        logger.warning(f"{resume} records no fingerprint of its run (an older fastbert wrote it): resuming unchecked")
    if env.is_main:
        root = os.path.join(out, checkpoint.CHECKPOINT_DIR)
        os.makedirs(out, exist_ok=True)
        checkpoint.remove_incomplete(root)
        checkpoint.set_aside(out, os.path.join(out, METRICS_FILE), resume)


def _recorded_later(resume: str, saved: dict) -> dict:
    """The values an older checkpoint ran with of the model fields its fingerprint did not record yet
    (fingerprint.RECORDED_LATER: tie_word_embeddings): its model/config.json's (the whole config, whether set by
    --model's file or a --model.* flag), else its run.json's --model.* overrides (FSDP2 writes model/ last only)."""
    from fastbert.train.fingerprint import RECORDED_LATER
    values = _json_object(os.path.join(resume, checkpoint.MODEL_DIR, "config.json"))
    return {name: value for name, value in {**saved.get("model_overrides", {}), **values}.items()
            if name in RECORDED_LATER}


def _json_object(path: str) -> dict:
    """The JSON object in `path`; {} where there is none (no file, not JSON, not an object)."""
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def write_run_config(run: Run) -> None:
    """The run's options into config.json (rank 0), once a resume has loaded: a refused one leaves the
    directory's as it was."""
    if run.env.is_main:
        write_text(os.path.join(run.out, RUN_CONFIG_FILE),
                   json.dumps({**dataclasses.asdict(run.cfg), "model_overrides": run.model_overrides}, indent=2))


def _refuse_model_directory(out: str) -> None:
    """ValueError where --out holds a model (HF config.json, weights) rather than a run: the run's config.json
    would replace the model's."""
    options = _json_object(os.path.join(out, RUN_CONFIG_FILE))
    weights = [name for name in os.listdir(out) if name.endswith((".safetensors", ".bin"))]
    if weights or options and "model_overrides" not in options:
        raise ValueError(f"--out {out} holds a model ({', '.join(weights) or RUN_CONFIG_FILE}), not a pretraining "
                         f"run: the run would write its own {RUN_CONFIG_FILE} there; choose another --out")


def build_run(cfg: PretrainConfig, model_overrides: dict) -> Run:
    """Check the options, join the process group, find the data, lock and prepare the output directory,
    and build the model and the optimizer: initialised from cfg.seed, or on the meta device and then
    materialised uninitialised when a checkpoint is to be loaded into them (state.restore)."""
    from fastbert.train.fingerprint import fingerprint

    cfg.validate()
    env = distributed.init(cfg.device)
    if cfg.micro_batch_size == AUTO_MICRO_BATCH and env.device.type != "cuda":
        raise ValueError(f"--micro-batch-size auto plans the step's memory on a GPU and needs one; the device here is "
                         f"{env.device.type!r}: give a number (--micro-batch-size 8), or leave it out for no "
                         "accumulation")
    config = model_config(cfg, dict(model_overrides))
    trained_class = model_class(config, cfg.objective)
    if cfg.objective == MLM_NSP and config.type_vocab_size < 2:  # found by the first forward, after the set-up
        raise ValueError(f"--model.type_vocab_size {config.type_vocab_size} cannot hold --objective mlm+nsp's second "
                         "segments (token type 1): give 2 or more, or --objective mlm")
    ops.check_backend(config.backend, env.device, "--model.backend")  # else a traceback at the first step
    # RoBERTa's positions start after the padding index: 514 of them hold 512 tokens
    phases = plan_phases(cfg, config.max_sequence_length, env.world_size)
    sharded = env.distributed and cfg.distributed == "fsdp"
    dtype = compute_dtype(cfg.precision, env.device)
    if sharded and dtype == torch.float16:
        raise ValueError("--precision fp16 is not supported with --distributed fsdp; use bf16")
    dataset = _find_data(cfg, config, phases, env)
    if cfg.model in PRESETS:  # a preset takes the data's vocabulary (ModernBERT's presets pad with id 50283)
        from_data = {"vocab_size": dataset.vocab_size, "pad_token_id": dataset.special_ids["pad"]}
        config = config.replace(**{k: v for k, v in from_data.items() if k not in model_overrides})
    if config.vocab_size < dataset.vocab_size:
        raise ValueError(f"the model's vocab_size {config.vocab_size} is smaller than the data's {dataset.vocab_size}")
    if config.pad_token_id != dataset.special_ids["pad"]:
        raise ValueError(f"the model's pad_token_id {config.pad_token_id} differs from the data's "
                         f"[PAD] id {dataset.special_ids['pad']}")

    out = cfg.out or os.path.join("runs", cfg.run_name or default_run_name(cfg))
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file; the run writes a directory there")
    if os.path.isdir(out):
        _refuse_model_directory(out)
    resume = _resume_point(cfg, os.path.join(out, checkpoint.CHECKPOINT_DIR))
    recorded = cfg
    if cfg.micro_batch_size == AUTO_MICRO_BATCH:
        auto_micro_batches(cfg, config, phases, env, dtype, resume)
        # the fingerprint records the sizes chosen, which a resume keeps (auto_micro_batches)
        recorded = dataclasses.replace(cfg, micro_batch_size=",".join(str(p.micro_batch_size) for p in phases))
    current = fingerprint(recorded, config, phases, dtype)
    lock = _lock(out, env)
    try:
        _prepare_directory(cfg, model_overrides, out, resume, current, env)
        torch.manual_seed(cfg.seed)
        if resume and checkpoint_objective(resume) == cfg.objective:
            with torch.device("meta"):
                model = trained_class(config)
            model.to_empty(device=env.device)
            model.tie_weights()
        else:  # a fresh run, or a resume (--accept-changes) from the other objective's checkpoint, whose heads
            # differ: those it lacks start initialised (state.restore)
            model = trained_class(config).to(env.device)
        # not a math change (the recomputation reruns the same kernels with the same dropout seeds), so a
        # resume may change it (fingerprint.CHANGEABLE_OPTIONS)
        model.config.activation_checkpointing = cfg.activation_checkpointing
        wrapped = distributed.wrap(model, cfg.distributed, env, dtype if dtype != torch.float32 else None)
        optimizer = build_optimizer(model, cfg.optimizer, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay,
                                    sharded)
        warmup = int(cfg.warmup) if cfg.warmup >= 1 else round(cfg.warmup * cfg.steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_decay(max(warmup, 1), cfg.steps))
        scaler = torch.amp.GradScaler(env.device.type, enabled=dtype == torch.float16)
    except BaseException:
        lock.close()
        raise
    pinned = resume if resume and cfg.resume not in ("auto", "never") else None
    return Run(cfg, model_overrides, env, config, phases, dtype, sharded, out, resume, model, wrapped, optimizer,
               scheduler, scaler, current, pinned, lock)
