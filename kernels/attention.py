# Bidirectional (non-causal) scaled dot-product attention, flash style, forward and backward:
#     out = dropout(softmax(q k^T * scale + key mask)) v
# for BERT's self-attention, on a padded batch with a [B, S] key padding mask (`attention`) or on packed
# tokens with cu_seqlens (`attention_varlen`). The S x S scores never exist in memory.
#
# Algorithm (FlashAttention-2). The forward runs one program per (query block, head, sequence); it streams
# the key/value blocks of its sequence through an online softmax kept in fp32 (running max m, running sum
# l, rescaled accumulator), in base 2 (scores are multiplied by scale * log2(e) and exponentiated with
# exp2), and writes only the output and, where a backward follows, the per-row log-sum-exp (at inference,
# `attention_infer`, none). The backward recomputes the scores
# blockwise from q, k and the saved log-sum-exp, with no atomics, so it is deterministic: a preprocess
# kernel gives delta = rowsum(dO * O); then program i of the backward kernel owns key block i, looping
# over the query blocks for its dk and dv, and then query block i, looping over the key blocks for its
# dq (the Triton tutorial's split: every gradient row has one writer). dq, dk and dv are written into one
# buffer, [B, S, 3, heads, d] (packed: [T, 3, heads, d]): the token-major gradient of the fused QKV
# projection's output, which kernels/qkv.py's backward then reads in place instead of gathering three tensors
# into it (a pass over 3 x tokens x H elements and a second buffer of that size, in each layer).
# Padded and packed layouts share these kernels (constexpr VARLEN): a sequence is a row offset into the
# layout, a row count and a range [lo, hi) of rows that can hold tokens. With a mask, lo/hi are its first and
# last 1 (+1), so right padding (the common case) skips the padded key and query blocks entirely, and the mask
# itself is read inside that range, so any 0/1 pattern works. Padded query rows are written as zeros with
# log-sum-exp +inf, which makes their probabilities, and so every gradient through them, exactly zero; a fully
# padded sequence gives zeros, never NaN.
#
# Dropout drops probability (row, col) of head h of sequence b when the uniform float of output col % 4
# of Philox (seed; counters col // 4, row, h, b: one call per four keys) is below p, and scales the kept
# ones by 1 / (1 - p). The counters are the element's position within its sequence, so the backward
# regenerates the forward's mask, and the padded and packed layouts of the same batch draw the same mask.
# The seed is an int64 tensor drawn with torch's generator on the tensors' device (no host sync;
# torch.manual_seed reproduces a mask).
#
# Relative-position bias (MPNet; constexpr HAS_REL_BIAS): score (i, j) of head h gets
# relative_bias[bucket(j - i), h] added, relative_bias [num_buckets, heads] a parameter and bucket() T5's
# bidirectional bucketing, given as a table relative_buckets [2D + 1] of the distances -D..D (every
# longer distance is in the bucket of +-D: kernels look a distance up at clamp(j - i, -D, D) + D, integer
# work only). Positions are offsets inside the sequence, so the padded and packed layouts agree. The
# launcher gathers the two tables into one, bias_by_distance [heads, 2D + 1] fp32 (already times log2(e),
# the base-2 scores' unit), so the forward and both backward phases add the bias with one gather per score
# from a table of a few KB that stays in cache, instead of a bucket lookup then a bias lookup. The bias
# gradient is the sum, per head and bucket, of dS (the gradient of the natural-unit score), computed
# deterministically: in the dq phase, which visits every score tile once, a program looks up the bucket of
# each score and adds, for each bucket from the tile's least to its greatest (one in a tile whose distances
# are all at the clamp, most tiles of a long sequence; up to all near the diagonal), the masked sum of the
# tile's dS to an fp32 accumulator of one entry per bucket. (Skipping the lookup in tiles at the clamp, in a
# branch, cost the 128-row backward configs 4 to 16 bytes of spills on sm_90a.) The program writes its sums to
# its own rows of a [sequences, heads, slots, buckets] buffer, and the launcher adds the rows up with one
# torch sum (a fixed order, no atomics). A slot is the smallest query block any config uses
# (BIAS_GRAD_SLOT_ROWS rows); a program with a larger block writes its sums to its first slot and zeros to
# the others, so every slot is written whatever block the autotuner picks (no zero fill, no stale rows
# from its timing runs). Saved for the backward besides the usual: relative_bias and relative_buckets
# themselves (the parameter and a small table, alive anyway); nothing of size S^2 (the bias is never
# materialised: bias_by_distance is rebuilt by the backward, and the bucket sums' buffer is
# sequences x heads x S/64 x buckets floats). Precision: the gradient inherits flash attention's row term
# delta = dO . O, whose error (O's fp32 accumulation) every bucket's sum of dS carries; in fp32 it can
# exceed 3x the error of a materialised softmax's, whose delta sums its own P * dP
# (measured: test_dropout_forward_and_backward_use_one_mask in tests/test_attention_relative_bias.py).
#
# Rotary positions (ModernBERT; constexpr ROTARY): q and k are rotated inside the kernels, RoPE's rotate_half
# layout: dimension i < d/2 pairs with i + d/2, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) at angle
# position * inv_freq[i], inv_freq = base ** (-2i / d), the position the token's offset in its sequence (the
# padded row index, or the packed row minus its sequence's start, so the layouts agree). It is done here
# rather than in the QKV projection's epilogue because a rotated column needs its partner column of the other
# half of the head, which a matmul tile of whole output columns does not hold, while the attention kernel loads
# a head's q or k rows as two half-width tiles and multiplies them with two half-width dots (the same bytes
# and MMA work as one full-width load and dot). The rotation runs in fp32 on each tile as it is loaded and is
# cast back to the input dtype, as transformers' apply_rotary_pos_emb does; cos and sin are computed from
# the position in fp32, and inv_freq is a [d/2] fp32 vector made on the host with transformers' own formula,
# so the fp32 angle position * inv_freq is bitwise transformers' (a device pow differs by ulps, which at
# position 8192 are 1e-3 radians). The backward accumulates dq and dk in the rotated frame (two half-width
# accumulators each) and applies the transpose rotation once, before the store. Saved for the backward: q
# and k unrotated, as without rotary: no rotated copy is kept (the backward rotates its tiles again).
#
# Sliding window (ModernBERT's local layers; constexpr WINDOW): query i keeps the keys j with |i - j| <= w
# (transformers' bidirectional sliding-window mask, distance <= config.sliding_window, 64 on ModernBERT-base).
# Every block loop visits only the blocks that intersect the band (`_block_range`: from max(lo, first row - w)
# to min(hi, last row + w + 1)), so a local layer costs O(S w), not O(S^2); the band's element mask is
# applied in the tiles, inside the boundary blocks. A token row always keeps itself, so l > 0 on every token
# row; padded rows are zeros as without a window. Dropout's counters are unchanged (the mask's elements are
# those of the full attention, which the band only drops). The relative-position bias is not combined with
# rotary positions or a window (no model asks for both): the launchers refuse the combination.
#
# Limits. Head dim 32, 64 or 128; fp32, fp16 or bf16 (q, k, v of one dtype; fp32 dots run in TF32 on tensor
# cores when PyTorch allows TF32 matmuls, else in exact IEEE fp32, PyTorch's default and the tests':
# several times slower, without tensor cores and with large register spills); any sequence length
# (blocks are masked, not padded); heads and batch up to 65535 (grid axes); q, k, v and the output
# gradient with any strides (offsets across sequences and heads are int64; offsets inside one sequence,
# of the inputs and of the outputs, must fit int32, checked: for the gradients, 3 x S x heads x d elements).
# Block sizes are autotuned on the GPU per (sequence length bucket, head dim, dtype, dropout, precision), the
# same for the padded and the packed layout; the autotuned choice is fixed within a process, so results are
# bitwise reproducible there.
#
# Sources: Dao, "FlashAttention-2" (2023), algorithms 1 and 2; the Triton tutorial "Fused Attention"
# (06-fused-attention.py: base-2 softmax, the dk/dv-then-dq backward program, delta preprocess);
# flash-attention's flash_attn_triton.py and its varlen interface (cu_seqlens, max_seqlen).
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from fastbert.kernels.arguments import check_max_seqlen, check_relative_bias, check_rotary_window
from fastbert.kernels.fused_op import backward_follows, fused_op, register_no_backward
from fastbert.kernels.launch import cdiv, launch, next_power_of_2, placeholders
from fastbert.kernels.numerics import INTERPRETER, cast, dot, dot_accumulate, dot_precision, dropout_seed
from fastbert.last_mask import LastMask

