# Matmul with a fused epilogue: out = act(x @ weight.T + bias), for the two projections whose
# epilogue is worth fusing.
#
#   - the FFN up-projection (kernels/bias_gelu.py): bias + GELU in the epilogue, optionally also
#     storing the pre-activation x @ weight.T + bias that the backward needs;
#   - the GeGLU up-projection (GATED, ModernBERT): weight [2N, K] holds the input rows 0..N-1 and the gate
#     rows N..2N-1; a program computes the same [BLOCK_M, BLOCK_N] output tile for both halves, two
#     accumulators over the one x tile it loads (weight rows n and N + n: the two halves of a tile sit
#     N rows apart in the weight), and writes out = gelu(a) * b [M, N], and when asked the pre-activation
#     h = [a, b] [M, 2N] (a in columns 0..N-1, b in N..2N-1, as transformers' chunk(2) reads them);
#   - the QKV projection (kernels/qkv.py): the bias, then a store that scatters the [M, 3H] tile
#     straight into the attention layout [3, B, heads, S, d], so no transpose/contiguous follows.
#
# Algorithm: the tiled matmul of Triton's matmul tutorial: one program per [BLOCK_M, BLOCK_N] output
# tile, tiles visited in GROUP_M-row super-groups so neighbouring programs share weight tiles in L2,
# fp32 accumulation over BLOCK_K slices of K (masked on the last slice), the epilogue in fp32, one
# rounding to the output dtype. fp32 operands multiply as PyTorch's fp32 matmuls do at the time of the
# call (kernels/numerics.py `dot_precision`): TF32 on tensor cores when PyTorch allows it, else exact
# IEEE fp32 (PyTorch's default, and the tests'), which runs without tensor cores and is several times slower.
#
# The GELU and its derivative live here, as the epilogue's activations; the elementwise kernels of
# kernels/bias_gelu.py use the same two functions, so both forms compute identical GELUs.
# `row_groups`, the row split of the deterministic bias-gradient sums of bias_gelu.py and qkv.py,
# and `sm_count`, which layer_norm.py and mlm_loss.py also size their grids by, are shared from here too.
#
# Tiles are autotuned per (N, K, dtype, epilogue), not per M: with packed tokens M changes every
# batch, and a retune per batch would cost more than any tile choice gains.
#
# The bias is optional (HAS_BIAS; ModernBERT's projections have none).
#
# Limits: x [M, K] and weight [N, K] ([2N, K] gated) of one dtype (fp32, fp16 or bf16), any strides; M >= 0;
# N, K >= 1.
# Offsets are int64 (M * N passes 2**31 for large batches).
# Sources: Triton tutorial 03-matrix-multiplication; Liger-Kernel's fused linear epilogues.
import functools

import torch
import triton
import triton.language as tl

from fastbert.kernels.launch import cdiv, launch
from fastbert.kernels.numerics import INTERPRETER, cast, dot_accumulate, dot_precision

ACTIVATIONS = ("none", "gelu", "gelu_tanh")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# tl.constexpr: compiled (non-interpreted) @triton.jit code may read a module global only when it is a
# constexpr; a plain float is a NameError at compile time on the GPU (the interpreter accepts it).
_SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_TANH_CUBIC = tl.constexpr(0.044715)


@triton.jit
def _tanh_gelu_parts(z):
    """For the tanh form, with u = sqrt(2/pi) (z + 0.044715 z^3): (s, s (1 - s), u') where
    s = sigmoid(2u) = (1 + tanh(u)) / 2. From t = exp(-2|u|) <= 1, so nothing overflows and
    s (1 - s) = t / (1 + t)^2 keeps its precision where s rounds to 1 (1 - s would be 0 or noise)."""
    u = _SQRT_2_OVER_PI * (z + _TANH_CUBIC * z * z * z)
    t = tl.exp(-2.0 * tl.abs(u))
    r = 1.0 / (1.0 + t)
    s = tl.where(u >= 0, r, t * r)
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * z * z)
    return s, t * r * r, du


@triton.jit
def gelu(z, APPROXIMATE: tl.constexpr):
    """GELU of fp32 z. "none": z Phi(z) with the exact erf. "tanh": z (1 + tanh(u)) / 2 = z sigmoid(2u)
    (no tanh needed: not every Triton version's tl.math has one)."""
    if APPROXIMATE == "tanh":
        s, _, _ = _tanh_gelu_parts(z)
        return z * s
    else:
        return 0.5 * z * (1.0 + tl.math.erf(z * _SQRT_HALF))


