# How every kernel multiplies and rounds: one `dot` and one `cast` that all kernels call instead of
# tl.dot and .to(dtype), so that Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) computes what
# the GPU computes.
#
# The interpreter runs a kernel in numpy and keeps bf16 values as their raw uint16 bits. Its tl.dot
# multiplies those bits as integers (bf16 results are garbage), its casts between bf16 and anything but
# fp32 convert the bits as integers too, its bf16 -> fp32 cast mangles subnormals, and its fp32 -> bf16
# cast truncates where the GPU rounds to nearest even. Under the interpreter only, `dot` therefore
# upcasts bf16 operands to fp32 (exact: a bf16 product fits fp32's mantissa, and the GPU's bf16 MMA
# also accumulates in fp32), and `cast` converts from and to bf16 from the bits, rounding to nearest
# even. Kernels convert every floating value with `cast`, upcasts included, never with .to. The choice
# is a tl.constexpr global fixed when the kernels are defined (the interpreter is chosen then too), so
# on the GPU the helpers compile to the plain tl.dot and .to: the same PTX (line-number labels aside)
# and the same SASS (tests/test_numerics.py checks a probe kernel; every kernel of fastbert compiled
# for sm_90 before and after the helpers gave identical PTX and SASS with line info off).
#
# fp32 dots: `dot_precision` reads PyTorch's setting for fp32 matmuls when a launcher runs. "tf32"
# (torch.backends.cuda.matmul.fp32_precision = "tf32", or the older allow_tf32 = True /
# set_float32_matmul_precision("high" or "medium")) runs them on tensor cores with 10-bit-mantissa
# inputs and fp32 accumulation, as cuBLAS then does; "ieee" (PyTorch's default, "highest") keeps exact
# fp32 products, which have no tensor-core path: several times slower, and register-hungry in the
# attention kernels. Under the interpreter `dot` truncates fp32 operands to TF32 when asked, as the
# tensor cores do (Triton hands them the fp32 registers; they ignore the low 13 mantissa bits), so the
# tests see the precision that was chosen.
import os

import torch
import triton
import triton.language as tl

# Triton picks its interpreter when a @triton.jit function is defined, from the same variable. The
# interpreter (CPU tests) runs each program in numpy at a fixed cost per operation: few, large tiles
# are what make it fast, so the launchers pick larger tiles under it. Every launcher chooses its tiles
# by this flag, never by the tensors' device: compiled, they pick the GPU's tiles whatever the tensors
# claim, which is what lets `fastbert bench --suite compile` compile them for a GPU from meta tensors
# on a machine without one.
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRETED = tl.constexpr(INTERPRETER)


def philox_seed(device: torch.device) -> torch.Tensor:
    """int64 [1]: the seed of a kernel's Philox dropout mask (attention, LayerNorm, dropout), drawn from
    torch's generator on `device`, so torch.manual_seed reproduces the mask, without a host sync."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
_CANONICAL_BF16_NAN = tl.constexpr(0x7FC0)


# torch >= 2.9 has fp32_precision; once a program sets it, the older getters raise instead of answering. Read
# through the getter that torch.backends.cuda.matmul.fp32_precision calls (the attribute's own lookup costs a
# microsecond per launch), then through the older getter's C function (torch.get_float32_matmul_precision is
# a Python wrapper around it). Both are called in dot_precision itself, not in helpers: it runs on every fp32
# launch of a matmul-type kernel, where every Python call adds to the host's time.
_FP32_PRECISION_GETTER = getattr(torch._C, "_get_fp32_precision_getter", None)
_MATMUL_PRECISION_GETTER = getattr(torch._C, "_get_float32_matmul_precision", torch.get_float32_matmul_precision)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands of `dtype`, as PyTorch would multiply fp32 matrices now:
    "tf32" when it allows TF32, "ieee" when it asks for full fp32 ("highest", the default). 16-bit
    operands get "tf32", Triton's default, which does not affect them."""
    if dtype != torch.float32:
        return "tf32"
    if _FP32_PRECISION_GETTER is not None:
        precision = _FP32_PRECISION_GETTER("cuda", "matmul")
    else:
        precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    # the literals, not PyTorch's string (a new object each call): the C launch's recent-call cache compares a
    # constexpr by its address, so a new string at each launch would miss it every time
    if precision == "tf32":
        return "tf32"
    if precision == "ieee":
        return "ieee"
    return "ieee" if _MATMUL_PRECISION_GETTER() == "highest" else "tf32"


