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
# A gradient autograd does not ask for (needs_input_grad: a weight frozen under LoRA or BitFit, a frozen
# input, a missing bias) is not computed: no matmul for dx, dw1 or dw2, no column sums for db1 or db2,
# and g is not recomputed without dw2, as PyTorch's own linear backward skips them.
#
# The recomputed g is gelu(h) of the rounded h, where the forward's epilogue applied the GELU to the
# fp32 accumulator: dw2 differs from the gradient of an unfused layer by that rounding (within the
# tolerance rule, tests/test_ffn.py), while the forward is bitwise kernels/bias_gelu.py's epilogue form.
# Both recompute settings run the same kernels on the same inputs, so their gradients are bitwise equal.
#
# GeGLU (gated, ModernBERT): out = (gelu(a) * b) @ w2.T + b2 with [a, b] = h = x @ w1.T + b1 split in
# halves, w1 [2N, K] (transformers' Wi: the input rows, then the gate rows), w2 [K2, N]. The same steps,
# each with its gated form:
# Forward:  g, h = the gated epilogue matmul (kernels/matmul.py GATED: one tile of a and b per program,
#                  g = gelu(a) * b; h [M, 2N] stored if kept)
#           out  = g @ w2.T + b2; g freed
# Backward: [recompute_pre: h = the same gated epilogue matmul]
#           g    = gelu(a) * b             dw2 = dout^T g;  db2 = sum_rows dout;  g freed
#           dg   = dout w2
#           dh   = [dg * b * gelu'(a), dg * gelu(a)], db1 = sum_rows dh   (bias_gelu.py's backward kernel,
#                  GATED; a new [M, 2N], dg being half its size)
#           dx   = dh w1;  dw1 = dh^T x
# Saved: x, w1, w2 and h ([M, 2N]: both halves, never g); with recompute_pre x, w1, w2 and b1.
#
# Biases are optional (b1, b2 None: ModernBERT's mlp_bias=False): the epilogue adds none and the
# backward sums no columns for them.
#
# residual (ModernBERT's pre-LayerNorm stream, optional): out = residual + FFN(x), the residual as the
# down-projection's addmm input (beta = 1), which PyTorch copies into the output and the GEMM accumulates onto:
# no add op, no second [M, K2] output and, in training, no autograd node of its own. Its gradient is dout. The
# copy moves as many bytes as the add did; with residual_in_place (the caller's stream, dead after the FFN) an
# inference call (grad mode off, nothing traced) has the GEMM accumulate onto the residual itself (addmm_): no
# copy, no add, no allocation, one [M, K2] read and write less.
#
# form (kernels/bias_gelu.py's LINEAR_BIAS_GELU_FORMS) picks how h and g are made, forward and recompute:
# "epilogue" (above) or "cublas_then_bias_gelu": h by cuBLAS (addmm), then g from h by the elementwise
# kernel the backward recomputes it with (bias_gelu / geglu forward). Same saves, same backward; g is the
# GELU of the rounded h, as the backward's recomputed g always is. fastbert.paths picks the faster per GPU.
#
# Limits: as kernels/matmul.py and kernels/bias_gelu.py: x [..., K] (M rows), w1 [N, K] ([2N, K] gated), b1 [N] ([2N])
# or None, w2 [K2, N], b2 [K2] or None, of one dtype (fp32, fp16, bf16), any strides, M >= 0.
# Sources: Megatron-LM's fused bias-GELU with recomputation; Korthikanti et al. 2022 (selective
# activation recomputation).
import math

import torch
import torch.nn.functional as F

from fastbert.kernels.bias_gelu import (APPROXIMATIONS, LINEAR_BIAS_GELU_FORMS, bias_gelu_bwd, bias_gelu_fwd,
                                        geglu_bwd, geglu_fwd, linear_bias_gelu_fwd)
from fastbert.kernels.fused_op import backward_follows, fused_op, or_empty, runs_directly
from fastbert.kernels.launch import as_rows
from fastbert.kernels.matmul import DTYPES


