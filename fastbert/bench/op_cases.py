"""Per-op benchmark cases: inputs, the providers side by side, and the FLOP / byte formulas.

Providers (every case has the first four; some add a variant of fastbert's):
- "fastbert": the Triton kernels, through `fastbert.ops(..., backend="triton")`.
- "fastbert-eager": fastbert's pure-PyTorch reference, `backend="torch"`.
- "torch": torch's own ops the way a user writes them (F.layer_norm, F.gelu, F.linear + view /
  transpose / contiguous, scaled_dot_product_attention with the same padding mask, F.cross_entropy
  on the full logits as HF's head does).
- "torch.compile": torch.compile of "fastbert-eager".
- "fastbert-varlen" (padded attention cases): the Triton kernel on the same batch packed without padding.
- "fastbert-split" (FFN up-projection): cuBLAS matmul, then the Triton bias + GELU kernel; (QKV projection)
  its cuBLAS form, PyTorch's forward and the kernel's backward.

Each provider maps the case's inputs to the outputs the backward differentiates. FLOPs follow
DESIGN.md (matmul 2MNK, its backward twice that; attention 4 * heads * d * sum(L_i^2), backward
2.5x; the MLM head's on its labelled rows only). Bytes are the least a fused kernel must move, the
same figure for every provider, so GB/s reads as effective bandwidth against the measured copy
bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from fastbert import ops

FASTBERT, EAGER, TORCH, COMPILE = "fastbert", "fastbert-eager", "torch", "torch.compile"
VARLEN, SPLIT = "fastbert-varlen", "fastbert-split"
# providers that run Triton kernels, or compile for minutes on a CPU: never in the smoke run
GPU_PROVIDERS = frozenset({FASTBERT, COMPILE, VARLEN, SPLIT})
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
LAYER_NORM_EPS = 1e-12


@dataclass
class OpCase:
    op: str  # "layer_norm", "bias_gelu", "ffn_up", "qkv_projection", "attention", "mlm_head"
    shape: dict  # the sizes, as recorded in every row
    dtype: torch.dtype
    make_inputs: Callable[[torch.device], dict[str, torch.Tensor]]  # seeded; leaves that need grad say so
    providers: dict[str, Callable[..., tuple[torch.Tensor, ...]]]  # name -> fn(**inputs) -> outputs
    flops: Callable[[str], float] | None = None  # direction -> FLOPs
    bytes: Callable[[str], float] | None = None  # direction -> least bytes moved
    notes: dict[str, str] = field(default_factory=dict)  # provider -> what it runs, for the report
    # outputs -> the gradients the backward is handed, laid out as a model's next op hands them; None: a random
    # tensor of each output's shape
    grad_outputs: Callable[[tuple[torch.Tensor, ...]], list[torch.Tensor]] | None = None

    @property
    def name(self) -> str:
        return self.op + "/" + ",".join(f"{k}={v}" for k, v in self.shape.items())

    def provider(self, name: str) -> Callable[..., tuple[torch.Tensor, ...]]:
        if name == COMPILE:
            return torch.compile(self.providers[EAGER], dynamic=False)
        return self.providers[name]

    def provider_names(self) -> list[str]:
        return [*self.providers, COMPILE]


def _by_direction(forward: float, backward: float) -> Callable[[str], float]:
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}.__getitem__


def _randn(shape, device, dtype, generator, requires_grad=True, scale=1.0, mean=0.0):
    t = torch.randn(shape, generator=generator, dtype=torch.float32) * scale + mean
    return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)


def _layer_norm_weight(hidden, device, dtype, generator):
    """A LayerNorm's weight near one, as an initialised or trained one is: a standard normal's puts a fifth of
    its columns below the kernel's MIN_WEIGHT, past its SIDE_COLUMNS exact ones (the backward's NaN case)."""
    return _randn((hidden,), device, dtype, generator, scale=0.1, mean=1.0)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_lengths(batch: int, seqlen: int, generator: torch.Generator) -> torch.Tensor:
    """Realistic padding: lengths uniform in [S/4, S] (int64 [batch])."""
    low = max(1, seqlen // 4)
    return torch.randint(low, seqlen + 1, (batch,), generator=generator)


def mask_from_lengths(lengths: torch.Tensor, seqlen: int) -> torch.Tensor:
    """[B, S] int mask, 1 = token, 0 = padding (right padding)."""
    return (torch.arange(seqlen)[None, :] < lengths[:, None]).to(torch.int32)


def layer_norm_case(rows: int, hidden: int, dtype: torch.dtype, dropout_p: float = 0.1) -> OpCase:
    """LayerNorm(dropout(x) + residual), the residual LayerNorm of every encoder sublayer."""
    def make_inputs(device):
        g = _generator()
        return {"x": _randn((rows, hidden), device, dtype, g), "residual": _randn((rows, hidden), device, dtype, g),
                "weight": _layer_norm_weight(hidden, device, dtype, g), "bias": _randn((hidden,), device, dtype, g)}

    def fused(backend):
        return lambda x, residual, weight, bias: (ops.layer_norm(
            x, weight, bias, LAYER_NORM_EPS, residual, dropout_p, True, backend=backend),)

    def native(x, residual, weight, bias):
        return (F.layer_norm(F.dropout(x, dropout_p, True) + residual, (hidden,), weight, bias, LAYER_NORM_EPS),)

    elem = rows * hidden * torch.finfo(dtype).bits // 8
    return OpCase("layer_norm", {"rows": rows, "hidden": hidden, "dropout_p": dropout_p}, dtype, make_inputs,
                  {FASTBERT: fused("triton"), EAGER: fused("torch"), TORCH: native},
                  # forward reads x, residual, writes y; backward reads dy and the pre-norm sum, writes dx, dresidual
                  bytes=_by_direction(3 * elem, 4 * elem))


def bias_gelu_case(rows: int, features: int, dtype: torch.dtype) -> OpCase:
    """gelu(x + bias) on the FFN's intermediate activations (exact erf GELU, as BERT uses)."""
    def make_inputs(device):
        g = _generator()
        return {"x": _randn((rows, features), device, dtype, g), "bias": _randn((features,), device, dtype, g)}

    def fused(backend):
        return lambda x, bias: (ops.bias_gelu(x, bias, "none", backend=backend),)

    elem = rows * features * torch.finfo(dtype).bits // 8
    return OpCase("bias_gelu", {"rows": rows, "features": features}, dtype, make_inputs,
                  {FASTBERT: fused("triton"), EAGER: fused("torch"), TORCH: lambda x, bias: (F.gelu(x + bias),)},
                  # forward reads x, writes y; backward reads dy and x, writes dx
                  bytes=_by_direction(2 * elem, 3 * elem))


