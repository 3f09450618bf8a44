"""`fastbert bench --suite memory`: the memory of one training step on an 80 GB GPU, planned without a GPU.

Every case runs the model on the meta device through fastbert.bench.memory_plan.plan_step (a dispatch-level
tracker of live storages; fastbert's Triton launchers and autograd Functions run through the stand-in driver,
nothing is launched), for fastbert and for transformers' model (BERT, ModernBERT) with eager attention and
with SDPA on its flash backend, on the same inputs: full-length sequences, two segments (BERT), 15% of the
tokens labelled for the MLM loss (fastbert reads them through its static budget,
config.max_predictions_per_seq = ceil(0.15 S), as `fastbert pretrain` sets it) and an NSP label per sequence
(BERT; ModernBERT pretrains its masked LM alone).

Per (case, provider) one JSON row: the peak at the stated batch, the bytes live at the end of the forward
and those kept for the backward, the encoder's saved bytes per token per layer (and that figure over h, read
against Megatron's 34·s·b·h), the breakdown at the peak, the largest batch that fits the planned GPU with
RESERVE kept, and the per-rank peak under FSDP2 for world sizes 2, 4 and 8 (computed from the plan).
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import torch

import fastbert
from fastbert.bench.model_cases import LABEL_FRACTION, SIZES, training_head

FASTBERT, HF_SDPA, HF_EAGER = "fastbert", "hf-sdpa", "hf-eager"
PROVIDERS = (FASTBERT, HF_SDPA, HF_EAGER)
GiB = 1 << 30
# The planned device: an H100 80 GB (80 GiB of HBM3). Its driver keeps part of it (CUDA reports about 79.1 GiB
# as total_memory), which the reserve's fixed part covers.
PLANNED_DEVICE_BYTES = 80 * GiB
PLANNED_DEVICE = "planned H100 80 GB (meta tensors, no GPU)"
FSDP2_WORLD_SIZES = (2, 4, 8)
MEGATRON_SBH = 34  # bytes per layer / (s·b·h) of a 16-bit layer with flash attention (Korthikanti et al., 2022)
LARGEST_BATCH_LIMIT = 65535  # the most sequences fastbert's attention takes (a grid dimension); the search stops there
ROOT_KIND = "(the model's top-level forward: its loss)"  # what the root module ("") saves itself
SECANT_STEPS = 4  # refits of the line before the search falls back to galloping and bisecting
STATE_CATEGORIES = ("weights", "gradients", "optimizer")  # plan_step's breakdown keys that FSDP2 shards
PAPER_SBH = 20  # issue 18's exact-backward floor: input 2, Q K V 6, attention output + LSE 2, FFN pre-act 8, LN 2


@dataclass(frozen=True)
class Reserve:
    """Memory a step may not plan on: a fixed part for what torch's allocator does not count (the share of HBM
    the driver keeps, the CUDA context with its loaded kernels, cuBLAS/cuDNN workspaces, NCCL buffers under
    torchrun) and a fraction of the planned peak for the caching allocator's rounding and fragmentation
    (blocks rounded to 512 B, segments of 2 MiB and 20 MiB whose free tails other sizes cannot always use)."""
    fixed_bytes: int
    fraction: float

    def needed(self, peak_bytes: int) -> int:
        """The device memory a step whose plan peaks at peak_bytes needs."""
        return self.fixed_bytes + math.ceil(peak_bytes * (1 + self.fraction))

    def text(self) -> str:
        return f"{self.fixed_bytes / GiB:g} GiB + {100 * self.fraction:g}% of the planned peak"


# 3 GiB: about 0.9 GiB of an 80 GiB H100 is not visible to CUDA, a context with fastbert's and cuBLAS's kernels
# loaded takes about 0.5-1 GiB, cuBLAS workspaces and NCCL buffers the rest. 10%: the caching allocator's
# reserved-over-allocated ratio at the peak of a training step is typically 1.02-1.10 without
# expandable_segments; the upper end is kept so that a batch the plan accepts does not run out of memory.
RESERVE = Reserve(fixed_bytes=3 * GiB, fraction=0.10)


@dataclass
class MemoryCase:
    mode: str  # "pretrain" (BertForPreTraining step), "finetune" (BertForSequenceClassification step), "inference"
    size: str  # a preset of model_cases.SIZES, or the name of a user's config
    seqlen: int
    batch: int  # the stated batch of the peak
    optimizer: str | None  # "adamw" | "lamb"; None for inference
    checkpointing: str = "none"  # fastbert's --activation-checkpointing option
    providers: tuple[str, ...] = PROVIDERS
    config: fastbert.BertConfig | None = field(default=None, repr=False)  # None: the preset `size`

    @property
    def op(self) -> str:
        return "memory"

    @property
    def name(self) -> str:
        extra = "" if self.optimizer is None else f",{self.optimizer}"
        extra += "" if self.checkpointing == "none" else f",checkpointing={self.checkpointing}"
        return f"{self.mode}/{self.size},S={self.seqlen}{extra}"

    @property
    def bert_config(self) -> fastbert.BertConfig:
        return self.config if self.config is not None else SIZES[self.size]()

    @property
    def precision(self) -> str:
        return "bf16-weights" if self.mode == "inference" else "bf16"

    @property
    def shape(self) -> dict:
        return {"size": self.size, "seqlen": self.seqlen, "batch": self.batch, "mode": self.mode,
                "optimizer": self.optimizer, "checkpointing": self.checkpointing}


def checkpointing_options() -> tuple[str, ...]:
    """fastbert's --activation-checkpointing options, "none" first; only "none" while the model has no switch."""
    from fastbert import config

    return tuple(getattr(config, "ACTIVATION_CHECKPOINTING", ("none",)))