def _check(x, w1, b1, w2, b2, approximate, gated=False, form="epilogue", residual=None) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if form not in LINEAR_BIAS_GELU_FORMS:
        raise ValueError(f"form must be one of {LINEAR_BIAS_GELU_FORMS}, got {form!r}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; supported dtypes are {DTYPES}")
    for name, t in (("w1", w1), ("w2", w2)):
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if gated and w1.shape[0] % 2:
        raise ValueError(f"w1 has {w1.shape[0]} rows; the GeGLU's w1 holds two halves [2I, K], so they must be even")
    projected, out_features = w1.shape[0], w2.shape[0]
    inner = projected // 2 if gated else projected
    dtype, device = x.dtype, x.device
    for name, t, expected in (("w1", w1, (projected, x.shape[-1])), ("b1", b1, (projected,)),
                              ("w2", w2, (out_features, inner)), ("b2", b2, (out_features,))):
        if t is None:
            continue
        if t.shape != expected:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {expected}")
        if t.dtype != dtype or t.device != device:
            raise ValueError(f"{name} has dtype {t.dtype} on {t.device}, expected x's {dtype} on {device}")
    if residual is not None:
        expected = (*x.shape[:-1], out_features)
        if residual.shape != expected:
            raise ValueError(f"residual has shape {tuple(residual.shape)}, expected the output's {expected}")
        if residual.dtype != dtype or residual.device != device:
            raise ValueError(f"residual has dtype {residual.dtype} on {residual.device}, expected x's {dtype} on "
                             f"{device}")


def _up_projection(x, w1, b1, approximate, keep_pre, gated, form):
    """(g, h): g = gelu(h) [M, N] (gated: gelu(a) * b), h = x @ w1.T + b1 [M, N] ([M, 2N] gated), or None
    without keep_pre; made by `form` (header)."""
    if form == "epilogue":
        return linear_bias_gelu_fwd(x, w1, b1, approximate, store_pre=keep_pre, gated=gated)
    # F.linear: PyTorch's addmm(b1, x, w1.t()) (x @ w1.t() without b1) with the transpose made in C++, which
    # costs the host less than the Python call of w1.t() and torch.addmm's argument parsing
    pre = F.linear(x, w1, b1)
    g = geglu_fwd(pre, approximate) if gated else bias_gelu_fwd(pre, None, approximate)
    return g, pre if keep_pre else None


def feed_forward_fwd(x, w1, b1, w2, b2, approximate, keep_pre=True, gated=False, form="epilogue", residual=None):
    """(out, h): x [..., K] (M rows); out = gelu(h) @ w2.T + b2 [..., K2] (gated: (gelu(a) * b) @ w2.T + b2),
    plus residual [..., K2] where given, h = x @ w1.T + b1 [M, N] ([M, 2N] gated), both contiguous; without
    keep_pre h is never written (an empty [0, N] stands for it): nothing will read it. b1, b2, residual may be
    None. form: how h and gelu(h) are made (header)."""
    g, pre = _up_projection(as_rows(x), w1, b1, approximate, keep_pre, gated, form)
    if residual is None:
        out = F.linear(g, w2, b2)  # as in _up_projection
    else:  # the GEMM adds onto the residual (addmm's input)
        out = torch.addmm(as_rows(residual), g, w2.t())
        if b2 is not None:
            out += b2
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], w2.shape[0])
    return out, x.new_empty(0, w1.shape[0]) if pre is None else pre


def _add_in_place(residual, x, w1, b1, w2, b2, approximate, gated, form):
    """residual += the FFN of x, in place, and residual returned: the GEMM accumulates onto it (header). For an
    inference call only: nothing here is recorded for autograd or a tracer. residual contiguous."""
    g, _ = _up_projection(as_rows(x), w1, b1, approximate, False, gated, form)
    rows = as_rows(residual)  # a view of it
    rows.addmm_(g, w2.t())
    if b2 is not None:
        rows += b2
    return residual


