# Fused residual + dropout + LayerNorm: y = LayerNorm(dropout(x) + residual) * weight + bias over the
# last dimension, forward and backward, as used after the attention output and the FFN of a (post-LN)
# BERT layer; with residual=None and no dropout it is the plain LayerNorm of the embeddings and the MLM
# transform. Two switches serve pre-LN encoders (ModernBERT): bias=None (HAS_BIAS off: y = xhat * weight,
# dbias not computed), and return_residual, where the forward also writes the pre-LN residual stream
# summed = dropout(x) + residual (x's dtype) and y is the LayerNorm of summed AS STORED (h is rounded to
# x's dtype before the statistics, as transformers' `hidden = hidden + attn_out; norm(hidden)` computes
# it); the backward then adds the incoming gradient of summed to dh before it becomes dresidual and dx.
#
# Algorithm. Each program works on tiles of BLOCK_ROWS whole rows, [BLOCK_ROWS, BLOCK_H] in registers
# (BLOCK_H is the next power of two of H, at least 4; several rows per tile keep small hidden sizes from
# leaving most of a program idle). The dropout keep-mask comes from Philox keyed by a seed, one call per four
# consecutive columns of a row (numerics.keep_mask_rows), so it does not depend on strides or tiling and the
# backward regenerates it. The forward reads x and the residual in their own dtype, computes each
# row's statistics in fp32 in two passes over the registers (mean, then the centred variance) and
# writes y (in the dtype the caller asks for: a 16-bit y from fp32 embeddings under autocast) and, for a
# backward, one fp32 row of statistics per row (the side buffer below or the mean, then rstd): no mask, no
# pre-norm sum and no fp32 copy of a 16-bit input are stored.
#
# The backward works, by default (save="output"), from the saved OUTPUT (apex's memory-efficient
# LayerNorm): xhat = (y - bias) / weight, so it needs y, weight, bias, rstd and the seed, and never x or
# the residual. y is what the next op (a matmul) saves anyway, so a LayerNorm adds only rstd (4 bytes a
# row) and a small side buffer (below) to what a layer keeps. Without a bias, xhat = y / weight.
# Precision: xhat carries y's rounding (half an ulp of |w * xhat + b|) divided by |weight|, where
# PyTorch's backward has xhat exact from x. In fp32 the gradients stay within the tolerance rule against
# PyTorch's. In fp16 and bf16, dx does too (its error is its own rounding), but dweight = sum over rows of
# dy * xhat adds up the rows' rounding of y: its error is 2x to 5.3x PyTorch's (a fused LayerNorm's,
# rounded once; tests/test_layer_norm.py's cases, the same seven that failed on the first H100 run) and
# equals, to three digits, that of the exact backward from the rounded y. That is this mode's promise in
# 16 bits, as TF32 is allow_tf32's, and what its tests hold it to; save="input" keeps PyTorch's precision.
# For |weight| >= MIN_WEIGHT (1/4) the division stays tame (with 1/8, one bf16 single-row case of 60
# drawn broke the rule: a column with |b| >> |w * xhat|). A weight near 0 erases its column of xhat
# (y = bias there), and that
# column's dweight, and through mean(g * xhat) every dx of the row, would be wrong. Trained
# checkpoints do hold such weights (all-MiniLM-L6-v2's last LayerNorm has 5e-33, 6e-33 and 1.5e-9), and
# finding them on the host would cost a GPU sync per call, so the kernels find them themselves: the
# forward writes the exact fp32 xhat of the first SIDE_COLUMNS (8) columns with |weight| < MIN_WEIGHT
# to a [rows, 8] side buffer (32 bytes a row), the backward reads those columns from it and every other
# column from y: exact for any weights with at most 8 small ones. A further small-weight column gets
# NaN, never a finite wrong value: its dweight and the dx of every row are NaN, which a training loop's
# non-finite check reports (fastbert's skips the step and stops after max_bad_steps in a row), and
# save="input" (keep x, the residual and the mean, recompute the pre-norm rows: 2 more activations)
# is exact for any weights.
#
# What autograd keeps for the backward, besides weight, bias and (with dropout) the int64 seed, the
# statistics in one [rows, stats_width] buffer (one allocation, one saved tensor):
#   save="output":                      y, side and rstd [rows, SIDE_COLUMNS + 1]   (with or without
#                                       return_residual: summed is not needed)
#   save="input":                       x, residual (if any), mean and rstd [rows, 2]
#   save="input", return_residual:      summed (instead of x and residual: one activation, not two; the
#                                       backward reads the pre-norm rows from it), mean and rstd
#
# dx and dresidual follow from xhat and the regenerated mask. dweight and dbias are reduced without atomics: each
# backward program owns a contiguous chunk of rows, accumulates their partial sums in fp32 registers and
# writes them to a [programs, 1 + has bias, H] buffer that one torch.sum over the programs finishes. Tile and
# program counts depend only on H, the row count and the device, so the results are bitwise reproducible.
#
# Limits. Hidden size 1..MAX_HIDDEN (8192: a whole row lives in registers); any number of rows; x and
# residual fp32, fp16 or bf16 of one dtype; y fp32, fp16 or bf16; weight and bias fp32, fp16 or bf16,
# with save="output" at most SIDE_COLUMNS weights of |weight| < MIN_WEIGHT (see above). Inputs may have any
# strides: the launchers pass both strides of the 2-D view (copying only a view whose column offsets
# would not fit int32), and copy a strided weight or bias (H elements). 0 <= dropout_p < 1.
#
# Sources: the Triton tutorial "Layer Normalization" (row-parallel forward, partial weight gradients),
# flash-attention's flash_attn/ops/triton/layer_norm.py (fused residual + dropout, seeded dropout
# regenerated in the backward, per-program partial dweight/dbias), Liger-Kernel's layer_norm, and
# apex's FusedLayerNorm with memory_efficient=True (the backward from the output).
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from fastbert.kernels.fused_op import as_dtype, backward_follows, fused_op, register_no_backward
from fastbert.kernels.launch import as_rows, cdiv, launch, next_power_of_2, row_strides
from fastbert.kernels.matmul import sm_count
from fastbert.kernels.numerics import INTERPRETER, cast, dropout_seed, keep_mask_rows

