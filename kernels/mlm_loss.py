# Fused decoder matmul + softmax cross entropy over the vocabulary (the masked-LM loss), forward and
# backward, without ever holding the [N, V] logits. For x [N, H], the decoder weight W [V, H] (tied
# to the word embeddings), bias b [V] and targets t [N], with z = x W^T + b and label smoothing e
# (F.cross_entropy's semantics):
#   m = max_v z_v,  s = log sum_v exp(z_v - m)   (so log sum_v exp(z_v) = m + s)
#   loss_row = (1 - e) (m - z_t) + e (m - mean_v(z_v)) + s     (labelled rows only)
#   loss = sum of loss_row ("sum") or that / number of labelled rows ("mean"; 0 when there is none)
#   num_correct = labelled rows whose first argmax of z is t
#
# Forward: one Triton kernel over (row block, vocabulary split). For each [BLOCK_N, BLOCK_V] tile it
# computes the logits with tl.dot over H (fp32 accumulation; fp32 inputs in TF32 or IEEE fp32 as PyTorch's
# fp32 matmuls at the time of the call, see kernels/numerics.py: IEEE is exact and several times slower) and
# folds them into per-row running statistics: an online log-sum-exp (max, sum of exp(z - max)), the
# target's logit, the sum of logits and the first argmax. The vocabulary is split across programs so
# that few rows (N = 2458 is 20 row blocks) still fill the GPU. A second kernel, one program, merges the
# [splits, N] partials row block by row block (m, s, the first argmax: that of the first split holding m,
# the row loss) and sums the N row losses in fp64, as PyTorch's CPU nll_loss does, and the correct and
# labelled rows, in a fixed order: no atomics, bitwise reproducible. Two launches and no torch op: each
# torch op costs the host about a launch, and the ~20 small ones that merged the partials made the loss's
# host time 12.8x PyTorch's F.linear + F.cross_entropy (PERF.md's host suite at 900a9ab). Only m and s [N]
# and the labelled rows' count (one buffer) are kept for the backward. Nothing of size N x V is written.
#
# Why m and s apart, not their sum lse = m + s: a row whose target holds nearly all the probability
# has d loss / d z_t = exp(z_t - lse) - 1, a difference of two numbers near 1. One fp32 lse near 10 is
# rounded to a multiple of 2**-20 (~1e-6), which that difference inherits in full (a 10x larger dW
# error than PyTorch's at V = 1000). exp((z - m) - s), like PyTorch's log_softmax, has z - m exact and
# s small, so the difference keeps fp32's precision. The loss is formed the same way.
#
# Backward, with c = grad_loss (/ labelled rows for "mean") on labelled rows and 0 on the others:
#   dz = (softmax(z) - (1 - e) onehot(t) - e / V) * c
#   dx = dz W,   dW = dz^T x,   db = sum_rows dz
# The vocabulary is cut into column chunks so that N x chunk stays under BACKWARD_CHUNK_ELEMENTS. For
# each chunk a Triton kernel recomputes the chunk's logits and writes dz [N, chunk] in x's dtype (c from
# grad_loss, the forward's labelled-row count and the targets, in the kernel: no torch op before it), then
# two cuBLAS GEMMs give dW for the chunk's vocabulary rows (written once, never accumulated) and add
# dz W_chunk into an fp32 dx, chunk by chunk in a fixed order: no atomics, bitwise reproducible. The
# chunk's product reaches dx in fp32, never rounded to 16 bits (with many chunks whose products cancel,
# that rounding made dx several times less accurate than PyTorch's one-GEMM gradient).
#
# Why this split, for the pretraining shape on an H100 (N = 2458, H = 768, V = 30522; one logits
# matmul is 2 N V H = 115 GFLOP): it costs four such matmuls and no [N, V] traffic beyond the bounded
# dz chunk. A fully fused backward (a dx kernel over row blocks and a dW kernel over vocabulary blocks,
# each recomputing its logit tiles) costs five, and its per-program accumulators are [block, H=768]
# fp32 (192 KiB for 64 rows: 192 registers per thread of 8 warps before any operand, so it spills),
# so it must also tile H and recompute the logits once per H tile, or accumulate through memory. Liger-Kernel's scheme (gradients in the
# forward, row chunk by row chunk, over full-vocabulary logits) costs three, but adds each chunk's
# dz^T x into the whole fp32 dW [V, H] (94 MB read and written per chunk), does the gradient work
# even when no backward follows (evaluation, accuracy), and keeps dW alive from forward to backward.
# Here the forward alone is one fused matmul, and the backward's two GEMMs have long reduction
# dimensions (N for dW, the chunk for dx) and full-H outputs, the shapes cuBLAS runs best. (This is
# reasoned from FLOP and byte counts; no GPU has timed it yet.)
#
# Limits. x and W fp32, fp16 or bf16 of one dtype; b fp32, fp16, bf16 or None; targets any integer
# dtype, ignore_index anywhere; a target outside [0, V) that is not ignore_index gives a NaN loss and
# NaN gradients (no host sync to check it). 1 <= V < 2**31, H >= 1, any N (0 gives loss 0). Any strides.
# Offsets are int64 (rows and vocabulary indices times strides, splits times N): N x H, V x H and
# N x chunk may pass 2**31; no offset spans N x V, which nothing here stores.
#
# Sources: Liger-Kernel's fused_linear_cross_entropy and cross_entropy (online softmax over vocabulary
# blocks, label smoothing gradient, chunking to bound memory), flash-attention's online softmax and
# split-K style partial merge (flash-decoding), the Triton matmul tutorial (tiling, masks).
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from fastbert.kernels.arguments import CROSS_ENTROPY_REDUCTIONS, check_cross_entropy_options, check_cross_entropy_shapes
from fastbert.kernels.fused_op import backward_follows, fused_op, or_empty, register_no_backward
from fastbert.kernels.launch import cdiv, launch, next_power_of_2
from fastbert.kernels.matmul import sm_count
from fastbert.kernels.numerics import INTERPRETER, cast, dot_accumulate, dot_precision

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
_INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})  # pass at once
MAX_VOCAB = 2**31 - 1
MAX_GRID_AXIS = 65535  # CUDA's limit on grid axis 1: the backward's vocabulary tiles per chunk
# dz is materialised one vocabulary chunk at a time: N x chunk elements at most (64 MiB in 16-bit),
# few enough chunks at N = 2458 that the per-chunk GEMMs stay large.
BACKWARD_CHUNK_ELEMENTS = 1 << 25
# Forward programs wanted per SM: enough resident programs to hide load latency behind the dots.
FORWARD_PROGRAMS_PER_SM = 4
# Under the interpreter (CPU) the split only has to exist (so the merge is exercised), not be fast.
INTERPRETER_FORWARD_PROGRAMS = 8
INTERPRETER_BLOCK_V = 2048
INTERPRETER_BLOCK_K = 256
DZ_ROW_ALIGNMENT = 16  # elements
# The merge kernel's tile per row block: splits (rounded up to a power of 2) x rows, about this many elements
MERGE_TILE_ELEMENTS = 4096  # 16 per thread of 8 warps and plane
INTERPRETER_MERGE_TILE_ELEMENTS = 1 << 16


