# Fused QKV projection: qkv = x @ Wqkv.T + bias stored straight in the attention layout.
#
# Forward: one Triton matmul (kernels/matmul.py) over x [M, H] (M = B*S tokens) and Wqkv [3H, H]
# whose epilogue adds the bias and scatters output column n = which*H + head*d + c of token
# m = b*S + s to qkv[which, b, head, s, c] of one [3, B, heads, S, d] buffer (packed tokens
# x [T, H]: [3, T, heads, d]). q, k, v are the three contiguous slices of that buffer, so no
# transpose or contiguous copy follows the matmul (eager: addmm, view, transpose, contiguous).
#
# Backward: with dQKV [M, 3H] the gradient of the matmul's output in token-major order,
#   dx = dQKV @ Wqkv,   dWqkv = dQKV^T @ x,   dbias = sum over tokens of dQKV.
# fastbert's attention backward writes dq, dk, dv as the three column blocks of one [M, 3H] buffer
# (kernels/attention.py), which is dQKV as it is: nothing is gathered, and dbias is one torch column sum over
# it (fp32 accumulation for 16-bit dQKV, PyTorch's own bias gradient; deterministic). Gradients laid out
# otherwise (another attention's, or ones autograd summed) are gathered by one Triton launch (any strides),
# which sums the columns in the same pass into per-row-group partials in fp64 (a few conversions in a
# memory-bound pass; fixed order, no atomics, so dbias is reproducible). The two matmuls are cuBLAS's.
#
# The bias is optional (None: no bias in the epilogue and no column sums in the backward; ModernBERT's Wqkv
# has none).
#
# Limits: fp32, fp16, bf16; hidden size H >= 1 divisible by num_heads; any number of tokens; x of
# any strides (a [B, S, H] whose B and S do not merge is copied by reshape). Offsets are int64.
# Sources: Megatron-LM's fused QKV layout, flash-attention's qkv-packed interface.
import functools

import torch
import triton
import triton.language as tl

from fastbert.kernels.fused_op import backward_follows, c_apply, fused_op, once_differentiable, or_empty, tracing
from fastbert.kernels.launch import cdiv, launch, next_power_of_2, placeholders
from fastbert.kernels.matmul import DTYPES, matmul_fwd, row_groups
from fastbert.kernels.numerics import INTERPRETER, cast

# Elements per tile of the gradient gather: as kernels/bias_gelu.py's backward (each thread keeps an fp64 column
# sum per tile element across the loop; at 2048 on 4 warps, 64 registers in bf16 and 72 in fp32 on sm_90a, no
# barrier in the loop: `python benchmarks/loop_barriers.py`; the per-tile reduction before put 16 in each iteration).
_TILE_ELEMENTS = 65536 if INTERPRETER else 2048
_MAX_BLOCK_N = 256