MAX_HIDDEN = 8192
SAVE_CHOICES = ("output", "input")  # what the backward works from (see the header)
# The smallest |weight| whose column the backward from the output recovers from y: xhat's error is y's
# rounding over |w|, within the tolerance rule for |w| >= MIN_WEIGHT in fp32, fp16 and bf16
# (tests/test_layer_norm.py); below it xhat means nothing (a trained checkpoint can hold weights of 1e-33).
MIN_WEIGHT = 2.0**-2
# Columns per LayerNorm whose xhat the forward keeps in fp32 beside y because |weight| < MIN_WEIGHT: 32 bytes
# a row (rstd is 4, a 16-bit y of BERT-base 1536); a further small-weight column gives NaN gradients.
# all-MiniLM-L6-v2 has at most 3 weights below 1/4 in any of its 13 LayerNorms.
SIDE_COLUMNS = 8
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
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
def _side_slots(w, col_exists, min_weight, SIDE_COLUMNS: tl.constexpr):
    """[BLOCK_H] int32: the side-buffer column of each of the first SIDE_COLUMNS columns whose |weight| <
    min_weight, in column order, -1 for every other column (the forward and the backward agree on it)."""
    small = (tl.abs(w) < min_weight) & col_exists
    rank = tl.cumsum(small.to(tl.int32), axis=0) - 1
    return tl.where(small & (rank < SIDE_COLUMNS), rank, -1)


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
        keep = keep_mask_rows(tl.load(SEED), rows, 0, H, dropout_p, rows.shape[0], cols.shape[0])
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
    B,  # [H] bias; read only when HAS_BIAS
    Y,  # [rows, H] output, contiguous, fp32, fp16 or bf16
    SUM,  # [rows, H] contiguous, X's dtype: the pre-norm rows dropout(x) + residual; written when STORE_SUM
    STATS,  # [rows, stats_width(SAVE_SIDE)] fp32, per pre-norm row: with SAVE_SIDE the xhat of the small-weight
            # columns (_side_slots), else the mean, then 1 / sqrt(var + eps); written when STORE_STATS
    SEED,  # [1] int64 Philox seed; read only when HAS_DROPOUT
    stride_x_row, stride_x_col, stride_r_row, stride_r_col,
    n_rows, H, eps, dropout_p, dropout_scale, min_weight,
    HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_SUM: tl.constexpr,
    STORE_STATS: tl.constexpr, SAVE_SIDE: tl.constexpr, SIDE_COLUMNS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_exists = rows < n_rows
    col_exists = cols < H
    in_tile = row_exists[:, None] & col_exists[None, :]
    h, _ = _pre_norm_tile(X, R, SEED, rows, cols, in_tile, stride_x_row, stride_x_col, stride_r_row,
                          stride_r_col, H, dropout_p, dropout_scale, HAS_RESIDUAL, HAS_DROPOUT)
    if STORE_SUM:
        # the stream as stored is what gets normalised, so y = LayerNorm(summed) holds bit for bit and a
        # backward from the saved summed recomputes exactly this h
        h = cast(h, SUM.dtype.element_ty)
        tl.store(SUM + rows[:, None] * H + cols[None, :], h, mask=in_tile)
        h = cast(h, tl.float32)
    mean = tl.sum(h, axis=1) / H  # [BLOCK_ROWS]
    centred = tl.where(in_tile, h - mean[:, None], 0.0)
    var = tl.sum(centred * centred, axis=1) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    # weight and bias read in the tile's shape, each row's copy from L1: a [BLOCK_H] read broadcast over the rows
    # went through shared memory to the tile's layout (4 of the inference forward's 7 barriers on sm_90a at 768)
    tile_cols = tl.broadcast_to(cols[None, :], (BLOCK_ROWS, BLOCK_H))
    tile_col_exists = tile_cols < H
    w = cast(tl.load(W + tile_cols, mask=tile_col_exists, other=0.0), tl.float32)
    y = centred * rstd[:, None] * w
    if HAS_BIAS:
        y += cast(tl.load(B + tile_cols, mask=tile_col_exists, other=0.0), tl.float32)
    tl.store(Y + rows[:, None] * H + cols[None, :], cast(y, Y.dtype.element_ty), mask=in_tile)
    if STORE_STATS:  # for a backward; an inference forward writes y (and summed) alone
        # the side slots first: at an odd offset the backward's gather of them took 7 more registers on sm_90a
        width: tl.constexpr = (SIDE_COLUMNS + 1) if SAVE_SIDE else 2
        stats = STATS + rows * width  # [BLOCK_ROWS] pointers to each row's statistics
        tl.store(stats + (width - 1), rstd, mask=row_exists)
        if SAVE_SIDE:
            # how many slots the small-weight columns fill: one reduction (every row of the tile counts them), so
            # that the slots' scan and store (10 of the 15 barriers a row on sm_90a at 768) run only for a weight
            # with such columns (3 of all-MiniLM-L6-v2's 13 LayerNorms; none as initialised)
            small = (tl.abs(w) < min_weight) & tile_col_exists
            used = tl.minimum(tl.sum(small.to(tl.int32)) // BLOCK_ROWS, SIDE_COLUMNS)
            if used > 0:
                w_row = cast(tl.load(W + cols, mask=col_exists, other=0.0), tl.float32)
                slot = _side_slots(w_row, col_exists, min_weight, SIDE_COLUMNS)
                tl.store(stats[:, None] + slot[None, :], centred * rstd[:, None],
                         mask=row_exists[:, None] & (slot >= 0)[None, :])
            # the slots past the small-weight columns hold zeros, written here so that the launcher's buffer
            # needs no fill (a launch of its own on a GPU)
            side_cols = tl.arange(0, SIDE_COLUMNS)
            tl.store(stats[:, None] + side_cols[None, :], tl.zeros([BLOCK_ROWS, SIDE_COLUMNS], dtype=tl.float32),
                     mask=row_exists[:, None] & (side_cols >= used)[None, :])
        else:
            tl.store(stats, mean, mask=row_exists)


@triton.jit
def _layer_norm_bwd_kernel(
    DY,  # [rows, H] gradient of y, strides (stride_dy_row, stride_dy_col)
    DSUM,  # [rows, H] gradient of the forward's summed, strides (stride_ds_row, stride_ds_col); read when HAS_DSUM
    X,  # [rows, H] forward input (X_IS_SUM: its summed), strides (stride_x_row, stride_x_col); read only when
        # not FROM_OUTPUT
    R,  # [rows, H] forward residual; read only when HAS_RESIDUAL and not FROM_OUTPUT and not X_IS_SUM
    Y,  # [rows, H] forward output, contiguous; read only when FROM_OUTPUT
    W,  # [H] weight
    B,  # [H] bias; read only when FROM_OUTPUT and HAS_BIAS
    STATS,  # [rows, stats_width(FROM_OUTPUT)] fp32, the forward's: the side slots when FROM_OUTPUT, else the mean,
            # then 1 / std
    SEED,  # [1] int64, the forward's Philox seed; read only when HAS_DROPOUT
    DX,  # [rows, H] gradient of x, contiguous, x's dtype
    DR,  # [rows, H] gradient of the residual, contiguous; written only when HAS_RESIDUAL
    PARTIAL,  # [programs, 1 + HAS_BIAS, H] fp32 partial sums of dweight (and dbias), one row of each per program
    stride_dy_row, stride_dy_col, stride_ds_row, stride_ds_col, stride_x_row, stride_x_col, stride_r_row,
    stride_r_col, n_rows, rows_per_program, H, dropout_p, dropout_scale, min_weight,
    HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DSUM: tl.constexpr,
    X_IS_SUM: tl.constexpr, FROM_OUTPUT: tl.constexpr, SIDE_COLUMNS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # With h = dropout(x) + residual, xhat = (h - mean) * rstd, y = xhat * w + b and g = dy * w, per row:
    #   xhat = (y - b) / w   when FROM_OUTPUT, where |w| >= min_weight; the forward's side buffer for the
    #                        first SIDE_COLUMNS columns with a smaller |w|; NaN for any further one
    #   dh = rstd * (g - mean_H(g) - xhat * mean_H(g * xhat))  [+ dsummed, the gradient of h itself, when
    #        the forward returned h as summed (HAS_DSUM)]
    #   dresidual = dh;  dx = dh * keep / (1 - p)  (dx = dh without dropout)
    #   dweight = sum_rows(dy * xhat);  dbias = sum_rows(dy)  (only when HAS_BIAS)
    #   xhat = y / w without a bias; from the input, h = the saved summed when X_IS_SUM
    program = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_exists = cols < H
    w = cast(tl.load(W + cols, mask=col_exists, other=1.0), tl.float32)
    if FROM_OUTPUT:
        b = tl.zeros((BLOCK_H,), dtype=tl.float32)
        if HAS_BIAS:
            b = cast(tl.load(B + cols, mask=col_exists, other=0.0), tl.float32)
        # one division per column, not per element; NaN, not a huge finite xhat, where w is too small (its
        # division by 1 only keeps a zero weight from dividing by zero)
        large = tl.abs(w) >= min_weight
        w_inverse = tl.where(large, 1.0 / tl.where(large, w, 1.0), float("nan"))
        slot = _side_slots(w, col_exists, min_weight, SIDE_COLUMNS)
    dw = tl.zeros((BLOCK_ROWS, BLOCK_H), dtype=tl.float32)
    db = tl.zeros((BLOCK_ROWS, BLOCK_H), dtype=tl.float32)
    # rows_per_program is a multiple of BLOCK_ROWS, so programs never share a tile
    row_start = program * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for tile_start in range(row_start, row_end, BLOCK_ROWS):
        rows = tile_start + tl.arange(0, BLOCK_ROWS)
        row_exists = rows < row_end
        in_tile = row_exists[:, None] & col_exists[None, :]
        out_offsets = rows[:, None] * H + cols[None, :]
        width: tl.constexpr = (SIDE_COLUMNS + 1) if FROM_OUTPUT else 2
        stats = STATS + rows * width
        rstd = tl.load(stats + (width - 1), mask=row_exists, other=0.0)
        if FROM_OUTPUT:
            y = cast(tl.load(Y + out_offsets, mask=in_tile, other=0.0), tl.float32)
            in_side = in_tile & (slot >= 0)[None, :]
            side = tl.load(stats[:, None] + slot[None, :], mask=in_side, other=0.0)
            xhat = tl.where(in_side, side, tl.where(in_tile, (y - b[None, :]) * w_inverse[None, :], 0.0))
        else:
            # X_IS_SUM: X holds the pre-norm rows themselves, nothing to add or drop
            h, _ = _pre_norm_tile(X, R, SEED, rows, cols, in_tile, stride_x_row, stride_x_col, stride_r_row,
                                  stride_r_col, H, dropout_p, dropout_scale, HAS_RESIDUAL and not X_IS_SUM,
                                  HAS_DROPOUT and not X_IS_SUM)
            mean = tl.load(stats, mask=row_exists, other=0.0)
            xhat = tl.where(in_tile, (h - mean[:, None]) * rstd[:, None], 0.0)
        dy_offsets = rows[:, None] * stride_dy_row + cols[None, :] * stride_dy_col
        dy = cast(tl.load(DY + dy_offsets, mask=in_tile, other=0.0), tl.float32)
        g = dy * w[None, :]
        mean_g = tl.sum(g, axis=1) / H
        mean_gx = tl.sum(g * xhat, axis=1) / H
        dh = (g - mean_g[:, None] - xhat * mean_gx[:, None]) * rstd[:, None]
        if HAS_DSUM:
            ds_offsets = rows[:, None] * stride_ds_row + cols[None, :] * stride_ds_col
            dh += cast(tl.load(DSUM + ds_offsets, mask=in_tile, other=0.0), tl.float32)
        if HAS_RESIDUAL:
            tl.store(DR + out_offsets, cast(dh, DR.dtype.element_ty), mask=in_tile)
        if HAS_DROPOUT:
            keep = keep_mask_rows(tl.load(SEED), rows, 0, H, dropout_p, BLOCK_ROWS, BLOCK_H)
            dh = tl.where(keep, dh * dropout_scale, 0.0)
        tl.store(DX + out_offsets, cast(dh, DX.dtype.element_ty), mask=in_tile)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    partial = PARTIAL + program * (1 + HAS_BIAS) * H + cols
    tl.store(partial, tl.sum(dw, axis=0), mask=col_exists)
    if HAS_BIAS:
        tl.store(partial + H, tl.sum(db, axis=0), mask=col_exists)


def check_inputs(x, weight, bias, residual, out_dtype) -> None:
    """Raise ValueError for what the kernels do not support, before anything is launched (bias may be None):
    the shapes, then `check_limits`."""
    hidden = x.shape[-1] if x.dim() else 0
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.shape != (hidden,):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected ({hidden},) (x's hidden size)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, expected x's shape {tuple(x.shape)}")
    check_limits(x, weight, bias, residual, out_dtype)


def check_limits(x, weight, bias, residual, out_dtype) -> None:
    """The kernels' limits on shapes already checked (fastbert.ops checks them itself): the hidden size, the
    dtypes, one device. One condition for the inputs that pass (every call), the messages for those that do
    not."""
    hidden = x.shape[-1] if x.dim() else 0
    device = x.device
    if (1 <= hidden <= MAX_HIDDEN and x.dtype in _SUPPORTED and weight.dtype in _SUPPORTED
            and weight.device == device and out_dtype in _SUPPORTED
            and (bias is None or (bias.dtype in _SUPPORTED and bias.device == device))
            and (residual is None or (residual.dtype == x.dtype and residual.device == device))):
        return
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"x has hidden size (last dimension) {hidden}; the Triton LayerNorm supports "
                         f"1 to {MAX_HIDDEN} (one row must fit in registers)")
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias), ("residual", residual)):
        if tensor is None:
            continue
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {tensor.dtype}; the Triton LayerNorm supports {SUPPORTED_DTYPES}")
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, x on {device}; all must share one device")
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"residual has dtype {residual.dtype}, expected x's dtype {x.dtype}")
    raise ValueError(f"out_dtype is {out_dtype}; the Triton LayerNorm supports {SUPPORTED_DTYPES}")