SUPPORTED_HEAD_DIMS = (32, 64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_GRID_AXIS = 65535  # CUDA's limit on grid axes 1 and 2 (heads, sequences)
LOG2E = 1.4426950408889634
INT32_MAX = 2**31 - 1


def _configs(gpu_shapes, interpreter_shape, names=("BLOCK_M", "BLOCK_N")):
    """Autotuning candidates (block sizes named `names`, num_warps, num_stages); under Triton's
    interpreter (CPU) one fixed shape, whose two block sizes differ so the tests exercise both."""
    if INTERPRETER:
        gpu_shapes = [interpreter_shape]
    return [triton.Config(dict(zip(names, (m, n))), num_warps=w, num_stages=s) for m, n, w, s in gpu_shapes]


# Keyed by the sequence-length bucket, not the length, so that varying batch lengths do not retune; not
# by the layout (VARLEN, HAS_MASK), so a packed batch runs the blocks of its padded twin and gives its
# bitwise results. Triton adds every tensor argument's dtype to the key: q's (and so out's), and those
# of the mask, bounds, cu_seqlens and seed pointers, which are fixed (`launch.placeholders` when unused), and
# the log-sum-exp's, fp32 whether it is stored or not (a placeholder at inference): an inference forward runs
# the training forward's blocks and gives its output bitwise.
AUTOTUNE_KEY = ["seqlen_bucket", "HEAD_DIM", "DROPOUT", "DOT_PRECISION", "HAS_REL_BIAS", "ROTARY", "WINDOW"]
# Candidates per GPU architecture, (block, block, num_warps, num_stages), each checked by the compile audit
# (`fastbert bench --suite compile`) to spill no register with Triton 3.6 and 3.9: Hopper (sm_90, warpgroup
# MMA) and Ampere (sm_80, MMA, whose fragments need more registers for the same tile).
# Forward: large query blocks amortise the K/V loads; 8 warps for 128 x 128 tiles. On sm_80, 128 x 64 on
# 4 warps and 128 x 128 on 8 spilled (4 to 16 bytes).
FWD_SHAPES = {90: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3),
                   (64, 32, 4, 2)],
              80: [(128, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 2)]}
# Backward (BLOCK_MAJOR, BLOCK_MINOR): a program holds a major block (k, v, dk, dv, then q, dO, dq) and
# streams small minor blocks through it. A major block of 128 takes 8 warps: on 4, the fp32 dk and dv
# alone fill half the registers and the rest spilled (48 to 472 bytes on sm_90a); 64 x 64 on 4 warps
# spilled 4 bytes with Triton 3.6. On sm_80 a major block of 64 takes 8 warps too (4 to 64 bytes spilled
# on 4), and 128 x 64 spilled 44 to 220 bytes.
BWD_SHAPES = {90: [(128, 32, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 16, 4, 2)],
              80: [(128, 32, 8, 3), (64, 16, 8, 2)]}
# Forward with the relative-position bias (HAS_REL_BIAS), a subset of FWD_SHAPES: the bias is gathered per
# score, and the software pipeliner stages those loads through shared memory as it does K and V, which
# costs registers. With it, 128 x 64 on 4 warps spilled 8 to 16 bytes on sm_90a, 128 x 32 on 4 warps 16 to
# 36 with dropout, and 128 x 128 outgrew shared memory (240 KB); on sm_80 64 x 64 spilled 4 to 8 bytes,
# 128 x 32 on 4 warps 4, and 128 x 64 on 8 warps outgrew its shared memory in fp32 (192 KB of 163 KB; the
# audit of 80ce329). The backward's candidates all held (its dq phase spends registers on the gradient's
# bucket sums, not on a wider tile).
FWD_REL_BIAS_SHAPES = {90: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)],
                       80: [(64, 32, 4, 2)]}
# With rotary positions (ROTARY), subsets found spill-free by the compile audit at ModernBERT-base's shapes (d 64,
# with and without the window): the rotated tiles, their fp32 cos and sin and, in the backward, the split dq and dk
# accumulators cost registers. The backward's 128 x 64 on 8 warps spilled 8 to 168 bytes on sm_90a, 128 x 32 on
# 8 warps 100 to 280 on sm_80; the forward's 128 x 64 on 4 warps spilled 16 bytes on sm_90a and 64 x 64 20 bytes
# on sm_80 (Triton 3.9, packed).
FWD_ROTARY_SHAPES = {90: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3), (64, 32, 4, 2)],
                     80: [(128, 64, 8, 3), (128, 32, 4, 4), (64, 32, 4, 2)]}
BWD_ROTARY_SHAPES = {90: [(128, 32, 8, 3), (64, 32, 4, 3), (64, 16, 4, 2)], 80: [(64, 16, 8, 2)]}
FWD_CONFIGS = _configs(list(dict.fromkeys(FWD_SHAPES[90] + FWD_SHAPES[80])), (128, 64, 4, 1))
BWD_CONFIGS = _configs(list(dict.fromkeys(BWD_SHAPES[90] + BWD_SHAPES[80])), (128, 64, 4, 1),
                       names=("BLOCK_MAJOR", "BLOCK_MINOR"))
PREPROCESS_BLOCK_M = 64
# Rows of a slot of the relative-position bias gradient's partial sums: the smallest query block of any
# backward config, which every config's block is a multiple of (all are powers of two).
BIAS_GRAD_SLOT_ROWS = min(shape[0] for shapes in BWD_SHAPES.values() for shape in shapes)
assert all(c.kwargs["BLOCK_MAJOR"] % BIAS_GRAD_SLOT_ROWS == 0 for c in BWD_CONFIGS)
_BIAS_GRAD_SLOT_ROWS = tl.constexpr(BIAS_GRAD_SLOT_ROWS)  # the kernels' copy (jit code reads constexpr globals)
# With dropout each four probabilities of a row share a Philox call, whose state takes registers: the blocks keep
# at most this many probabilities per thread (more spilled 20 to 88 bytes in the forward, 24 in the
# backward, on sm_90a; on sm_80, where the limits are lower, 4 to 16 bytes).
FWD_DROPOUT_PROBABILITIES_PER_THREAD = {90: 32, 80: 16}
BWD_DROPOUT_PROBABILITIES_PER_THREAD = {90: 16, 80: 4}


def _architecture() -> int:
    """90 on Hopper and later GPUs (warpgroup MMA), 80 on Ampere and Ada: the key of the lists above."""
    return 90 if triton.runtime.driver.active.get_current_target().arch >= 90 else 80


def _prune(shapes: dict, probabilities_per_thread: dict, flag_shapes: Optional[dict] = None):
    """An autotuner's early_config_prune: the configs of the GPU's architecture (from flag_shapes[flag] for the
    first constexpr flag of `flag_shapes` that is set, else from `shapes`), and with DROPOUT those whose score
    block spreads at most its `probabilities_per_thread` over the threads."""
    def prune(configs, named_args, **kwargs):
        if INTERPRETER:
            return configs  # no GPU, no architecture: the interpreter's own configs (tests may give it two)
        architecture = _architecture()
        flagged = [candidates for flag, candidates in (flag_shapes or {}).items() if kwargs[flag]]
        allowed = (flagged[0] if flagged else shapes)[architecture]
        fitting = [c for c in configs if (*c.kwargs.values(), c.num_warps, c.num_stages) in allowed]
        if kwargs["DROPOUT"]:
            fitting = [c for c in fitting if math.prod(c.kwargs.values()) // (32 * c.num_warps)
                       <= probabilities_per_thread[architecture]]
        return fitting or [c for c in configs if (*c.kwargs.values(), c.num_warps, c.num_stages) == allowed[-1]]
    return prune


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _sequence_span(CU_SEQLENS, KEY_LO, KEY_HI, b, seqlen, VARLEN: tl.constexpr, HAS_MASK: tl.constexpr):
    """(row offset of the sequence's first token in the layout, rows the sequence owns, lo, hi): rows
    outside [lo, hi) are padding."""
    if VARLEN:
        seq_start = tl.load(CU_SEQLENS + b).to(tl.int64)
        n_rows = (tl.load(CU_SEQLENS + b + 1) - tl.load(CU_SEQLENS + b)).to(tl.int32)
        lo = 0
        hi = n_rows
    else:
        seq_start = 0
        n_rows = seqlen
        if HAS_MASK:
            lo = tl.load(KEY_LO + b)
            hi = tl.load(KEY_HI + b)
        else:
            lo = 0
            hi = seqlen
    return seq_start, n_rows, lo, hi


@triton.jit
def _token_valid(KEY_MASK, stride_mb, stride_ms, b64, idx, lo, hi, HAS_MASK: tl.constexpr):
    """Which positions idx of sequence b64 hold tokens. One mask serves keys and queries (self-attention)."""
    valid = (idx >= lo) & (idx < hi)
    if HAS_MASK:
        valid = valid & (tl.load(KEY_MASK + b64 * stride_mb + idx * stride_ms, mask=valid, other=0) != 0)
    return valid


@triton.jit
def _dropout_keep(seed, b, h, rows, first_col, dropout_p, BLOCK_N: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """Keep-mask of the probabilities of head h of sequence b at rows (queries, [BLOCK_M]) and the BLOCK_N keys
    from first_col (a multiple of 4): [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] with KEYS_FIRST. One Philox call
    per four consecutive keys of a row, counted (col // 4, row, h, b), each of its four outputs deciding one key
    (not a call per score with three outputs thrown away: numerics.keep_mask_rows says why)."""
    groups = first_col // 4 + tl.arange(0, BLOCK_N // 4)
    c0, c1 = tl.broadcast(groups[None, :], rows[:, None])  # [BLOCK_M, BLOCK_N // 4]
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, h, b)
    r = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (rows.shape[0], BLOCK_N))
    keep = tl.uint_to_uniform_float(r) >= dropout_p
    if KEYS_FIRST:
        # drawn in the queries' orientation and transposed (the booleans): drawing the transposed tile directly
        # needs a permute of the four outputs, which spilled 8 to 36 bytes in the dk/dv phase with a relative bias
        keep = tl.trans(keep)
    return keep


