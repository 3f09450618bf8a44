# Fused residual + dropout + LayerNorm: y = LayerNorm(dropout(x) + residual) * weight + bias over the
# last dimension, forward and backward, as used after the attention output and the FFN of a (post-LN)
# BERT layer; with residual=None and no dropout it is the plain LayerNorm of the embeddings and the MLM
# transform.
#
# Algorithm. Each program works on tiles of BLOCK_ROWS whole rows, [BLOCK_ROWS, BLOCK_H] in registers
# (BLOCK_H is the next power of two of H; several rows per tile keep small hidden sizes from leaving
# most of a program idle). The dropout keep-mask comes from Philox (`tl.rand`) keyed by a seed and
# counted by the element's logical offset row * H + col, so it does not depend on strides or tiling and
# the backward regenerates it. The forward computes each row's statistics in fp32 in two passes over
# the registers (mean, then the centred variance) and writes y and only the fp32 mean and rstd of each
# row: no mask and no pre-norm sum are stored. The backward recomputes the pre-norm rows from x,
# residual and the mask and gives dx and dresidual. dweight and dbias are reduced without atomics: each
# backward program owns a contiguous chunk of rows, accumulates their partial sums in fp32 registers and
# writes them to a [programs, H] buffer that one torch.sum over the programs finishes. Tile and program
# counts depend only on H, the row count and the device, so the results are bitwise reproducible.
#
# Limits. Hidden size 1..MAX_HIDDEN (8192: a whole row lives in registers); any number of rows; x and
# residual fp32, fp16 or bf16 of one dtype; weight and bias fp32, fp16 or bf16. Inputs may have any
# strides: the launchers pass both strides of the 2-D view (copying only a view whose column offsets
# would not fit int32), and copy a strided weight or bias (H elements). 0 <= dropout_p < 1.
#
# Sources: the Triton tutorial "Layer Normalization" (row-parallel forward, partial weight gradients),
# flash-attention's flash_attn/ops/triton/layer_norm.py (fused residual + dropout, seeded dropout
# regenerated in the backward, per-program partial dweight/dbias) and Liger-Kernel's layer_norm.
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from fastbert.kernels.matmul import sm_count
from fastbert.kernels.numerics import INTERPRETER, cast

MAX_HIDDEN = 8192
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# On a GPU, tiles of at least GPU_TILE_ELEMENTS with 8 elements per thread: compiled for sm_90, the
# backward with residual and dropout then fits in registers up to H = 2048, spills 8 bytes at 4096 and
# about 256 at 8192 (32 warps). Under the interpreter (CPU) each Triton op costs a fixed overhead, so
# tiles are as large as numpy handles comfortably.
GPU_TILE_ELEMENTS = 1024
GPU_ELEMENTS_PER_THREAD = 8
INTERPRETER_TILE_ELEMENTS = 65536
# Backward programs per SM: several resident programs per SM hide memory latency; more would grow the
# [programs, H] partial-sum buffer that the final reduction reads. Under the interpreter the count
# only has to be fixed.
BACKWARD_PROGRAMS_PER_SM = 8
INTERPRETER_BACKWARD_PROGRAMS = 16