@functools.lru_cache(maxsize=None)
def _tile(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_H, num_warps) for rows of `hidden` elements; BLOCK_H at least 4 (the dropout mask
    takes columns four at a time)."""
    block_h = max(4, next_power_of_2(hidden))
    if INTERPRETER:
        return max(1, INTERPRETER_TILE_ELEMENTS // block_h), block_h, 4
    block_rows = max(1, GPU_TILE_ELEMENTS // block_h)
    num_warps = min(32, max(4, block_rows * block_h // (32 * GPU_ELEMENTS_PER_THREAD)))
    return block_rows, block_h, num_warps


def _with_int32_columns(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(t, the row stride and the column stride of its rows) for t [..., H] read as [rows, H]: t itself where its
    rows merge in place (launch.row_strides: no view op), else t as [rows, H] (launch.as_rows); copied to
    contiguous when its column offsets would not fit the kernels' int32."""
    strides = row_strides(t)
    if strides is None:
        t = as_rows(t)
        strides = t.stride()
    stride_row, stride_col = strides
    if stride_col * (t.shape[-1] - 1) < 2**31:
        return t, stride_row, stride_col
    t = as_rows(t).contiguous()
    return t, t.shape[1], 1


@functools.lru_cache(maxsize=4096)
def _backward_split(device: torch.device, rows: int, block_rows: int) -> tuple[int, int]:
    """(programs, rows_per_program) for the backward over rows >= 1; rows_per_program is a multiple of
    block_rows and every program gets at least one row. Cached: it depends on the shape and the device only."""
    if INTERPRETER:
        programs = INTERPRETER_BACKWARD_PROGRAMS
    else:
        programs = BACKWARD_PROGRAMS_PER_SM * sm_count(device)
    rows_per_program = cdiv(cdiv(rows, programs), block_rows) * block_rows
    return cdiv(rows, rows_per_program), rows_per_program