# which fused form ops.linear_bias_gelu runs on the Triton path (kernels/bias_gelu.py's switch)
FFN_FORM = getattr(ops.KERNELS.get("bias_gelu"), "LINEAR_BIAS_GELU_FORM", "none: Triton does not import")


def ffn_up_case(rows: int, hidden: int, intermediate: int, dtype: torch.dtype) -> OpCase:
    """gelu(x @ W^T + b): the FFN up-projection with its activation, in two fused forms."""
    def make_inputs(device):
        g = _generator()
        return {"x": _randn((rows, hidden), device, dtype, g),
                "weight": _randn((intermediate, hidden), device, dtype, g, scale=hidden ** -0.5),
                "bias": _randn((intermediate,), device, dtype, g)}

    def fused(backend):
        return lambda x, weight, bias: (ops.linear_bias_gelu(x, weight, bias, "none", backend=backend),)

    def split(x, weight, bias):
        return (ops.bias_gelu(F.linear(x, weight), bias, "none", backend="triton"),)

    def native(x, weight, bias):
        return (F.gelu(F.linear(x, weight, bias)),)

    matmul = 2 * rows * hidden * intermediate
    return OpCase("ffn_up", {"rows": rows, "hidden": hidden, "intermediate": intermediate}, dtype, make_inputs,
                  {FASTBERT: fused("triton"), SPLIT: split, EAGER: fused("torch"), TORCH: native},
                  flops=_by_direction(matmul, 2 * matmul),
                  notes={FASTBERT: f"the model's path: form {FFN_FORM!r}",
                         SPLIT: "cuBLAS matmul, then bias + GELU kernel"})