@triton.jit
def _pre_norm_tile(
    X,  # [rows, H] input, strides (stride_x_row, stride_x_col)
    R,  # [rows, H] residual, X's dtype; read only when HAS_RESIDUAL
    SEED,  # [1] int64 Philox seed; read only when HAS_DROPOUT
    rows,  # [BLOCK_ROWS] int64 row indices of the tile
    cols,  # [BLOCK_H] column indices
    in_tile,  # [BLOCK_ROWS, BLOCK_H] rows and columns that exist
    stride_x_row, stride_x_col, stride_r_row, stride_r_col, H, dropout_p, dropout_scale,
    HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    """h = dropout(x) + residual in fp32 for a [BLOCK_ROWS, BLOCK_H] tile, and the keep-mask
    (in_tile when there is no dropout)."""
    # int32 column offsets (the launchers guarantee stride_col * H < 2**31) save registers over int64
    h = tl.load(X + rows[:, None] * stride_x_row + cols[None, :] * stride_x_col, mask=in_tile, other=0.0)
    h = cast(h, tl.float32)
    keep = in_tile
    if HAS_DROPOUT:
        # int64 offsets: rows * H can pass 2**31
        keep = tl.rand(tl.load(SEED), rows[:, None] * H + cols[None, :]) >= dropout_p
        h = tl.where(keep, h * dropout_scale, 0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r_row + cols[None, :] * stride_r_col, mask=in_tile, other=0.0)
        h += cast(r, tl.float32)
    return h, keep


@triton.jit
def _layer_norm_fwd_kernel(
    X,  # [rows, H] input, strides (stride_x_row, stride_x_col)
    R,  # [rows, H] residual, X's dtype; read only when HAS_RESIDUAL
    W,  # [H] weight
    B,  # [H] bias
    Y,  # [rows, H] output, contiguous, X's dtype
    MEAN,  # [rows] fp32 mean of each pre-norm row
    RSTD,  # [rows] fp32 1 / sqrt(var + eps) of each pre-norm row
    SEED,  # [1] int64 Philox seed; read only when HAS_DROPOUT
    stride_x_row, stride_x_col, stride_r_row, stride_r_col,
    n_rows, H, eps, dropout_p, dropout_scale,
    HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_exists = rows < n_rows
    col_exists = cols < H
    in_tile = row_exists[:, None] & col_exists[None, :]
    h, _ = _pre_norm_tile(X, R, SEED, rows, cols, in_tile, stride_x_row, stride_x_col, stride_r_row,
                          stride_r_col, H, dropout_p, dropout_scale, HAS_RESIDUAL, HAS_DROPOUT)
    mean = tl.sum(h, axis=1) / H  # [BLOCK_ROWS]
    centred = tl.where(in_tile, h - mean[:, None], 0.0)
    var = tl.sum(centred * centred, axis=1) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    w = cast(tl.load(W + cols, mask=col_exists, other=0.0), tl.float32)
    b = cast(tl.load(B + cols, mask=col_exists, other=0.0), tl.float32)
    y = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows[:, None] * H + cols[None, :], cast(y, Y.dtype.element_ty), mask=in_tile)
    tl.store(MEAN + rows, mean, mask=row_exists)
    tl.store(RSTD + rows, rstd, mask=row_exists)


@triton.jit
def _layer_norm_bwd_kernel(
    DY,  # [rows, H] gradient of y, strides (stride_dy_row, stride_dy_col)
    X,  # [rows, H] forward input, strides (stride_x_row, stride_x_col)
    R,  # [rows, H] forward residual; read only when HAS_RESIDUAL
    W,  # [H] weight
    MEAN,  # [rows] fp32, from the forward
    RSTD,  # [rows] fp32, from the forward
    SEED,  # [1] int64, the forward's Philox seed; read only when HAS_DROPOUT
    DX,  # [rows, H] gradient of x, contiguous, X's dtype
    DR,  # [rows, H] gradient of the residual, contiguous; written only when HAS_RESIDUAL
    DW_PARTIAL,  # [programs, H] fp32 partial sums of dweight, one row per program
    DB_PARTIAL,  # [programs, H] fp32 partial sums of dbias, one row per program
    stride_dy_row, stride_dy_col, stride_x_row, stride_x_col, stride_r_row, stride_r_col,
    n_rows, rows_per_program, H, dropout_p, dropout_scale,
    HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # With h = dropout(x) + residual, xhat = (h - mean) * rstd, y = xhat * w + b and g = dy * w, per row:
    #   dh = rstd * (g - mean_H(g) - xhat * mean_H(g * xhat))
    #   dresidual = dh;  dx = dh * keep / (1 - p)  (dx = dh without dropout)
    #   dweight = sum_rows(dy * xhat);  dbias = sum_rows(dy)
    program = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_exists = cols < H
    w = cast(tl.load(W + cols, mask=col_exists, other=0.0), tl.float32)
    dw = tl.zeros((BLOCK_ROWS, BLOCK_H), dtype=tl.float32)
    db = tl.zeros((BLOCK_ROWS, BLOCK_H), dtype=tl.float32)
    # rows_per_program is a multiple of BLOCK_ROWS, so programs never share a tile
    row_start = program * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for tile_start in range(row_start, row_end, BLOCK_ROWS):
        rows = tile_start + tl.arange(0, BLOCK_ROWS)
        row_exists = rows < row_end
        in_tile = row_exists[:, None] & col_exists[None, :]
        h, keep = _pre_norm_tile(X, R, SEED, rows, cols, in_tile, stride_x_row, stride_x_col, stride_r_row,
                                 stride_r_col, H, dropout_p, dropout_scale, HAS_RESIDUAL, HAS_DROPOUT)
        mean = tl.load(MEAN + rows, mask=row_exists, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_exists, other=0.0)
        xhat = tl.where(in_tile, (h - mean[:, None]) * rstd[:, None], 0.0)
        dy_offsets = rows[:, None] * stride_dy_row + cols[None, :] * stride_dy_col
        dy = cast(tl.load(DY + dy_offsets, mask=in_tile, other=0.0), tl.float32)
        g = dy * w[None, :]
        mean_g = tl.sum(g, axis=1) / H
        mean_gx = tl.sum(g * xhat, axis=1) / H
        dh = (g - mean_g[:, None] - xhat * mean_gx[:, None]) * rstd[:, None]
        out_offsets = rows[:, None] * H + cols[None, :]
        if HAS_RESIDUAL:
            tl.store(DR + out_offsets, cast(dh, DR.dtype.element_ty), mask=in_tile)
        if HAS_DROPOUT:
            dh = tl.where(keep, dh * dropout_scale, 0.0)
        tl.store(DX + out_offsets, cast(dh, DX.dtype.element_ty), mask=in_tile)
        dw += dy * xhat
        db += dy
    tl.store(DW_PARTIAL + program * H + cols, tl.sum(dw, axis=0), mask=col_exists)
    tl.store(DB_PARTIAL + program * H + cols, tl.sum(db, axis=0), mask=col_exists)


def _check_inputs(x, weight, bias, residual) -> None:
    """Raise ValueError for what the kernels do not support, before anything is launched."""
    hidden = x.shape[-1] if x.dim() else 0
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"x has hidden size (last dimension) {hidden}; the Triton LayerNorm supports "
                         f"1 to {MAX_HIDDEN} (one row must fit in registers)")
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual)):
        if tensor is not None and tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {tensor.dtype}; the Triton LayerNorm supports {SUPPORTED_DTYPES}")
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}; all must share one device")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tuple(tensor.shape) != (hidden,):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected ({hidden},) (x's hidden size)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, expected x's shape {tuple(x.shape)}")
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"residual has dtype {residual.dtype}, expected x's dtype {x.dtype}")


