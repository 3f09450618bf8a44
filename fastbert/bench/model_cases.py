"""Whole-model benchmark cases: BertForPreTraining training steps, BertModel inference and the
largest batch that fits, fastbert against transformers' BERT on the same config and batch; MPNet
(MPNetForMaskedLM training, MPNetModel inference: the relative-position bias in the attention kernel)
against transformers' MPNet, which has eager attention only; and ModernBERT-base at S = 512 and 8,192
(masked-LM training, inference; fastbert unpadded on its kernels, with its windowed rotary attention) against
transformers' SDPA and eager paths, and its flash-attention-2 path where the flash_attn package imports.

Providers:
- "fastbert": fastbert's model with its default config (backend="auto": on a GPU each op runs the path
  fastbert/paths.json measured fastest there), what a user gets; "fastbert-unpad": the same with config.unpad=True.
- "fastbert-eager": fastbert's model on the reference ops (backend="torch"; the smoke run's provider).
- "fastbert-triton" (BERT-base inference): fastbert's model with every fused op on its Triton kernel
  (backend="triton"), where "auto" may run cuBLAS or PyTorch's path: beside it, what a forward the host bounds
  gains or loses by each path's host cost (a Triton launch against cuBLAS's per-GEMM host work).
- "fastbert-apply" (BERT-base training): transformers' BertForPreTraining after fastbert.apply() with its
  defaults, called as transformers' (its MLM loss fused: issue 25).
A training step of fastbert's classes and of the applied model reads the MLM head on the same static budget of
positions per sequence (config.max_predictions_per_seq, as `fastbert pretrain` sets it); each row names the
backend its fastbert model ran with.
- "fastbert-graph" (BERT-base inference): fastbert's model through fastbert.CapturedForward, one CUDA graph of the
  case's shape, replayed.
- "hf-sdpa": transformers' BertForPreTraining / BertModel with scaled_dot_product_attention (its default);
  "hf-eager": its eager attention; "hf-sdpa+compile": torch.compile of hf-sdpa.

A training step is forward (bf16 autocast on a GPU) with MLM + NSP labels, backward and an AdamW step
(fused on a GPU), parameters in fp32. Inference runs the bf16 model under torch.inference_mode.
Tokens are the non-padding tokens. Model FLOPs are pretraining's count (fastbert.train.metrics:
training = 3x forward, the MLM head on the labelled tokens only, padding not counted), the same for
every provider (the useful work, not what a provider chooses to compute), so
MFU = FLOPs / time / measured bf16 matmul rate ranks providers as tokens/s does.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

import fastbert
from fastbert import architectures
from fastbert.bench.op_cases import mask_from_lengths, random_lengths
from fastbert.bench.timing import device_time_fields, peak_memory, time_ms
from fastbert.data.examples import MLM, MLM_NSP
from fastbert.family_config import ModernBertConfig, MPNetConfig
from fastbert.in_place import fastbert_config
from fastbert.simulated.pretraining import LABEL_FRACTION, training_head
from fastbert.train.metrics import encoder_flops, training_flops

FASTBERT, UNPAD, EAGER, TRITON = "fastbert", "fastbert-unpad", "fastbert-eager", "fastbert-triton"
APPLY, GRAPH = "fastbert-apply", "fastbert-graph"
FASTBERT_MODELS = frozenset({FASTBERT, UNPAD, EAGER, TRITON, GRAPH})  # fastbert's own classes
PROVIDER_BACKENDS = {EAGER: "torch", TRITON: "triton"}  # providers that set config.backend (others keep the config's)
HF_SDPA, HF_EAGER, HF_COMPILE, HF_FA2 = "hf-sdpa", "hf-eager", "hf-sdpa+compile", "hf-flash-attention-2"
HF_ATTENTION = {HF_SDPA: "sdpa", HF_EAGER: "eager", HF_COMPILE: "sdpa", HF_FA2: "flash_attention_2"}
GPU_PROVIDERS = frozenset({FASTBERT, UNPAD, TRITON, HF_COMPILE, APPLY, GRAPH})
TRAINABLE = ("all", "bitfit")  # ModelCase.trainable: every parameter, or the bias terms alone (freeze)
SIZES = {"base": fastbert.BertConfig.base, "large": fastbert.BertConfig.large, "tiny": fastbert.BertConfig.tiny,
         # all-mpnet-base-v2's shape (514 positions: 512 tokens after the padding index's offset)
         "mpnet-base": lambda: MPNetConfig(max_position_embeddings=514), "mpnet-tiny": MPNetConfig.tiny,
         "modernbert-base": ModernBertConfig.base, "modernbert-large": ModernBertConfig.large,
         "modernbert-tiny": ModernBertConfig.tiny}


def oom_errors() -> tuple[type[BaseException], ...]:
    return (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else (torch.cuda.OutOfMemoryError,)


@dataclass
class ModelCase:
    mode: str  # "train" (BertForPreTraining step), "inference" (BertModel forward) or "capacity"
    size: str  # "base", "large" or "tiny"
    batch: int  # the batch asked for; train halves it until it fits, capacity searches upwards from it
    seqlen: int
    padded: bool  # lengths uniform in [S/4, S] instead of full sequences
    providers: tuple[str, ...]
    trainable: str = "all"  # TRAINABLE: which parameters train

    @property
    def op(self) -> str:
        return "model"

    @property
    def config(self) -> fastbert.BertConfig:
        return SIZES[self.size]()

    @property
    def shape(self) -> dict:
        frozen = {} if self.trainable == "all" else {"trainable": self.trainable}  # the rows of every-parameter runs
        return {"size": self.size, "batch": self.batch, "seqlen": self.seqlen, "padded": self.padded, **frozen}

    @property
    def name(self) -> str:
        return (f"{self.mode}/{self.size},batch={self.batch},seqlen={self.seqlen}" + (",padded" if self.padded else "")
                + ("" if self.trainable == "all" else f",{self.trainable}"))

    def provider_names(self) -> list[str]:
        return list(self.providers)


def freeze(model: torch.nn.Module, trainable: str) -> None:
    """Leave only `trainable` (TRAINABLE) requiring grad: "bitfit" (Ben Zaken et al., 2021) trains the bias terms
    alone, so every weight matrix is frozen and each op's backward skips its weight-gradient matmul."""
    if trainable not in TRAINABLE:
        raise ValueError(f"trainable must be one of {TRAINABLE}, got {trainable!r}")
    if trainable == "bitfit":
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name.endswith("bias"))