def stats_width(save_output: bool) -> int:
    """Columns of the forward's fp32 statistics per row: the side slots (save_output) or the mean, then 1 / std."""
    return 1 + SIDE_COLUMNS if save_output else 2


def _forward(x, weight, bias, residual, seed, eps, dropout_p, out_dtype, save_output, store_sum, store_stats):
    """The forward launch: (y, stats, summed) as in `layer_norm_fwd`, but summed None without store_sum, and
    without store_stats (an inference forward) stats None: neither allocated nor written."""
    # y and summed take x's shape (contiguous, so their rows are [rows, H] as the kernel writes them)
    # empty_like: an allocation from a shape tuple costs the host half a microsecond more
    y = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if store_sum else None
    x, stride_x_row, stride_x_col = _with_int32_columns(x)
    hidden = x.shape[-1]
    rows = x.numel() // hidden  # hidden >= 1 (check_limits)
    if residual is None:  # x's strides stand for the residual's, never read
        stride_r_row, stride_r_col = stride_x_row, stride_x_col
    else:
        residual, stride_r_row, stride_r_col = _with_int32_columns(residual)
    # one buffer for what the backward reads per row; not filled: the kernel writes every slot, zeros past the
    # small-weight columns
    stats = x.new_empty(rows, stats_width(save_output), dtype=torch.float32) if store_stats else None
    if rows == 0:
        return y, stats, summed
    block_rows, block_h, num_warps = _tile(hidden)
    # None for each pointer a flag leaves unread: Triton compiles it as a constant, and no tensor is read for it
    launch(_layer_norm_fwd_kernel, (cdiv(rows, block_rows),),
           x, residual, weight.contiguous(), None if bias is None else bias.contiguous(), y, summed, stats, seed,
           stride_x_row, stride_x_col, stride_r_row, stride_r_col, rows, hidden, eps, dropout_p,
           1.0 / (1.0 - dropout_p), MIN_WEIGHT,
           HAS_RESIDUAL=residual is not None, HAS_DROPOUT=seed is not None, HAS_BIAS=bias is not None,
           STORE_SUM=store_sum, STORE_STATS=store_stats, SAVE_SIDE=save_output, SIDE_COLUMNS=SIDE_COLUMNS,
           BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=num_warps)
    return y, stats, summed


