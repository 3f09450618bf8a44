# Fused bias + GELU: y = gelu(x + bias), exact erf form ("none") or tanh approximation ("tanh"),
# and the FFN up-projection with it, y = gelu(x @ weight.T + bias).
#
# bias_gelu: an elementwise kernel over [BLOCK_M, BLOCK_N] tiles of the 2-D view x [M, N]; the
# forward saves x (not x + bias: same memory, and the backward recomputes the sum for free). The
# backward kernel computes dx = dy * gelu'(x + bias) and, in the same pass, dbias = sum_rows dx: each
# program owns a fixed group of rows and one column block, adds each row tile's dx into a tile of sums
# (element by element: no thread talks to another), sums that tile's rows once after its last row tile and
# writes one row of partial sums; torch sums the [groups, N] partials. No atomics, so dbias is
# bitwise reproducible. The sums are fp64 (a conversion and an add per element, free in a
# memory-bound pass), so dbias carries one rounding, not the error of a long fp32 summation. (Summing the
# rows of every tile as it came crossed warps: for BERT-base's [32768, 3072] in bf16 on sm_90a, 16 barriers
# (and shared-memory round trips) in each loop iteration of 4 x 1024 elements, the H100 profile's bias-GELU
# backward at ~3x its bytes' floor; now none in the loop, and on tiles half the forward's size, _BWD_TILE_ELEMENTS.
# `python benchmarks/loop_barriers.py` prints the registers and the barriers per loop.)
#
# linear_bias_gelu has two forms; LINEAR_BIAS_GELU_FORM picks the one the model uses:
#   "epilogue"              one Triton matmul (kernels/matmul.py) with bias + GELU in its epilogue,
#                           which also stores the pre-activation h = x @ weight.T + bias for the
#                           backward; the backward runs the dx kernel above on h (no bias) to get
#                           dh and dbias, then dx = dh @ weight and dweight = dh.T @ x (cuBLAS).
#   "cublas_then_bias_gelu" x @ weight.T by cuBLAS, then the bias_gelu kernel; autograd chains the
#                           two backwards.
# The epilogue form saves one read of the [M, N] activation and a launch in the forward (both forms
# write h and y); cuBLAS's matmul may still be the faster on a given GPU. The benchmark (see
# PERF.md) measures both (`form=` picks one per call), and LINEAR_BIAS_GELU_FORM records the verdict.
#
# The GeGLU (ModernBERT's FFN, kernels/ffn.py) runs the same two kernels with GATED: the forward reads
# h = [a, b] [M, 2N] and writes gelu(a) * b [M, N] (the backward's recomputation of the epilogue's
# output), the backward reads dy = dg [M, N] and h and writes dh = [da, db] [M, 2N] with
#   da = dg * b * gelu'(a),   db = dg * gelu(a),
# and, when the up-projection has a bias, the column sums of both halves (SUM_COLUMNS: without a bias
# nothing is summed).
#
# Limits: fp32, fp16, bf16; x and dy of any strides (leading dims that cannot be merged into one are
# copied by reshape); any number of rows; N >= 1. Math in fp32, one rounding to the output dtype.
# Sources: Megatron-LM's fused bias_gelu, Liger-Kernel's GEGLU/elementwise kernels.
import functools

import torch
import triton
import triton.language as tl

from fastbert.kernels.fused_op import backward_follows, fused_op, or_empty, register_no_backward
from fastbert.kernels.launch import as_rows, cdiv, launch, next_power_of_2, placeholders
from fastbert.kernels.matmul import DTYPES, check_operands, gelu, gelu_grad, matmul_fwd, row_groups
from fastbert.kernels.numerics import INTERPRETER, cast

APPROXIMATIONS = ("none", "tanh")
LINEAR_BIAS_GELU_FORMS = ("epilogue", "cublas_then_bias_gelu")
# The form linear_bias_gelu (the model's FFN up-projection) uses; a benchmark run settles it.
LINEAR_BIAS_GELU_FORM = "epilogue"