def make_batch(config: fastbert.BertConfig, batch: int, seqlen: int, padded: bool, device: torch.device) -> dict:
    """A seeded pretraining batch: right padding, two segments (where the model has token types), 15% of
    the real tokens labelled, and a next-sentence label for BERT."""
    g = torch.Generator().manual_seed(0)
    lengths = random_lengths(batch, seqlen, g) if padded else torch.full((batch,), seqlen)
    mask = mask_from_lengths(lengths, seqlen)  # [B, S]
    positions = torch.arange(seqlen)[None, :]
    pad = config.pad_token_id
    input_ids = torch.randint(1, config.vocab_size, (batch, seqlen), generator=g)
    input_ids = torch.where(input_ids == pad, (pad + 1) % config.vocab_size, input_ids).masked_fill(~mask.bool(), pad)
    token_type_ids = ((positions >= (lengths[:, None] // 2)) & mask.bool()).long()
    labels = torch.randint(0, config.vocab_size, (batch, seqlen), generator=g)
    labels[(torch.rand((batch, seqlen), generator=g) >= LABEL_FRACTION) | ~mask.bool()] = -100
    tensors = {"input_ids": input_ids, "attention_mask": mask.long(), "labels": labels}
    if config.type_vocab_size:
        tensors["token_type_ids"] = token_type_ids
    next_sentence_label = torch.randint(0, 2, (batch,), generator=g)
    if training_head(config) == "ForPreTraining":
        tensors["next_sentence_label"] = next_sentence_label
    most_labelled = int((labels != -100).sum(dim=1).max())  # on the host, before the batch goes to the device
    return {"tensors": {k: v.to(device) for k, v in tensors.items()}, "lengths": lengths,
            "most_labelled": most_labelled}


def model_flops(config: fastbert.BertConfig, lengths: torch.Tensor, labelled: int, mode: str) -> float:
    """A training step's FLOPs (3x forward, MLM + NSP heads for BERT, the MLM head for the rest), or the base
    model's forward for inference (MPNet's relative-position bias, one addition per score, left out)."""
    if mode == "inference":
        return encoder_flops(config, lengths)
    objective = MLM_NSP if training_head(config) == "ForPreTraining" else MLM
    return training_flops(config, lengths, labelled, objective)


def provider_backend(provider: str, config: fastbert.BertConfig) -> str | None:
    """The backend the provider's model runs fastbert's ops on (None: transformers' own model): a row names it
    whether the provider's step was measured or not (skipped for the time budget, failed)."""
    if provider in FASTBERT_MODELS or provider == APPLY:
        return PROVIDER_BACKENDS.get(provider, config.backend)
    return None


def build_model(provider: str, config: fastbert.BertConfig, mode: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    head = "Model" if mode == "inference" else training_head(config)
    if provider in FASTBERT_MODELS:
        config = config.replace(backend=provider_backend(provider, config),
                                unpad=config.unpad or provider == UNPAD)  # ModernBERT's is always True
        with torch.device(device):
            model = architectures.model_class(config, head)(config)
    else:
        import transformers

        values = config.to_dict()
        hf_config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
        cls = getattr(transformers, type(hf_config).__name__.removesuffix("Config") + head)
        with torch.device(device):
            model = cls._from_config(hf_config, attn_implementation=HF_ATTENTION.get(provider, "sdpa"))
        if provider == APPLY:
            model = fastbert.apply(model)
    if mode == "inference":
        model = model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    else:
        model.train()
    return torch.compile(model) if provider == HF_COMPILE else model


def make_step(provider: str, model: torch.nn.Module, optimizer, mode: str, tensors: dict,
              device: torch.device) -> Callable[[], None]:
    fastbert_model = provider in FASTBERT_MODELS
    if mode == "inference":
        inputs = {k: tensors[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in tensors}
        if provider == GRAPH:
            batch, seqlen = inputs["input_ids"].shape
            model = fastbert.CapturedForward(model, batch_sizes=(batch,), length_buckets=(seqlen,))

        def infer():
            with torch.inference_mode():
                model(**inputs)
        return infer

    # default arguments, the input checks on (they run on the device); return_logits=False: the training path
    extra = {"return_logits": False} if fastbert_model else {}

    def train_step():
        # bf16 autocast on a GPU; none on a CPU (the smoke run), nor on meta tensors, which have no autocast of
        # their own (a plan's, fastbert.simulated.meta_gpu.planned_gpu, stands for the GPU's)
        with torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext():
            loss = model(**tensors, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return train_step


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class ProviderRun:
    """One provider's model and optimizer, reused across the batch sizes tried."""

    def __init__(self, case: ModelCase, provider: str, device: torch.device):
        self.case, self.provider, self.device = case, provider, device
        self.model = build_model(provider, case.config, case.mode, device)
        self.optimizer = None
        if case.mode != "inference":
            freeze(self.model, case.trainable)
            trained = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=device.type == "cuda")

    def step_for(self, batch: int, padded: bool) -> tuple[Callable[[], None], dict]:
        data = make_batch(self.case.config, batch, self.case.seqlen, padded, self.device)
        config = fastbert_config(self.model)
        if config is not None and self.case.mode != "inference":
            # as `fastbert pretrain` runs it: the MLM head on a static budget of positions per sequence, the batch's
            # most labelled, counted on the host (budget 0 would run the head's decoder on every position)
            config.max_predictions_per_seq = data["most_labelled"]
        step = make_step(self.provider, self.model, self.optimizer, self.case.mode, data["tensors"], self.device)
        return step, {**data, "backend": None if config is None else config.backend}

    def fits(self, batch: int) -> bool:
        """Two steps at this batch (the first allocates AdamW's state) without running out of memory."""
        try:
            step, _ = self.step_for(batch, self.case.padded)
            step()
            step()
            ok = True
        except oom_errors():
            ok = False
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        free_memory(self.device)
        return ok


def prepare(case: ModelCase, provider: str, device: torch.device) -> tuple[Callable[[], None], dict]:
    """The provider's step at the largest batch up to case.batch that fits (training), with its batch."""
    run = ProviderRun(case, provider, device)
    batch = case.batch
    # a CPU has no device memory to run out of (and the smoke run wants no extra steps)
    while case.mode == "train" and device.type == "cuda" and batch > 1 and not run.fits(batch):
        batch //= 2
    return run.step_for(batch, case.padded)


def measure_step(case: ModelCase, step: Callable[[], None], data: dict, device: torch.device, peaks: dict,
                 timing: dict | None = None) -> dict:
    """The step's median time, peak memory, tokens/s, sequences/s, TFLOP/s and MFU.
    timing: keyword arguments of time_ms (default: at least 100 ms of warm-up and 500 ms of calls)."""
    times = time_ms(step, device, **(timing or {"warmup_ms": 100.0, "rep_ms": 500.0}))
    memory = peak_memory(step, device)
    lengths = data["lengths"]
    batch = lengths.numel()
    labelled = int((data["tensors"]["labels"] != -100).sum())
    seconds = times["median_ms"] * 1e-3
    row = {"direction": "train_step" if case.mode == "train" else "inference", "batch": batch,
           "backend": data["backend"],
           "tokens": int(lengths.sum()), "padding": round(1 - float(lengths.sum()) / (batch * case.seqlen), 4),
           **times, **memory, "tokens_per_s": float(lengths.sum()) / seconds, "sequences_per_s": batch / seconds}
    if device.type == "cuda" and case.mode == "inference":
        # how much of the wall time is the host's: the GPU's time of a forward alone. A BERT-base forward launched
        # 139 kernels (fastbert) and 203 (transformers SDPA) in the third H100 run's profile: 3 calls keep some 600
        # launches waiting behind the timer's sleep. A queue of pending launches that fills (its depth is CUDA's)
        # ends the sleep first: no GPU time alone then, never a wrong one
        row.update(device_time_fields(step, device, calls=3))
    # model FLOPs count every parameter's gradient: a frozen one's matmul is skipped, so a BitFit step has no
    # FLOPs or MFU to compare with the full steps' (tokens/s compares them)
    if case.trainable == "all":
        row["flops"] = model_flops(case.config, lengths, labelled, case.mode)
        row["tflops"] = row["flops"] / seconds / 1e12
        if peaks.get("tflops"):
            row["mfu"] = row["tflops"] / peaks["tflops"]
    return row


def measure_model(case: ModelCase, provider: str, device: torch.device, peaks: dict,
                  timing: dict | None = None) -> list[dict]:
    if case.mode == "capacity":
        return [capacity_row(case, ProviderRun(case, provider, device))]
    step, data = prepare(case, provider, device)
    return [measure_step(case, step, data, device, peaks, timing)]


def capacity_row(case: ModelCase, run: ProviderRun) -> dict:
    """The largest batch whose training step fits: doubling from case.batch, then bisecting to
    within an eighth of the last power of two that fitted."""
    fitted, failed = 0, None
    batch = case.batch
    while failed is None and batch <= 1 << 14:
        if run.fits(batch):
            fitted, batch = batch, batch * 2
        else:
            failed = batch
    if failed is not None and fitted:
        resolution = max(1, fitted // 8)
        while failed - fitted > resolution:
            middle = (fitted + failed) // 2
            fitted, failed = (middle, failed) if run.fits(middle) else (fitted, middle)
    return {"direction": "capacity", "batch": fitted, "first_failed_batch": failed,
            "total_memory_bytes": torch.cuda.get_device_properties(run.device).total_memory
            if run.device.type == "cuda" else None}


def gpu_model_cases() -> list[ModelCase]:
    """Issue 7's shapes: training at phase 1 (S=128, batch up to 256) and phase 2 (S=512, up to 32),
    full and padded, base and large; BERT-base inference at (1, 128), (8, 512), (32, 128); the largest batch
    at S=512. torch.compile only for BERT-base, as each compile takes about a minute."""
    cases = []
    for size in ("base", "large"):
        for batch, seqlen in ((256, 128), (32, 512)):
            for padded in (False, True):
                providers = [FASTBERT] + ([UNPAD] if padded else []) + [HF_SDPA, HF_EAGER]
                cases.append(ModelCase("train", size, batch, seqlen, padded, tuple(providers)))
    for size in ("base",):  # inference of BERT-large would not fit the 10-minute budget
        for batch, seqlen in ((1, 128), (8, 512), (32, 128)):
            for padded in (False, True):
                providers = [FASTBERT] + ([UNPAD] if padded else []) + [HF_SDPA, HF_EAGER]
                cases.append(ModelCase("inference", size, batch, seqlen, padded, tuple(providers)))
    for case in cases:
        if case.size == "base" and (case.mode == "train" or (case.batch, case.seqlen) == (32, 128)):
            case.providers += (HF_COMPILE,)
        # issue 25: the applied model trains as fast as fastbert's; inference replayed as a graph, on PyTorch's path
        # (backend="torch", fewer Python calls a layer than "auto"'s kernels, and no Triton launch) and on the
        # kernels alone (backend="triton", no cuBLAS call), beside "auto"'s where the host bounds the forward
        if case.size == "base":
            case.providers += (APPLY,) if case.mode == "train" else (GRAPH, EAGER, TRITON)
    cases.append(ModelCase("capacity", "base", 32, 512, False, (FASTBERT, HF_SDPA)))
    # what a frozen weight saves (issue 25's fused backwards skip its gradient's matmul, as PyTorch's linear does)
    cases.append(ModelCase("train", "base", 256, 128, False, (FASTBERT, HF_SDPA, APPLY), trainable="bitfit"))
    # MPNet (all-mpnet-base-v2's shape) against transformers' MPNet, which has eager attention only
    mpnet = (FASTBERT, UNPAD, HF_EAGER)
    cases += [ModelCase("train", "mpnet-base", 32, 512, True, mpnet),
              ModelCase("inference", "mpnet-base", 32, 128, True, mpnet),
              ModelCase("inference", "mpnet-base", 8, 512, True, mpnet)]
    # ModernBERT-base (unpadded on fastbert's kernels, so no separate unpad provider) at its two lengths
    modernbert = (FASTBERT, HF_SDPA, HF_EAGER) + ((HF_FA2,) if importlib.util.find_spec("flash_attn") else ())
    cases += [ModelCase("train", "modernbert-base", 32, 512, True, modernbert),
              ModelCase("train", "modernbert-base", 2, 8192, True, modernbert),
              ModelCase("inference", "modernbert-base", 32, 512, True, modernbert),
              ModelCase("inference", "modernbert-base", 2, 8192, True, modernbert)]
    return cases


def smoke_model_cases() -> list[ModelCase]:
    providers = (EAGER, HF_SDPA)  # hf-eager differs from hf-sdpa by one string: the GPU suite runs it
    return [ModelCase("train", "tiny", 2, 16, True, providers), ModelCase("inference", "tiny", 2, 16, True, providers),
            ModelCase("train", "tiny", 2, 16, True, providers, trainable="bitfit"),
            ModelCase("train", "mpnet-tiny", 2, 16, True, (EAGER, HF_EAGER)),
            ModelCase("train", "modernbert-tiny", 2, 16, True, (EAGER, HF_SDPA))]