@fused_op("fastbert::layer_norm_fwd")
def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   residual: Optional[torch.Tensor], seed: Optional[torch.Tensor], eps: float, dropout_p: float,
                   out_dtype: torch.dtype, save_output: bool, store_sum: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual [..., H] (any strides, checked by `layer_norm`); weight [H]; bias [H] or None; seed int64 [1]
    or None (no dropout). rows below: the product of the leading dimensions.

    Returns y [..., H] contiguous in out_dtype; stats, fp32 [rows, stats_width(save_output)]: for each
    pre-norm row, with save_output its side buffer (SIDE_COLUMNS slots: xhat of the columns whose
    |weight| < MIN_WEIGHT, zeros past them), else its mean, then its rstd; and with store_sum the pre-norm rows summed =
    dropout(x) + residual [..., H] contiguous in x's dtype (y is then their LayerNorm as stored), else
    an empty [0]. save_output chooses what autograd keeps for the backward (see `layer_norm`).
    """
    y, stats, summed = _forward(x, weight, bias, residual, seed, eps, dropout_p, out_dtype, save_output, store_sum,
                                True)
    return y, stats, x.new_empty(0) if summed is None else summed


@fused_op("fastbert::layer_norm_infer")
def layer_norm_infer(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     residual: Optional[torch.Tensor], seed: Optional[torch.Tensor], eps: float, dropout_p: float,
                     out_dtype: torch.dtype, store_sum: bool) -> list[torch.Tensor]:
    """`layer_norm_fwd` where no backward follows: [y], with store_sum [y, summed]; no statistics written or
    allocated (a list, so that no empty tensor stands for a summed not asked for: an allocation a call)."""
    y, _, summed = _forward(x, weight, bias, residual, seed, eps, dropout_p, out_dtype, False, store_sum, False)
    return [y] if summed is None else [y, summed]


def _sum_shape(x: torch.Tensor, store_sum: bool) -> tuple[int, ...]:
    return tuple(x.shape) if store_sum else (0,)


@layer_norm_infer.register_fake
def _(x, weight, bias, residual, seed, eps, dropout_p, out_dtype, store_sum):
    check_inputs(x, weight, bias, residual, out_dtype)
    y = x.new_empty(x.shape, dtype=out_dtype)
    return [y, x.new_empty(x.shape)] if store_sum else [y]


register_no_backward(layer_norm_infer, "mean or rstd", "layer_norm_fwd, or layer_norm")


@layer_norm_fwd.register_fake
def _(x, weight, bias, residual, seed, eps, dropout_p, out_dtype, save_output, store_sum=False):
    check_inputs(x, weight, bias, residual, out_dtype)
    return (x.new_empty(x.shape, dtype=out_dtype),
            x.new_empty((math.prod(x.shape[:-1]), stats_width(save_output)), dtype=torch.float32),
            x.new_empty(_sum_shape(x, store_sum)))


@fused_op("fastbert::layer_norm_bwd")
def layer_norm_bwd(dy: torch.Tensor, x: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                   y: Optional[torch.Tensor], stats: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   seed: Optional[torch.Tensor], dropout_p: float, x_dtype: torch.dtype, has_residual: bool,
                   dsum: Optional[torch.Tensor] = None, x_is_sum: bool = False, reduce_parameters: bool = True,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `layer_norm_fwd` from its output y (contiguous [..., H]) when y is given, else from its
    inputs x and residual (x_is_sum: x is the forward's summed and residual None); with its stats (the side
    buffer with y, the mean without, then rstd), weight, bias (or None) and the seed. dsum
    [..., H] (any strides), the gradient of the forward's summed, or None.

    dy, x, residual [..., H] (any strides), the forward's shape. Returns dx [..., H] in x_dtype, dresidual
    [..., H] in x_dtype (empty [0] without a residual), and fp32 [1 + has bias, H]: dweight, then dbias
    (without reduce_parameters, when neither is needed, an empty [0]: the kernel still writes its partial sums,
    but they are not reduced).
    From y, more than SIDE_COLUMNS weight elements with |w| < MIN_WEIGHT make dweight of the further ones
    and every dx NaN (the kernel header says why).
    """
    from_output = y is not None
    like = y if from_output else x
    hidden = like.shape[-1]
    rows = stats.shape[0]
    dx = torch.empty_like(like, dtype=x_dtype, memory_format=torch.contiguous_format)
    dres = torch.empty_like(dx) if has_residual else dx.new_empty(0)
    parameters = 1 if bias is None else 2  # the gradients reduced over rows: dweight, dbias
    if rows == 0:
        return dx, dres, (torch.zeros((parameters, hidden), dtype=torch.float32, device=like.device)
                          if reduce_parameters else dx.new_empty(0, dtype=torch.float32))
    block_rows, block_h, num_warps = _tile(hidden)
    # the strides of a tensor not read (None) repeat another's
    dy, stride_dy_row, stride_dy_col = _with_int32_columns(dy)
    if dsum is None:
        stride_ds_row, stride_ds_col = stride_dy_row, stride_dy_col
    else:
        dsum, stride_ds_row, stride_ds_col = _with_int32_columns(dsum)
    if x is None:  # reading y, contiguous
        stride_x_row, stride_x_col = hidden, 1
    else:
        x, stride_x_row, stride_x_col = _with_int32_columns(x)
    if residual is None:
        stride_r_row, stride_r_col = stride_x_row, stride_x_col
    else:
        residual, stride_r_row, stride_r_col = _with_int32_columns(residual)
    programs, rows_per_program = _backward_split(like.device, rows, block_rows)
    # every program writes its whole rows of partial sums, so no zero-fill is needed; dweight's and dbias's in one
    # buffer, so that one reduction (a launch of its own on a GPU) finishes both
    partial = like.new_empty(programs, parameters, hidden, dtype=torch.float32)
    launch(_layer_norm_bwd_kernel, (programs,),
        dy, dsum, x, residual, y, weight.contiguous(), None if bias is None else bias.contiguous(), stats, seed, dx,
        dres if has_residual else None, partial,
        stride_dy_row, stride_dy_col, stride_ds_row, stride_ds_col, stride_x_row, stride_x_col, stride_r_row,
        stride_r_col, rows, rows_per_program, hidden, dropout_p, 1.0 / (1.0 - dropout_p), MIN_WEIGHT,
        HAS_RESIDUAL=has_residual, HAS_DROPOUT=seed is not None, HAS_BIAS=bias is not None,
        HAS_DSUM=dsum is not None, X_IS_SUM=x_is_sum, FROM_OUTPUT=from_output,
        SIDE_COLUMNS=SIDE_COLUMNS, BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=num_warps,
    )
    return dx, dres, partial.sum(dim=0) if reduce_parameters else partial.new_empty(0)