def memory_cases() -> list[MemoryCase]:
    """The suite: pretraining at BERT-base and -large, S = 128 (batch 256) and 512 (batch 64), AdamW and LAMB,
    each checkpointing option (fastbert only beyond "none"); fine-tuning at S = 128, batch 32; inference at
    batch 256, S = 512."""
    cases = []
    for size in ("base", "large"):
        for seqlen, batch in ((128, 256), (512, 64)):
            for optimizer in ("adamw", "lamb"):
                for option in checkpointing_options():
                    cases.append(MemoryCase("pretrain", size, seqlen, batch, optimizer, option,
                                            PROVIDERS if option == "none" else (FASTBERT,)))
    cases += [MemoryCase("finetune", size, 128, 32, "adamw") for size in ("base", "large")]
    cases += [MemoryCase("inference", size, 512, 256, None) for size in ("base", "large")]
    # ModernBERT-base (masked-LM pretraining) at S = 512 and 8,192, against transformers' SDPA and eager paths
    cases += [MemoryCase("pretrain", "modernbert-base", 512, 64, "adamw"),
              MemoryCase("pretrain", "modernbert-base", 8192, 4, "adamw")]
    return cases


def label_budget(seqlen: int) -> int:
    """Labelled tokens per sequence: what `fastbert pretrain` sets as max_predictions_per_seq."""
    return math.ceil(seqlen * LABEL_FRACTION)


def build_model(case: MemoryCase, provider: str, device: str | torch.device = "meta") -> torch.nn.Module:
    """The case's model on `device` (meta: sizes only): fastbert with backend "auto" (in a plan: the paths
    fastbert.paths chooses on the planned H100), or transformers' BERT with the provider's attention. Inference
    models hold bf16 weights; training models fp32 (autocast computes in bf16)."""
    config = case.bert_config
    if case.mode == "pretrain":
        config = config.replace(max_predictions_per_seq=label_budget(case.seqlen))
    head = {"pretrain": training_head(config), "finetune": "ForSequenceClassification", "inference": "Model"}[case.mode]
    if provider == FASTBERT:
        from fastbert.architectures import model_class

        config = config.replace(backend="auto")
        if case.checkpointing != "none":
            config = config.replace(activation_checkpointing=case.checkpointing)
        with torch.device(device):
            model = model_class(config, head)(config)
    else:
        import transformers

        values = config.to_dict()  # config.json's fields: fastbert's own switches are not among them
        hf_config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        hf_class = getattr(transformers, type(hf_config).__name__.removesuffix("Config") + head)
        with torch.device(device):
            model = hf_class._from_config(hf_config, attn_implementation="eager" if provider == HF_EAGER else "sdpa")
    if case.mode == "inference":
        return model.to(torch.bfloat16).eval()
    return model.train()