# Elements per tile of the elementwise kernels: 4096 (32 per thread at 4 warps) is enough work per
# program to hide memory latency on an H100; the interpreter wants few, large programs instead.
_TILE_ELEMENTS = 65536 if INTERPRETER else 4096
# The backward's tiles are half as large: each thread keeps an fp64 sum per tile element across the loop, which at
# the forward's 4096 elements on 8 warps cost the backward occupancy. At 2048 (sm_90a, BERT-base's training shapes,
# `python benchmarks/loop_barriers.py`): 48-68 registers in bf16, 94 for the GeGLU's (at 4096 with per-tile
# reductions before: 76-97 and 154, and 16 and 32 barriers in every loop iteration; now none), still one 16-byte
# load per thread and operand per iteration in 16-bit.
_BWD_TILE_ELEMENTS = 65536 if INTERPRETER else 2048
_MAX_BLOCK_N = 1024
# The backward's tile and its fp64 column sums on 4 warps spilled 4 to 16 bytes on sm_80 and sm_90a (Triton 3.9)
_BWD_WARPS = 8


@triton.jit
def _bias_gelu_fwd_kernel(
    x_ptr,  # [M, N]; [M, 2N] when GATED (a, then b)
    bias_ptr,  # [N] (read when HAS_BIAS)
    y_ptr,  # [M, N] contiguous
    M, N,
    stride_xm, stride_xn,
    HAS_BIAS: tl.constexpr,  # False: y = gelu(x), the FFN's backward recomputing gelu(pre) (kernels/ffn.py)
    GATED: tl.constexpr,  # y = gelu(a) * b, the GeGLU FFN's backward recomputing its epilogue's output
    APPROXIMATE: tl.constexpr,  # "none" or "tanh"
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # times a column stride: past 2**31
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = cast(tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0),
             tl.float32)
    if HAS_BIAS:
        x += cast(tl.load(bias_ptr + cols, mask=cols < N, other=0.0), tl.float32)[None, :]
    y = gelu(x, APPROXIMATE)
    if GATED:
        gate_offsets = rows[:, None] * stride_xm + (cols + N)[None, :] * stride_xn
        y *= cast(tl.load(x_ptr + gate_offsets, mask=mask, other=0.0), tl.float32)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], cast(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    dy_ptr,  # [M, N]
    x_ptr,  # [M, N]; [M, 2N] when GATED (a, then b)
    bias_ptr,  # [N] (read when HAS_BIAS)
    dx_ptr,  # [M, N] contiguous; [M, 2N] when GATED
    dbias_partial_ptr,  # [num_row_groups, N] ([.., 2N] GATED) fp64: column sums of dx over each group's rows,
                        # written when SUM_COLUMNS
    M, N, rows_per_group,
    stride_dym, stride_dyn, stride_xm, stride_xn,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    SUM_COLUMNS: tl.constexpr,
    APPROXIMATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # y = gelu(z), z = x + bias:  dx = dy * gelu'(z);  dbias = sum over rows of dx.
    # GATED, y = gelu(a) * b with x = [a, b]:  da = dy * b * gelu'(a);  db = dy * gelu(a);  dx = [da, db].
    group = tl.program_id(0).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # times a column stride: past 2**31
    col_mask = cols < N
    b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        b = cast(tl.load(bias_ptr + cols, mask=col_mask, other=0.0), tl.float32)
    dx_row = 2 * N if GATED else N  # dx's and the partial sums' row length
    # column sums accumulated per tile element, reduced over the tile's rows once after the loop: a reduction
    # across rows in every iteration crosses warps (shared memory and barriers in each)
    dbias = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
    dbias_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
    first = group * rows_per_group
    last = tl.minimum(first + rows_per_group, M)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < last) & col_mask[None, :]
        dy = cast(tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :] * stride_dyn, mask=mask, other=0.0),
                  tl.float32)
        z = cast(tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0),
                 tl.float32) + b[None, :]
        if GATED:
            gate = tl.load(x_ptr + rows[:, None] * stride_xm + (cols + N)[None, :] * stride_xn, mask=mask, other=0.0)
            dgate = cast(dy * gelu(z, APPROXIMATE), dx_ptr.dtype.element_ty)
            tl.store(dx_ptr + rows[:, None] * dx_row + N + cols[None, :], dgate, mask=mask)
            if SUM_COLUMNS:
                dbias_gate += tl.where(mask, cast(dgate, tl.float64), 0.0)
            dy = dy * cast(gate, tl.float32)
        dx = cast(dy * gelu_grad(z, APPROXIMATE), dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + rows[:, None] * dx_row + cols[None, :], dx, mask=mask)
        if SUM_COLUMNS:
            # Sum the rounded dx, as autograd does for an unfused x + bias.
            dbias += tl.where(mask, cast(dx, tl.float64), 0.0)
    if SUM_COLUMNS:
        tl.store(dbias_partial_ptr + group * dx_row + cols, tl.sum(dbias, axis=0), mask=col_mask)
        if GATED:
            tl.store(dbias_partial_ptr + group * dx_row + N + cols, tl.sum(dbias_gate, axis=0),
                     mask=col_mask)