@layer_norm_bwd.register_fake
def _(dy, x, residual, y, stats, weight, bias, seed, dropout_p, x_dtype, has_residual, dsum=None, x_is_sum=False,
      reduce_parameters=True):
    dres = dy.new_empty(dy.shape if has_residual else (0,), dtype=x_dtype)
    return (dy.new_empty(dy.shape, dtype=x_dtype), dres,
            dy.new_empty((1 if bias is None else 2, dy.shape[-1]) if reduce_parameters else (0,), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, seed, eps, dropout_p, out_dtype, save_output, store_sum = inputs
    y, stats, summed = output
    # from the output, nothing of x's size beyond y, which the next op keeps anyway; from the input, summed
    # when it was written (one activation instead of x and the residual); see the header
    if save_output:
        saved = (None, None, y)
    else:
        saved = (summed, None, None) if store_sum else (x, residual, None)
    ctx.save_for_backward(*saved, stats, weight, bias, seed)
    ctx.dropout_p = dropout_p
    ctx.x_dtype = x.dtype
    ctx.has_residual = residual is not None
    ctx.store_sum = store_sum
    ctx.mark_non_differentiable(stats)
    # without store_sum y is the one output a backward starts from: the gradients of the others stay None
    # rather than zeros allocated for them (with store_sum, y or summed may go unused: zeros stand for it)
    ctx.set_materialize_grads(store_sum)


def _backward(ctx, dy, dstats, dsum):
    x, residual, y, stats, weight, bias, seed = ctx.saved_tensors
    needs_dweight, needs_dbias = ctx.needs_input_grad[1:3]  # both False for a frozen LayerNorm (LoRA)
    # without store_sum, dsum (None) belongs to the unused empty output
    dx, dres, dparameters = layer_norm_bwd(dy, x, residual, y, stats, weight, bias, seed, ctx.dropout_p,
                                           ctx.x_dtype, ctx.has_residual, dsum if ctx.store_sum else None,
                                           ctx.store_sum and y is None, needs_dweight or needs_dbias)
    dw = db = None
    if needs_dweight:
        dw = as_dtype(dparameters[0], weight.dtype)
    if needs_dbias:
        db = as_dtype(dparameters[1], bias.dtype)
    return dx, dw, db, dres if ctx.has_residual else None, None, None, None, None, None, None


layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def check_options(residual, dropout_p, save, return_residual) -> None:
    """Raise ValueError for an option `layer_norm` does not take (fastbert.ops checks the same, in the same
    words)."""
    if return_residual and residual is None:
        raise ValueError("return_residual=True needs a residual (summed = dropout(x) + residual), got residual=None")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if save not in SAVE_CHOICES:
        raise ValueError(f"save must be one of {SAVE_CHOICES}, got {save!r}")


def layer_norm(x, weight, bias, eps=1e-12, residual=None, dropout_p=0.0, training=True, out_dtype=None,
               save="output", return_residual=False):
    """LayerNorm(dropout(x) + residual) * weight + bias over the last dimension.

    x, residual [..., H] (any strides; residual may be None); weight [H]; bias [H] or None (no bias).
    return_residual (needs a residual) returns (y, summed): summed = dropout(x) + residual [..., H] in x's
    dtype, the pre-LN residual stream, and y the LayerNorm of summed as stored; both are differentiable
    (the backward adds summed's gradient to what reaches x and the residual). Dropout applies only
    when training and dropout_p > 0; its seed is drawn from torch's generator on x's device, so
    torch.manual_seed reproduces the mask. Returns [..., H] in out_dtype (None: x's dtype),
    differentiable in x, residual, weight and bias. save="output": the backward keeps the output, an
    fp32 side buffer and rstd in one [rows, SIDE_COLUMNS + 1] buffer, and the seed, nothing else of x's size,
    and takes at most SIDE_COLUMNS weights with |weight| < MIN_WEIGHT (more give NaN gradients); save="input": it
    keeps x, the residual, mean and rstd, exact for any weight (with return_residual: summed instead of
    x and the residual).
    Raises ValueError for unsupported sizes, dtypes, devices or `save`, or return_residual without a residual.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    check_inputs(x, weight, bias, residual, out_dtype)
    check_options(residual, dropout_p, save, return_residual)
    return layer_norm_unchecked(x, weight, bias, eps, residual, dropout_p, training, out_dtype, save,
                                return_residual)



def layer_norm_unchecked(x, weight, bias, eps, residual, dropout_p, training, out_dtype, save, return_residual):
    """`layer_norm` after its checks (`check_inputs`, `check_options`), which the caller has made; out_dtype
    given."""
    # no call where no dropout applies (every LayerNorm of an inference forward)
    dropout_p, seed = dropout_seed(dropout_p, training, x.device) if training and dropout_p else (0.0, None)
    # x and the residual go in with their own shapes ([..., H]), the ops flattening them: a reshape here would
    # be a node of autograd's graph, forward and backward, for each of x, the residual and y
    if backward_follows((x, weight, bias, residual)):
        y, _, summed = layer_norm_fwd(x, weight, bias, residual, seed, float(eps), dropout_p, out_dtype,
                                      save == "output", return_residual)
    else:  # no backward can follow: no statistics, no side buffer
        y, *rest = layer_norm_infer(x, weight, bias, residual, seed, float(eps), dropout_p, out_dtype,
                                    return_residual)
        summed = rest[0] if rest else None
    return (y, summed) if return_residual else y