@triton.jit
def _distance_index(queries, keys, max_distance):
    """Index of the key-minus-query distances into the [2D + 1] tables: clamp(keys - queries, -D, D) + D,
    in the broadcast shape of queries and keys (either orientation)."""
    return tl.minimum(tl.maximum(keys - queries, -max_distance), max_distance) + max_distance


@triton.jit
def _add_bucket_sums(sums, ds, bucket, NUM_BUCKETS_PADDED: tl.constexpr):
    """sums [NUM_BUCKETS_PADDED] plus, for each bucket n, the sum of the ds tile over its entries whose
    bucket (a tile of bucket numbers) is n. Only the buckets from the tile's least to its greatest are
    visited: one in a tile whose distances are all at the clamp (most tiles of a long sequence)."""
    slots = tl.arange(0, NUM_BUCKETS_PADDED)
    for n in range(tl.min(bucket), tl.max(bucket) + 1):
        sums += tl.where(slots == n, tl.sum(tl.where(bucket == n, ds, 0.0)), 0.0)
    return sums


@triton.jit
def _block_range(block_start, BLOCK: tl.constexpr, lo, hi, window, INNER: tl.constexpr, WINDOW: tl.constexpr):
    """[start, end) of the inner loop (blocks of INNER positions, start a multiple of INNER) of the block of
    BLOCK positions at block_start: the positions [lo, hi) that can hold tokens, and with WINDOW only those
    within `window` of the block's (the band is symmetric, so one range serves keys of a query block and
    queries of a key block). A block without any position in [lo, hi) gets an empty range."""
    block_live = (block_start < hi) & (block_start + BLOCK > lo)
    if WINDOW:
        first = tl.maximum(lo, block_start - window)
        last = tl.minimum(hi, block_start + BLOCK + window)
    else:
        first = lo
        last = hi
    start = (first // INNER) * INNER
    return start, tl.where(block_live, last, start)


@triton.jit
def _in_window(rows, cols, window):
    """|rows - cols| <= window, in the broadcast shape of rows and cols (either orientation)."""
    return tl.abs(rows - cols) <= window


@triton.jit
def _rotary_angles(positions, inv_freq, TRANSPOSED: tl.constexpr):
    """fp32 angles positions x inv_freq: [n, d/2], or [d/2, n] TRANSPOSED."""
    if TRANSPOSED:
        return positions[None, :].to(tl.float32) * inv_freq[:, None]
    else:
        return positions[:, None].to(tl.float32) * inv_freq[None, :]


@triton.jit
def _load_rotated(ptr, positions, valid, stride_pos, stride_dim, inv_freq, HALF: tl.constexpr,
                  TRANSPOSED: tl.constexpr):
    """The rows `positions` of a head (ptr at its position 0), rotated at their positions, as its two halves
    (x1 cos - x2 sin, x2 cos + x1 sin) in the input dtype: [n, HALF] each, or [HALF, n] TRANSPOSED. Rows
    where `valid` is false load as zeros."""
    half = tl.arange(0, HALF)
    if TRANSPOSED:
        offsets = positions[None, :] * stride_pos + half[:, None] * stride_dim
        mask = valid[None, :]
    else:
        offsets = positions[:, None] * stride_pos + half[None, :] * stride_dim
        mask = valid[:, None]
    x1 = tl.load(ptr + offsets, mask=mask, other=0.0)
    x2 = tl.load(ptr + offsets + HALF * stride_dim, mask=mask, other=0.0)
    angles = _rotary_angles(positions, inv_freq, TRANSPOSED)
    cos = tl.cos(angles)
    sin = tl.sin(angles)
    x1f = cast(x1, tl.float32)
    x2f = cast(x2, tl.float32)
    return cast(x1f * cos - x2f * sin, x1.dtype), cast(x2f * cos + x1f * sin, x1.dtype)


@triton.jit
def _store_rotated_back(ptr, positions, valid, stride_pos, stride_dim, g1, g2, inv_freq, HALF: tl.constexpr):
    """Store the gradient (g1, g2) [n, HALF] fp32 of rotated rows as the gradient of the unrotated rows: the
    transpose rotation (g1 cos + g2 sin, g2 cos - g1 sin), in ptr's dtype."""
    angles = _rotary_angles(positions, inv_freq, False)
    cos = tl.cos(angles)
    sin = tl.sin(angles)
    offsets = positions[:, None] * stride_pos + tl.arange(0, HALF)[None, :] * stride_dim
    tl.store(ptr + offsets, cast(g1 * cos + g2 * sin, ptr.dtype.element_ty), mask=valid[:, None])
    tl.store(ptr + offsets + HALF * stride_dim, cast(g2 * cos - g1 * sin, ptr.dtype.element_ty),
             mask=valid[:, None])


@triton.autotune(configs=FWD_CONFIGS, key=AUTOTUNE_KEY,
                 prune_configs_by={"early_config_prune": _prune(FWD_SHAPES, FWD_DROPOUT_PROBABILITIES_PER_THREAD,
                                                                 {"HAS_REL_BIAS": FWD_REL_BIAS_SHAPES,
                                                                  "ROTARY": FWD_ROTARY_SHAPES})})
@triton.jit
def _attention_fwd_kernel(
    Q,  # [B, heads, S, d] (VARLEN: [T, heads, d]), strides (stride_qb, stride_qh, stride_qs, stride_qd)
    K,  # like Q
    V,  # like Q
    Out,  # like Q, Q's dtype
    LSE,  # [B, heads, S] fp32 (VARLEN: [heads, T]): each row's base-2 log-sum-exp, +inf for padded rows (STORE_LSE)
    KEY_MASK,  # [B, S] uint8, 1 = token (HAS_MASK)
    KEY_LO,  # [B] int32: first position of the mask holding a token (HAS_MASK)
    KEY_HI,  # [B] int32: last such position + 1 (HAS_MASK)
    CU_SEQLENS,  # [B + 1] int32 token offsets of the sequences (VARLEN)
    SEED,  # [1] int64 Philox seed (DROPOUT)
    REL_BIAS,  # [heads, 2D + 1] fp32, contiguous: log2(e) * the bias of distance d at d + D (HAS_REL_BIAS)
    INV_FREQ,  # [d/2] fp32: the rotary inverse frequencies base ** (-2i / d) (ROTARY)
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_mb, stride_ms,
    seqlen,  # S (VARLEN: max_seqlen)
    seqlen_bucket,  # next power of two of seqlen: only an autotuning key
    scale_log2,  # scale * log2(e)
    dropout_p, keep_scale,  # keep_scale = 1 / (1 - dropout_p)
    max_distance,  # D of the relative-position tables (HAS_REL_BIAS)
    window,  # keys with |i - j| <= window (WINDOW)
    HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" or "tf32" (kernels/numerics.py dot_precision)
    HAS_REL_BIAS: tl.constexpr, ROTARY: tl.constexpr, WINDOW: tl.constexpr,
    STORE_LSE: tl.constexpr,  # write LSE: a backward will read it (LSE is None at inference)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    h64 = h.to(tl.int64)
    b64 = b.to(tl.int64)
    seq_start, n_rows, lo, hi = _sequence_span(CU_SEQLENS, KEY_LO, KEY_HI, b, seqlen, VARLEN, HAS_MASK)
    Q += b64 * stride_qb + h64 * stride_qh + seq_start * stride_qs
    K += b64 * stride_kb + h64 * stride_kh + seq_start * stride_ks
    V += b64 * stride_vb + h64 * stride_vh + seq_start * stride_vs
    Out += b64 * stride_ob + h64 * stride_oh + seq_start * stride_os
    REL_BIAS += h64 * (2 * max_distance + 1)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    in_rows = rows < n_rows
    row_valid = _token_valid(KEY_MASK, stride_mb, stride_ms, b64, rows, lo, hi, HAS_MASK)
    if ROTARY:
        inv_freq = tl.load(INV_FREQ + tl.arange(0, HEAD_DIM // 2))
        q1, q2 = _load_rotated(Q, rows, in_rows, stride_qs, stride_qd, inv_freq, HEAD_DIM // 2, False)
    else:
        q = tl.load(Q + rows[:, None] * stride_qs + dims[None, :] * stride_qd, mask=in_rows[:, None], other=0.0)
    if DROPOUT:
        seed = tl.load(SEED)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # A query block with no row in [lo, hi) holds only padding: it runs no iteration and writes zeros.
    n_start, n_end = _block_range(pid_m * BLOCK_M, BLOCK_M, lo, hi, window, BLOCK_N, WINDOW)
    offs_n = tl.arange(0, BLOCK_N)
    kt_ptrs = K + offs_n[None, :] * stride_ks + dims[:, None] * stride_kd  # block at key 0; the loop shifts it
    v_ptrs = V + offs_n[:, None] * stride_vs + dims[None, :] * stride_vd
    for start_n in range(n_start, n_end, BLOCK_N):
        cols = start_n + offs_n
        col_valid = _token_valid(KEY_MASK, stride_mb, stride_ms, b64, cols, lo, hi, HAS_MASK)
        in_cols = cols < hi
        if ROTARY:
            kt1, kt2 = _load_rotated(K, cols, in_cols, stride_ks, stride_kd, inv_freq, HEAD_DIM // 2, True)
            s = dot(q2, kt2, dot(q1, kt1, None, DOT_PRECISION), DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        else:
            kt = tl.load(kt_ptrs + start_n * stride_ks, mask=in_cols[None, :], other=0.0)
            s = dot(q, kt, None, DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if HAS_REL_BIAS:
            s += tl.load(REL_BIAS + _distance_index(rows[:, None], cols[None, :], max_distance))
        if WINDOW:
            s = tl.where(col_valid[None, :] & _in_window(rows[:, None], cols[None, :], window), s, float("-inf"))
        else:
            s = tl.where(col_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row whose keys so far are all masked has m = -inf; exponentiating against 0 instead keeps
        # its p and alpha at exactly 0 rather than NaN from (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            # the normaliser l sums the probabilities before dropout; only the values are dropped
            p = tl.where(_dropout_keep(seed, b, h, rows, start_n, dropout_p, BLOCK_N, False), p, 0.0)
        v = tl.load(v_ptrs + start_n * stride_vs, mask=in_cols[:, None], other=0.0)
        acc = dot_accumulate(cast(p, v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new

    # Every token row sees at least itself, so l > 0 on valid rows; padded rows get zeros.
    l_safe = tl.where(row_valid, l_i, 1.0)
    out = tl.where(row_valid[:, None], acc * (keep_scale / l_safe)[:, None], 0.0)
    tl.store(Out + rows[:, None] * stride_os + dims[None, :] * stride_od, cast(out, Out.dtype.element_ty),
             mask=in_rows[:, None])
    if STORE_LSE:
        lse = tl.where(row_valid, m_i + tl.math.log2(l_safe), float("inf"))
        tl.store(LSE + b64 * stride_lb + h64 * stride_lh + seq_start + rows, lse, mask=in_rows)


@triton.jit
def _attention_bwd_preprocess_kernel(
    Out,  # [B, heads, S, d] (VARLEN: [T, heads, d]), the forward's output
    DO,  # like Out: the output's gradient
    DELTA,  # [B, heads, S] fp32 (VARLEN: [heads, T]), laid out like the forward's LSE
    CU_SEQLENS,  # [B + 1] int32 (VARLEN)
    stride_ob, stride_oh, stride_os, stride_od,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_lb, stride_lh,
    seqlen,
    HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # delta_i = sum_j P~_ij dP~_ij = dO_i . O_i (P~ the dropped probabilities): the row term of dS.
    pid_m = tl.program_id(0)
    h64 = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    seq_start, n_rows, _, _ = _sequence_span(CU_SEQLENS, CU_SEQLENS, CU_SEQLENS, b, seqlen, VARLEN, False)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    in_rows = rows < n_rows
    out_ptrs = Out + b64 * stride_ob + h64 * stride_oh + (seq_start + rows[:, None]) * stride_os
    do_ptrs = DO + b64 * stride_dob + h64 * stride_doh + (seq_start + rows[:, None]) * stride_dos
    o = cast(tl.load(out_ptrs + dims[None, :] * stride_od, mask=in_rows[:, None], other=0.0), tl.float32)
    do = cast(tl.load(do_ptrs + dims[None, :] * stride_dod, mask=in_rows[:, None], other=0.0), tl.float32)
    tl.store(DELTA + b64 * stride_lb + h64 * stride_lh + seq_start + rows, tl.sum(o * do, 1), mask=in_rows)


# Backward math, per head, with s = scale * q k^T, P = softmax(s) (recomputed as exp2(s*log2e - lse)),
# Z the dropout keep-mask, P~ = P * Z / (1 - p) and O = P~ V:
#     dV = P~^T dO
#     dP = (dO V^T) * Z / (1 - p)                        (gradient w.r.t. P through the dropout)
#     dS = P * (dP - delta),  delta_i = sum_j P_ij dP_ij = dO_i . O_i
#     dQ = scale * dS K,      dK = scale * dS^T Q
#     d relative_bias[n, h] = sum of dS_ij over the scores (i, j) of head h with bucket(j - i) = n
# (s includes the bias, which enters it with weight 1). Masked keys have P = 0 (so dS = 0); padded query
# rows have lse = +inf (so P = 0).

@triton.autotune(configs=BWD_CONFIGS, key=AUTOTUNE_KEY,
                 prune_configs_by={"early_config_prune": _prune(BWD_SHAPES, BWD_DROPOUT_PROBABILITIES_PER_THREAD,
                                                                 {"ROTARY": BWD_ROTARY_SHAPES})})
@triton.jit
def _attention_bwd_kernel(
    Q, K, V,  # [B, heads, S, d] (VARLEN: [T, heads, d]), any strides
    DO,  # like Q: the output's gradient
    DQ, DK, DV,  # like Q, K, V
    LSE, DELTA,  # [B, heads, S] fp32 (VARLEN: [heads, T]): the forward's log-sum-exp, the preprocess' delta
    KEY_MASK, KEY_LO, KEY_HI, CU_SEQLENS, SEED, REL_BIAS,  # as in the forward
    REL_BUCKETS,  # [2D + 1] int32: the bucket of distance d at d + D (HAS_REL_BIAS)
    INV_FREQ,  # as in the forward (ROTARY)
    DBIAS_SLOTS,  # [B, heads, ceil(S / BIAS_GRAD_SLOT_ROWS), NUM_BUCKETS_PADDED] fp32: per-slot bias grad sums
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    stride_lb, stride_lh, stride_mb, stride_ms,
    stride_gb, stride_gh, stride_gs,  # DBIAS_SLOTS' (its bucket stride is 1)
    seqlen, seqlen_bucket, scale, scale_log2, dropout_p, keep_scale, max_distance, window,
    HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" or "tf32" (kernels/numerics.py dot_precision)
    HAS_REL_BIAS: tl.constexpr, ROTARY: tl.constexpr, WINDOW: tl.constexpr,
    NUM_BUCKETS_PADDED: tl.constexpr,  # next power of two of num_buckets (HAS_REL_BIAS)
    BLOCK_MAJOR: tl.constexpr,  # the keys of the dk/dv phase and the queries of the dq phase
    BLOCK_MINOR: tl.constexpr,  # the blocks each phase streams through: queries, then keys
):
    # Program `pid` owns key block pid (dk, dv: it loops over query blocks) and then query block pid
    # (dq: it loops over key blocks). Every gradient row has one owner, so there are no atomics.
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    h64 = h.to(tl.int64)
    b64 = b.to(tl.int64)
    seq_start, n_rows, lo, hi = _sequence_span(CU_SEQLENS, KEY_LO, KEY_HI, b, seqlen, VARLEN, HAS_MASK)
    Q += b64 * stride_qb + h64 * stride_qh + seq_start * stride_qs
    K += b64 * stride_kb + h64 * stride_kh + seq_start * stride_ks
    V += b64 * stride_vb + h64 * stride_vh + seq_start * stride_vs
    DO += b64 * stride_dob + h64 * stride_doh + seq_start * stride_dos
    DQ += b64 * stride_dqb + h64 * stride_dqh + seq_start * stride_dqs
    DK += b64 * stride_dkb + h64 * stride_dkh + seq_start * stride_dks
    DV += b64 * stride_dvb + h64 * stride_dvh + seq_start * stride_dvs
    LSE += b64 * stride_lb + h64 * stride_lh + seq_start
    DELTA += b64 * stride_lb + h64 * stride_lh + seq_start
    REL_BIAS += h64 * (2 * max_distance + 1)
    dims = tl.arange(0, HEAD_DIM)
    offs_minor = tl.arange(0, BLOCK_MINOR)
    if DROPOUT:
        seed = tl.load(SEED)
    if ROTARY:
        inv_freq = tl.load(INV_FREQ + tl.arange(0, HEAD_DIM // 2))
    # Only positions in [lo, hi) (with WINDOW, in the band) can matter; a block without any token runs no
    # iteration and gets zeros. The band is symmetric: the same range for both phases.
    minor_start, minor_end = _block_range(pid * BLOCK_MAJOR, BLOCK_MAJOR, lo, hi, window, BLOCK_MINOR, WINDOW)

    # dk, dv of key block pid, on transposed scores s^T [BLOCK_MAJOR keys, BLOCK_MINOR queries].
    keys = pid * BLOCK_MAJOR + tl.arange(0, BLOCK_MAJOR)
    in_keys = keys < n_rows
    key_valid = _token_valid(KEY_MASK, stride_mb, stride_ms, b64, keys, lo, hi, HAS_MASK)
    if ROTARY:
        # dk accumulates in the rotated frame, as two halves, rotated back before the store
        k1, k2 = _load_rotated(K, keys, in_keys, stride_ks, stride_kd, inv_freq, HEAD_DIM // 2, False)
        dk1 = tl.zeros([BLOCK_MAJOR, HEAD_DIM // 2], dtype=tl.float32)
        dk2 = tl.zeros([BLOCK_MAJOR, HEAD_DIM // 2], dtype=tl.float32)
    else:
        k = tl.load(K + keys[:, None] * stride_ks + dims[None, :] * stride_kd, mask=in_keys[:, None], other=0.0)
        dk = tl.zeros([BLOCK_MAJOR, HEAD_DIM], dtype=tl.float32)
    v = tl.load(V + keys[:, None] * stride_vs + dims[None, :] * stride_vd, mask=in_keys[:, None], other=0.0)
    dv = tl.zeros([BLOCK_MAJOR, HEAD_DIM], dtype=tl.float32)
    qt_ptrs = Q + offs_minor[None, :] * stride_qs + dims[:, None] * stride_qd  # block at query 0; shifted below
    do_ptrs = DO + offs_minor[:, None] * stride_dos + dims[None, :] * stride_dod
    for start_m in range(minor_start, minor_end, BLOCK_MINOR):
        rows = start_m + offs_minor
        in_rows = rows < hi
        if ROTARY:
            qt1, qt2 = _load_rotated(Q, rows, in_rows, stride_qs, stride_qd, inv_freq, HEAD_DIM // 2, True)
        else:
            qt = tl.load(qt_ptrs + start_m * stride_qs, mask=in_rows[None, :], other=0.0)
        do = tl.load(do_ptrs + start_m * stride_dos, mask=in_rows[:, None], other=0.0)
        lse = tl.load(LSE + rows, mask=in_rows, other=float("inf"))
        delta = tl.load(DELTA + rows, mask=in_rows, other=0.0)
        if ROTARY:
            st = dot(k2, qt2, dot(k1, qt1, None, DOT_PRECISION), DOT_PRECISION) * scale_log2
        else:
            st = dot(k, qt, None, DOT_PRECISION) * scale_log2
        if HAS_REL_BIAS:
            st += tl.load(REL_BIAS + _distance_index(rows[None, :], keys[:, None], max_distance))
        if WINDOW:
            pt = tl.where(key_valid[:, None] & _in_window(rows[None, :], keys[:, None], window),
                          tl.math.exp2(st - lse[None, :]), 0.0)
        else:
            pt = tl.where(key_valid[:, None], tl.math.exp2(st - lse[None, :]), 0.0)
        dpt = dot(v, tl.trans(do), None, DOT_PRECISION)  # (dO V^T)^T
        if DROPOUT:
            keep = _dropout_keep(seed, b, h, rows, pid * BLOCK_MAJOR, dropout_p, BLOCK_MAJOR, True)
            pt_dropped = tl.where(keep, pt * keep_scale, 0.0)
            dpt = tl.where(keep, dpt * keep_scale, 0.0)
        else:
            pt_dropped = pt
        dv = dot_accumulate(cast(pt_dropped, do.dtype), do, dv, DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        if ROTARY:
            dk1 = dot_accumulate(cast(dst, qt1.dtype), tl.trans(qt1), dk1, DOT_PRECISION)
            dk2 = dot_accumulate(cast(dst, qt2.dtype), tl.trans(qt2), dk2, DOT_PRECISION)
        else:
            dk = dot_accumulate(cast(dst, qt.dtype), tl.trans(qt), dk, DOT_PRECISION)
    if ROTARY:
        _store_rotated_back(DK, keys, in_keys, stride_dks, stride_dkd, dk1 * scale, dk2 * scale, inv_freq,
                            HEAD_DIM // 2)
    else:
        dk *= scale
        tl.store(DK + keys[:, None] * stride_dks + dims[None, :] * stride_dkd, cast(dk, DK.dtype.element_ty),
                 mask=in_keys[:, None])
    tl.store(DV + keys[:, None] * stride_dvs + dims[None, :] * stride_dvd, cast(dv, DV.dtype.element_ty),
             mask=in_keys[:, None])

    # dq of query block pid, on scores s [BLOCK_MAJOR queries, BLOCK_MINOR keys].
    rows = pid * BLOCK_MAJOR + tl.arange(0, BLOCK_MAJOR)
    in_rows = rows < n_rows
    if ROTARY:
        q1, q2 = _load_rotated(Q, rows, in_rows, stride_qs, stride_qd, inv_freq, HEAD_DIM // 2, False)
        dq1 = tl.zeros([BLOCK_MAJOR, HEAD_DIM // 2], dtype=tl.float32)
        dq2 = tl.zeros([BLOCK_MAJOR, HEAD_DIM // 2], dtype=tl.float32)
    else:
        q = tl.load(Q + rows[:, None] * stride_qs + dims[None, :] * stride_qd, mask=in_rows[:, None], other=0.0)
        dq = tl.zeros([BLOCK_MAJOR, HEAD_DIM], dtype=tl.float32)
    do = tl.load(DO + rows[:, None] * stride_dos + dims[None, :] * stride_dod, mask=in_rows[:, None], other=0.0)
    lse = tl.load(LSE + rows, mask=in_rows, other=float("inf"))
    delta = tl.load(DELTA + rows, mask=in_rows, other=0.0)
    dbias = tl.zeros([NUM_BUCKETS_PADDED], dtype=tl.float32)  # this program's sums of dS per bucket
    kt_ptrs = K + offs_minor[None, :] * stride_ks + dims[:, None] * stride_kd  # block at key 0; shifted below
    vt_ptrs = V + offs_minor[None, :] * stride_vs + dims[:, None] * stride_vd
    for start_n in range(minor_start, minor_end, BLOCK_MINOR):
        cols = start_n + offs_minor
        in_cols = cols < hi
        col_valid = _token_valid(KEY_MASK, stride_mb, stride_ms, b64, cols, lo, hi, HAS_MASK)
        if ROTARY:
            kt1, kt2 = _load_rotated(K, cols, in_cols, stride_ks, stride_kd, inv_freq, HEAD_DIM // 2, True)
        else:
            kt = tl.load(kt_ptrs + start_n * stride_ks, mask=in_cols[None, :], other=0.0)
        vt = tl.load(vt_ptrs + start_n * stride_vs, mask=in_cols[None, :], other=0.0)
        if ROTARY:
            s = dot(q2, kt2, dot(q1, kt1, None, DOT_PRECISION), DOT_PRECISION) * scale_log2
        else:
            s = dot(q, kt, None, DOT_PRECISION) * scale_log2
        if HAS_REL_BIAS:
            distance = _distance_index(rows[:, None], cols[None, :], max_distance)
            s += tl.load(REL_BIAS + distance)
        if WINDOW:
            p = tl.where(col_valid[None, :] & _in_window(rows[:, None], cols[None, :], window),
                         tl.math.exp2(s - lse[:, None]), 0.0)
        else:
            p = tl.where(col_valid[None, :], tl.math.exp2(s - lse[:, None]), 0.0)
        dp = dot(do, vt, None, DOT_PRECISION)
        if DROPOUT:
            keep = _dropout_keep(seed, b, h, rows, start_n, dropout_p, BLOCK_MINOR, False)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if ROTARY:
            dq1 = dot_accumulate(cast(ds, kt1.dtype), tl.trans(kt1), dq1, DOT_PRECISION)
            dq2 = dot_accumulate(cast(ds, kt2.dtype), tl.trans(kt2), dq2, DOT_PRECISION)
        else:
            dq = dot_accumulate(cast(ds, kt.dtype), tl.trans(kt), dq, DOT_PRECISION)
        if HAS_REL_BIAS:
            dbias = _add_bucket_sums(dbias, ds, tl.load(REL_BUCKETS + distance), NUM_BUCKETS_PADDED)
    if ROTARY:
        _store_rotated_back(DQ, rows, in_rows, stride_dqs, stride_dqd, dq1 * scale, dq2 * scale, inv_freq,
                            HEAD_DIM // 2)
    else:
        dq *= scale
        tl.store(DQ + rows[:, None] * stride_dqs + dims[None, :] * stride_dqd, cast(dq, DQ.dtype.element_ty),
                 mask=in_rows[:, None])
    if HAS_REL_BIAS:
        # this program's block spans BLOCK_MAJOR / BIAS_GRAD_SLOT_ROWS slots: its sums go to the first,
        # zeros to the others
        slot_offs = tl.arange(0, BLOCK_MAJOR // _BIAS_GRAD_SLOT_ROWS)
        slots = pid * (BLOCK_MAJOR // _BIAS_GRAD_SLOT_ROWS) + slot_offs
        buckets = tl.arange(0, NUM_BUCKETS_PADDED)
        sums = tl.where(slot_offs[:, None] == 0, dbias[None, :], 0.0)  # [slots, NUM_BUCKETS_PADDED]
        tl.store(DBIAS_SLOTS + b64 * stride_gb + h64 * stride_gh + slots[:, None] * stride_gs + buckets[None, :],
                 sums, mask=(slots < tl.cdiv(seqlen, _BIAS_GRAD_SLOT_ROWS))[:, None])


# ----------------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, relative_bias,
                  relative_buckets, rotary_base=None, window=None) -> None:
    """Raise ValueError for what the kernels do not support, before anything is launched: the arguments'
    own rules (`_check_arguments`), then the kernels' limits (`check_limits`)."""
    _check_arguments(q, k, v, key_mask, cu_seqlens, dropout_p, relative_bias, relative_buckets, rotary_base, window)
    check_limits(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, relative_bias, relative_buckets, rotary_base,
                 window)


def _check_arguments(q, k, v, key_mask, cu_seqlens, dropout_p, relative_bias, relative_buckets, rotary_base,
                     window) -> None:
    """The rules of the arguments themselves, which fastbert.ops checks too (in the same words) before it
    chooses a path: one layout shape for q, k, v, the mask's or cu_seqlens' shape, dropout_p, the
    relative-position bias and the rotary / window arguments."""
    varlen = cu_seqlens is not None
    layout = "[T, heads, d]" if varlen else "[B, heads, S, d]"
    if q.dim() != (3 if varlen else 4) or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share one {layout} shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if varlen:
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be int32 [B+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    elif key_mask is not None and key_mask.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"attention_mask has shape {tuple(key_mask.shape)}, expected {(q.shape[0], q.shape[2])}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    check_relative_bias(relative_bias, relative_buckets, q.shape[-2] if varlen else q.shape[1])
    check_rotary_window(rotary_base, window, q.shape[-1])


def check_limits(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, relative_bias, relative_buckets,
                 rotary_base=None, window=None) -> None:
    """Raise ValueError for what the kernels do not support among arguments that keep their own rules
    (`_check_arguments`, which fastbert.ops makes itself): dtypes, one device, head dims, grid sizes,
    max_seqlen, the relative bias with rotary positions or a window, offsets past int32."""
    varlen = cu_seqlens is not None
    dtype = q.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q has dtype {dtype}; the Triton attention supports {SUPPORTED_DTYPES}")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dtype != dtype:
            if tensor.dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"{name} has dtype {tensor.dtype}; the Triton attention supports {SUPPORTED_DTYPES}")
            raise ValueError(f"{name} has dtype {tensor.dtype}, expected q's dtype {dtype}")
    device = q.device
    for name, tensor in (("k", k), ("v", v), ("attention_mask", key_mask), ("cu_seqlens", cu_seqlens),
                         ("seed", seed), ("relative_bias", relative_bias), ("relative_buckets", relative_buckets)):
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, q on {device}; all must share one device")
    head_dim = q.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim (q's last dimension) is {head_dim}; the Triton attention supports "
                         f"{SUPPORTED_HEAD_DIMS}")
    heads = q.shape[-2] if varlen else q.shape[1]
    batch = cu_seqlens.numel() - 1 if varlen else q.shape[0]
    for name, size in (("number of heads", heads), ("batch size (number of sequences)", batch)):
        if size > MAX_GRID_AXIS:
            raise ValueError(f"{name} is {size}; the Triton attention supports at most {MAX_GRID_AXIS}")
    if varlen:
        check_max_seqlen(max_seqlen, q.shape[0])
    if relative_bias is not None and (rotary_base is not None or window is not None):
        given = " and ".join(f"{name}={value!r}" for name, value in (("rotary_base", _float_or_none(rotary_base)),
                                                                      ("window", window)) if value is not None)
        raise ValueError(f"relative_bias with {given}: the Triton attention does not combine the relative-position "
                         f"bias with rotary positions or a window")
    seqlen = max_seqlen if varlen else q.shape[2]
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _check_sequence_reach(name, tensor, seqlen, varlen)
    # out is allocated [B, S, heads, d] (packed: [T, heads, d]): a sequence step of heads * d
    _check_reach("out", seqlen, heads * head_dim, seqlen * heads * head_dim + head_dim)
    if backward_follows((q, k, v, relative_bias)):
        _check_grads_reach(seqlen, heads, head_dim)  # the backward writes dq, dk, dv for any of these


def _check_grads_reach(seqlen, heads, head_dim) -> None:
    """dq, dk and dv are the column blocks of [B, S, 3, heads, d] (`_empty_qkv_grads`): a sequence step of
    3 heads * d."""
    _check_reach("dq, dk, dv", seqlen, 3 * heads * head_dim, 3 * seqlen * heads * head_dim + head_dim)


def _check_sequence_reach(name, tensor, seqlen, varlen) -> None:
    """Offsets inside one sequence are int32 in the kernels (across sequences and heads they are int64)."""
    strides = tensor.stride()
    seq_stride = abs(strides[-3 if varlen else -2])
    _check_reach(name, seqlen, seq_stride, seqlen * seq_stride + tensor.shape[-1] * abs(strides[-1]))


def _check_reach(name, seqlen, seq_stride, reach) -> None:
    if reach > INT32_MAX:
        raise ValueError(f"{name}: one sequence spans {reach} elements (sequence length {seqlen} x a stride of "
                         f"{seq_stride}); offsets within a sequence must fit int32 ({INT32_MAX})")


def _bhsd_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(batch, head, sequence, dim) strides of [B, heads, S, d], or of packed [T, heads, d] (batch 0)."""
    strides = t.stride()
    if varlen:
        return 0, strides[1], strides[0], strides[2]
    return strides


def _empty_like_qkv(q: torch.Tensor, varlen: bool) -> torch.Tensor:
    """An output of q's shape. Padded ones are laid out [B, S, heads, d] in memory, so that merging the
    heads back into [B, S, heads * d] for the output projection is a view, as for packed [T, heads, d]."""
    if varlen:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    batch, heads, seqlen, head_dim = q.shape
    return torch.empty_strided((batch, heads, seqlen, head_dim), (seqlen * heads * head_dim, head_dim,
                                                                  heads * head_dim, 1), dtype=q.dtype, device=q.device)


def _empty_qkv_grads(q: torch.Tensor, varlen: bool) -> torch.Tensor:
    """The backward's one buffer for dq, dk and dv: [B, S, 3, heads, d] (packed: [T, 3, heads, d]), that is the
    token-major [tokens, 3 H] gradient of a fused QKV projection's output, so that its backward reads it as it
    is (kernels/qkv.py) rather than gathering three tensors into it. One tensor: a custom op's outputs may not
    alias one another, so the op returns it and `qkv_grads` takes the three views."""
    if varlen:
        return q.new_empty(q.shape[0], 3, q.shape[1], q.shape[2])
    batch, heads, seqlen, head_dim = q.shape
    return q.new_empty(batch, seqlen, 3, heads, head_dim)


def qkv_grads(grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, each shaped as q ([B, heads, S, d] or packed [T, heads, d]), as views of the backward's
    buffer (`_empty_qkv_grads`)."""
    if grads.dim() == 4:  # packed [T, 3, heads, d]
        return grads.unbind(1)
    dq, dk, dv = grads.unbind(2)  # [B, S, heads, d] each
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _new_row_stats(q: torch.Tensor, varlen: bool) -> torch.Tensor:
    """fp32 per-row statistics: [B, heads, S], or [heads, T] when packed."""
    if varlen:
        return q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], dtype=torch.float32)


def _row_stats_strides(stats: torch.Tensor, varlen: bool) -> tuple[int, int]:
    strides = stats.stride()
    return (0, strides[0]) if varlen else (strides[0], strides[1])


# the uint8 mask and bounds of the last key mask (fastbert.last_mask: every layer takes its forward's one mask)
_LAST_MASK = LastMask()


def _mask_and_bounds(q, key_mask, unread):
    """The key mask as uint8 [B, S] (1 = token) and, per sequence, the first token position and the last
    + 1 as int32 [B] (S and 0 for a fully padded sequence), from torch ops on the device: no host sync.
    Without a mask, placeholders from `unread` (launch.placeholders of q's device), as in the helpers below."""
    if key_mask is None:
        bounds = unread[torch.int32]
        return unread[torch.uint8], bounds, bounds, 0, 0
    return _LAST_MASK.get(key_mask, None, lambda: _bounds(key_mask))


def _bounds(key_mask):
    keep = key_mask != 0  # [B, S] bool
    seqlen = keep.shape[1]
    positions = torch.arange(seqlen, device=keep.device, dtype=torch.int32)
    lo = torch.where(keep, positions, seqlen).amin(dim=1).to(torch.int32)
    hi = torch.where(keep, positions + 1, 0).amax(dim=1).to(torch.int32)
    mask = keep.view(torch.uint8)
    return mask, lo, hi, mask.stride(0), mask.stride(1)


def _bias_by_distance(relative_bias, relative_buckets, unread):
    """[heads, 2D + 1] fp32: log2(e) * relative_bias[relative_buckets[d + D], h] at [h, d + D] (the
    base-2 scores' unit), or an empty placeholder without a bias. A few KB: the kernels' one gather."""
    if relative_bias is None:
        return unread[torch.float32]
    return (relative_bias.float()[relative_buckets.long()] * LOG2E).t().contiguous()


# (device, head dim, rotary base) -> _inv_freq's tensor, made once: every attention call of a rotary model
# (forward and backward, each layer) reads the same few values, which took four torch ops a call to make
_INV_FREQ: dict = {}
INV_FREQ_KEPT = 64  # entries before the cache starts again (one per head dim and base a process uses)


def _inv_freq(q, rotary_base, unread):
    """[d/2] fp32 base ** (-2i / d) with transformers' formula (ModernBertRotaryEmbedding's, in fp32), so the
    kernels' angles position * inv_freq are its own bitwise; an empty placeholder without rotary positions.
    Kept per device, head dim and base, never an op's output (as `placeholders`)."""
    if rotary_base is None:
        return unread[torch.float32]
    head_dim = q.shape[-1]
    key = (q.device, head_dim, rotary_base)
    found = _INV_FREQ.get(key)
    if found is None:
        if len(_INV_FREQ) >= INV_FREQ_KEPT:
            _INV_FREQ.clear()
        exponents = torch.arange(0, head_dim, 2, device=q.device, dtype=torch.int64).to(torch.float32) / head_dim
        found = _INV_FREQ[key] = 1.0 / (rotary_base ** exponents)
    return found


@functools.lru_cache(maxsize=4096)
def _launch_constants(seqlen, head_dim, varlen, has_mask, dropout, dropout_p, scale, precision, max_distance,
                      has_rel_bias, rotary, window):
    """What the launches of one call shape share, cached: the scalars (seqlen, its bucket, scale * log2(e),
    dropout_p, 1 / (1 - dropout_p), max_distance, the window) and the constexpr flags."""
    scalars = (seqlen, next_power_of_2(max(seqlen, 1)), scale * LOG2E, dropout_p, 1.0 / (1.0 - dropout_p),
               max_distance,
               # a window past the sequence keeps every key; clamped so that it stays an int32
               0 if window is None else min(window, seqlen))
    flags = dict(HEAD_DIM=head_dim, VARLEN=varlen, HAS_MASK=has_mask, DROPOUT=dropout, DOT_PRECISION=precision,
                 HAS_REL_BIAS=has_rel_bias, ROTARY=rotary, WINDOW=window is not None)
    return scalars, flags


def _launch_meta(q, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias, relative_buckets,
                 rotary_base, window):
    """What every kernel launch shares: (grid dims (heads, sequences), pointers (mask, its bounds,
    cu_seqlens, seed, bias by distance, rotary inverse frequencies), mask strides, scalars (_launch_constants),
    constexpr flags)."""
    varlen = cu_seqlens is not None
    if varlen:
        heads, batch, seqlen = q.shape[1], cu_seqlens.numel() - 1, max_seqlen
    else:
        batch, heads, seqlen, _ = q.shape
    unread = placeholders(q.device)
    mask, lo, hi, stride_mb, stride_ms = _mask_and_bounds(q, None if varlen else key_mask, unread)
    # the kernels read cu_seqlens[b] at offset b: a strided view (x[::2]) is copied, never read past its elements
    pointers = (mask, lo, hi, unread[torch.int32] if cu_seqlens is None else cu_seqlens.contiguous(),
                unread[torch.int64] if seed is None else seed,
                _bias_by_distance(relative_bias, relative_buckets, unread),
                _inv_freq(q, rotary_base, unread))
    scalars, flags = _launch_constants(
        seqlen, q.shape[-1], varlen, key_mask is not None and not varlen, seed is not None and dropout_p > 0.0,
        dropout_p, scale, dot_precision(q.dtype),
        0 if relative_buckets is None else (relative_buckets.numel() - 1) // 2, relative_bias is not None,
        rotary_base is not None, window)
    return (heads, batch), pointers, (stride_mb, stride_ms), scalars, flags


def _forward(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias, relative_buckets,
             rotary_base, window, store_lse):
    """`attention_fwd`'s out and lse, but lse None (neither allocated nor written) without store_lse."""
    varlen = cu_seqlens is not None
    out = _empty_like_qkv(q, varlen)
    lse = _new_row_stats(q, varlen) if store_lse else None
    if q.numel() == 0:
        return out, lse
    (heads, batch), pointers, mask_strides, scalars, flags = _launch_meta(
        q, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias, relative_buckets, rotary_base,
        window)
    seqlen = scalars[0]
    grid = lambda meta: (cdiv(seqlen, meta["BLOCK_M"]), heads, batch)  # noqa: E731
    # unstored, the log-sum-exp's pointer is an fp32 placeholder, not None: the autotuner keys on every tensor
    # argument's dtype (AUTOTUNE_KEY's comment), so inference shares the training forward's choice
    launch(_attention_fwd_kernel, grid,
        q, k, v, out, lse if store_lse else placeholders(q.device)[torch.float32], *pointers,
        *_bhsd_strides(q, varlen), *_bhsd_strides(k, varlen), *_bhsd_strides(v, varlen),
        *_bhsd_strides(out, varlen), *(_row_stats_strides(lse, varlen) if store_lse else (0, 0)), *mask_strides,
        *scalars, STORE_LSE=store_lse, **flags,
    )
    return out, lse


@fused_op("fastbert::attention_fwd")
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
                  cu_seqlens: Optional[torch.Tensor], max_seqlen: int, seed: Optional[torch.Tensor],
                  dropout_p: float, scale: float, relative_bias: Optional[torch.Tensor] = None,
                  relative_buckets: Optional[torch.Tensor] = None, rotary_base: Optional[float] = None,
                  window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded (cu_seqlens None): q, k, v [B, heads, S, d], key_mask [B, S] (nonzero = token) or None.
    Packed (cu_seqlens int32 [B+1]): q, k, v [T, heads, d], max_seqlen >= the longest sequence.
    Any strides. seed int64 [1] (dropout with probability dropout_p) or None. relative_bias float
    [num_buckets, heads] and relative_buckets int32 [2D + 1] (entries in [0, num_buckets)), or both None.
    rotary_base (RoPE's theta) or None, window (keys with |i - j| <= window) or None; not with relative_bias.

    Returns out (q's shape and dtype; padded query rows are zeros) and the fp32 base-2 log-sum-exp of
    each row ([B, heads, S], or [heads, T]) for the backward. The arguments are checked by `attention`,
    `attention_varlen` (or fastbert.ops) and, where PyTorch traces, by the fake registration.
    """
    return _forward(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias,
                    relative_buckets, rotary_base, window, True)


@attention_fwd.register_fake
def _(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias=None, relative_buckets=None,
      rotary_base=None, window=None):
    _check_inputs(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, relative_bias, relative_buckets,
                  rotary_base, window)
    varlen = cu_seqlens is not None
    return _empty_like_qkv(q, varlen), _new_row_stats(q, varlen)


@fused_op("fastbert::attention_infer")
def attention_infer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
                    cu_seqlens: Optional[torch.Tensor], max_seqlen: int, seed: Optional[torch.Tensor],
                    dropout_p: float, scale: float, relative_bias: Optional[torch.Tensor] = None,
                    relative_buckets: Optional[torch.Tensor] = None, rotary_base: Optional[float] = None,
                    window: Optional[int] = None) -> torch.Tensor:
    """`attention_fwd` where no backward follows (no input needs a gradient, or grad mode is off): out alone. Its
    kernel writes no log-sum-exp, whose buffer is never allocated: an output nothing would read. Its own op, not a
    flag, as mlm_loss_inference: a custom op's outputs are fixed."""
    return _forward(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias,
                    relative_buckets, rotary_base, window, False)[0]


@attention_infer.register_fake
def _(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias=None, relative_buckets=None,
      rotary_base=None, window=None):
    _check_inputs(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, relative_bias, relative_buckets,
                  rotary_base, window)
    return _empty_like_qkv(q, cu_seqlens is not None)


register_no_backward(attention_infer, "log-sum-exp", "attention_fwd, or attention / attention_varlen")


@fused_op("fastbert::attention_bwd")
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, key_mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                  max_seqlen: int, seed: Optional[torch.Tensor], dropout_p: float, scale: float,
                  relative_bias: Optional[torch.Tensor] = None, relative_buckets: Optional[torch.Tensor] = None,
                  rotary_base: Optional[float] = None, window: Optional[int] = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (dqkv, d relative_bias) of `attention_fwd` from its inputs, output, log-sum-exp and seed (the
    same dropout mask is regenerated): dqkv holds dq, dk and dv ([B, S, 3, heads, d], packed [T, 3, heads, d];
    `qkv_grads` views them). dout has out's shape, any strides. d relative_bias has relative_bias' shape and
    dtype (an empty tensor without a bias: a custom op cannot return None). Deterministic: no atomics."""
    varlen = cu_seqlens is not None
    if dout.shape != out.shape:
        raise ValueError(f"dout has shape {tuple(dout.shape)}, expected out's shape {tuple(out.shape)}")
    seqlen = max_seqlen if varlen else q.shape[2]
    _check_sequence_reach("dout", dout, seqlen, varlen)
    _check_grads_reach(seqlen, q.shape[-2] if varlen else q.shape[1], q.shape[-1])
    # k and v have q's shape: their gradients are the buffer's three column blocks, laid out as one another
    grads = _empty_qkv_grads(q, varlen)
    dq, dk, dv = qkv_grads(grads)
    if q.numel() == 0:
        return grads, _bias_grad_without_kernel(q, relative_bias)
    (heads, batch), pointers, mask_strides, scalars, flags = _launch_meta(
        q, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias, relative_buckets, rotary_base,
        window)
    seqlen, seqlen_bucket, scale_log2, dropout_p, keep_scale, max_distance, window_size = scalars
    num_buckets = 0 if relative_bias is None else relative_bias.shape[0]
    num_buckets_padded = next_power_of_2(max(num_buckets, 1))
    unread = placeholders(q.device)
    # [B, heads, slots, buckets]: every entry is written by the kernel (see the header)
    dbias_slots = (q.new_empty(batch, heads, cdiv(seqlen, BIAS_GRAD_SLOT_ROWS), num_buckets_padded,
                               dtype=torch.float32)
                   if relative_bias is not None else unread[torch.float32])
    slot_strides = dbias_slots.stride()[:3] if relative_bias is not None else (0, 0, 0)
    delta = _new_row_stats(q, varlen)
    stats_strides = _row_stats_strides(lse, varlen)
    out_strides, dout_strides = _bhsd_strides(out, varlen), _bhsd_strides(dout, varlen)
    launch(_attention_bwd_preprocess_kernel, (cdiv(seqlen, PREPROCESS_BLOCK_M), heads, batch),
        out, dout, delta, pointers[3], *out_strides, *dout_strides,
        *stats_strides, seqlen, HEAD_DIM=flags["HEAD_DIM"], VARLEN=varlen, BLOCK_M=PREPROCESS_BLOCK_M,
    )
    # dq, dk and dv are laid out as one another
    grad_strides = _bhsd_strides(dq, varlen)
    launch(_attention_bwd_kernel, lambda meta: (cdiv(seqlen, meta["BLOCK_MAJOR"]), heads, batch),
        q, k, v, dout, dq, dk, dv, lse, delta, *pointers[:-1],
        unread[torch.int32] if relative_buckets is None else relative_buckets, pointers[-1],
        dbias_slots,
        *_bhsd_strides(q, varlen), *_bhsd_strides(k, varlen), *_bhsd_strides(v, varlen), *dout_strides,
        *grad_strides, *grad_strides, *grad_strides,
        *stats_strides, *mask_strides, *slot_strides, seqlen, seqlen_bucket, scale,
        scale_log2, dropout_p, keep_scale, max_distance, window_size,
        **flags, NUM_BUCKETS_PADDED=num_buckets_padded,
    )
    if relative_bias is None:
        return grads, _bias_grad_without_kernel(q, None)
    # the slots' sums in one fixed-order reduction: [heads, buckets] -> [num_buckets, heads]
    dbias = dbias_slots.sum(dim=(0, 2))[:, :num_buckets].t().to(relative_bias.dtype).contiguous()
    return grads, dbias


def _bias_grad_without_kernel(q, relative_bias):
    """d relative_bias where the kernel computes none: zeros of relative_bias' shape and dtype (no scores,
    no gradient), or an empty tensor when there is no bias (a custom op returns tensors, never None)."""
    if relative_bias is None:
        return q.new_empty(0)
    return torch.zeros_like(relative_bias, memory_format=torch.contiguous_format)


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias=None,
      relative_buckets=None, rotary_base=None, window=None):
    return _empty_qkv_grads(q, cu_seqlens is not None), _bias_grad_without_kernel(q, relative_bias)


def _setup_context(ctx, inputs, output):
    (q, k, v, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias, relative_buckets, rotary_base,
     window) = inputs
    out, lse = output
    # q and k unrotated: the backward rotates its tiles again (no rotated copy is kept)
    ctx.save_for_backward(q, k, v, out, lse, key_mask, cu_seqlens, seed, relative_bias, relative_buckets)
    ctx.max_seqlen, ctx.dropout_p, ctx.scale = max_seqlen, dropout_p, scale
    ctx.rotary_base, ctx.window = rotary_base, window
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # out's gradient starts every backward; lse's stays None, not zeros


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, key_mask, cu_seqlens, seed, relative_bias, relative_buckets = ctx.saved_tensors
    grads, dbias = attention_bwd(dout, q, k, v, out, lse, key_mask, cu_seqlens, ctx.max_seqlen, seed, ctx.dropout_p,
                                 ctx.scale, relative_bias, relative_buckets, ctx.rotary_base, ctx.window)
    return (*qkv_grads(grads), None, None, None, None, None, None, None if relative_bias is None else dbias, None, None,
            None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------
# Public entry points (the signatures `fastbert.ops` calls)
# ----------------------------------------------------------------------------------------------------

def attention(q, k, v, attention_mask=None, dropout_p=0.0, scale=None, training=True, relative_bias=None,
              relative_buckets=None, rotary_base=None, window=None):
    """softmax(q k^T * scale + key padding mask + relative-position bias) v with dropout on the
    probabilities, bidirectional.

    q, k, v [B, heads, S, d] fp32/fp16/bf16 with d in SUPPORTED_HEAD_DIMS, any strides;
    attention_mask [B, S] (bool or int; 1 = token, 0 = padding) or None; scale None means d ** -0.5.
    relative_bias [num_buckets, heads] (any float dtype; it gets its gradient, in its dtype) with
    relative_buckets int32 [2D + 1] (fastbert.ops.relative_position_buckets), or both None: score (i, j)
    of head h gets relative_bias[relative_buckets[clamp(j - i, -D, D) + D], h] (MPNet's bias).
    rotary_base (RoPE's theta, or None): q and k rotated at their row index (rotate_half layout, as
    transformers' apply_rotary_pos_emb); window (or None): only keys with |i - j| <= window (ModernBERT's
    local layers). Neither combines with relative_bias.
    Returns [B, heads, S, d] in q's dtype: padded query rows are zeros (a fully padded sequence gives
    zeros, never NaN) with zero gradients. Raises ValueError for unsupported input.
    """
    rotary_base = _float_or_none(rotary_base)
    _check_inputs(q, k, v, attention_mask, None, q.shape[2] if q.dim() == 4 else 0, None, dropout_p, relative_bias,
                  relative_buckets, rotary_base, window)
    return attention_unchecked(q, k, v, attention_mask, dropout_p, scale, training, relative_bias, relative_buckets,
                               rotary_base, window)


def attention_unchecked(q, k, v, attention_mask, dropout_p, scale, training, relative_bias, relative_buckets,
                        rotary_base, window):
    """`attention` after its checks, which the caller has made (fastbert.ops: its own, then `check_limits`)."""
    dropout_p, seed = dropout_seed(dropout_p, training, q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _attend(q, k, v, attention_mask, None, q.shape[2], seed, dropout_p, scale, relative_bias, relative_buckets,
                   _float_or_none(rotary_base), window)


def attention_varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, scale=None, training=True,
                     relative_bias=None, relative_buckets=None, rotary_base=None, window=None):
    """Attention over packed sequences: each token attends to the tokens of its own sequence only.

    q, k, v [T, heads, d]; cu_seqlens int32 [B+1] (0, ..., T); max_seqlen an int >= the longest sequence
    (a smaller value leaves the rows past it unwritten). Dropout draws the same mask as `attention` on
    the padded layout of the same batch. relative_bias, relative_buckets, rotary_base, window as in
    `attention`, with the positions inside each sequence (they restart at every sequence). Returns
    [T, heads, d] in q's dtype.
    """
    rotary_base = _float_or_none(rotary_base)
    _check_inputs(q, k, v, None, cu_seqlens, max_seqlen, None, dropout_p, relative_bias, relative_buckets,
                  rotary_base, window)
    return attention_varlen_unchecked(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale, training, relative_bias,
                                      relative_buckets, rotary_base, window)


def attention_varlen_unchecked(q, k, v, cu_seqlens, max_seqlen, dropout_p, scale, training, relative_bias,
                               relative_buckets, rotary_base, window):
    """`attention_varlen` after its checks, which the caller has made (fastbert.ops: its own, then
    `check_limits`)."""
    dropout_p, seed = dropout_seed(dropout_p, training, q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _attend(q, k, v, None, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias, relative_buckets,
                   _float_or_none(rotary_base), window)


def _attend(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias, relative_buckets,
            rotary_base, window):
    """out of the forward op for attention_fwd's arguments: `attention_infer`'s where no backward follows, else
    `attention_fwd`'s, whose lse the backward reads."""
    op = attention_fwd if backward_follows((q, k, v, relative_bias)) else attention_infer
    out = op(q, k, v, key_mask, cu_seqlens, max_seqlen, seed, dropout_p, scale, relative_bias, relative_buckets,
             rotary_base, window)
    return out[0] if op is attention_fwd else out


def _float_or_none(rotary_base):
    """The custom op's schema takes a float: an int theta (ModernBERT's configs give 160000) converted; a bool
    or a non-number is left for the checks to name."""
    if isinstance(rotary_base, int) and not isinstance(rotary_base, bool):
        return float(rotary_base)
    return rotary_base