@functools.lru_cache(maxsize=None)
def _blocks(cols: int, tile: int = _TILE_ELEMENTS) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of a tile of about `tile` elements over rows of `cols`."""
    block_n = min(next_power_of_2(cols), _MAX_BLOCK_N)
    return max(1, tile // block_n), block_n


def _check(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; supported dtypes are {DTYPES}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a last dimension of size >= 1, got shape {tuple(x.shape)}")
    if bias is not None:
        if bias.shape != (x.shape[-1],):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected {(x.shape[-1],)}")
        if bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(f"bias is {bias.dtype} on {bias.device}, expected x's {x.dtype} on {x.device}")


# The launchers below take what the public entries (`bias_gelu`, `linear_bias_gelu`, kernels/ffn.py's
# `feed_forward`) have checked, and check only their own options.

def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias) (bias None: gelu(x)). x [..., N] (any strides), bias [N] or None, one dtype.
    Returns contiguous [..., N]."""
    x2 = as_rows(x)
    rows, cols = x2.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows == 0:
        return y
    block_m, block_n = _blocks(cols)
    grid = (cdiv(rows, block_m), cdiv(cols, block_n))
    # the kernels index the bias as contiguous: a strided one (a slice) is copied, N elements
    launch(_bias_gelu_fwd_kernel, grid, x2, x2 if bias is None else bias.contiguous(), y, rows, cols,
           *x2.stride(), HAS_BIAS=bias is not None, GATED=False, APPROXIMATE=approximate, BLOCK_M=block_m,
           BLOCK_N=block_n)
    return y


def bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None,
                  approximate: str = "none", in_place: bool = False,
                  sum_columns: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of y = gelu(x + bias) (bias None: y = gelu(x)).

    dy, x [..., N] (any strides, one shape and dtype), bias [N] or None. Returns (dx [..., N] contiguous in
    x's dtype, dbias [N] in x's dtype, the column sums of dx; None without sum_columns: no bias, or a frozen one).
    in_place writes dx over dy, which must then be contiguous (the FFN's backward: one [M, N] buffer less at
    its peak); each element is read before it is written. Raises ValueError for a strided dy to overwrite.
    """
    if in_place and not dy.is_contiguous():
        raise ValueError(f"in_place needs a contiguous dy, got strides {dy.stride()}")
    x2, dy2 = as_rows(x), as_rows(dy)
    rows, cols = x2.shape
    dx = dy if in_place else torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, _gelu_bwd_launch(dy2, x2, bias, dx, rows, cols, approximate, False, sum_columns)


def _gelu_bwd_launch(dy2, x2, bias, dx, rows, cols, approximate, gated, sum_columns):
    """Launch _bias_gelu_bwd_kernel over dy2 [rows, cols] into dx; returns the column sums of dx in dx's
    dtype ([2 * cols] when gated), or None without sum_columns."""
    sums = 2 * cols if gated else cols
    if rows == 0:
        return torch.zeros(sums, dtype=dx.dtype, device=dx.device) if sum_columns else None
    block_m, block_n = _blocks(cols, _BWD_TILE_ELEMENTS)
    col_blocks = cdiv(cols, block_n)
    groups, rows_per_group = row_groups(rows, col_blocks, block_m, dx.device)
    partial = (dx.new_empty(groups, sums, dtype=torch.float64) if sum_columns
               else placeholders(dx.device)[torch.float64])
    launch(_bias_gelu_bwd_kernel, (groups, col_blocks),
        dy2, x2, x2 if bias is None else bias.contiguous(), dx, partial, rows, cols, rows_per_group,
        *dy2.stride(), *x2.stride(),
        HAS_BIAS=bias is not None, GATED=gated, SUM_COLUMNS=sum_columns, APPROXIMATE=approximate,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=_BWD_WARPS)
    return partial.sum(dim=0).to(dx.dtype) if sum_columns else None


def geglu_fwd(h: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(a) * b with [a, b] = h split in halves: h [..., 2N] (any strides, 2N even) -> contiguous [..., N]
    in h's dtype."""
    h2 = as_rows(h)
    rows, cols = h2.shape[0], h2.shape[1] // 2
    y = h.new_empty(*h.shape[:-1], cols)
    if rows == 0:
        return y
    block_m, block_n = _blocks(cols)
    grid = (cdiv(rows, block_m), cdiv(cols, block_n))
    launch(_bias_gelu_fwd_kernel, grid, h2, h2, y, rows, cols, *h2.stride(), HAS_BIAS=False, GATED=True,
           APPROXIMATE=approximate, BLOCK_M=block_m, BLOCK_N=block_n)
    return y


def geglu_bwd(dy: torch.Tensor, h: torch.Tensor, approximate: str = "none",
              sum_columns: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of y = gelu(a) * b, [a, b] = h split in halves. dy [..., N], h [..., 2N] (any strides, one
    dtype). Returns (dh [..., 2N] contiguous in h's dtype, its column sums [2N] (the bias gradient of the
    up-projection) or None without sum_columns)."""
    h2, dy2 = as_rows(h), as_rows(dy)
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    return dh, _gelu_bwd_launch(dy2, h2, None, dh, h2.shape[0], dy2.shape[1], approximate, True, sum_columns)


# ---- custom ops: autograd and fake registrations so torch.compile traces through them ----

@fused_op("fastbert::bias_gelu")
def _bias_gelu_op(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    return bias_gelu_fwd(x, bias, approximate)


@_bias_gelu_op.register_fake
def _(x, bias, approximate):
    return x.new_empty(x.shape)


@fused_op("fastbert::bias_gelu_bwd")
def _bias_gelu_bwd_op(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str,
                      sum_columns: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """bias_gelu_bwd; without sum_columns (no bias gradient needed) an empty [0] for dbias."""
    return or_empty(x, *bias_gelu_bwd(dy, x, bias, approximate, sum_columns=sum_columns))


@_bias_gelu_bwd_op.register_fake
def _(dy, x, bias, approximate, sum_columns):
    return x.new_empty(x.shape), x.new_empty(x.shape[-1:] if sum_columns else (0,))


def _bias_gelu_setup(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _bias_gelu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    needs_dbias = ctx.needs_input_grad[1]  # no column sums for a frozen bias
    dx, dbias = _bias_gelu_bwd_op(dy, x, bias, ctx.approximate, needs_dbias)
    return dx, dbias if needs_dbias else None, None


_bias_gelu_op.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)


def linear_bias_gelu_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         approximate: str, store_pre: bool = True,
                         gated: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(gelu(h), h) with h = x @ weight.T + bias, both contiguous [M, N], from one epilogue matmul; h is
    None (never written) without store_pre. x [M, K], weight [N, K], bias [N] or None, one dtype.
    gated (GeGLU): weight [2N, K], bias [2N], returns (gelu(a) * b [M, N], h = [a, b] [M, 2N]).
    The operands are checked by the callers' entries (matmul.check_operands)."""
    y = x.new_empty(x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0])
    pre = x.new_empty(x.shape[0], weight.shape[0]) if store_pre else None
    matmul_fwd(x, weight, bias, y, "gelu_tanh" if approximate == "tanh" else "gelu", pre, gated)
    return y, pre