def make_inputs(case: MemoryCase, batch: int, device: str | torch.device = "meta") -> dict:
    """The case's seeded batch on `device`: full-length sequences, [B, S] int64 ids, mask and (BERT) two
    segments; pretrain adds [B, S] MLM labels (label_budget(S) random positions per sequence, -100 elsewhere)
    and (BERT) [B] NSP labels, finetune [B] labels of 2 classes; inference takes no labels."""
    config, seqlen = case.bert_config, case.seqlen
    g = torch.Generator().manual_seed(0)
    tensors = {"input_ids": torch.randint(1, config.vocab_size, (batch, seqlen), generator=g),
               "attention_mask": torch.ones(batch, seqlen, dtype=torch.long)}
    segments = (torch.arange(seqlen) >= seqlen // 2).long().expand(batch, seqlen).contiguous()
    if config.type_vocab_size > 1:  # BERT's two segments; one-segment models (ModernBERT, mlm) take none
        tensors["token_type_ids"] = segments
    if case.mode == "finetune":
        tensors["labels"] = torch.randint(0, 2, (batch,), generator=g)
    elif case.mode == "pretrain":
        positions = torch.rand(batch, seqlen, generator=g).argsort(dim=1)[:, :label_budget(seqlen)]  # [B, k]
        labels = torch.full((batch, seqlen), -100)
        labels.scatter_(1, positions, torch.randint(0, config.vocab_size, positions.shape, generator=g))
        next_sentence_label = torch.randint(0, 2, (batch,), generator=g)
        tensors["labels"] = labels
        if training_head(config) == "ForPreTraining":
            tensors["next_sentence_label"] = next_sentence_label
    return {k: v.to(device) for k, v in tensors.items()}


def plan(case: MemoryCase, provider: str, batch: int):
    """plan_step of the case's step at this batch: a fastbert.bench.memory_plan.StepMemory."""
    from fastbert.bench.memory_plan import plan_step

    mode = "inference" if case.mode == "inference" else "train"
    return plan_step(build_model(case, provider), provider_inputs(case, provider, batch), mode=mode,
                     optimizer=case.optimizer, precision=case.precision)


def provider_inputs(case: MemoryCase, provider: str, batch: int, device: str | torch.device = "meta") -> dict:
    """make_inputs as the provider's forward takes them. transformers reads an attention mask's data to drop an
    all-ones one (which lets SDPA take its flash kernel); the sequences are full, so no mask is what it runs on
    a GPU, and a meta tensor has no data to read."""
    inputs = make_inputs(case, batch, device)
    if provider != FASTBERT:
        del inputs["attention_mask"]
    return inputs


def fits(peak_bytes: int, device_bytes: int, reserve: Reserve = RESERVE) -> bool:
    return reserve.needed(peak_bytes) <= device_bytes


def largest_batch(peak_of, device_bytes: int, reserve: Reserve = RESERVE, known: dict | None = None,
                  limit: int = 1 << 20) -> tuple[int, int]:
    """(the largest batch whose planned peak fits device_bytes with the reserve, the plans it took).

    peak_of(batch) -> peak bytes. Past small batches (whose peak is the optimizer step's: weights, gradients and
    state) a step's peak is affine in the batch, so a line through two planned batches near the budget crosses
    it at the answer: the search plans a second batch (half the one known), then the line's crossing, refitted
    (secant steps) until the batch fits and the next does not; where the line is off it gallops and bisects, so
    the answer is exact either way. known: {batch: peak bytes} already planned. The search goes no further than
    `limit`, returned when it fits; (0, plans) when not even batch 1 fits."""
    peaks = dict(known or {})
    budget = (device_bytes - reserve.fixed_bytes) / (1 + reserve.fraction)  # the largest peak that fits

    def ok(b: int) -> bool:
        if b not in peaks:
            peaks[b] = peak_of(b)
        return fits(peaks[b], device_bytes, reserve)

    def plans() -> int:
        return len(peaks) - len(known or {})

    def bracket() -> tuple[int, int | None]:
        fitting = [b for b in peaks if ok(b)]
        return max(fitting, default=0), min((b for b in peaks if not ok(b)), default=None)

    def crossing() -> int:
        """The line's crossing with the budget, through the planned batch nearest it and one far enough from
        it that rounding does not tilt the line."""
        near = sorted(peaks, key=lambda b: abs(peaks[b] - budget))
        a = near[0]
        b = next((b for b in near[1:] if abs(b - a) >= max(2, a // 8)), near[1])
        slope = (peaks[b] - peaks[a]) / (b - a)
        return limit if slope <= 0 else round(a + (budget - peaks[a]) / slope)

    if not any(ok(b) for b in list(peaks)) and not ok(1):
        return 0, plans()
    if len(peaks) < 2:
        only = next(iter(peaks))
        ok(only // 2 if only > 1 else 2)
    low, high = bracket()
    for _ in range(SECANT_STEPS):
        if high is not None and high - low <= 1:
            return low, plans()
        guess = min(max(crossing(), low + 1), limit if high is None else high - 1)
        if guess in peaks:
            break
        ok(guess)
        low, high = bracket()
    step = 1
    while high is None:  # gallop upwards from the largest batch that fits
        following = min(limit, low + step)
        if following == low:
            return low, plans()
        if ok(following):
            low, step = following, 2 * step
        else:
            high = following
    while high - low > 1:
        middle = (low + high) // 2
        if ok(middle):
            low = middle
        else:
            high = middle
    return low, plans()


# an encoder layer's module names in HF's layouts: ...encoder.layer.N... (BERT), ...transformer.layer.N...
# (DistilBERT), ...layers.N... (ModernBERT); and the layers' container, which with full activation
# checkpointing keeps each layer's input
LAYER = re.compile(r"\.(?:encoder\.layer|transformer\.layer|layers)\.(\d+)(?:\.|$)")
LAYERS = re.compile(r"\.(?:encoder|transformer|layers)$")


def layer_index(name: str) -> str | None:
    """The encoder layer a module or parameter name belongs to, or None."""
    match = LAYER.search(f".{name}")
    return None if match is None else match.group(1)


def encoder_saved_bytes(saved_by_module: dict[str, int]) -> int:
    """Bytes saved for the backward by the encoder's layers, and by the encoder itself (LAYER, LAYERS)."""
    return sum(v for name, v in saved_by_module.items()
               if layer_index(name) is not None or LAYERS.search(f".{name}"))


def gathered_parameters(model: torch.nn.Module) -> int:
    """Parameters FSDP2 holds unsharded at once under `--distributed fsdp` (one shard group per encoder layer
    plus the root): the root's (embeddings and heads, gathered through the root's forward) and two layers'
    (the one computing and the one prefetched)."""
    layers: dict[str, int] = {}
    root = 0
    for name, p in model.named_parameters():
        index = layer_index(name)
        if index is not None:
            layers[index] = layers.get(index, 0) + p.numel()
        else:
            root += p.numel()
    return root + 2 * max(layers.values(), default=0)


def fsdp2_per_rank(memory, gathered_params: int, world_size: int) -> int:
    """A rank's peak under FSDP2 with bf16 all-gathers: the peak's weights, gradients and optimizer state
    divided by the world size, the rest (activations, transients) unchanged, plus the gathered parameters in
    bf16 (fastbert.bench.memory_cases.gathered_parameters)."""
    state = sum(memory.peak_breakdown.get(k, 0) for k in STATE_CATEGORIES)
    return memory.peak_bytes - state + math.ceil(state / world_size) + 2 * gathered_params


def row_figures(case: MemoryCase, provider: str, batch_peaks: dict | None = None) -> dict:
    """The row's figures for one (case, provider): the plan at the stated batch and the derived columns."""
    start = time.monotonic()
    config = case.bert_config
    memory = plan(case, provider, case.batch)
    gathered = gathered_parameters(build_model(case, provider))
    tokens = case.batch * case.seqlen
    saved = encoder_saved_bytes(memory.saved_by_module)
    per_token_layer = saved / (tokens * config.num_hidden_layers)
    known = dict(batch_peaks or {})
    known[case.batch] = memory.peak_bytes
    largest, plans = largest_batch(lambda b: plan(case, provider, b).peak_bytes, PLANNED_DEVICE_BYTES,
                                   known=known, limit=LARGEST_BATCH_LIMIT)
    return {
        "batch": case.batch, "tokens": tokens, "precision": case.precision,
        "peak_bytes": memory.peak_bytes, "forward_end_bytes": memory.forward_end_bytes,
        "saved_for_backward_bytes": memory.saved_for_backward_bytes, "encoder_saved_bytes": saved,
        "bytes_per_token_per_layer": per_token_layer, "sbh_per_layer": per_token_layer / config.hidden_size,
        "weights_bytes": memory.weights_bytes, "gradients_bytes": memory.gradients_bytes,
        "optimizer_bytes": memory.optimizer_bytes, "peak_breakdown": dict(memory.peak_breakdown),
        "saved_by_module_kind": saved_by_kind(memory.saved_by_module), "phase_of_peak": memory.phase_of_peak,
        "device_bytes": PLANNED_DEVICE_BYTES, "reserve": RESERVE.text(), "largest_batch": largest,
        "largest_batch_plans": plans + 1,
        "fsdp2_peak_bytes": {str(w): fsdp2_per_rank(memory, gathered, w) for w in FSDP2_WORLD_SIZES},
        **recompute_figures(case, provider),
        "plan_seconds": round(time.monotonic() - start, 2),
    }


def recompute_figures(case: MemoryCase, provider: str) -> dict:
    """What fastbert's --activation-checkpointing option costs at the stated batch: the extra forward FLOPs the
    backward reruns, and their share of the step's model FLOPs (fastbert.train.metrics)."""
    if provider != FASTBERT or case.mode != "pretrain":
        return {}
    from fastbert.data.examples import MLM, MLM_NSP
    from fastbert.train.metrics import recompute_flops_per_token, training_flops

    lengths = torch.full((case.batch,), case.seqlen)  # [B], full-length sequences
    extra = recompute_flops_per_token(case.bert_config, case.checkpointing, case.seqlen) * case.batch * case.seqlen
    objective = MLM_NSP if training_head(case.bert_config) == "ForPreTraining" else MLM
    step = training_flops(case.bert_config, lengths, case.batch * label_budget(case.seqlen), objective)
    return {"checkpointing_extra_flops": extra, "checkpointing_extra_flops_fraction": extra / step}


def saved_by_kind(saved_by_module: dict[str, int]) -> dict[str, int]:
    """Saved bytes per module kind: a module's qualified name without its layer index (encoder.layer.3.attention
    and encoder.layer.7.attention are both encoder.layer.*.attention)."""
    kinds: dict[str, int] = {}
    for name, value in saved_by_module.items():
        kind = ".".join("*" if part.isdigit() else part for part in name.split(".")) or ROOT_KIND
        kinds[kind] = kinds.get(kind, 0) + value
    return kinds


def planned_provenance(command: list[str] | None) -> dict:
    """The rows' provenance: the run's versions, commit, date and command; the device is the planned GPU and
    the machine that planned it is named as the host."""
    from fastbert.bench.provenance import cpu_name, provenance

    return {**provenance(torch.device("cpu"), command), "device": PLANNED_DEVICE, "device_type": "planned",
            "host": cpu_name(), "timer": None, "memory_meter": "fastbert.bench.memory_plan.plan_step"}


def run_memory_suite(out_dir: str, only: str | None = None, progress: bool = True,
                     command: list[str] | None = None) -> tuple[str, list[dict]]:
    """Plan every (case, provider) of memory_cases(); write the rows to a JSON file under out_dir after each
    item (fastbert.bench.runner's row format); return the file's path and the rows. A provider that fails is a
    row with status "error" and the run goes on."""
    import logging
    import os
    import re
    import sys

    from tqdm import tqdm

    from fastbert.bench.runner import case_fields, result_path, write_rows

    logger = logging.getLogger("fastbert.bench")
    common = {**planned_provenance(command), "suite": "memory"}
    os.makedirs(out_dir, exist_ok=True)
    path = result_path(out_dir, "memory", common)
    items = [(case, provider) for case in memory_cases() for provider in case.providers]
    if only:
        pattern = re.compile(only)
        items = [(c, p) for c, p in items if pattern.search(f"{c.name} {p}")]
    start, rows = time.monotonic(), []
    for case, provider in tqdm(items, desc="fastbert bench memory", unit="plan", file=sys.stderr,
                               disable=not progress, dynamic_ncols=True):
        base = {**common, **case_fields(case), "dtype": case.precision, "provider": provider}
        try:
            rows.append({**base, "status": "ok", **row_figures(case, provider)})
        except Exception as exc:  # one provider failing must not lose the rest of the run
            logger.exception(f"{case.name} [{provider}] failed; the run goes on")
            rows.append({**base, "status": "error", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                         if str(exc) else type(exc).__name__})
        write_rows(path, rows)
    for row in rows:
        row["suite_seconds"] = round(time.monotonic() - start, 1)
    write_rows(path, rows)
    return path, rows


def user_case(model: str, seqlen: int, batch: int) -> MemoryCase:
    """The pretraining step (AdamW, bf16 autocast) of a user's config: a preset name or a config.json path.
    Raises ValueError naming the argument when a value is out of range or the config cannot be read."""
    import os

    if model in SIZES:
        config = SIZES[model]()
    elif os.path.exists(model):
        config = fastbert.BertConfig.from_json(model)
    else:
        raise ValueError(f"--model must be one of {tuple(SIZES)} or a config.json path, got {model!r}")
    if not 1 <= seqlen <= config.max_position_embeddings:
        raise ValueError(f"--seq-length must be in [1, max_position_embeddings={config.max_position_embeddings}], "
                         f"got {seqlen}")
    if batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")
    name = model if model in SIZES else os.path.basename(os.path.normpath(model))
    return MemoryCase("pretrain", name, seqlen, batch, "adamw", providers=(FASTBERT,), config=config)


def plan_table(case: MemoryCase, figures: dict) -> str:
    """The plan of one (case, fastbert) as a plain-text table (bytes and GiB), from row_figures' dict."""
    config = case.bert_config
    lines = [f"fastbert memory plan: {case.name}, batch {case.batch}, {config.num_hidden_layers} layers, "
             f"h={config.hidden_size}, bf16 autocast with fp32 weights, AdamW; {PLANNED_DEVICE}",
             f"{'figure':<52} {'bytes':>18} {'GiB':>9}"]

    def line(label: str, value: int) -> None:
        lines.append(f"{label:<52} {value:>18,} {value / GiB:>9.3f}")

    line(f"peak (in the {figures['phase_of_peak']})", figures["peak_bytes"])
    for category, value in figures["peak_breakdown"].items():
        line(f"  at the peak: {category}", value)
    line("live at the end of the forward", figures["forward_end_bytes"])
    line("  of which saved for the backward", figures["saved_for_backward_bytes"])
    line("  of which saved by the encoder's layers", figures["encoder_saved_bytes"])
    for kind, value in figures["saved_by_module_kind"].items():
        line(f"    saved by {kind}", value)
    line("weights", figures["weights_bytes"])
    line("gradients", figures["gradients_bytes"])
    line("optimizer state", figures["optimizer_bytes"])
    for world, value in figures["fsdp2_peak_bytes"].items():
        line(f"peak per rank under FSDP2, {world} ranks", value)
    lines += [f"encoder's saved bytes per token per layer: {figures['bytes_per_token_per_layer']:,.1f} = "
              f"{figures['sbh_per_layer']:.2f}·s·b·h bytes per layer (Megatron's: {MEGATRON_SBH}·s·b·h)",
              f"largest batch that fits {PLANNED_DEVICE_BYTES / GiB:g} GiB keeping {figures['reserve']}: "
              f"{figures['largest_batch']}" + (" (the most the search tries)"
                                               if figures["largest_batch"] == LARGEST_BATCH_LIMIT else "")]
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """The suite's rows as a plain-text table for the terminal."""
    lines = [f"{'case':<46} {'provider':<9} {'batch':>5} {'peak GiB':>9} {'saved GiB':>9} {'x sbh':>6} "
             f"{'max batch':>9}"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['case'][:46]:<46} {r['provider']:<9} {r['status']}: {r.get('error', '')}")
            continue
        sbh = "-" if r["shape"]["mode"] == "inference" else f"{r['sbh_per_layer']:6.2f}"
        lines.append(f"{r['case'][:46]:<46} {r['provider']:<9} {r['batch']:>5} {r['peak_bytes'] / GiB:>9.2f} "
                     f"{r['saved_for_backward_bytes'] / GiB:>9.2f} {sbh:>6} {r['largest_batch']:>9}")
    return "\n".join(lines)


@dataclass
class MicroBatchChoice:
    """`fastbert pretrain --micro-batch-size auto` for one phase: the micro-batch, the largest batch that fits
    and the plan of a step at the micro-batch (peak and what is saved for the backward, bytes)."""
    micro_batch_size: int
    largest_batch: int
    peak_bytes: int
    saved_for_backward_bytes: int
    plans: int


def choose_micro_batch(config: fastbert.BertConfig, seqlen: int, rank_batch: int, optimizer: str, precision: str,
                       free_bytes: int, fsdp_world_size: int = 1) -> MicroBatchChoice:
    """The largest divisor of rank_batch (this rank's sequences per step) whose planned step fits free_bytes with
    RESERVE kept: a fastbert BertForPreTraining step at sequence length seqlen, with the model's config
    (its activation_checkpointing included), the optimizer, precision "bf16" or "fp32", per rank under FSDP2
    when fsdp_world_size > 1. Raises ValueError when not even a micro-batch of one sequence fits."""
    from fastbert.bench.memory_plan import plan_step

    case = MemoryCase("pretrain", "run", seqlen, rank_batch, optimizer, providers=(FASTBERT,), config=config)
    gathered = gathered_parameters(build_model(case, FASTBERT)) if fsdp_world_size > 1 else 0
    plans: dict[int, object] = {}

    def step(batch: int):
        if batch not in plans:
            plans[batch] = plan_step(build_model(case, FASTBERT), provider_inputs(case, FASTBERT, batch), mode="train",
                                     optimizer=optimizer, precision=precision)
        return plans[batch]

    def peak_of(batch: int) -> int:
        memory = step(batch)
        return memory.peak_bytes if fsdp_world_size == 1 else fsdp2_per_rank(memory, gathered, fsdp_world_size)

    largest, count = largest_batch(peak_of, free_bytes, limit=rank_batch)
    if largest == 0:
        raise ValueError(f"--micro-batch-size auto: a micro-batch of 1 sequence of length {seqlen} needs "
                         f"{RESERVE.needed(peak_of(1)) / GiB:.2f} GiB by the plan ({RESERVE.text()} kept), and the "
                         f"GPU has {free_bytes / GiB:.2f} GiB free")
    size = max(d for d in range(1, largest + 1) if rank_batch % d == 0)
    return MicroBatchChoice(size, largest, peak_of(size), step(size).saved_for_backward_bytes, count)