def _tile(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_H, num_warps) for rows of `hidden` elements."""
    block_h = triton.next_power_of_2(hidden)
    if INTERPRETER:
        return max(1, INTERPRETER_TILE_ELEMENTS // block_h), block_h, 4
    block_rows = max(1, GPU_TILE_ELEMENTS // block_h)
    num_warps = min(32, max(4, block_rows * block_h // (32 * GPU_ELEMENTS_PER_THREAD)))
    return block_rows, block_h, num_warps


def _with_int32_columns(t: torch.Tensor) -> torch.Tensor:
    """t [rows, H], copied to contiguous when its column offsets would not fit the kernels' int32."""
    return t if t.stride(1) * (t.shape[1] - 1) < 2**31 else t.contiguous()


def _backward_split(device: torch.device, rows: int, block_rows: int) -> tuple[int, int]:
    """(programs, rows_per_program) for the backward over rows >= 1; rows_per_program is a multiple of
    block_rows and every program gets at least one row."""
    if INTERPRETER:
        programs = INTERPRETER_BACKWARD_PROGRAMS
    else:
        programs = BACKWARD_PROGRAMS_PER_SM * sm_count(device)
    rows_per_program = triton.cdiv(triton.cdiv(rows, programs), block_rows) * block_rows
    return triton.cdiv(rows, rows_per_program), rows_per_program