@triton.jit
def gelu_grad(z, APPROXIMATE: tl.constexpr):
    """d gelu / dz at fp32 z.
    "none":  Phi(z) + z phi(z),  Phi(z) = (1 + erf(z / sqrt 2)) / 2,  phi(z) = exp(-z^2 / 2) / sqrt(2 pi).
    "tanh":  s + 2 z s (1 - s) u',  s = sigmoid(2u),  u' = sqrt(2/pi) (1 + 3 * 0.044715 z^2)."""
    if APPROXIMATE == "tanh":
        s, s_one_minus_s, du = _tanh_gelu_parts(z)
        return s + 2.0 * z * s_one_minus_s * du
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(z * _SQRT_HALF))
        return cdf + z * _INV_SQRT_2PI * tl.exp(-0.5 * z * z)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["multiprocessor_count"]


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU the kernels run on, as Triton's active driver reports them
    (cached: launchers size their grids by it on every call). A device without an index (meta tensors
    of a compile-only run) means the driver's current device."""
    index = device.index if device.index is not None else triton.runtime.driver.active.get_current_device()
    return _sm_count(index)


@functools.lru_cache(maxsize=4096)
def row_groups(rows: int, col_blocks: int, block_m: int, device: torch.device) -> tuple[int, int]:
    """Split rows into (groups, rows_per_group), rows_per_group a multiple of block_m, for the
    deterministic column sums of kernels/bias_gelu.py and kernels/qkv.py: one program per group
    and column block, about four programs per SM in all. Depends only on the shape and the device,
    so the summation order, hence every bit of the sum, is fixed for a given GPU (and cached)."""
    target = 4 if INTERPRETER else 4 * sm_count(device)
    groups = max(1, min(cdiv(rows, block_m), cdiv(target, col_blocks)))
    rows_per_group = cdiv(cdiv(rows, groups), block_m) * block_m
    return cdiv(rows, rows_per_group), rows_per_group


def _configs():
    if INTERPRETER:
        # The interpreter runs each program in numpy: few large tiles are fastest, tuning is moot.
        return [triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 256, "GROUP_M": 8})]
    # Hopper-sized tiles (Triton tutorial / Liger choices), each of whole warpgroups (4 warps or more: with
    # fewer, sm_90a falls back from warpgroup MMA to MMA); the pruning below drops what a call cannot use.
    shapes = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 32, 4, 4), (128, 64, 64, 4, 4),
              (64, 128, 64, 4, 4), (64, 64, 64, 4, 4)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for bm, bn, bk, s, w in shapes + list(_GATED_ONLY_SHAPES)]


# Tiles only the GeGLU epilogue may pick, on Hopper (warpgroup MMA) only, exempt from the accumulator rule of
# _prune: with two accumulators the rule leaves it only 64 x 64 tiles of the shapes above, while these, on two
# warpgroups, compile without spills for sm_90a (the compile gates hold them to it; 128 x 128: 247 registers,
# 128 x 64: 124) and give each warpgroup MMA its full 64-row height; 128 x 128 only without a bias (with one,
# storing h, it spilled 84 to 96 bytes). On one warpgroup 128 x 64 spilled 20 bytes and 128 x 128 2.3 KB; for
# sm_80 (MMA) 128 x 128 spilled 212 to 228 bytes and 128 x 64 16 (Triton 3.6).
_GATED_ONLY_SHAPES = ((128, 64, 64, 4, 8), (128, 128, 64, 3, 8))
_GATED_ONLY_WITHOUT_BIAS = ((128, 128, 64, 3, 8),)


# The GELU epilogue's own temporaries need about half the registers: with more than 64 fp32 accumulator
# values per thread (128 x 256 on 8 warps, 128 x 128 on 4) it spills on sm_90a, with either GELU.
_GELU_EPILOGUE_ACCUMULATOR_PER_THREAD = 64


def _shape(config) -> tuple[int, int, int, int, int]:
    return (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"], config.num_stages,
            config.num_warps)