@triton.jit
def _logits_tile(
    x_ptr,  # [N, H] activations, strides (stride_xn, stride_xh)
    w_ptr,  # [V, H] decoder weight, strides (stride_wv, stride_wh)
    b_ptr,  # [V] decoder bias, stride stride_b; read only when HAS_BIAS
    rows, row_mask,  # [BLOCK_N] int64 row indices and rows < N
    cols, col_mask,  # [BLOCK_V] int64 vocabulary indices and which of them this tile owns
    H, stride_xn, stride_xh, stride_wv, stride_wh, stride_b,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """fp32 logits x[rows] W[cols]^T + b[cols], [BLOCK_N, BLOCK_V]; masked rows and columns read zeros."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)  # times a hidden-dimension stride: past 2**31 for a transposed x
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        in_k = k < H
        a = tl.load(x_ptr + rows[:, None] * stride_xn + k[None, :] * stride_xh,
                    mask=row_mask[:, None] & in_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        b = tl.load(w_ptr + cols[None, :] * stride_wv + k[:, None] * stride_wh,
                    mask=col_mask[None, :] & in_k[:, None], other=0.0)  # [BLOCK_K, BLOCK_V]
        acc = dot_accumulate(a, b, acc, DOT_PRECISION)
    if HAS_BIAS:
        acc += cast(tl.load(b_ptr + cols * stride_b, mask=col_mask, other=0.0), tl.float32)[None, :]
    return acc


@triton.jit
def _split_columns(split, cols_per_split, V):
    """The vocabulary columns [v_start, v_end) of a forward split, int64: with V past 2**30, the last
    split's start + cols_per_split passes 2**31."""
    v_start = split.to(tl.int64) * cols_per_split
    v_end = tl.minimum(v_start + cols_per_split, V)
    return v_start, v_end


@triton.jit
def _partial_planes(partials_ptr, plane):
    """The forward's fp32 [6, splits, N] partials buffer as its planes' base pointers: the fp32 max, sum of
    exp, target logit and logit sum, and the int64 argmax in the last two planes' bytes (one buffer, so one
    allocation; an int32 argmax made the fp32 forward spill on sm_90a). Each plane is added to the scalar
    pointer on its own: four planes may pass 2**31 elements, one does not."""
    sumexp_ptr = partials_ptr + plane
    target_logit_ptr = sumexp_ptr + plane
    logit_sum_ptr = target_logit_ptr + plane
    argmax_ptr = (logit_sum_ptr + plane).to(tl.pointer_type(tl.int64))
    return partials_ptr, sumexp_ptr, target_logit_ptr, logit_sum_ptr, argmax_ptr


@triton.jit
def _mlm_loss_fwd_kernel(
    x_ptr,  # [N, H] activations
    w_ptr,  # [V, H] decoder weight
    b_ptr,  # [V] decoder bias; read only when HAS_BIAS
    target_ptr,  # [N] integer targets, stride stride_t
    partials_ptr,  # [6, splits, N] out (_partial_planes), planes `plane` = splits x N apart, per split and
    # row: the max logit over the split's columns, the sum of exp(z - max) over them, z_t when t is among
    # them (else 0), the sum of z over them, and the first column of the split holding its max
    N, V, H, cols_per_split, plane,
    stride_xn, stride_xh, stride_wv, stride_wh, stride_b, stride_t,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" or "tf32" (kernels/numerics.py dot_precision)
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    split = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    target = tl.load(target_ptr + rows * stride_t, mask=row_mask, other=-1).to(tl.int64)
    run_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    run_sumexp = tl.zeros((BLOCK_N,), dtype=tl.float32)
    target_logit = tl.zeros((BLOCK_N,), dtype=tl.float32)
    logit_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    argmax = tl.zeros((BLOCK_N,), dtype=tl.int64)
    v_start, v_end = _split_columns(split, cols_per_split, V)
    # The launcher makes every split start below V, so each tile has a column and run_max turns
    # finite on the first tile (exp(-inf - finite) = 0 then, never -inf - -inf).
    offs_v = tl.arange(0, BLOCK_V)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + offs_v.to(tl.int64)
        col_mask = cols < v_end
        z = _logits_tile(x_ptr, w_ptr, b_ptr, rows, row_mask, cols, col_mask, H,
                         stride_xn, stride_xh, stride_wv, stride_wh, stride_b,
                         HAS_BIAS, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
        # Element-wise tests use the in-tile column offs_v (int32), v0 added after the reductions: an int64
        # [BLOCK_N, BLOCK_V] index tile costs two registers per element and made the 16-bit sm_90 build spill
        in_tile = offs_v < (v_end - v0).to(tl.int32)
        z = tl.where(in_tile[None, :], z, float("-inf"))
        tile_max = tl.max(z, axis=1)
        tile_argmax = v0 + tl.min(tl.where(z == tile_max[:, None], offs_v[None, :], BLOCK_V), axis=1)
        # tiles come in column order: a strictly larger max is needed to move the argmax, so ties
        # keep the first column
        argmax = tl.where(tile_max > run_max, tile_argmax, argmax)
        new_max = tl.maximum(run_max, tile_max)
        run_sumexp = run_sumexp * tl.exp(run_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), axis=1)
        run_max = new_max
        target_in_tile = tl.where((target >= v0) & (target < v0 + BLOCK_V), target - v0, -1).to(tl.int32)
        target_logit += tl.sum(tl.where(offs_v[None, :] == target_in_tile[:, None], z, 0.0), axis=1)
        logit_sum += tl.sum(tl.where(in_tile[None, :], z, 0.0), axis=1)
    max_ptr, sumexp_ptr, target_logit_ptr, logit_sum_ptr, argmax_ptr = _partial_planes(partials_ptr, plane)
    out = split.to(tl.int64) * N + rows
    tl.store(max_ptr + out, run_max, mask=row_mask)
    tl.store(sumexp_ptr + out, run_sumexp, mask=row_mask)
    tl.store(target_logit_ptr + out, target_logit, mask=row_mask)
    tl.store(logit_sum_ptr + out, logit_sum, mask=row_mask)
    tl.store(argmax_ptr + out, argmax, mask=row_mask)


@triton.jit
def _mlm_loss_merge_kernel(
    partials_ptr,  # [6, splits, N]: the forward kernel's (_partial_planes), planes `plane` = splits x N apart
    target_ptr,  # [N] integer targets, stride stride_t
    stats_ptr,  # [2 N + 1] fp32 out, mlm_loss_fwd's softmax_stats: each row's max logit m, then
    # s = log sum_v exp(z_v - m), then the labelled rows, for the backward's "mean"; written only when STORE_STATS
    loss_ptr,  # [] fp32 out: the loss
    correct_ptr,  # [] int64 out: num_correct
    N, V, splits, plane, ignore_index, label_smoothing, stride_t,
    MEAN: tl.constexpr,  # divide the loss by the labelled rows (at least 1)
    STORE_STATS: tl.constexpr,  # write softmax_stats: a backward will read them (not at inference)
    BLOCK_S: tl.constexpr,  # splits, rounded up to a power of 2
    BLOCK_N: tl.constexpr,
):
    # One program, row block after row block in order, so that the fp64 sum of the row losses and the counts
    # are reproducible without atomics. A row block's [BLOCK_S, BLOCK_N] partials are loaded at once, so each
    # block waits for memory about once per plane, not once per split (the pretraining shape, N = 2458 in 27
    # splits on an H100, is 20 row blocks of 128; no GPU has timed it yet).
    max_ptr, sumexp_ptr, target_logit_ptr, logit_sum_ptr, argmax_ptr = _partial_planes(partials_ptr, plane)
    offs_s = tl.arange(0, BLOCK_S)
    split_mask = offs_s < splits
    loss = tl.zeros((BLOCK_N,), dtype=tl.float64)
    correct = tl.zeros((BLOCK_N,), dtype=tl.int64)
    labelled_rows = tl.zeros((BLOCK_N,), dtype=tl.int64)
    for r0 in range(0, N, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N).to(tl.int64)
        row_mask = rows < N
        # padding rows read the last row's partials (finite: no -inf - -inf or log(0)); nothing of theirs is kept
        read_rows = tl.minimum(rows, N - 1)
        mask = split_mask[:, None]
        offsets = offs_s[:, None].to(tl.int64) * N + read_rows[None, :]  # [BLOCK_S, BLOCK_N] into one plane
        split_max = tl.load(max_ptr + offsets, mask=mask, other=float("-inf"))
        row_max = tl.max(split_max, axis=0)
        # the first split holding the row's max has its first argmax (ties: the first column)
        first = tl.min(tl.where(split_max == row_max[None, :], offs_s[:, None], BLOCK_S), axis=0)
        argmax = tl.load(argmax_ptr + first.to(tl.int64) * N + read_rows, mask=first < splits, other=-1)
        sumexp = tl.load(sumexp_ptr + offsets, mask=mask, other=0.0)
        log_sumexp = tl.log(tl.sum(tl.exp(split_max - row_max[None, :]) * sumexp, axis=0))
        row_loss = row_max - tl.sum(tl.load(target_logit_ptr + offsets, mask=mask, other=0.0), axis=0)
        if label_smoothing != 0.0:  # with none, (1 - e) * l + e * l' is l itself
            logit_sum = tl.sum(tl.load(logit_sum_ptr + offsets, mask=mask, other=0.0), axis=0)
            row_loss = (1.0 - label_smoothing) * row_loss + label_smoothing * (row_max - logit_sum / V)
        row_loss += log_sumexp
        if STORE_STATS:
            tl.store(stats_ptr + rows, row_max, mask=row_mask)
            tl.store(stats_ptr + N + rows, log_sumexp, mask=row_mask)
        target = tl.load(target_ptr + rows * stride_t, mask=row_mask, other=0).to(tl.int64)
        labelled = row_mask & (target != ignore_index)
        row_loss = tl.where(labelled, row_loss, 0.0)
        row_loss = tl.where(labelled & ((target < 0) | (target >= V)), float("nan"), row_loss)
        # fp64 accumulation of the N row losses, as PyTorch's CPU nll_loss does: an fp32 sum of thousands
        # of terms would add more error than the whole rest of the computation
        loss += cast(row_loss, tl.float64)
        correct += (labelled & (argmax == target)).to(tl.int64)
        labelled_rows += labelled.to(tl.int64)
    total = tl.sum(loss, axis=0)
    count = tl.sum(labelled_rows, axis=0)
    if MEAN:
        total = total / cast(tl.maximum(count, 1), tl.float64)
    tl.store(loss_ptr, cast(total, tl.float32))
    tl.store(correct_ptr, tl.sum(correct, axis=0))
    if STORE_STATS:
        # in fp32, as the backward divides by it: the same rounding (above 2**24 rows) as its cast from int64
        # would make
        tl.store(stats_ptr + 2 * N, cast(count, tl.float32))


@triton.jit
def _mlm_loss_bwd_kernel(
    x_ptr,  # [N, H] activations
    w_ptr,  # [V, H] decoder weight
    b_ptr,  # [V] decoder bias; read only when HAS_BIAS
    target_ptr,  # [N] integer targets, stride stride_t
    stats_ptr,  # [2 N + 1] fp32 softmax_stats from the forward: each row's max logit m, then
    # s = log sum_v exp(z_v - m), then the labelled rows (read only when MEAN)
    grad_loss_ptr,  # [] d loss from the caller, any float dtype
    dz_ptr,  # [N, V1 - V0] out, x's dtype, row stride stride_dzn: d loss / d z for columns [V0, V1)
    N, V, H, V0, V1, ignore_index, label_smoothing,
    stride_xn, stride_xh, stride_wv, stride_wh, stride_b, stride_t, stride_dzn,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,  # as in the forward
    MEAN: tl.constexpr,  # "mean" reduction: grad_loss / labelled rows (at least 1)
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # d loss_row / d z_v = softmax(z)_v - (1 - e) [v == t] - e / V, with softmax(z)_v = exp((z_v - m) - s)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = V0 + tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < N
    col_mask = cols < V1
    z = _logits_tile(x_ptr, w_ptr, b_ptr, rows, row_mask, cols, col_mask, H,
                     stride_xn, stride_xh, stride_wv, stride_wh, stride_b,
                     HAS_BIAS, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
    row_max = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)
    # padding rows: exp(.) = 0
    log_sumexp = tl.load(stats_ptr + N + rows, mask=row_mask, other=float("inf"))
    target = tl.load(target_ptr + rows * stride_t, mask=row_mask, other=-1).to(tl.int64)
    # d loss / d loss_row: grad_loss (/ labelled rows for "mean") on labelled rows, 0 on the others, NaN on
    # labelled rows whose target is outside [0, V)
    grad = cast(tl.load(grad_loss_ptr), tl.float32)
    if MEAN:
        grad = grad / tl.maximum(tl.load(stats_ptr + 2 * N), 1.0)
    labelled = target != ignore_index
    coef = tl.where(labelled, grad, 0.0)
    coef = tl.where(labelled & ((target < 0) | (target >= V)), float("nan"), coef)
    dz = tl.exp((z - row_max[:, None]) - log_sumexp[:, None]) - label_smoothing / V
    dz -= tl.where(cols[None, :] == target[:, None], 1.0 - label_smoothing, 0.0)
    # unlabelled rows give exact zeros whatever their logits; a NaN coef (bad target) propagates
    dz = tl.where(coef[:, None] != 0.0, dz * coef[:, None], 0.0)
    tl.store(dz_ptr + rows[:, None] * stride_dzn + (cols - V0)[None, :], cast(dz, dz_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def inputs_pass(x, weight, bias, target, reduction, label_smoothing) -> bool:
    """Whether the kernels take these inputs as they are: x [N, H], weight [V, H] and bias [V] or None of one
    supported dtype, an integer target [N], all on one device, the vocabulary size and the options in range. One
    condition that reads each attribute once: it runs on every call of the loss, whose host cost is two launches
    beside PyTorch's two ops (`fastbert bench --suite host`)."""
    x_shape, weight_shape, dtype, device = x.shape, weight.shape, x.dtype, x.device
    return (len(x_shape) == 2 and len(weight_shape) == 2 and x_shape[1] == weight_shape[1] >= 1
            and 1 <= weight_shape[0] <= MAX_VOCAB and dtype in _SUPPORTED and weight.dtype == dtype
            and weight.device == device and target.shape == (x_shape[0],) and target.dtype in _INTEGER_DTYPES
            and target.device == device and reduction in CROSS_ENTROPY_REDUCTIONS and 0.0 <= label_smoothing <= 1.0
            and (bias is None or (bias.shape == (weight_shape[0],) and bias.dtype == dtype and bias.device == device)))


def check_inputs(x, weight, bias, target, reduction, label_smoothing) -> None:
    """Raise ValueError for what the kernels do not support, before anything is launched (`inputs_pass`, and for
    the inputs it refuses the checks that name what is wrong)."""
    if not inputs_pass(x, weight, bias, target, reduction, label_smoothing):
        _explain(x, weight, bias, target, reduction, label_smoothing)


def _explain(x, weight, bias, target, reduction, label_smoothing) -> None:
    """Raise the ValueError that names what `inputs_pass` refused; return for what the kernels take too: an integer
    target of a dtype outside _INTEGER_DTYPES (uint16 to uint64), a bias of another supported dtype than x's."""
    check_cross_entropy_shapes(x, weight, bias, target)
    vocab, hidden = weight.shape
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"weight has vocabulary size {vocab}; the Triton cross entropy supports 1 to {MAX_VOCAB}")
    if hidden < 1:
        raise ValueError(f"x has hidden size {hidden}; the Triton cross entropy needs at least 1")
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {tensor.dtype}; the Triton cross entropy supports {SUPPORTED_DTYPES}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight has dtype {weight.dtype}, expected x's dtype {x.dtype}")
    for name, tensor in (("weight", weight), ("bias", bias), ("target", target)):
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}; all must share one device")
    check_cross_entropy_options(reduction, label_smoothing)


def _config(dtype: torch.dtype, rows: int, forward: bool) -> dict:
    """Tile sizes. The interpreter's cost is per operation, not per element, so on CPU the tiles are as
    large as the same kernels allow; on a GPU, _gpu_config."""
    if INTERPRETER:
        return dict(BLOCK_N=_block_n(rows, 16), BLOCK_V=INTERPRETER_BLOCK_V, BLOCK_K=INTERPRETER_BLOCK_K)
    return _gpu_config(dtype, rows, forward)


def _block_n(rows: int, smallest: int) -> int:
    """Fewer rows than 128 take the next power of two (at least `smallest`) rather than computing padding."""
    return min(128, max(smallest, next_power_of_2(rows)))


def _gpu_config(dtype: torch.dtype, rows: int, forward: bool) -> dict:
    """Hopper: up to 128 rows over 8 warps, and never fewer than 64 rows, a warpgroup MMA's height (with 32
    or 16, as few labelled rows would give, sm_90a falls back to MMA). Vocabulary tiles of 128 columns, 64
    in the forward: its running statistics with a 128 x 128 tile of logits filled the registers (8 bytes
    spilled on sm_90a). K tiles of 64 (16-bit) or 32 (fp32) keep a pipeline stage at 32 KiB of shared
    memory at most, so 3 stages fit."""
    return dict(BLOCK_N=_block_n(rows, 64), BLOCK_V=64 if forward else 128,
                BLOCK_K=32 if dtype == torch.float32 else 64, num_warps=8, num_stages=3)


def _forward_cols_per_split(device: torch.device, rows: int, vocab: int, block_n: int, block_v: int) -> int:
    """Columns per vocabulary split, a multiple of block_v, such that every split starts below vocab."""
    if INTERPRETER:
        programs = INTERPRETER_FORWARD_PROGRAMS
    else:
        programs = FORWARD_PROGRAMS_PER_SM * sm_count(device)
    vocab_tiles = cdiv(vocab, block_v)
    splits = max(1, min(vocab_tiles, cdiv(programs, cdiv(rows, block_n))))
    return cdiv(vocab_tiles, splits) * block_v


def _backward_chunk_cols(rows: int, vocab: int, block_v: int) -> int:
    """Vocabulary columns per backward chunk: equal chunks (multiples of block_v) of at most
    BACKWARD_CHUNK_ELEMENTS elements of dz, but never narrower than one tile. A chunk also spans at
    most MAX_GRID_AXIS tiles: with a handful of rows and a vocabulary past 8M, one chunk would
    otherwise need more blocks on grid axis 1 than a GPU launch allows (the interpreter has no limit)."""
    chunks = max(1, cdiv(rows * vocab, BACKWARD_CHUNK_ELEMENTS), cdiv(vocab, MAX_GRID_AXIS * block_v))
    return min(vocab, cdiv(cdiv(vocab, chunks), block_v) * block_v)


def _merge_config(splits: int, rows: int) -> dict:
    """The merge kernel's tile: every split of as many rows as fit MERGE_TILE_ELEMENTS (at least one)."""
    block_s = next_power_of_2(splits)
    tile = INTERPRETER_MERGE_TILE_ELEMENTS if INTERPRETER else MERGE_TILE_ELEMENTS
    config = dict(BLOCK_S=block_s, BLOCK_N=min(next_power_of_2(rows), max(1, tile // block_s)))
    if not INTERPRETER:
        config.update(num_warps=8 if block_s * config["BLOCK_N"] >= MERGE_TILE_ELEMENTS else 4)
    return config


@functools.lru_cache(maxsize=4096)
def _forward_plan(device: torch.device, dtype: torch.dtype, rows: int, vocab: int, has_bias: bool, mean: bool,
                  keep_stats: bool, precision: str) -> tuple[dict, tuple, int, int, dict]:
    """(the forward kernel's constexprs, its grid, columns per split, splits, the merge kernel's constexprs) of a
    forward over rows >= 1 whose tl.dot runs at `precision` (dot_precision, read per call: PyTorch's fp32 matmul
    precision can change at run time): a function of the shape, the options and the device only, so cached
    (working it out cost the host more than the launch). Every call shares the dicts, which nothing changes:
    plain dicts, since a ** of a read-only proxy (a mapping, not a dict) costs each launch more host time, as
    does a keyword beside the ** (a new dict merged per call)."""
    config = _config(dtype, rows, forward=True)
    cols_per_split = _forward_cols_per_split(device, rows, vocab, config["BLOCK_N"], config["BLOCK_V"])
    splits = cdiv(vocab, cols_per_split)
    grid = (cdiv(rows, config["BLOCK_N"]), splits)
    merge = dict(MEAN=mean, STORE_STATS=keep_stats, **_merge_config(splits, rows))
    return dict(HAS_BIAS=has_bias, DOT_PRECISION=precision, **config), grid, cols_per_split, splits, merge


@functools.lru_cache(maxsize=4096)
def _backward_plan(dtype: torch.dtype, rows: int, vocab: int, has_bias: bool, mean: bool,
                   precision: str) -> tuple[dict, int]:
    """(the backward kernel's constexprs, vocabulary columns per chunk) of a backward over rows >= 1 whose tl.dot
    runs at `precision`, cached and shared as `_forward_plan`'s."""
    config = _config(dtype, rows, forward=False)
    return (dict(HAS_BIAS=has_bias, MEAN=mean, DOT_PRECISION=precision, **config),
            _backward_chunk_cols(rows, vocab, config["BLOCK_V"]))


def _forward(x, weight, bias, target, ignore_index, reduction, label_smoothing, keep_stats):
    """`mlm_loss_fwd`'s loss, num_correct and softmax_stats, or None for softmax_stats unless keep_stats."""
    rows, hidden = x.shape  # each shape read makes a torch.Size
    vocab = weight.shape[0]
    if rows == 0:
        def zero(dtype, *shape):
            return torch.zeros(shape, dtype=dtype, device=x.device)
        return zero(torch.float32), zero(torch.int64), zero(torch.float32, 1) if keep_stats else None
    device = x.device  # read once: each read makes a torch.device
    constexprs, grid, cols_per_split, splits, merge_constexprs = _forward_plan(
        device, x.dtype, rows, vocab, bias is not None, reduction == "mean", keep_stats, dot_precision(x.dtype))
    plane = splits * rows
    # [6, splits, N] (_partial_planes), flat: the kernels index it by plane, and an int size allocates faster
    partials = torch.empty(6 * plane, dtype=torch.float32, device=device)
    stride_t = target.stride(0)
    launch(_mlm_loss_fwd_kernel, grid,
        x, weight, bias, target, partials, rows, vocab, hidden, cols_per_split, plane, *x.stride(),
        *weight.stride(), 0 if bias is None else bias.stride(0), stride_t, **constexprs,
    )
    softmax_stats = torch.empty(2 * rows + 1, dtype=torch.float32, device=device) if keep_stats else None
    # empty_strided: PyTorch parses a size tuple, () included, slower than sizes given one by one
    loss = torch.empty_strided((), (), dtype=torch.float32, device=device)
    num_correct = torch.empty_strided((), (), dtype=torch.int64, device=device)
    launch(_mlm_loss_merge_kernel, (1,), partials, target, softmax_stats, loss, num_correct, rows, vocab, splits,
           plane, ignore_index, label_smoothing, stride_t, **merge_constexprs)
    return loss, num_correct, softmax_stats


@fused_op("fastbert::mlm_loss_fwd")
def mlm_loss_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
                 ignore_index: int, reduction: str,
                 label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H], weight [V, H], bias [V] or None (any strides), target int [N], checked by
    `linear_cross_entropy` (or fastbert.ops) and, where PyTorch traces, by the fake registration.

    Returns loss (fp32 scalar), num_correct (int64 scalar), and for the backward softmax_stats (fp32
    [2 N + 1]: each row's max logit m, then each row's log sum exp(z - m), then the labelled rows' count: one
    buffer, so one allocation and one saved tensor).
    """
    return _forward(x, weight, bias, target, ignore_index, reduction, label_smoothing, True)


@mlm_loss_fwd.register_fake
def _(x, weight, bias, target, ignore_index, reduction, label_smoothing):
    check_inputs(x, weight, bias, target, reduction, label_smoothing)
    return (x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.int64),
            x.new_empty(2 * x.shape[0] + 1, dtype=torch.float32))


@fused_op("fastbert::mlm_loss_inference")
def mlm_loss_inference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
                       ignore_index: int, reduction: str, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`mlm_loss_fwd` where no backward follows (no input needs a gradient, or grad mode is off): loss and
    num_correct alone. Its merge kernel writes no softmax_stats, so the buffer is never allocated. Its own
    op, not a flag, since a custom op's outputs are fixed and an empty stand-in would be an allocation too."""
    loss, num_correct, _ = _forward(x, weight, bias, target, ignore_index, reduction, label_smoothing, False)
    return loss, num_correct


@mlm_loss_inference.register_fake
def _(x, weight, bias, target, ignore_index, reduction, label_smoothing):
    check_inputs(x, weight, bias, target, reduction, label_smoothing)
    return x.new_empty((), dtype=torch.float32), x.new_empty((), dtype=torch.int64)


register_no_backward(mlm_loss_inference, "softmax statistics", "mlm_loss_fwd, or linear_cross_entropy")


@fused_op("fastbert::mlm_loss_bwd")
def mlm_loss_bwd(grad_loss: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 target: torch.Tensor, softmax_stats: torch.Tensor, ignore_index: int, reduction: str,
                 label_smoothing: float, needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `mlm_loss_fwd` from its inputs and softmax_stats; grad_loss a scalar tensor; needs one
    bool per x, weight, bias (autograd's needs_input_grad, False for a missing bias).

    Returns dx [N, H] in x's dtype, dweight [V, H] in weight's dtype and dbias fp32 [V], all contiguous; an
    empty [0] for each gradient not needed (a custom op returns tensors): a frozen decoder weight (the word
    embeddings it is tied to, frozen under LoRA) costs no [V, H] matmul or buffer.
    """
    needs_dx, needs_dweight, needs_dbias = needs
    rows, hidden = x.shape
    vocab = weight.shape[0]
    if rows == 0:
        return or_empty(x, x.new_empty((0, hidden)) if needs_dx else None,
                        torch.zeros((vocab, hidden), dtype=weight.dtype, device=x.device) if needs_dweight else None,
                        torch.zeros(vocab, dtype=torch.float32, device=x.device) if needs_dbias else None)
    constexprs, chunk_cols = _backward_plan(x.dtype, rows, vocab, bias is not None, reduction == "mean",
                                            dot_precision(x.dtype))
    # one chunk: dW and db come out of their ops whole; several: each chunk's rows are written into them
    chunks = chunk_cols < vocab
    dweight = weight.new_empty(vocab, hidden) if chunks and needs_dweight else None
    dbias = torch.empty(vocab, dtype=torch.float32, device=x.device) if chunks and needs_dbias else None
    dx = None
    for v0 in range(0, vocab, chunk_cols):
        v1 = min(v0 + chunk_cols, vocab)
        # dz's rows start at multiples of DZ_ROW_ALIGNMENT elements, also for a last chunk of odd width
        # (10,042 columns at N = 2458): Triton specialises the row stride as divisible by 16 and stores
        # whole vectors (an unaligned stride spilled 180 bytes on sm_90a), and cuBLAS gets an aligned
        # leading dimension
        width = v1 - v0
        aligned = cdiv(width, DZ_ROW_ALIGNMENT) * DZ_ROW_ALIGNMENT
        dz = x.new_empty(rows, aligned)
        if aligned != width:
            dz = dz[:, :width]
        launch(_mlm_loss_bwd_kernel, (cdiv(rows, constexprs["BLOCK_N"]), cdiv(width, constexprs["BLOCK_V"])),
            x, weight, bias, target, softmax_stats, grad_loss, dz,
            rows, vocab, hidden, v0, v1, ignore_index, label_smoothing, *x.stride(), *weight.stride(),
            0 if bias is None else bias.stride(0), target.stride(0), dz.stride(0), **constexprs,
        )
        if chunks:
            if needs_dweight:
                torch.mm(dz.t(), x, out=dweight[v0:v1])
            if needs_dbias:
                torch.sum(dz, dim=0, dtype=torch.float32, out=dbias[v0:v1])
        else:
            if needs_dweight:
                dweight = torch.mm(dz.t(), x)
            if needs_dbias:
                dbias = torch.sum(dz, dim=0, dtype=torch.float32)
        if needs_dx:
            product = _mm_fp32(dz, weight[v0:v1] if chunks else weight)
            if dx is None:
                dx = product
            else:
                dx += product
    if dx is not None and x.dtype != torch.float32:
        dx = dx.to(x.dtype)
    return or_empty(x, dx, dweight, dbias)


# torch >= 2.8: cuBLAS writes the fp32 accumulator of a 16-bit GEMM as it is (mm's out_dtype, CUDA only)
_MM_HAS_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32, its fp32 accumulation never rounded to 16-bit a's dtype: each vocabulary chunk's
    dz W adds into dx unrounded. Without mm's out_dtype (the CPU, where the kernels run only in tests,
    or an older torch) the operands are upcast: exact, slower."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda and _MM_HAS_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    if not torch.amp.is_autocast_available(a.device.type):  # meta tensors (shape checks, the compile audit)
        return torch.mm(a.float(), b.float())
    with torch.autocast(a.device.type, enabled=False):  # a backward run under autocast would cast them back
        return torch.mm(a.float(), b.float())


@mlm_loss_bwd.register_fake
def _(grad_loss, x, weight, bias, target, softmax_stats, ignore_index, reduction, label_smoothing, needs):
    needs_dx, needs_dweight, needs_dbias = needs
    return (x.new_empty(x.shape if needs_dx else (0,)), weight.new_empty(weight.shape if needs_dweight else (0,)),
            x.new_empty(weight.shape[0], dtype=torch.float32) if needs_dbias else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, bias, target, ignore_index, reduction, label_smoothing = inputs
    _, num_correct, softmax_stats = output
    ctx.save_for_backward(x, weight, bias, target, softmax_stats)
    ctx.arguments = (ignore_index, reduction, label_smoothing)
    ctx.mark_non_differentiable(num_correct, softmax_stats)
    ctx.set_materialize_grads(False)  # the loss's gradient starts every backward; the others stay None


def _backward(ctx, grad_loss, grad_num_correct, grad_softmax_stats):
    x, weight, bias, target, softmax_stats = ctx.saved_tensors
    needs_dx, needs_dweight, needs_dbias = needs = ctx.needs_input_grad[:3]  # a missing bias needs none
    dx, dweight, dbias = mlm_loss_bwd(grad_loss, x, weight, bias, target, softmax_stats, *ctx.arguments, needs)
    if needs_dbias and dbias.dtype != bias.dtype:
        dbias = dbias.to(bias.dtype)
    return (dx if needs_dx else None, dweight if needs_dweight else None, dbias if needs_dbias else None,
            None, None, None, None)


mlm_loss_fwd.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(x, weight, bias, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """Cross entropy of x @ weight.T + bias over the vocabulary, never holding the [N, V] logits.

    x [N, H] and weight [V, H] of one dtype (fp32, fp16 or bf16), bias [V] or None, target integer
    [N] in [0, V) or ignore_index; any strides. reduction "mean" (over labelled rows) or "sum";
    label_smoothing in [0, 1] as in F.cross_entropy. Returns (loss fp32 scalar, differentiable in x,
    weight and bias; num_correct int64 scalar: labelled rows whose first argmax is the target).
    No labelled row gives loss 0 and zero gradients. Raises ValueError for unsupported inputs.
    Autocast does not see custom ops: fastbert.ops.linear_cross_entropy casts the inputs first.
    """
    check_inputs(x, weight, bias, target, reduction, label_smoothing)
    return linear_cross_entropy_unchecked(x, weight, bias, target, ignore_index, reduction, label_smoothing)


def linear_cross_entropy_unchecked(x, weight, bias, target, ignore_index, reduction, label_smoothing):
    """`linear_cross_entropy` after its checks (`inputs_pass` or `check_inputs`), which the caller has made
    (fastbert.ops)."""
    ignore_index, label_smoothing = int(ignore_index), float(label_smoothing)
    if backward_follows((x, weight, bias)):
        loss, num_correct, _ = mlm_loss_fwd(x, weight, bias, target, ignore_index, reduction, label_smoothing)
        return loss, num_correct
    return mlm_loss_inference(x, weight, bias, target, ignore_index, reduction, label_smoothing)