def qkv_case(batch: int, seqlen: int, hidden: int, heads: int, dtype: torch.dtype) -> OpCase:
    """x @ Wqkv^T + b split into q, k, v [B, heads, S, d]."""
    head_dim = hidden // heads

    def make_inputs(device):
        g = _generator()
        return {"x": _randn((batch, seqlen, hidden), device, dtype, g),
                "weight": _randn((3 * hidden, hidden), device, dtype, g, scale=hidden ** -0.5),
                "bias": _randn((3 * hidden,), device, dtype, g)}

    def fused(backend):
        return lambda x, weight, bias: tuple(ops.qkv_projection(x, weight, bias, heads, backend=backend))

    def split(x, weight, bias):
        return tuple(ops.KERNELS["qkv"].qkv_projection(x, weight, bias, heads, cublas_forward=True))

    def native(x, weight, bias):
        # HF's layout change: each of q, k, v viewed per head, transposed and made contiguous
        return tuple(t.view(batch, seqlen, heads, head_dim).transpose(1, 2).contiguous()
                     for t in F.linear(x, weight, bias).chunk(3, dim=-1))

    def attention_layout_grads(outputs):
        # dq, dk, dv as fastbert's attention backward writes them in a model: the column blocks of one
        # [B, S, 3H] buffer, which the kernel's backward reads in place and PyTorch's autograd stacks
        q = outputs[0]
        buffer = torch.randn((batch, seqlen, 3, heads, head_dim), generator=_generator(2)).to(q.device, q.dtype)
        return [g.transpose(1, 2) for g in buffer.unbind(2)]  # kernels/attention.py's qkv_grads

    matmul = 2 * batch * seqlen * hidden * 3 * hidden
    # the kernel and the reference first: a budget that cuts the case keeps the pair the table has compared longest
    return OpCase("qkv_projection", {"batch": batch, "seqlen": seqlen, "hidden": hidden, "heads": heads}, dtype,
                  make_inputs, {FASTBERT: fused("triton"), EAGER: fused("torch"), SPLIT: split, TORCH: native},
                  flops=_by_direction(matmul, 2 * matmul), notes={SPLIT: "PyTorch's forward, the kernel's backward"},
                  grad_outputs=attention_layout_grads)


def attention_case(batch: int, seqlen: int, heads: int, head_dim: int, dtype: torch.dtype, padded: bool,
                   dropout_p: float = 0.0) -> OpCase:
    """Bidirectional attention; padded: key padding mask with lengths uniform in [S/4, S]."""
    g = _generator(1)
    lengths = random_lengths(batch, seqlen, g) if padded else torch.full((batch,), seqlen)
    mask = mask_from_lengths(lengths, seqlen)

    def make_inputs(device):
        g = _generator()
        q, k, v = (_randn((batch, heads, seqlen, head_dim), device, dtype, g) for _ in range(3))
        inputs = {"q": q, "k": k, "v": v, "mask": mask.to(device) if padded else None}
        if padded:
            keep = mask.to(device=device, dtype=torch.bool).flatten()
            for name, t in (("q", q), ("k", k), ("v", v)):  # [B, heads, S, d] -> packed [T, heads, d]
                inputs[name + "_packed"] = t.detach().transpose(1, 2).flatten(0, 1)[keep].requires_grad_(True)
            cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
            inputs["cu_seqlens"] = cu.to(device=device, dtype=torch.int32)
        return inputs

    def padded_fn(backend):
        def run(q, k, v, mask, **_):
            return (ops.attention(q, k, v, mask, dropout_p, None, True, backend=backend),)
        return run

    def varlen(q_packed, k_packed, v_packed, cu_seqlens, **_):
        return (ops.attention_varlen(q_packed, k_packed, v_packed, cu_seqlens, seqlen, dropout_p, None, True,
                                     backend="triton"),)

    def native(q, k, v, mask, **_):
        attn_mask = None if mask is None else mask.to(torch.bool)[:, None, None, :]  # True = attend
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p),)

    providers = {FASTBERT: padded_fn("triton")}
    if padded:
        providers[VARLEN] = varlen
    providers.update({EAGER: padded_fn("torch"), TORCH: native})
    forward = 4 * heads * head_dim * float((lengths.double() ** 2).sum())
    shape = {"batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": head_dim,
             "padding": round(1 - float(lengths.sum()) / (batch * seqlen), 4) if padded else 0.0,
             "dropout_p": dropout_p}
    return OpCase("attention", shape, dtype, make_inputs, providers, flops=_by_direction(forward, 2.5 * forward),
                  notes={VARLEN: "same batch packed without padding (cu_seqlens)"})