@torch.library.custom_op("fastbert::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: Optional[torch.Tensor],
                   seed: Optional[torch.Tensor], eps: float,
                   dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual [rows, H] (any strides); weight, bias [H]; seed int64 [1] or None (no dropout).

    Returns y [rows, H] contiguous in x's dtype, and fp32 mean [rows] and rstd [rows] for the backward.
    Raises ValueError for unsupported sizes or dtypes.
    """
    _check_inputs(x, weight, bias, residual)
    rows, hidden = x.shape
    x = _with_int32_columns(x)
    residual = None if residual is None else _with_int32_columns(residual)
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return y, mean, rstd
    block_rows, block_h, num_warps = _tile(hidden)
    res = x if residual is None else residual  # a placeholder pointer when there is no residual
    _layer_norm_fwd_kernel[(triton.cdiv(rows, block_rows),)](
        x, res, weight.contiguous(), bias.contiguous(), y, mean, rstd, x if seed is None else seed,
        x.stride(0), x.stride(1), res.stride(0), res.stride(1),
        rows, hidden, eps, dropout_p, 1.0 / (1.0 - dropout_p),
        HAS_RESIDUAL=residual is not None, HAS_DROPOUT=seed is not None, BLOCK_ROWS=block_rows, BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return y, mean, rstd


@layer_norm_fwd.register_fake
def _(x, weight, bias, residual, seed, eps, dropout_p):
    _check_inputs(x, weight, bias, residual)
    rows = x.shape[0]
    return (x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32))


@torch.library.custom_op("fastbert::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, residual: Optional[torch.Tensor],
                   seed: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor,
                   dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `layer_norm_fwd` from the forward's inputs, mean, rstd and seed.

    dy, x, residual [rows, H] (any strides). Returns dx [rows, H] in x's dtype, dresidual [rows, H]
    (empty [0] when residual is None), and fp32 dweight [H] and dbias [H].
    """
    rows, hidden = x.shape
    dx = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    dres = torch.empty((rows, hidden) if residual is not None else (0,), dtype=x.dtype, device=x.device)
    if rows == 0:
        zeros = torch.zeros(hidden, dtype=torch.float32, device=x.device)
        return dx, dres, zeros, zeros.clone()
    block_rows, block_h, num_warps = _tile(hidden)
    dy, x = _with_int32_columns(dy), _with_int32_columns(x)
    residual = None if residual is None else _with_int32_columns(residual)
    programs, rows_per_program = _backward_split(x.device, rows, block_rows)
    # every program writes its whole row of partial sums, so no zero-fill is needed
    dw_partial = torch.empty((programs, hidden), dtype=torch.float32, device=x.device)
    db_partial = torch.empty((programs, hidden), dtype=torch.float32, device=x.device)
    res = x if residual is None else residual  # a placeholder pointer when there is no residual
    _layer_norm_bwd_kernel[(programs,)](
        dy, x, res, weight.contiguous(), mean, rstd, x if seed is None else seed, dx, dres, dw_partial, db_partial,
        dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), res.stride(0), res.stride(1),
        rows, rows_per_program, hidden, dropout_p, 1.0 / (1.0 - dropout_p),
        HAS_RESIDUAL=residual is not None, HAS_DROPOUT=seed is not None, BLOCK_ROWS=block_rows,
        BLOCK_H=block_h, num_warps=num_warps,
    )
    return dx, dres, dw_partial.sum(dim=0), db_partial.sum(dim=0)


@layer_norm_bwd.register_fake
def _(dy, x, weight, residual, seed, mean, rstd, dropout_p):
    hidden = x.shape[1]
    dres = x.new_empty(x.shape if residual is not None else (0,))
    return (x.new_empty(x.shape), dres, x.new_empty(hidden, dtype=torch.float32),
            x.new_empty(hidden, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, seed, eps, dropout_p = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, residual, seed, mean, rstd)
    ctx.dropout_p = dropout_p
    ctx.bias_dtype = bias.dtype
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, dy, dmean, drstd):
    x, weight, residual, seed, mean, rstd = ctx.saved_tensors
    dx, dres, dw, db = layer_norm_bwd(dy, x, weight, residual, seed, mean, rstd, ctx.dropout_p)
    return dx, dw.to(weight.dtype), db.to(ctx.bias_dtype), dres if residual is not None else None, None, None, None


layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def layer_norm(x, weight, bias, eps=1e-12, residual=None, dropout_p=0.0, training=True):
    """LayerNorm(dropout(x) + residual) * weight + bias over the last dimension.

    x, residual [..., H] (any strides; residual may be None); weight, bias [H]. Dropout applies only
    when training and dropout_p > 0; its seed is drawn from torch's generator on x's device, so
    torch.manual_seed reproduces the mask. Returns [..., H] in x's dtype, differentiable in x,
    residual, weight and bias. Raises ValueError for unsupported sizes, dtypes or devices.
    """
    _check_inputs(x, weight, bias, residual)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    hidden = x.shape[-1]
    use_dropout = training and dropout_p > 0.0
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=x.device) if use_dropout else None
    y, _, _ = layer_norm_fwd(x.reshape(-1, hidden), weight, bias,
                             None if residual is None else residual.reshape(-1, hidden),
                             seed, float(eps), float(dropout_p) if use_dropout else 0.0)
    return y.view(x.shape)