def feed_forward_bwd(dout, x, w1, b1, w2, pre, approximate, gated=False, needs=(True,) * 5, form="epilogue"):
    """Gradients (dx, dw1, db1, dw2, db2) of feed_forward_fwd's out, each None where `needs` (one bool per
    input x, w1, b1, w2, b2: autograd's needs_input_grad, False for a missing bias) says no: a frozen
    weight's gradient (LoRA, BitFit) costs no matmul, as in PyTorch's own linear backward. pre None
    recomputes h from x and b1 (b1 is read only then, by `form`: the forward's). dout [..., K2] and x [..., K]
    in the forward's shapes; dx takes x's."""
    needs_dx, needs_dw1, needs_db1, needs_dw2, needs_db2 = needs
    shape = x.shape
    x, dout = as_rows(x), as_rows(dout)
    through_h = needs_dx or needs_dw1 or needs_db1
    if pre is None and (needs_dw2 or through_h):
        _, pre = _up_projection(x, w1, b1, approximate, True, gated, form)
    dw2 = db2 = dx = dw1 = db1 = None
    if needs_dw2:
        g = geglu_fwd(pre, approximate) if gated else bias_gelu_fwd(pre, None, approximate)  # [M, N]
        dw2 = dout.t() @ g
        del g
    if needs_db2:
        db2 = dout.sum(dim=0)
    if through_h:
        dg = dout @ w2  # [M, N]
        if gated:  # dh is twice dg's size: a new buffer
            dpre, db1 = geglu_bwd(dg, pre, approximate, sum_columns=needs_db1)  # [M, 2N], [2N]
        else:
            dpre, db1 = bias_gelu_bwd(dg, pre, None, approximate, in_place=True, sum_columns=needs_db1)  # over dg
        del dg
        if needs_dx:
            dx = dpre @ w1
            dx = dx if len(shape) == 2 else dx.view(*shape)
        if needs_dw1:
            dw1 = dpre.t() @ x
    return dx, dw1, db1, dw2, db2


# ---- custom ops: autograd and fake registrations so torch.compile traces through them ----