@triton.jit
def _qkv_bwd_kernel(
    dq_ptr, dk_ptr, dv_ptr,  # [B, heads, S, d] each (packed tokens: [1, heads, T, d]), any strides
    dqkv_ptr,  # [M, 3H] contiguous
    dbias_partial_ptr,  # [num_row_groups, 3H] fp64: column sums of dqkv over each group's rows (SUM_COLUMNS)
    M, H, seqlen, rows_per_group,
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    HEAD_DIM: tl.constexpr,
    SUM_COLUMNS: tl.constexpr,  # False without a bias: nothing to sum
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Grid axis 2 picks dq, dk or dv (one launch for the three): which = 0, 1, 2 fills columns [which H, which H + H).
    # dQKV[m, which H + c] = grad[m // S, c // d, m % S, c % d];  dbias[which H + c] = sum_m of it.
    which = tl.program_id(2)
    grad_ptr = tl.where(which == 0, dq_ptr, tl.where(which == 1, dk_ptr, dv_ptr))
    stride_b = tl.where(which == 0, stride_qb, tl.where(which == 1, stride_kb, stride_vb)).to(tl.int64)
    stride_h = tl.where(which == 0, stride_qh, tl.where(which == 1, stride_kh, stride_vh)).to(tl.int64)
    stride_s = tl.where(which == 0, stride_qs, tl.where(which == 1, stride_ks, stride_vs)).to(tl.int64)
    stride_d = tl.where(which == 0, stride_qd, tl.where(which == 1, stride_kd, stride_vd)).to(tl.int64)
    col_offset = which * H
    group = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < H
    col_off = (cols // HEAD_DIM).to(tl.int64) * stride_h + (cols % HEAD_DIM).to(tl.int64) * stride_d  # [BLOCK_N]
    # column sums accumulated per tile element, reduced over the tile's rows once after the loop (a reduction
    # across rows in every iteration crosses warps: shared memory and barriers in each)
    dbias = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
    first = group * rows_per_group
    last = tl.minimum(first + rows_per_group, M)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < last) & col_mask[None, :]
        row_off = (rows // seqlen) * stride_b + (rows % seqlen) * stride_s  # [BLOCK_M]
        g = tl.load(grad_ptr + row_off[:, None] + col_off[None, :], mask=mask, other=0.0)
        tl.store(dqkv_ptr + rows[:, None] * (3 * H) + col_offset + cols[None, :], g, mask=mask)
        if SUM_COLUMNS:
            dbias += cast(g, tl.float64)  # masked elements loaded as 0
    if SUM_COLUMNS:
        tl.store(dbias_partial_ptr + group * (3 * H) + col_offset + cols, tl.sum(dbias, axis=0), mask=col_mask)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int) -> None:
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [B, S, H] or [T, H], got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    if x.dtype not in DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; supported dtypes are {DTYPES}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0 or hidden % num_heads:
        raise ValueError(f"num_heads ({num_heads!r}) must be a positive int that divides the hidden size {hidden}")
    if weight.shape != (3 * hidden, hidden):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected {(3 * hidden, hidden)}")
    if bias is not None and bias.shape != (3 * hidden,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected {(3 * hidden,)}")
    _check_weights(x, weight, bias)


def check_limits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The checks beyond the shapes, which fastbert.ops makes itself (in the same words): dtypes and devices."""
    if x.dtype not in DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; supported dtypes are {DTYPES}")
    _check_weights(x, weight, bias)


def _check_weights(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    dtype, device = x.dtype, x.device
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != dtype or t.device != device):
            raise ValueError(f"{name} is {t.dtype} on {t.device}, expected x's {dtype} on {device}")


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    """[..., heads, S, d] view of one of q, k, v: [B, heads, S, d] as it is, [T, heads, d] as
    [1, heads, T, d] (same memory, strides permuted)."""
    return t if t.dim() == 4 else t.unsqueeze(0).transpose(1, 2)


def qkv_projection_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       num_heads: int) -> torch.Tensor:
    """x [B, S, H] -> qkv [3, B, heads, S, d]; x [T, H] -> qkv [3, T, heads, d]; contiguous.

    weight [3H, H] (query, key, value rows in that order), bias [3H] or None, one dtype; x any strides (checked
    by `qkv_projection`).
    """
    hidden = x.shape[-1]
    head_dim = hidden // num_heads
    if x.dim() == 3:
        qkv = x.new_empty(3, x.shape[0], num_heads, x.shape[1], head_dim)
        out = qkv
        x = x.reshape(-1, hidden)
    else:
        qkv = x.new_empty(3, x.shape[0], num_heads, head_dim)
        out = qkv.unsqueeze(1).transpose(2, 3)  # [3, 1, heads, T, d]
    matmul_fwd(x, weight, bias, out)
    return qkv


@functools.lru_cache(maxsize=4096)
def _backward_tiles(rows: int, hidden: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, column blocks, row groups, rows per group) of the gradient gather, cached."""
    block_n = min(next_power_of_2(hidden), _MAX_BLOCK_N)
    block_m = _TILE_ELEMENTS // block_n
    col_blocks = cdiv(hidden, block_n)
    groups, rows_per_group = row_groups(rows, 3 * col_blocks, block_m, device)  # dq, dk and dv share the grid
    return block_m, block_n, col_blocks, groups, rows_per_group


def _one_matrix(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, rows: int, hidden: int) -> torch.Tensor | None:
    """The [rows, 3H] matrix whose column blocks dq, dk and dv are, as attention's backward writes them (views
    of one [B, S, 3, heads, d] or [T, 3, heads, d] buffer), or None for gradients laid out otherwise. Read
    from the strides, the storage offsets and the storage itself, not from `_base`: torch.compile's Inductor
    hands a custom op views made without one."""
    row_stride = 3 * hidden
    strides = (row_stride, dq.shape[-1], 1) if dq.dim() == 3 else (dq.shape[2] * row_stride, dq.shape[3], row_stride, 1)
    start = dq.storage_offset()
    if dq.stride() != strides or dk.stride() != strides or dv.stride() != strides \
            or dk.storage_offset() != start + hidden or dv.storage_offset() != start + 2 * hidden \
            or not (torch._C._is_alias_of(dk, dq) and torch._C._is_alias_of(dv, dq)):  # one storage
        return None
    # dq[b, h, s, c] is at start + (b S + s) 3H + h d + c, dk's and dv's H and 2H further: row b S + s of the
    # matrix at start, whose last element is dv's last (in the storage's bounds)
    return dq.as_strided((rows, row_stride), (row_stride, 1))


def qkv_projection_bwd(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, x: torch.Tensor,
                       weight: torch.Tensor, needs: tuple = (True, True, True)
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """dq, dk, dv shaped like q, k, v (any strides, x's dtype: autograd hands over gradients of its outputs'
    shapes and dtypes) -> (dx like x, dweight [3H, H], dbias [3H]), each None where `needs` (one bool per input
    x, weight, bias: autograd's needs_input_grad, False for a missing bias) says no: a frozen weight (BitFit)
    costs no matmul, as in PyTorch's own linear backward."""
    needs_dx, needs_dweight, needs_dbias = needs
    hidden = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, hidden)
    rows = x2.shape[0]
    if rows == 0:
        return (torch.zeros_like(x) if needs_dx else None, torch.zeros_like(weight) if needs_dweight else None,
                x.new_zeros(3 * hidden) if needs_dbias else None)
    dqkv = _one_matrix(dq, dk, dv, rows, hidden)
    if dqkv is not None:
        # accumulated in fp32 for 16-bit dQKV (as PyTorch's own bias gradient), with no copy of dQKV: an fp64
        # sum would first convert all of it
        dbias = dqkv.sum(dim=0) if needs_dbias else None
    else:
        dqkv = x.new_empty(rows, 3 * hidden)
        block_m, block_n, col_blocks, groups, rows_per_group = _backward_tiles(rows, hidden, x.device)
        partial = (x.new_empty(groups, 3 * hidden, dtype=torch.float64) if needs_dbias
                   else placeholders(x.device)[torch.float64])
        dq, dk, dv = _heads_view(dq), _heads_view(dk), _heads_view(dv)
        launch(_qkv_bwd_kernel, (groups, col_blocks, 3),
            dq, dk, dv, dqkv, partial, rows, hidden, dq.shape[2], rows_per_group, *dq.stride(), *dk.stride(),
            *dv.stride(), HEAD_DIM=dq.shape[3], SUM_COLUMNS=needs_dbias, BLOCK_M=block_m, BLOCK_N=block_n)
        dbias = partial.sum(dim=0).to(x.dtype) if needs_dbias else None
    dx = None
    if needs_dx:
        dx = dqkv @ weight
        dx = dx if x.dim() == 2 else dx.view_as(x)
    return dx, dqkv.t() @ x2 if needs_dweight else None, dbias


# ---- custom ops: autograd and fake registrations so torch.compile traces through them ----

@fused_op("fastbert::qkv_projection")
def _qkv_projection_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       num_heads: int) -> torch.Tensor:
    return qkv_projection_fwd(x, weight, bias, num_heads)


@_qkv_projection_op.register_fake
def _(x, weight, bias, num_heads):
    head_dim = x.shape[-1] // num_heads
    if x.dim() == 3:
        return x.new_empty((3, x.shape[0], num_heads, x.shape[1], head_dim))
    return x.new_empty((3, x.shape[0], num_heads, head_dim))


@fused_op("fastbert::qkv_projection_bwd")
def _qkv_projection_bwd_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, x: torch.Tensor,
                           weight: torch.Tensor,
                           needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv_projection_bwd with an empty [0] for each gradient not needed (a custom op returns tensors)."""
    return or_empty(x, *qkv_projection_bwd(dq, dk, dv, x, weight, needs))


@_qkv_projection_bwd_op.register_fake
def _(dq, dk, dv, x, weight, needs):
    shapes = (x.shape, weight.shape, weight.shape[:1])
    return tuple(x.new_empty(shape if needed else (0,)) for shape, needed in zip(shapes, needs))


def _project(x, weight, bias, num_heads: int, cublas_forward: bool):
    """q, k, v: slices of the forward op's buffer, or, in the cuBLAS form (what backend="auto" runs where
    fastbert.paths measured it faster), PyTorch's own projection: cuBLAS's GEMM with its bias, q, k, v strided
    views of its [M, 3H] output. Either way the backward is this module's: PyTorch's autograd would stack the
    three gradients into a new [M, 3H] tensor before its matmuls, though attention's backward wrote them as the
    column blocks of one (a pass over dQKV: the third H100 run's profile, at batch 256 x 128, put that stack at
    0.29 ms a BERT-base layer, and a second copy, which the reference's backward made then, at 0.22 ms)."""
    if cublas_forward:
        from fastbert.reference import qkv_projection  # here: a line above the kernels would change their hashes
        return qkv_projection(x, weight, bias, num_heads)
    return _qkv_projection_op(x, weight, bias, num_heads).unbind(0)


class _QKVProjection(torch.autograd.Function):
    """Returns q, k, v as views of one forward buffer and takes their gradients separately, so that the
    backward reads them where they are (attention's one buffer) or gathers them once (autograd's unbind
    backward would first stack them). New-style (setup_context apart), as torch.func.grad needs. No jvp: Dynamo
    refuses a Function that has one; forward-mode AD gets PyTorch's own error for a Function without."""

    @staticmethod
    def forward(x, weight, bias, num_heads, cublas_forward):
        return _project(x, weight, bias, num_heads, cublas_forward)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1])

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, weight = ctx.saved_tensors
        needs_dx, needs_dweight, needs_dbias = needs = ctx.needs_input_grad[:3]  # a missing bias needs none
        dx, dweight, dbias = _qkv_projection_bwd_op(dq, dk, dv, x, weight, needs)
        gradients = dx if needs_dx else None, dweight if needs_dweight else None, dbias if needs_dbias else None
        return once_differentiable("qkv_projection", (*gradients, None, None), ctx, (dq, dk, dv))


_QKV_EAGER_APPLY = c_apply(_QKVProjection)


def qkv_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                   cublas_forward: bool = False):
    """x [B, S, H] -> (q, k, v) each [B, heads, S, H/heads]; x [T, H] -> each [T, heads, H/heads].

    Contiguous outputs (three slices of one buffer; with cublas_forward, the cuBLAS form: strided views of
    cuBLAS's [tokens, 3H] output), differentiable in x, weight and bias.
    weight [3H, H], bias [3H] or None. Raises ValueError on mismatched shapes, dtypes or num_heads.
    """
    _check(x, weight, bias, num_heads)
    return qkv_projection_unchecked(x, weight, bias, num_heads, cublas_forward)


def qkv_projection_unchecked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                             cublas_forward: bool = False):
    """`qkv_projection` after its checks, which the caller has made (fastbert.ops: the shapes, then
    `check_limits`)."""
    if backward_follows((x, weight, bias)):
        # Function.apply's Python layer where PyTorch traces or transforms (torch.compile, torch.func)
        apply = _QKVProjection.apply if tracing() else _QKV_EAGER_APPLY
        return apply(x, weight, bias, num_heads, cublas_forward)
    return _project(x, weight, bias, num_heads, cublas_forward)
