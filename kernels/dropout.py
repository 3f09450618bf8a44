# Seeded dropout: y = x * keep / (1 - p), keep = (Philox uniform >= p), forward and backward, with no
# mask stored anywhere (DESIGN.md: dropout masks are regenerated from the seed, never stored).
#
# Algorithm. x is seen as a 2-D [rows, N] view (N its last dimension, any strides). Each program works
# on a [BLOCK_ROWS, BLOCK_N] tile; the keep-mask comes from Philox keyed by an int64 seed, one call per four
# consecutive columns of a row (numerics.keep_mask_rows), so it depends on neither strides nor tiles.
# Dropout is linear and its own backward: dx = dy * keep / (1 - p) with the same mask, so the backward
# runs the same kernel on dy with the forward's seed. What the autograd keeps is the seed (8 bytes):
# PyTorch's F.dropout keeps a bool mask of x's size (1 byte per element; on CUDA, native_dropout's).
# The seed is drawn from torch's generator on x's device, so torch.manual_seed reproduces the mask,
# with no host sync.
#
# Limits. Any shape and element count (int64 offsets) with a last dimension up to MAX_LAST_DIM (67M);
# x fp32, fp16 or bf16; 0 <= p < 1. Philox draws
# are not PyTorch's, so the mask differs from F.dropout's for the same torch seed (same rate).
#
# Sources: the Triton tutorial "Low-Memory Dropout" (seeded dropout from Philox over element offsets)
# and flash-attention's flash_attn/ops/triton/layer_norm.py (the seed regenerated in the backward).
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fastbert.kernels.fused_op import fused_op
from fastbert.kernels.launch import cdiv, launch, next_power_of_2
from fastbert.kernels.numerics import INTERPRETER, cast, keep_mask_rows, philox_seed

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# On a GPU, 2048-element tiles at 8 elements per thread (8 warps): each four elements of a row take one
# Philox call, which is register-hungry; under the interpreter (CPU) each Triton op costs a fixed overhead, so tiles are
# as large as numpy handles comfortably.
GPU_TILE_ELEMENTS = 2048
GPU_ELEMENTS_PER_THREAD = 8
INTERPRETER_TILE_ELEMENTS = 65536
MAX_BLOCK_N = 1024  # columns per tile; wider rows take several tiles
MAX_LAST_DIM = 65535 * MAX_BLOCK_N  # the column tiles are the grid's second axis, at most 65535 programs


@triton.jit
def _dropout_kernel(
    X,  # [rows, N] input (dy in the backward), strides (stride_x_row, stride_x_col)
    Y,  # [rows, N] output (dx in the backward), contiguous, X's dtype
    SEED,  # [1] int64 Philox seed
    stride_x_row, stride_x_col, n_rows, N, p, scale,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # forward y = x * keep * scale; backward dx = dy * keep * scale with the same keep (scale = 1 / (1 - p))
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_tile = (rows < n_rows)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :].to(tl.int64) * stride_x_col, mask=in_tile,
                other=0.0)
    keep = keep_mask_rows(tl.load(SEED), rows, tl.program_id(1) * BLOCK_N, N, p, BLOCK_ROWS, BLOCK_N)
    y = tl.where(keep, cast(x, tl.float32) * scale, 0.0)
    tl.store(Y + rows[:, None] * N + cols[None, :], cast(y, Y.dtype.element_ty), mask=in_tile)  # int64 offsets


def _check_inputs(x: torch.Tensor, p: float) -> None:
    """Raise ValueError for what the kernel does not support, before anything is launched."""
    check_limits(x)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p must be in [0, 1), got {p!r}")


def check_limits(x: torch.Tensor) -> None:
    """Raise ValueError for an x the kernel does not take (fastbert.ops checks p itself, in the same words)."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; the Triton dropout supports {SUPPORTED_DTYPES}")
    if x.dim() and x.shape[-1] > MAX_LAST_DIM:
        raise ValueError(f"x has last dimension {x.shape[-1]}; the Triton dropout supports at most {MAX_LAST_DIM} "
                         "(reshape it to [rows, N])")


@functools.lru_cache(maxsize=None)
def _tile(n: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_N, num_warps) for rows of n elements; BLOCK_N at least 4 (the mask takes columns four
    at a time)."""
    block_n = min(MAX_BLOCK_N, max(4, next_power_of_2(n)))
    if INTERPRETER:
        return max(1, INTERPRETER_TILE_ELEMENTS // block_n), block_n, 4
    block_rows = max(1, GPU_TILE_ELEMENTS // block_n)
    return block_rows, block_n, block_rows * block_n // (32 * GPU_ELEMENTS_PER_THREAD)


def _launch(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """x [..., N] (any strides) -> x * keep / (1 - p), contiguous, x's shape and dtype."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return y
    dims = x.dim()
    n = x.shape[-1] if dims else 1
    x2 = x if dims == 2 else x.reshape(-1, n)  # [rows, N], a view whenever the strides allow
    rows = x2.shape[0]
    stride_row, stride_col = x2.stride()
    block_rows, block_n, num_warps = _tile(n)
    launch(_dropout_kernel, (cdiv(rows, block_rows), cdiv(n, block_n)), x2, y, seed, stride_row, stride_col, rows,
           n, p, 1.0 / (1.0 - p), BLOCK_ROWS=block_rows, BLOCK_N=block_n, num_warps=num_warps)
    return y


@fused_op("fastbert::dropout")
def dropout_fwd(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """x [...] fp32/fp16/bf16 (any strides); seed int64 [1]; 0 <= p < 1 (checked by `dropout`, or
    fastbert.ops, and by the fake registration where PyTorch traces). Returns x * keep / (1 - p)
    (contiguous); the backward is this op on dy with the same seed."""
    return _launch(x, seed, p)


@dropout_fwd.register_fake
def _(x, seed, p):
    _check_inputs(x, p)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def dropout_bwd(dy: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """dx = dy * keep / (1 - p) with the forward's mask: the forward op itself (so it is differentiable
    again), on dy of x's shape."""
    return dropout_fwd(dy, seed, p)


def _setup_context(ctx, inputs, output):
    _, seed, p = inputs
    ctx.save_for_backward(seed)  # 8 bytes: the mask is regenerated from it
    ctx.p = p


def _backward(ctx, dy):
    (seed,) = ctx.saved_tensors
    return dropout_bwd(dy, seed, ctx.p), None, None


dropout_fwd.register_autograd(_backward, setup_context=_setup_context)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout without a stored mask. x [...] fp32/fp16/bf16, any strides. Returns x itself when not
    training or p == 0, else a new contiguous tensor of x's shape and dtype, differentiable in x.
    Raises ValueError for an unsupported dtype or p outside [0, 1)."""
    _check_inputs(x, p)
    return dropout_unchecked(x, p, training)


def dropout_unchecked(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`dropout` after its checks, which the caller has made (fastbert.ops: p, then `check_limits`)."""
    if not training or p == 0.0:
        return x
    return dropout_fwd(x, philox_seed(x.device), float(p))