@triton.jit
def _bf16_to_fp32(x):
    """Exact: bf16 is the top half of fp32 (the interpreter's own conversion mangles subnormals)."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _interpreter_cast(x, dtype: tl.constexpr):
    if x.dtype == tl.bfloat16:
        x = _bf16_to_fp32(x)
    if dtype == tl.bfloat16:
        # round to nearest even from the bits: add just under half a bf16 step, plus one if the kept
        # last bit is odd, and drop the low 16 bits; NaN becomes the canonical quiet NaN (the add could
        # carry a NaN's payload into the sign bit)
        x = x.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, _CANONICAL_BF16_NAN, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def cast(x, dtype: tl.constexpr):
    """x.to(dtype), rounding to nearest even as the GPU does (also under the interpreter)."""
    if _INTERPRETED:
        return _interpreter_cast(x, dtype)
    else:
        return x.to(dtype)


@triton.jit
def _interpreter_dot(a, b, acc, PRECISION: tl.constexpr):
    if a.dtype == tl.bfloat16:
        a = _bf16_to_fp32(a)
        b = _bf16_to_fp32(b)
    elif PRECISION == "tf32":
        if a.dtype == tl.float32:  # TF32 keeps 10 of fp32's 23 mantissa bits
            a = (a.to(tl.uint32, bitcast=True) >> 13 << 13).to(tl.float32, bitcast=True)
            b = (b.to(tl.uint32, bitcast=True) >> 13 << 13).to(tl.float32, bitcast=True)
    return tl.dot(a, b, acc)


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in fp32 (acc fp32, or None for 0; a, b of one dtype): tl.dot with
    input_precision=PRECISION (from `dot_precision`). Under the interpreter: bf16 operands as fp32, and
    "tf32" truncates fp32 ones."""
    if _INTERPRETED:
        return _interpreter_dot(a, b, acc, PRECISION)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


# Summing along K. An exact fp32 dot ("ieee") has no tensor-core path: Triton lowers tl.dot(a, b, acc) to one
# FMA chain per output element, acc = fma(a_k, b_k, acc) for every k, so a loop over K that passes the running
# total in as acc sums all K products one after another (rounding error growing ~K eps), where cuBLAS's fp32
# GEMMs (split-K, tree reductions) stay near one rounding: on an H100 the QKV projection at K = 384..1024 and the
# MLM logits at K = 768 had 10 to 17 times PyTorch's error. `dot_accumulate` sums blocked instead: each K
# step's product starts from zero (a chain of BLOCK_K) and is then added to the total (K / BLOCK_K adds), error
# ~(BLOCK_K + K / BLOCK_K) eps. The add must be opaque: Triton's combine pass rewrites acc + tl.dot(a, b, 0)
# into tl.dot(a, b, acc), which is the sequential chain again (Triton 3.6 and 3.9 both do), so on the GPU it is
# one PTX add.rn.f32 (.rn: rounded once, never contracted into an FMA). Tensor-core dots (16-bit, TF32)
# accumulate in the MMA's fp32 registers as cuBLAS's do, and keep tl.dot(a, b, acc): the same code as before.
@triton.jit
def _rounded_add(x, y):
    """x + y for fp32 tensors, as one instruction no compiler pass merges with what produced x or y."""
    if _INTERPRETED:
        return x + y
    else:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def dot_accumulate(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b for one step of a loop along the reduction dimension (acc fp32, the running total):
    `dot`, summed blocked for exact fp32 ("ieee") dots and in the MMA otherwise (see above)."""
    if PRECISION == "ieee":
        return _rounded_add(acc, dot(a, b, None, PRECISION))
    else:
        return dot(a, b, acc, PRECISION)


# Dropout's keep-mask along rows. tl.rand(seed, offset) runs one Philox-4x32-10 call per element and keeps one of
# its four 32-bit outputs: ten rounds of 32-bit multiplies, about 17 IMAD.WIDE / IMAD.HI per element compiled for
# sm_90a (`python benchmarks/dropout_sass.py`), which can take more issue slots per element than moving its bytes
# takes at HBM speed (not yet timed on a GPU). Here each call decides four consecutive columns, as PyTorch's fused
# dropout (curand_uniform4) and flash-attention use all four outputs.
@triton.jit
def keep_mask_rows(seed, rows, first_col, row_length, dropout_p, BLOCK_ROWS: tl.constexpr,
                   BLOCK_COLS: tl.constexpr):
    """The dropout keep-mask [BLOCK_ROWS, BLOCK_COLS] of rows (int64 [BLOCK_ROWS]) and columns first_col +
    [0, BLOCK_COLS) of a [*, row_length] tensor (first_col and BLOCK_COLS multiples of 4): element (row, col)
    is kept where output col % 4 of the Philox call counted row * ceil(row_length / 4) + col // 4 is >= dropout_p
    as a uniform float. It depends on the seed and the element alone, never on the tiles."""
    groups = first_col // 4 + tl.arange(0, BLOCK_COLS // 4)
    counters = rows[:, None] * ((row_length + 3) // 4) + groups[None, :]  # int64
    u0, u1, u2, u3 = tl.rand4x(seed, counters)
    # [BLOCK_ROWS, BLOCK_COLS // 4, 2, 2] in the order (u0, u1, u2, u3) per group, then one column each
    u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), (BLOCK_ROWS, BLOCK_COLS))
    return u >= dropout_p


def dropout_seed(dropout_p: float, training: bool, device: torch.device) -> tuple[float, torch.Tensor | None]:
    """(the dropout probability a kernel applies, its int64 [1] seed (philox_seed) or None) for a checked dropout_p:
    (0.0, None) when not training or p is 0, so that no seed is drawn (nor the generator advanced) for no dropout."""
    if not training or dropout_p == 0.0:
        return 0.0, None
    return float(dropout_p), philox_seed(device)