def _prune(configs, named_args, **kwargs):
    """The configs whose pipeline fits the GPU's shared memory (A (BLOCK_M x BLOCK_K) and B (BLOCK_K x
    BLOCK_N) tiles per stage, two B tiles when GATED; the epilogue reuses them) and, with a GELU epilogue,
    whose accumulators (two when GATED) leave the GELU its registers; the gated-only tiles (checked one by
    one instead) for GATED on Hopper alone (some of them only without a bias)."""
    driver = triton.runtime.driver.active
    hopper = driver.get_current_target().arch >= 90
    shared = driver.utils.get_device_properties(driver.get_current_device())["max_shared_mem"]
    element = named_args["x_ptr"].element_size()
    gelu_epilogue = kwargs["ACTIVATION"] != "none"
    gated = kwargs["GATED"]
    accumulators = 2 if gated else 1

    def fits(c):
        block_m, block_n, block_k, stages, warps = _shape(c)
        if (block_m + accumulators * block_n) * block_k * element * stages > shared:
            return False
        if _shape(c) in _GATED_ONLY_SHAPES:
            return gated and hopper and not (kwargs["HAS_BIAS"] and _shape(c) in _GATED_ONLY_WITHOUT_BIAS)
        return not (gelu_epilogue and accumulators * block_m * block_n // (32 * warps)
                    > _GELU_EPILOGUE_ACCUMULATOR_PER_THREAD)

    fitting = [c for c in configs if fits(c)]
    return fitting or [c for c in configs if _shape(c) not in _GATED_ONLY_SHAPES][-1:]