def mlm_head_case(batch: int, seqlen: int, hidden: int, vocab: int, dtype: torch.dtype,
                  label_fraction: float = 0.15) -> OpCase:
    """The MLM head plus its loss: transform (dense, GELU, LayerNorm), decoder, cross entropy.

    fastbert runs it on the labelled rows only, never holding the logits; "torch" is HF's head:
    every position through the transform and the decoder, then F.cross_entropy on the full
    logits in fp32 (what autocast gives HF's loss).
    """
    def make_labels(g):
        labels = torch.randint(0, vocab, (batch, seqlen), generator=g)
        labels[torch.rand((batch, seqlen), generator=g) >= label_fraction] = -100
        return labels

    def make_inputs(device):
        g = _generator()
        labels = make_labels(g)
        # the labelled positions, found here rather than in the timed call: a boolean index there would sync with
        # the host (the model's own index, modeling.labelled_positions, has a static size and does not)
        labelled = (labels.view(-1) != -100).nonzero().squeeze(1)
        return {"hidden_states": _randn((batch, seqlen, hidden), device, dtype, g),
                "dense_weight": _randn((hidden, hidden), device, dtype, g, scale=hidden ** -0.5),
                "dense_bias": _randn((hidden,), device, dtype, g),
                "ln_weight": _layer_norm_weight(hidden, device, dtype, g), "ln_bias": _randn((hidden,), device, dtype, g),
                "decoder_weight": _randn((vocab, hidden), device, dtype, g, scale=hidden ** -0.5),
                "decoder_bias": _randn((vocab,), device, dtype, g), "labels": labels.to(device),
                "labelled": labelled.to(device)}

    def masked_only(backend):
        def run(hidden_states, dense_weight, dense_bias, ln_weight, ln_bias, decoder_weight, decoder_bias, labels,
                labelled):
            h = hidden_states.view(-1, hidden).index_select(0, labelled)  # [N, H]: the labelled rows only
            h = ops.linear_bias_gelu(h, dense_weight, dense_bias, "none", backend=backend)
            h = ops.layer_norm(h, ln_weight, ln_bias, LAYER_NORM_EPS, backend=backend)
            targets = labels.view(-1).index_select(0, labelled)
            loss, _ = ops.linear_cross_entropy(h, decoder_weight, decoder_bias, targets, backend=backend)
            return (loss,)
        return run

    def hf_head(hidden_states, dense_weight, dense_bias, ln_weight, ln_bias, decoder_weight, decoder_bias, labels,
                labelled):
        h = F.gelu(F.linear(hidden_states, dense_weight, dense_bias))
        h = F.layer_norm(h, (hidden,), ln_weight, ln_bias, LAYER_NORM_EPS)
        logits = F.linear(h, decoder_weight, decoder_bias)  # [B, S, V]
        return (F.cross_entropy(logits.float().view(-1, vocab), labels.view(-1), ignore_index=-100),)

    shape = {"batch": batch, "seqlen": seqlen, "hidden": hidden, "vocab": vocab, "labelled": label_fraction}
    # the job's least work: the transform and the decoder on the labelled rows (HF's head does every row)
    matmul = 2 * int((make_labels(_generator()) != -100).sum()) * hidden * (hidden + vocab)
    return OpCase("mlm_head", shape, dtype, make_inputs,
                  {FASTBERT: masked_only("triton"), EAGER: masked_only("torch"), TORCH: hf_head},
                  flops=_by_direction(matmul, 2 * matmul),
                  notes={TORCH: "HF's head: all positions, full logits, F.cross_entropy",
                         EAGER: "labelled rows only, chunked reference cross entropy"})


def gpu_op_cases() -> list[OpCase]:
    """The shapes issues 3, 4 and 5 name: 16384 rows (B=32, S=512) at hidden 768 and 1024;
    attention at B*S = 16384, head dim 64, 32 heads (hidden 2048, the setting of FlashAttention's
    published figures), S in {128, 512, 2048}, full and padded; the MLM head at BERT-base size.
    In the order a short budget keeps: first every class BERT-base's paths are chosen from (its widths, attention
    without padding at its lengths, the MLM head), then BERT-large's widths and the rest."""
    bf16 = torch.bfloat16
    attention = {(seqlen, padded): attention_case(16384 // seqlen, seqlen, 32, 64, bf16, padded)
                 for seqlen in (128, 512, 2048) for padded in (False, True)}
    cases = [layer_norm_case(16384, 768, bf16), bias_gelu_case(16384, 3072, bf16), ffn_up_case(16384, 768, 3072, bf16),
             qkv_case(32, 512, 768, 12, bf16), attention.pop((128, False)), attention.pop((512, False)),
             mlm_head_case(32, 512, 768, 30522, bf16), layer_norm_case(16384, 1024, bf16),
             bias_gelu_case(16384, 4096, bf16), ffn_up_case(16384, 1024, 4096, bf16), qkv_case(32, 512, 1024, 16, bf16)]
    cases += attention.values()
    cases.append(attention_case(32, 512, 32, 64, bf16, padded=True, dropout_p=0.1))
    return cases


def smoke_op_cases() -> list[OpCase]:
    """Tiny fp32 shapes of every case, for the CPU smoke run."""
    f32 = torch.float32
    return [layer_norm_case(64, 128, f32), bias_gelu_case(64, 512, f32), ffn_up_case(64, 128, 512, f32),
            qkv_case(2, 16, 128, 2, f32), attention_case(2, 16, 2, 32, f32, padded=False),
            attention_case(3, 16, 2, 32, f32, padded=True),
            # B*S well above H, as at full size, so that the logits dominate HF's head's memory
            mlm_head_case(4, 64, 32, 1000, f32)]


def cpu_memory_cases() -> list[OpCase]:
    """Issue 5's MLM head at full size (B=32, S=512, H=768, V=30522, 15% labelled), fp32 on the CPU."""
    return [mlm_head_case(32, 512, 768, 30522, torch.float32)]