@fused_op("fastbert::linear_bias_gelu")
def _linear_bias_gelu_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (gelu(h), h) with h = x @ weight.T + bias; x [M, K]. h is kept for the backward."""
    return linear_bias_gelu_fwd(x, weight, bias, approximate)


@_linear_bias_gelu_op.register_fake
def _(x, weight, bias, approximate):
    y = x.new_empty((x.shape[0], weight.shape[0]))
    return y, torch.empty_like(y)


@fused_op("fastbert::linear_bias_gelu_infer")
def _linear_bias_gelu_infer_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                               approximate: str) -> torch.Tensor:
    """`_linear_bias_gelu_op` where no backward follows: gelu(h) alone; h, which only the backward reads, is never
    allocated or written (half the epilogue's stores)."""
    return linear_bias_gelu_fwd(x, weight, bias, approximate, store_pre=False)[0]


@_linear_bias_gelu_infer_op.register_fake
def _(x, weight, bias, approximate):
    return x.new_empty((x.shape[0], weight.shape[0]))


register_no_backward(_linear_bias_gelu_infer_op, "pre-activation", "fastbert::linear_bias_gelu, or linear_bias_gelu")


def _linear_bias_gelu_setup(ctx, inputs, output):
    x, weight, _, approximate = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.approximate = approximate
    ctx.set_materialize_grads(False)  # h is internal: its gradient stays None, not zeros of [M, N]


def _linear_bias_gelu_backward(ctx, dy, dpre):
    # y = gelu(h), h = x W^T + b:  dh = dy * gelu'(h);  dx = dh W;  dW = dh^T x;  db = sum_rows dh.
    # h is internal (the public function returns y only), so dpre is None. A gradient no input needs (a
    # frozen weight or bias: LoRA, BitFit) is not computed, as in PyTorch's own linear backward.
    x, weight, pre = ctx.saved_tensors
    needs_dx, needs_dweight, needs_dbias = ctx.needs_input_grad[:3]
    dh, dbias = _bias_gelu_bwd_op(dy, pre, None, ctx.approximate, needs_dbias)
    return (dh @ weight if needs_dx else None, dh.t() @ x if needs_dweight else None,
            dbias if needs_dbias else None, None)


_linear_bias_gelu_op.register_autograd(_linear_bias_gelu_backward, setup_context=_linear_bias_gelu_setup)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias), differentiable in x and bias. x [..., N], bias [N]; approximate "none" or "tanh".
    Raises ValueError on a mismatched bias, an unsupported dtype or approximation."""
    _check(x, bias, approximate)
    return _bias_gelu_op(x, bias, approximate)


def linear_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate: str = "none",
                     form: str | None = None) -> torch.Tensor:
    """gelu(x @ weight.T + bias): x [..., K], weight [N, K], bias [N] -> [..., N], differentiable in
    all three. form "epilogue" or "cublas_then_bias_gelu"; None (the model's path) means
    LINEAR_BIAS_GELU_FORM. Raises ValueError on mismatched shapes or dtypes, or an unknown form."""
    form = LINEAR_BIAS_GELU_FORM if form is None else form
    if form not in LINEAR_BIAS_GELU_FORMS:
        raise ValueError(f"form must be one of {LINEAR_BIAS_GELU_FORMS}, got {form!r}")
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    x2 = as_rows(x)
    check_operands(x2, weight, bias)
    if form == "cublas_then_bias_gelu":
        return _bias_gelu_op(x @ weight.t(), bias, approximate)
    if backward_follows((x2, weight, bias)):
        y, _ = _linear_bias_gelu_op(x2, weight, bias, approximate)
    else:
        y = _linear_bias_gelu_infer_op(x2, weight, bias, approximate)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
