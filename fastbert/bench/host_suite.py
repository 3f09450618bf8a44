"""`fastbert bench --suite host`: the host's microseconds per fused op call and per whole forward and training
step, fastbert beside PyTorch and transformers in the same run, without a GPU.

fastbert's kernels run their host code on CPU tensors with every Triton launch stubbed
(fastbert.simulated.host_time.stubbed_launches: the steady path of a GPU launch up to the driver's launch call);
PyTorch's ops and transformers' models run on the same CPU tensors, arithmetic included, at sizes where it is
small. Times are this thread's CPU time (other processes on the machine do not count), the least mean of
several repeats, the providers of a case taking turns, one intra-op thread.

Ops: each fused op against "the same job in PyTorch" as a user writes it (op_cases' "torch" provider:
dropout + add + F.layer_norm, F.gelu(x + b), F.linear and views, SDPA, F.linear + F.cross_entropy, ...), in
two directions: "fwd" (under torch.no_grad, as at inference) and "fwd+bwd" (the forward with autograd, then
the backward). Models: BERT-base's and ModernBERT-base's op graphs (their layer and head counts, every op) at
the narrow widths below, fastbert on its Triton path (backend="triton"), on its PyTorch path (TORCH_PATH) and
on an H100's (H100_AUTO), against transformers with SDPA, all called with their default arguments: an inference
forward of a padded batch (eval, no_grad) and a training step (the pretraining head's loss, backward, AdamW's
step), in float32 without autocast (the GPU suite trains under bf16 autocast, whose casts these rows leave out,
fastbert's and transformers' alike). Each row also counts the host syncs of one call (fastbert.host_syncs: what
would make the host wait for a GPU).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import types
from typing import Callable

import torch
import torch.nn.functional as F

from fastbert import ops, paths
from fastbert.bench import model_cases, op_cases
from fastbert.kernels.fused_op import always_custom_op
from fastbert.simulated.host_time import interleaved_host_microseconds, one_thread, stubbed_launches

FASTBERT, TORCH, HF_SDPA = op_cases.FASTBERT, op_cases.TORCH, model_cases.HF_SDPA
# fastbert's model on its PyTorch path (backend "torch"): what "auto" runs on CPU tensors (and, on an H100, for
# the QKV projection at BERT-base's width and for attention without a mask: fastbert/paths.json)
TORCH_PATH = model_cases.EAGER
# fastbert's model with its default backend, "auto", running the paths an H100 runs (fastbert/paths.json) at the
# GPU suite's shape of each call (H100_SHAPES): the path a user of an H100 runs, where on these CPU tensors "auto"
# would run the reference
H100_AUTO = "fastbert-h100"
# (batch, seqlen, padded) of the GPU suite's case whose choices an H100_AUTO call takes (model_cases.gpu_model_cases):
# issue 25's BERT-base inference and pretraining step, ModernBERT-base's at S = 512
H100_SHAPES = {("base", "inference"): (32, 128, True), ("base", "train"): (256, 128, False),
               ("modernbert-base", "inference"): (32, 512, True), ("modernbert-base", "train"): (32, 512, True)}
# fastbert's ops with every eager call through its torch.library custom op (kernels/fused_op.py: what an eager call
# costs that way, beside the direct call fastbert makes)
CUSTOM_OP = "fastbert-custom-op"
DIRECTIONS = ("fwd", "fwd+bwd")
# The models' widths: every op of BERT-base's (ModernBERT-base's) graph, its layers, at 2 heads of the kernels'
# smallest head dim (the head count is a view's size: it adds no op) and a small vocabulary, so that PyTorch's
# CPU arithmetic stays a small part of each op's time
NARROW = {"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 128}
MODEL_BATCH, MODEL_SEQLEN = 2, 8  # one sequence padded
CPU_CLOCK = ("time.thread_time_ns (CPU time of the measuring thread), least mean of repeated groups of calls, the "
             "providers of a case taking turns")
# An op call takes microseconds: the least of 5 groups let one slow spell set a row (two runs of the suite a
# minute apart at cf7d488 put the MLM loss's forward at 1.52x and 2.21x PyTorch's); 40 groups cost a few seconds
TIMING = {"number": 50, "repeats": 40}
# A model call takes milliseconds: 50 of them in a row let a slow spell of a shared machine fall on one
# provider's group (four runs at 9a6109d put BERT-base's training step at 0.96x to 1.23x transformers'); the
# same 250 calls in turns of 5 gave 1.14x to 1.18x in three runs
MODEL_TIMING = {"number": 5, "repeats": 50}
QUICK_TIMING = {"number": 3, "repeats": 2, "warmup": 2}


@dataclasses.dataclass
class HostCase:
    name: str  # e.g. "layer_norm/rows=32,hidden=384"
    op: str  # the fused op, or "model"
    providers: dict[str, Callable[[str], Callable[[], None]]]  # provider -> direction -> one call


@dataclasses.dataclass
class OpJob:
    """One fused op and the same job in PyTorch: fused(training, **inputs) and native(training, **inputs) return
    the outputs a backward differentiates; `training` switches dropout (off in the "fwd" direction)."""
    op: str
    shape: dict
    make_inputs: Callable[[], dict]  # seeded CPU tensors; leaves that need grad say so
    fused: Callable[..., tuple]
    native: Callable[..., tuple]

    @property
    def name(self) -> str:
        return self.op + "/" + ",".join(f"{k}={v}" for k, v in self.shape.items())


def _leaves(*shapes, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).requires_grad_() for shape in shapes]


def _job_calls(job: OpJob, provider: str) -> Callable[[str], Callable[[], None]]:
    """direction -> one call of the job: "fwd" under torch.no_grad with dropout off (inference), "fwd+bwd" the
    forward in training mode, then the backward."""
    def make(direction: str) -> Callable[[], None]:
        inputs = job.make_inputs()
        fn = job.native if provider == TORCH else job.fused
        if provider == CUSTOM_OP:
            fused = fn

            def fn(*args, **kwargs):
                with always_custom_op():
                    return fused(*args, **kwargs)
        if direction == "fwd":
            def forward():
                with torch.no_grad():
                    fn(False, **inputs)
            return forward
        leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]

        def forward_backward():
            outputs = fn(True, **inputs)
            torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
            for leaf in leaves:
                leaf.grad = None
        return forward_backward
    return make


P = 0.1  # dropout probability of the jobs that have one
EPS = 1e-12
T = "triton"


def op_jobs(tokens: int = 16, hidden: int = 64, heads: int = 2, seqlen: int = 8, vocab: int = 128) -> list[OpJob]:
    """Every fused op of the models at small fp32 shapes (16 tokens, hidden 64, 2 heads of the kernels'
    smallest head dim 32), where PyTorch's arithmetic on the CPU costs little beside its host work."""
    inner, batch, head_dim = 4 * hidden, tokens // seqlen, hidden // heads

    def rows(*shapes):
        return lambda: dict(zip(("x", "residual", "weight", "bias"), _leaves(*shapes)))

    def attention_inputs(padded: bool):
        def make():
            q, k, v = _leaves(*[(batch, heads, seqlen, head_dim)] * 3)
            mask = torch.ones(batch, seqlen, dtype=torch.long)
            if padded:
                mask[0, seqlen // 2:] = 0
            return {"q": q, "k": k, "v": v, "mask": mask}
        return make

    def varlen_inputs():
        q, k, v = _leaves(*[(tokens - seqlen // 2, heads, head_dim)] * 3)
        return {"q": q, "k": k, "v": v, "cu": torch.tensor([0, seqlen // 2, tokens - seqlen // 2], dtype=torch.int32)}

    def ffn_inputs():
        return dict(zip(("x", "w1", "b1", "w2", "b2"),
                        _leaves((tokens, hidden), (inner, hidden), (inner,), (hidden, inner), (hidden,))))

    def loss_inputs():
        x, weight, bias = _leaves((tokens // 4, hidden), (vocab, hidden), (vocab,))
        return {"x": x, "weight": weight, "bias": bias, "target": torch.arange(tokens // 4) % vocab}

    def sdpa(q, k, v, mask, training):
        return F.scaled_dot_product_attention(q, k, v, mask.bool()[:, None, None, :], dropout_p=P if training else 0.0)

    return [
        OpJob("layer_norm", {"tokens": tokens, "hidden": hidden, "dropout_p": P},
              rows((tokens, hidden), (tokens, hidden), (hidden,), (hidden,)),
              lambda training, x, residual, weight, bias: (ops.layer_norm(x, weight, bias, EPS, residual, P, training,
                                                                          backend=T),),
              lambda training, x, residual, weight, bias: (F.layer_norm(F.dropout(x, P, training) + residual,
                                                                        (hidden,), weight, bias, EPS),)),
        OpJob("bias_gelu", {"tokens": tokens, "features": inner}, rows((tokens, inner), (inner,)),
              lambda training, x, residual: (ops.bias_gelu(x, residual, backend=T),),
              lambda training, x, residual: (F.gelu(x + residual),)),
        OpJob("linear_bias_gelu", {"tokens": tokens, "hidden": hidden, "intermediate": inner},
              rows((tokens, hidden), (inner, hidden), (inner,)),
              lambda training, x, residual, weight: (ops.linear_bias_gelu(x, residual, weight, backend=T),),
              lambda training, x, residual, weight: (F.gelu(F.linear(x, residual, weight)),)),
        OpJob("feed_forward", {"tokens": tokens, "hidden": hidden, "intermediate": inner}, ffn_inputs,
              lambda training, x, w1, b1, w2, b2: (ops.feed_forward(x, w1, b1, w2, b2, backend=T),),
              lambda training, x, w1, b1, w2, b2: (F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2),)),
        OpJob("qkv_projection", {"batch": batch, "seqlen": seqlen, "hidden": hidden, "heads": heads},
              lambda: dict(zip(("x", "weight", "bias"), _leaves((batch, seqlen, hidden), (3 * hidden, hidden),
                                                                (3 * hidden,)))),
              lambda training, x, weight, bias: ops.qkv_projection(x, weight, bias, heads, backend=T),
              # transformers' layout change: each of q, k, v viewed per head and transposed
              lambda training, x, weight, bias: tuple(t.view(batch, seqlen, heads, head_dim).transpose(1, 2)
                                                      for t in F.linear(x, weight, bias).chunk(3, dim=-1))),
        *(OpJob("attention", {"batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": head_dim,
                              "padded": padded, "dropout_p": P}, attention_inputs(padded),
                lambda training, q, k, v, mask: (ops.attention(q, k, v, mask, P, None, training, backend=T),),
                lambda training, q, k, v, mask: (sdpa(q, k, v, mask, training),))
          for padded in (False, True)),
        OpJob("attention_varlen", {"tokens": tokens - seqlen // 2, "seqlen": seqlen, "heads": heads,
                                   "head_dim": head_dim, "dropout_p": P}, varlen_inputs,
              lambda training, q, k, v, cu: (ops.attention_varlen(q, k, v, cu, seqlen, P, None, training, backend=T),),
              # PyTorch's nearest job: SDPA on the padded batch, with its mask
              lambda training, q, k, v, cu: (sdpa(q.view(batch, -1, heads, head_dim).transpose(1, 2),
                                                  k.view(batch, -1, heads, head_dim).transpose(1, 2),
                                                  v.view(batch, -1, heads, head_dim).transpose(1, 2),
                                                  torch.ones(batch, q.shape[0] // batch), training),)),
        OpJob("linear_cross_entropy", {"tokens": tokens // 4, "hidden": hidden, "vocab": vocab}, loss_inputs,
              lambda training, x, weight, bias, target: (ops.linear_cross_entropy(x, weight, bias, target,
                                                                                  backend=T)[0],),
              lambda training, x, weight, bias, target: (F.cross_entropy(F.linear(x, weight, bias), target),)),
        OpJob("dropout", {"tokens": tokens, "hidden": hidden, "p": P}, rows((tokens, hidden)),
              lambda training, x: (ops.dropout(x, P, training, backend=T),),
              lambda training, x: (F.dropout(x, P, training),)),
    ]


def op_host_cases() -> list[HostCase]:
    return [HostCase(job.name, job.op, {provider: _job_calls(job, provider) for provider in (FASTBERT, CUSTOM_OP, TORCH)})
            for job in op_jobs()]


SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")


def model_config(size: str):
    """BERT-base's (ModernBERT-base's) config at the NARROW widths, its special token ids moved into the small
    vocabulary (ModernBERT's sit past 50000), on the Triton path (on these CPU tensors "auto" would run the
    reference)."""
    config = model_cases.SIZES[size]()
    ids = {name: getattr(config, name) % NARROW["vocab_size"] for name in SPECIAL_TOKENS
           if getattr(config, name, None) is not None}
    return config.replace(**NARROW, **ids, backend="triton")


@functools.cache
def h100_choices(size: str, mode: str) -> dict:
    """(op, direction) -> what backend="auto" runs on an H100 in this model's inference forward or training step
    at its H100_SHAPES, full width, as the GPU suite runs it (bf16 weights, or under bf16 autocast): recorded from
    that call on meta tensors standing for the H100's (fastbert.simulated.meta_gpu.planned_gpu)."""
    from fastbert.simulated.meta_gpu import planned_gpu

    environment = os.environ.get("FASTBERT_BACKEND", "")
    if environment not in ("", "auto"):  # "auto" would run it, and rows of other paths would be labelled an H100's
        raise ValueError(f"the fastbert-h100 rows run backend='auto': unset FASTBERT_BACKEND (it is {environment!r})")
    batch, seqlen, padded = H100_SHAPES[(size, mode)]
    case = model_cases.ModelCase(mode, size, batch, seqlen, padded, (FASTBERT,))
    with planned_gpu(dtype=torch.bfloat16 if mode == "train" else None), paths.recorded_choices() as choices:
        run = model_cases.ProviderRun(case, FASTBERT, torch.device("meta"))
        if mode == "inference":
            run.model.to(torch.bfloat16)  # the GPU suite's weights (build_model keeps a non-CUDA model's float32)
        step, _ = run.step_for(batch, padded)
        step()
    return types.MappingProxyType(choices)  # cached: every call shares it


def auto_choices(size: str, provider: str, mode: str):
    """What backend="auto" runs on the stubbed CPU tensors in this provider's calls of this model, for
    ops.set_stubbed_auto: the H100's choices for H100_AUTO (h100_choices), else None (the reference). Each call
    sets its own: the providers of a case take turns."""
    return h100_choices(size, mode) if provider == H100_AUTO else None


def model_and_inputs(size: str, provider: str, mode: str) -> tuple[torch.nn.Module, dict]:
    """The model of a model row and its keyword inputs on a padded batch: mode "inference" (eval; the ids, the
    mask and the token types) or "train" (the pretraining head; labels too)."""
    config = model_config(size)
    if provider in (TORCH_PATH, H100_AUTO):
        config = config.replace(backend="torch" if provider == TORCH_PATH else "auto")
    model = model_cases.build_model(FASTBERT if provider == H100_AUTO else provider, config, mode, torch.device("cpu"))
    batch = model_cases.make_batch(config, MODEL_BATCH, MODEL_SEQLEN, True, torch.device("cpu"))
    tensors = batch["tensors"]
    if mode == "inference":
        return model, {k: tensors[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in tensors}
    if provider != HF_SDPA:  # the MLM head's static budget, as `fastbert pretrain` sets it
        model.config.max_predictions_per_seq = batch["most_labelled"]
    return model, tensors


def _model_calls(size: str, provider: str) -> Callable[[str], Callable[[], None]]:
    """direction "fwd": an inference forward (eval, no_grad) of the base model on a padded batch; "fwd+bwd": a
    training step of the pretraining head (loss, backward, AdamW). Default arguments, as a user calls them. Each
    call first sets what "auto" runs in it (ops.set_stubbed_auto(auto_choices(...)): a tenth of a microsecond)."""
    def make(direction: str) -> Callable[[], None]:
        mode = "inference" if direction == "fwd" else "train"
        model, inputs = model_and_inputs(size, provider, mode)
        choices = auto_choices(size, provider, mode)
        if mode == "inference":
            def infer():
                ops.set_stubbed_auto(choices)
                with torch.no_grad():
                    model(**inputs)
            return infer
        # fused, as on a GPU: the CPU's single-tensor AdamW reads each step count back (a host sync per tensor)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def train_step():
            ops.set_stubbed_auto(choices)
            model(**inputs).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return train_step
    return make


MODEL_PROVIDERS = (FASTBERT, H100_AUTO, TORCH_PATH, HF_SDPA)


def model_host_cases() -> list[HostCase]:
    return [HostCase(f"model/{size},layers={model_config(size).num_hidden_layers},hidden={NARROW['hidden_size']},"
                     f"batch={MODEL_BATCH},seqlen={MODEL_SEQLEN},padded", "model",
                     {provider: _model_calls(size, provider) for provider in MODEL_PROVIDERS})
            for size in ("base", "modernbert-base")]


def host_cases() -> list[HostCase]:
    return op_host_cases() + model_host_cases()


def measure_case(case: HostCase, providers, direction: str, timing: dict) -> dict:
    """{provider: one row's figures (host microseconds per call, host syncs of one call)} for these providers of
    the case, timed taking turns (host_time.interleaved_host_microseconds)."""
    from fastbert.host_syncs import HostSyncCounter

    calls, syncs = {}, {}
    for provider in providers:
        call = calls[provider] = case.providers[provider](direction)
        call()  # the first call of each launch signature stubs its kernel (and autotunes)
        with HostSyncCounter() as counter:
            call()
        syncs[provider] = counter.syncs
    host_us = interleaved_host_microseconds(calls, **timing)
    return {provider: {"host_us": round(host_us[provider], 2), "host_syncs": syncs[provider]} for provider in providers}


def measure(quick: bool = False, progress: bool = True, only=None) -> list[dict]:
    """The suite's rows (without provenance): one per case, provider and direction; the providers of a case and
    direction timed taking turns, so that their ratio sees the same machine."""
    import re
    import sys

    from tqdm import tqdm

    op_timing, model_timing = (QUICK_TIMING, QUICK_TIMING) if quick else (TIMING, MODEL_TIMING)
    pattern = re.compile(only) if only else None
    groups = []  # (case, direction, its providers that `only` keeps)
    for case in host_cases():
        for direction in DIRECTIONS:
            providers = [p for p in case.providers if pattern is None or pattern.search(f"{case.name} {p}")]
            if providers:
                groups.append((case, direction, providers))
    rows = []
    with one_thread(), stubbed_launches():
        bar = tqdm(groups, desc="fastbert bench host", unit="case", file=sys.stderr, disable=not progress,
                   dynamic_ncols=True)
        for case, direction, providers in bar:
            bar.set_postfix_str(f"{case.name} {direction}", refresh=False)
            figures = measure_case(case, providers, direction, model_timing if case.op == "model" else op_timing)
            rows += [{"op": case.op, "case": case.name, "provider": provider, "direction": direction,
                      "dtype": "float32", "status": "ok", **figures[provider]} for provider in providers]
    return rows


def summary(rows: list[dict]) -> str:
    """Each case and direction: fastbert's host us (a model's on both paths), the same through the custom op, the
    comparison's (PyTorch's job, or transformers), fastbert's ratio to it and the host syncs of each."""
    by_key = {(r["case"], r["direction"], r["provider"]): r for r in rows if r["status"] == "ok"}
    lines = [f"{'case':<62} {'provider':<14} {'dir':<8} {'fastbert us':>11} {'custom op':>9} {'other us':>9} "
             f"{'ratio':>6} {'syncs':>7}"]
    for (case, direction, provider), row in by_key.items():
        if provider not in (FASTBERT, H100_AUTO, TORCH_PATH):
            continue
        custom = by_key.get((case, direction, CUSTOM_OP))
        other = by_key.get((case, direction, TORCH)) or by_key.get((case, direction, HF_SDPA))
        ratio = f"{row['host_us'] / other['host_us']:.2f}" if other else "-"
        other_us = f"{other['host_us']:.1f}" if other else "-"
        custom_us = f"{custom['host_us']:.1f}" if custom else "-"
        syncs = f"{row['host_syncs']}/{other['host_syncs']}" if other else str(row["host_syncs"])
        lines.append(f"{case[:62]:<62} {provider:<14} {direction:<8} {row['host_us']:>11.1f} {custom_us:>9} "
                     f"{other_us:>9} {ratio:>6} {syncs:>7}")
    return "\n".join(lines)