@fused_op("fastbert::feed_forward")
def _feed_forward_op(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                     b2: torch.Tensor | None, approximate: str, keep_pre: bool, gated: bool = False,
                     form: str = "epilogue", residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, h); h is internal: kept for the backward with keep_pre, else empty and the backward
    (if any) reruns the up-projection."""
    return feed_forward_fwd(x, w1, b1, w2, b2, approximate, keep_pre, gated, form, residual)


@_feed_forward_op.register_fake
def _(x, w1, b1, w2, b2, approximate, keep_pre, gated=False, form="epilogue", residual=None):
    rows = math.prod(x.shape[:-1]) if keep_pre else 0
    return x.new_empty((*x.shape[:-1], w2.shape[0])), x.new_empty((rows, w1.shape[0]))


@fused_op("fastbert::feed_forward_bwd")
def _feed_forward_bwd_op(dout: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None,
                         w2: torch.Tensor, pre: torch.Tensor | None, approximate: str, gated: bool,
                         needs: list[bool], form: str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """feed_forward_bwd with an empty [0] for each gradient not needed (a custom op returns tensors)."""
    return or_empty(dout, *feed_forward_bwd(dout, x, w1, b1, w2, pre, approximate, gated, needs, form))


@_feed_forward_bwd_op.register_fake
def _(dout, x, w1, b1, w2, pre, approximate, gated, needs, form):
    shapes = (x.shape, w1.shape, w1.shape[:1], w2.shape, w2.shape[:1])
    return tuple(dout.new_empty(shape if needed else (0,)) for shape, needed in zip(shapes, needs))


def _feed_forward_setup(ctx, inputs, output):
    x, w1, b1, w2, b2, approximate, keep_pre, gated, form, residual = inputs
    # h, or b1 to rerun the up-projection
    ctx.save_for_backward(x, w1, w2, *((None, output[1]) if keep_pre else (b1, None)))
    ctx.approximate = approximate
    ctx.gated, ctx.form = gated, form
    # needs_input_grad has an entry per argument the call passed: the custom op's (torch.compile, torch.export) may
    # end before a residual left at its default, so its presence is kept here
    ctx.has_residual = residual is not None
    ctx.set_materialize_grads(False)  # h is internal: its gradient stays None, not zeros of [M, N]


def _feed_forward_backward(ctx, dout, dpre):
    # h is internal (feed_forward returns out only), so dpre is None.
    x, w1, w2, b1, pre = ctx.saved_tensors
    needs = ctx.needs_input_grad[:5]  # x, w1, b1, w2, b2 (a missing bias needs none)
    # the residual's gradient is dout itself, as PyTorch's add hands its gradient to both inputs
    dresidual = dout if ctx.has_residual and ctx.needs_input_grad[9] else None
    if not any(needs):  # only the residual wants a gradient
        return None, None, None, None, None, None, None, None, None, dresidual
    dx, dw1, db1, dw2, db2 = _feed_forward_bwd_op(dout, x, w1, b1, w2, pre, ctx.approximate, ctx.gated, needs,
                                                  ctx.form)
    needs_dx, needs_dw1, needs_db1, needs_dw2, needs_db2 = needs
    return (dx if needs_dx else None, dw1 if needs_dw1 else None, db1 if needs_db1 else None,
            dw2 if needs_dw2 else None, db2 if needs_db2 else None, None, None, None, None, dresidual)


_feed_forward_op.register_autograd(_feed_forward_backward, setup_context=_feed_forward_setup)


def feed_forward(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                 b2: torch.Tensor | None, approximate: str = "none", recompute_pre: bool = False,
                 gated: bool = False, form: str = "epilogue", residual: torch.Tensor | None = None,
                 residual_in_place: bool = False) -> torch.Tensor:
    """gelu(x @ w1.T + b1) @ w2.T + b2, differentiable in all five tensors; gated (GeGLU):
    (gelu(a) * b) @ w2.T + b2 with [a, b] = x @ w1.T + b1 split in halves.

    x [..., K] (any strides), w1 [N, K] ([2N, K] gated), b1 [N] ([2N]) or None, w2 [K2, N], b2 [K2] or
    None, residual [..., K2] (added to the output by the down-projection, header) or None, one dtype (fp32,
    fp16, bf16). residual_in_place: the residual may be overwritten; a contiguous one is, with the result, in
    grad mode off (torch.no_grad, inference_mode) where the op's call would run directly (fused_op.runs_directly:
    nothing traced, no forward-mode AD, plain tensors off the meta device; the result is then residual).
    Returns [..., K2]. The backward keeps x and the weights, plus h [M, N] ([M, 2N]) unless recompute_pre
    (then it reruns the up-projection). form: "epilogue" or "cublas_then_bias_gelu" (header). Raises
    ValueError on mismatched shapes, dtypes, an unknown approximation or form.
    """
    _check(x, w1, b1, w2, b2, approximate, gated, form, residual)
    # grad mode first: one C call is all a training step's layer pays for the question. The in-place path runs past
    # the op's call, so only where that call would run its function directly: under forward-mode AD it refuses a
    # tangent, which the path would drop without an error; meta tensors and tensor subclasses take its registrations
    if residual_in_place and not torch.is_grad_enabled() and residual is not None and residual.is_contiguous() and (
            runs_directly(x, residual, w1, b1, w2, b2)):
        return _add_in_place(residual, x, w1, b1, w2, b2, approximate, gated, form)
    # h is written only for a backward that reads it: an inference forward never holds it beside the GELU
    # output while the second matmul runs (one [M, N] less at its peak), recompute_pre reruns it anyway, and a
    # backward that wants db2 alone (the rest frozen) needs only dout
    backward_reads_h = backward_follows((x, w1, w2, b1))
    # x goes in with its own shape, the op flattening it (launch.as_rows)
    out, _ = _feed_forward_op(x, w1, b1, w2, b2, approximate, backward_reads_h and not recompute_pre, gated, form,
                              residual)
    return out


def feed_forward_geglu(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                       b2: torch.Tensor | None, approximate: str = "none", recompute_pre: bool = False,
                       form: str = "epilogue", residual: torch.Tensor | None = None,
                       residual_in_place: bool = False) -> torch.Tensor:
    """ModernBERT's FFN: (gelu(h[..., :I]) * h[..., I:]) @ w2.T + b2 (+ residual) with h = x @ w1.T + b1;
    w1 [2I, K], b1 [2I] or None, w2 [K2, I], b2 [K2] or None. `feed_forward` with gated=True."""
    return feed_forward(x, w1, b1, w2, b2, approximate, recompute_pre, gated=True, form=form, residual=residual,
                        residual_in_place=residual_in_place)
