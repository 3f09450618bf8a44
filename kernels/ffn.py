# The BERT feed-forward block, out = gelu(x @ w1.T + b1) @ w2.T + b2, whose backward keeps the
# pre-activation h = x @ w1.T + b1 and not the GELU output g = gelu(h).
#
# Unfused (nn.Linear, GELU, nn.Linear) autograd keeps h for the GELU's backward AND g for the second
# Linear's weight gradient: 2 x [M, 4H] per layer (16 bytes per token and hidden unit in bf16). Here g
# is dropped once the second matmul has read it and recomputed in the backward from h, an elementwise
# pass (the GELU of kernels/matmul.py, in kernels/bias_gelu.py's forward kernel without a bias) that
# costs no matmul. With recompute_pre (`--activation-checkpointing ffn`) h is not kept either and the
# backward reruns the up-projection, which costs one [M, K] x [K, 4H] matmul and keeps only x. h is
# written only when a backward will read it (not with recompute_pre, not in an inference forward).
#
# Forward:  h, g = epilogue matmul (kernels/matmul.py: bias + GELU in the epilogue, h stored if kept)
#           out  = g @ w2.T + b2 (cuBLAS); g freed
# Backward: [recompute_pre: h = the same epilogue matmul, bitwise the forward's h]
#           g    = gelu(h)                 dw2 = dout^T g;  db2 = sum_rows dout;  g freed
#           dg   = dout w2
#           dh   = dg * gelu'(h), db1 = sum_rows dh    (kernels/bias_gelu.py's backward kernel, dh over dg)
#           dx   = dh w1;  dw1 = dh^T x
# Saved for the backward: x, w1, w2 and h ([M, 4H]); with recompute_pre x, w1, w2 and b1.
#
# The recomputed g is gelu(h) of the rounded h, where the forward's epilogue applied the GELU to the
# fp32 accumulator: dw2 differs from the gradient of an unfused layer by that rounding (within the
# tolerance rule, tests/test_ffn.py), while the forward is bitwise kernels/bias_gelu.py's epilogue form.
# Both recompute settings run the same kernels on the same inputs, so their gradients are bitwise equal.
#
# Limits: as kernels/matmul.py and kernels/bias_gelu.py: x [M, K], w1 [N, K], b1 [N], w2 [K2, N],
# b2 [K2] of one dtype (fp32, fp16, bf16), any strides, M >= 0.
# Sources: Megatron-LM's fused bias-GELU with recomputation; Korthikanti et al. 2022 (selective
# activation recomputation).
import torch

from fastbert.kernels.bias_gelu import APPROXIMATIONS, bias_gelu_bwd, bias_gelu_fwd, linear_bias_gelu_fwd
from fastbert.kernels.matmul import DTYPES


def _check(x, w1, b1, w2, b2, approximate) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; supported dtypes are {DTYPES}")
    for name, t in (("w1", w1), ("w2", w2)):
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    inner, out_features = w1.shape[0], w2.shape[0]
    expected = {"w1": (inner, x.shape[1]), "b1": (inner,), "w2": (out_features, inner), "b2": (out_features,)}
    for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {expected[name]}")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} has dtype {t.dtype} on {t.device}, expected x's {x.dtype} on {x.device}")


def feed_forward_fwd(x, w1, b1, w2, b2, approximate, keep_pre=True):
    """(out, h): out = gelu(h) @ w2.T + b2 [M, K2], h = x @ w1.T + b1 [M, N], both contiguous; without
    keep_pre h is never written (an empty [0, N] stands for it): nothing will read it."""
    g, pre = linear_bias_gelu_fwd(x, w1, b1, approximate, store_pre=keep_pre)
    return torch.addmm(b2, g, w2.t()), x.new_empty((0, w1.shape[0])) if pre is None else pre


def feed_forward_bwd(dout, x, w1, b1, w2, pre, approximate):
    """Gradients (dx, dw1, db1, dw2, db2) of feed_forward_fwd's out; pre None recomputes h from x and b1
    (b1 is read only then)."""
    if pre is None:
        _, pre = linear_bias_gelu_fwd(x, w1, b1, approximate)
    g = bias_gelu_fwd(pre, None, approximate)  # [M, N]
    dw2 = dout.t() @ g
    del g
    db2 = dout.sum(dim=0)
    dpre, db1 = bias_gelu_bwd(dout @ w2, pre, None, approximate, in_place=True)  # [M, N] over dg, [N]
    return dpre @ w1, dpre.t() @ x, db1, dw2, db2


# ---- custom ops: autograd and fake registrations so torch.compile traces through them ----

@torch.library.custom_op("fastbert::feed_forward", mutates_args=())
def _feed_forward_op(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                     approximate: str, keep_pre: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, h); h is internal: kept for the backward with keep_pre, else empty and the backward
    (if any) reruns the up-projection."""
    return feed_forward_fwd(x, w1, b1, w2, b2, approximate, keep_pre)


@_feed_forward_op.register_fake
def _(x, w1, b1, w2, b2, approximate, keep_pre):
    return x.new_empty((x.shape[0], w2.shape[0])), x.new_empty((x.shape[0] if keep_pre else 0, w1.shape[0]))


@torch.library.custom_op("fastbert::feed_forward_bwd", mutates_args=())
def _feed_forward_bwd_op(dout: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                         w2: torch.Tensor, pre: torch.Tensor | None, approximate: str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return feed_forward_bwd(dout, x, w1, b1, w2, pre, approximate)


@_feed_forward_bwd_op.register_fake
def _(dout, x, w1, b1, w2, pre, approximate):
    return (torch.empty_like(x), torch.empty_like(w1), w1.new_empty(w1.shape[:1]), torch.empty_like(w2),
            w2.new_empty(w2.shape[:1]))


def _feed_forward_setup(ctx, inputs, output):
    x, w1, b1, w2, _, approximate, keep_pre = inputs
    # h, or b1 to rerun the up-projection
    ctx.save_for_backward(x, w1, w2, *((None, output[1]) if keep_pre else (b1, None)))
    ctx.approximate = approximate


def _feed_forward_backward(ctx, dout, dpre):
    # h is internal (feed_forward returns out only), so dpre is None.
    x, w1, w2, b1, pre = ctx.saved_tensors
    dx, dw1, db1, dw2, db2 = _feed_forward_bwd_op(dout, x, w1, b1, w2, pre, ctx.approximate)
    return dx, dw1, db1, dw2, db2, None, None


_feed_forward_op.register_autograd(_feed_forward_backward, setup_context=_feed_forward_setup)


def feed_forward(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                 approximate: str = "none", recompute_pre: bool = False) -> torch.Tensor:
    """gelu(x @ w1.T + b1) @ w2.T + b2, differentiable in all five tensors.

    x [..., K] (any strides), w1 [N, K], b1 [N], w2 [K2, N], b2 [K2], one dtype (fp32, fp16, bf16).
    Returns [..., K2]. The backward keeps x and the weights, plus h [M, N] unless recompute_pre (then it
    reruns the up-projection). Raises ValueError on mismatched shapes, dtypes or an unknown approximation.
    """
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]: a view whenever the leading dims merge
    _check(x2, w1, b1, w2, b2, approximate)
    # h is written only for a backward that reads it: an inference forward never holds it beside the GELU
    # output while the second matmul runs (one [M, N] less at its peak), and recompute_pre reruns it anyway
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (x2, w1, b1, w2, b2))
    out, _ = _feed_forward_op(x2, w1, b1, w2, b2, approximate, backward and not recompute_pre)
    return out.view(*x.shape[:-1], w2.shape[0])
