"""`fastbert bench --suite memory`: the memory of one training step on an 80 GB GPU, planned without a GPU.

Every case runs the model on the meta device through fastbert.simulated.memory_plan.plan_step (a dispatch-level
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

import re
import time
from dataclasses import dataclass, field

import torch

import fastbert
from fastbert.bench.model_cases import SIZES
from fastbert.simulated.device_fit import (RESERVE, GiB, fsdp2_per_rank, gathered_parameters, largest_batch,
                                           layer_index)
from fastbert.simulated.memory_plan import plan_step
from fastbert.simulated.pretraining import (encoder_inputs, fastbert_model, label_budget, pretraining_batch,
                                            pretraining_model, training_head)

FASTBERT, HF_SDPA, HF_EAGER = "fastbert", "hf-sdpa", "hf-eager"
PROVIDERS = (FASTBERT, HF_SDPA, HF_EAGER)
# The planned device: an H100 80 GB (80 GiB of HBM3). Its driver keeps part of it (CUDA reports about 79.1 GiB
# as total_memory), which the reserve's fixed part covers.
PLANNED_DEVICE_BYTES = 80 * GiB
PLANNED_DEVICE = "planned H100 80 GB (meta tensors, no GPU)"
FSDP2_WORLD_SIZES = (2, 4, 8)
MEGATRON_SBH = 34  # bytes per layer / (s·b·h) of a 16-bit layer with flash attention (Korthikanti et al., 2022)
LARGEST_BATCH_LIMIT = 65535  # the most sequences fastbert's attention takes (a grid dimension); the search stops there
ROOT_KIND = "(the model's top-level forward: its loss)"  # what the root module ("") saves itself
PAPER_SBH = 20  # issue 18's exact-backward floor: input 2, Q K V 6, attention output + LSE 2, FFN pre-act 8, LN 2


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


def build_model(case: MemoryCase, provider: str, device: str | torch.device = "meta") -> torch.nn.Module:
    """The case's model on `device` (meta: sizes only): fastbert with backend "auto" (in a plan: the paths
    fastbert.paths chooses on the planned H100), or transformers' BERT with the provider's attention. Inference
    models hold bf16 weights; training models fp32 (autocast computes in bf16)."""
    config = case.bert_config
    head = {"pretrain": training_head(config), "finetune": "ForSequenceClassification", "inference": "Model"}[case.mode]
    if provider == FASTBERT:
        config = config.replace(backend="auto")
        if case.checkpointing != "none":
            config = config.replace(activation_checkpointing=case.checkpointing)
        model = (pretraining_model(config, case.seqlen, head, device) if case.mode == "pretrain"
                 else fastbert_model(config, head, device))
    else:
        import transformers

        # config.json's fields: fastbert's own switches (the label budget, checkpointing) are not among them
        values = config.to_dict()
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
    and (BERT) [B] NSP labels (simulated.pretraining.pretraining_batch), finetune [B] labels of 2 classes;
    inference takes no labels."""
    config = case.bert_config
    if case.mode == "pretrain":
        return pretraining_batch(config, batch, case.seqlen, training_head(config), device)
    g = torch.Generator().manual_seed(0)
    tensors = encoder_inputs(config, batch, case.seqlen, g)
    if case.mode == "finetune":
        tensors["labels"] = torch.randint(0, 2, (batch,), generator=g)
    return {k: v.to(device) for k, v in tensors.items()}


def plan(case: MemoryCase, provider: str, batch: int):
    """plan_step of the case's step at this batch: a fastbert.simulated.memory_plan.StepMemory. Every provider
    holds the whole batch: the mask transformers' forward is not given (given_inputs) is the caller's tensor
    all the same, counted among the inputs as fastbert's is."""
    mode = "inference" if case.mode == "inference" else "train"
    inputs = make_inputs(case, batch)
    given = given_inputs(inputs, provider)
    return plan_step(build_model(case, provider), given, mode=mode, optimizer=case.optimizer,
                     precision=case.precision, held=[t for name, t in inputs.items() if name not in given])


def given_inputs(inputs: dict, provider: str) -> dict:
    """The inputs the provider's forward is given. transformers reads an attention mask's data to drop an all-ones
    one (which lets SDPA take its flash kernel); the sequences are full, so no mask is what it runs on a GPU, and a
    meta tensor has no data to read."""
    return inputs if provider == FASTBERT else {k: v for k, v in inputs.items() if k != "attention_mask"}


# the container of the encoder's layers (device_fit.LAYER) in HF's layouts, which with full activation
# checkpointing keeps each layer's input
LAYERS = re.compile(r"\.(?:encoder|transformer|layers)$")


def encoder_saved_bytes(saved_by_module: dict[str, int]) -> int:
    """Bytes saved for the backward by the encoder's layers (device_fit.layer_index), and by the encoder itself
    (LAYERS)."""
    return sum(v for name, v in saved_by_module.items()
               if layer_index(name) is not None or LAYERS.search(f".{name}"))


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
            "host": cpu_name(), "timer": None, "memory_meter": "fastbert.simulated.memory_plan.plan_step"}


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