@triton.autotune(configs=_configs(), key=["N", "K", "SPLIT_HEADS", "ACTIVATION", "STORE_PRE", "GATED", "HAS_BIAS"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _matmul_fwd_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]; [2N, K] when GATED (input rows, then gate rows)
    bias_ptr,  # [N] ([2N] when GATED); read only when HAS_BIAS
    out_ptr,  # [M, N], or [3, B, heads, S, d] with M = B * S and N = 3 * heads * d when SPLIT_HEADS
    pre_ptr,  # [M, N] ([M, 2N] when GATED) contiguous: x @ w.T + bias before the activation (when STORE_PRE)
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk,
    seqlen,  # S: row m is token (m // S, m % S) of the output; S = M for a plain [M, N] output
    num_heads,
    stride_ob, stride_os,  # output strides of the batch and sequence (row) indices
    stride_o3, stride_oh, stride_od,  # output strides of which-of-qkv, head, and column within a head
    HEAD_DIM: tl.constexpr,  # d; columns within a head are contiguous runs of HEAD_DIM
    SPLIT_HEADS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # "none", "gelu" (erf) or "gelu_tanh"
    STORE_PRE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # out = act(a) * b with a, b the two halves of x @ w.T + bias (the GeGLU)
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" (kernels/numerics.py dot_precision)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_m = (pid // pids_per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_per_group) % group_rows
    pid_n = (pid % pids_per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap around instead of being masked: they load valid memory
    # and their results are dropped by the store mask, which keeps the inner loop mask-free in M, N.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    # K offsets and steps in int64: a transposed operand (x^T of 8M tokens, a column-major weight of 8M
    # rows) has a K stride whose product with K, or with BLOCK_K, passes 2**31
    k_offsets = offs_k.to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + k_offsets[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + k_offsets[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    x_step = tl.cast(stride_xk, tl.int64) * BLOCK_K
    w_step = tl.cast(stride_wk, tl.int64) * BLOCK_K

    # the gate half's rows of the same tile, N weight rows further on
    gate_offset = tl.cast(stride_wn, tl.int64) * N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = dot_accumulate(a, b, acc, INPUT_PRECISION)
        if GATED:
            b_gate = tl.load(w_ptrs + gate_offset, mask=offs_k[:, None] < k_left, other=0.0)
            acc_gate = dot_accumulate(a, b_gate, acc_gate, INPUT_PRECISION)
        x_ptrs += x_step
        w_ptrs += w_step

    if HAS_BIAS:
        acc += cast(tl.load(bias_ptr + cols), tl.float32)[None, :]
        if GATED:
            acc_gate += cast(tl.load(bias_ptr + N + cols), tl.float32)[None, :]
    out_rows = offs_m.to(tl.int64)
    out_cols = offs_n.to(tl.int64)
    mask = (out_rows[:, None] < M) & (out_cols[None, :] < N)
    if STORE_PRE:
        pre_row = pre_ptr + out_rows[:, None] * (2 * N if GATED else N)  # [BLOCK_M, 1]
        tl.store(pre_row + out_cols[None, :], cast(acc, pre_ptr.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(pre_row + N + out_cols[None, :], cast(acc_gate, pre_ptr.dtype.element_ty), mask=mask)
    if ACTIVATION == "gelu":
        acc = gelu(acc, "none")
    elif ACTIVATION == "gelu_tanh":
        acc = gelu(acc, "tanh")
    if GATED:
        acc = acc * acc_gate

    # The divisions stay in int32 (indices below M, N < 2**31), widened only to multiply the strides: an
    # int64 division is a subroutine call on the GPU, and a call sends the live accumulator to local
    # memory (328 to 1,560 bytes of spills per thread in the GELU epilogues on sm_90a).
    if SPLIT_HEADS:
        row_off = (offs_m // seqlen).to(tl.int64) * stride_ob + (offs_m % seqlen).to(tl.int64) * stride_os
        head = offs_n // HEAD_DIM  # 0 .. 3 * heads - 1: (which of q, k, v) * heads + head
        col_off = ((head // num_heads).to(tl.int64) * stride_o3 + (head % num_heads).to(tl.int64) * stride_oh
                   + (offs_n % HEAD_DIM).to(tl.int64) * stride_od)
    else:
        row_off = out_rows * stride_os
        col_off = out_cols * stride_od
    tl.store(out_ptr + row_off[:, None] + col_off[None, :], cast(acc, out_ptr.dtype.element_ty), mask=mask)


def check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise ValueError unless x [M, K], weight [N, K], bias [N] (or None) share a supported dtype and device."""
    if x.dtype not in DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; supported dtypes are {DTYPES}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, expected x's dtype {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, expected x's device {x.device}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[1] == 0:
        raise ValueError(f"x [M, K] and weight [N, K] must share K >= 1, "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected {(weight.shape[0],)}")


def matmul_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               activation: str = "none", pre: torch.Tensor | None = None, gated: bool = False) -> None:
    """Write act(x @ weight.T + bias) into `out` (bias None: no bias).

    x [M, K], weight [N, K], bias [N], any strides, one dtype and device: the callers' entries check them
    (`check_operands`). `out` is [M, N] (any strides), or [3, B, heads, S, d] (any strides) with B * S = M
    and 3 * heads * d = N: the head-split store. `pre`, if given, is a contiguous [M, N] that receives
    x @ weight.T + bias before the activation. gated (the GeGLU): weight [2N, K], bias [2N], out [M, N] =
    act(a) * b with [a, b] = x @ weight.T + bias split in halves, pre [M, 2N]; the activation must be a GELU.
    Raises ValueError on an unknown activation, or an out, pre or gated weight that does not fit.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    rows, inner = x.shape
    cols = weight.shape[0]
    out_dims = out.dim()
    if gated:
        if activation == "none" or out_dims != 2 or cols % 2:
            raise ValueError(f"a gated matmul needs a GELU activation (got {activation!r}), a 2-D out (got "
                             f"{out_dims}-D) and an even number of weight rows (got {cols})")
        cols //= 2
    if out_dims == 5:
        three, batch, heads, seqlen, head_dim = out.shape
        if three != 3 or batch * seqlen != rows or 3 * heads * head_dim != cols:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected [3, B, heads, S, d] with B*S = {rows} "
                             f"and 3*heads*d = {cols}")
        stride_o3, stride_ob, stride_oh, stride_os, stride_od = out.stride()
    elif out.shape == (rows, cols):
        seqlen, heads, head_dim = rows, 1, cols
        stride_ob, stride_o3, stride_oh = 0, 0, 0
        stride_os, stride_od = out.stride()
    else:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(rows, cols)} or [3, B, heads, S, d]")
    if pre is not None and (pre.shape != (rows, 2 * cols if gated else cols) or not pre.is_contiguous()):
        raise ValueError(f"pre must be a contiguous {(rows, 2 * cols if gated else cols)} tensor, "
                         f"got {tuple(pre.shape)}")
    if rows == 0:
        return

    def grid(meta):
        return (cdiv(rows, meta["BLOCK_M"]) * cdiv(cols, meta["BLOCK_N"]),)

    launch(_matmul_fwd_kernel, grid,
        # the kernel reads the bias as contiguous; weight stands in for a missing bias (never read)
        x, weight, weight if bias is None else bias.contiguous(), out, out if pre is None else pre,
        rows, cols, inner, *x.stride(), *weight.stride(),
        seqlen, heads, stride_ob, stride_os, stride_o3, stride_oh, stride_od,
        HEAD_DIM=head_dim if out_dims == 5 else 1, SPLIT_HEADS=out_dims == 5,
        ACTIVATION=activation, STORE_PRE=pre is not None, HAS_BIAS=bias is not None, GATED=gated,
        INPUT_PRECISION=dot_precision(x.dtype),
    )
