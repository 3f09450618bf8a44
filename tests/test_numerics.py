"""kernels/numerics.py: the `dot` and `cast` every kernel uses. Under Triton's interpreter they compute
what the GPU computes (bf16 dots from the values, not the bits; fp32 -> bf16 rounded to nearest even;
TF32 operands when asked); compiled for a GPU they are exactly tl.dot and .to (same PTX)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl

from fastbert import ops
from fastbert.kernels.numerics import cast, dot, dot_precision

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter's path")


@triton.jit
def _cast_kernel(x_ptr, y_ptr, back_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    y = cast(tl.load(x_ptr + offsets), y_ptr.dtype.element_ty)
    tl.store(y_ptr + offsets, y)
    tl.store(back_ptr + offsets, cast(y, back_ptr.dtype.element_ty))


def test_cast_to_bf16_rounds_to_nearest_even_as_torch(device):
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([
        torch.randn(4084, generator=gen) * 10.0 ** torch.randint(-40, 38, (4084,), generator=gen),
        torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-40, -0.0, 0.0]),
        # ties: exactly half a bf16 step above 1 and above 1 + 2**-7 (to even: down, then up)
        torch.tensor([1.0 + 2.0**-8, 1.0 + 2.0**-7 + 2.0**-8]),
        torch.tensor([0x7FFFFFFF, 0xFFFFFFFF - 2**32], dtype=torch.int64).to(torch.int32).view(torch.float32),
    ])
    x = x.to(device)
    y = torch.empty(4096, dtype=torch.bfloat16, device=device)
    back = torch.empty(4096, dtype=torch.float64, device=device)
    _cast_kernel[(1,)](x, y, back, N=4096)
    expected = x.to(torch.bfloat16)
    finite = ~expected.isnan()
    assert torch.equal(y.isnan(), ~finite)
    assert torch.equal(y[finite].view(torch.int16), expected[finite].view(torch.int16))
    # and bf16 -> fp64 from the value (the interpreter alone converts the raw bits as an integer)
    assert torch.equal(back[finite], expected[finite].double())


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.arange(0, M)
    tile = rows[:, None] * M + rows[None, :]
    acc = tl.full((M, M), 1.0, tl.float32)
    tl.store(c_ptr + tile, dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile), acc, PRECISION))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_dot(dtype, precision, device):
    """1 + a @ b with fp32 accumulation; "tf32" truncates fp32 operands to 10 mantissa bits as tensor
    cores do (error ~1e-3 relative), and changes nothing for 16-bit operands."""
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randn(32, 32, generator=gen).to(device, dtype) for _ in range(2))
    out = torch.empty(32, 32, device=device)
    _dot_kernel[(1,)](a, b, out, M=32, PRECISION=precision)
    error = (out.double() - (1.0 + a.double() @ b.double())).abs().max().item()
    if dtype == torch.float32 and precision == "tf32":
        tf32 = [t.view(torch.int32).bitwise_and(-(1 << 13)).view(torch.float32) for t in (a, b)]
        assert 1e-3 < error and torch.allclose(out.double(), 1.0 + tf32[0].double() @ tf32[1].double(), atol=1e-4)
    else:
        assert error < 1e-4  # fp32 accumulation of exact products: 32 terms of size ~1


PROBE = textwrap.dedent('''
    import os, re, sys
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fastbert.kernels.numerics import cast, dot

    @triton.jit
    def with_helpers(a_ptr, b_ptr, c_ptr, PRECISION: tl.constexpr):
        rows = tl.arange(0, 64)
        tile = rows[:, None] * 64 + rows[None, :]
        acc = dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile), None, PRECISION)
        tl.store(c_ptr + tile, cast(acc, c_ptr.dtype.element_ty))

    @triton.jit
    def plain(a_ptr, b_ptr, c_ptr, PRECISION: tl.constexpr):
        rows = tl.arange(0, 64)
        tile = rows[:, None] * 64 + rows[None, :]
        acc = tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile), None, input_precision=PRECISION)
        tl.store(c_ptr + tile, acc.to(c_ptr.dtype.element_ty))

    for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee"), ("fp32", "tf32")):
        ptx = []
        for fn in (with_helpers, plain):
            source = ASTSource(fn, {"a_ptr": "*" + dtype, "b_ptr": "*" + dtype, "c_ptr": "*" + dtype,
                                    "PRECISION": "constexpr"}, {"PRECISION": precision})
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
            # the name, and the comments' alignment to its length, are all that may differ
            text = compiled.asm["ptx"].replace(fn.__name__, "KERNEL")
            ptx.append([line.split("//")[0].split() for line in text.splitlines()])
        print(dtype, precision, "same" if ptx[0] == ptx[1] else "DIFFERENT")
''')


def test_helpers_compile_to_plain_dot_and_cast(tmp_path):
    """Compiled for sm_90 (no GPU needed), a kernel written with dot/cast gives the PTX of the one written
    with tl.dot/.to, for bf16 and for fp32 with both precisions."""
    probe = tmp_path / "probe.py"  # Triton reads a kernel's source from its file
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DISABLE_LINE_INFO"] = "1"  # source line numbers differ between the two kernels
    result = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:3] == ["bf16 tf32 same", "fp32 ieee same", "fp32 tf32 same"], result.stdout


ACCUMULATE_PROBE = textwrap.dedent(r'''
    import re
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fastbert.kernels.numerics import dot_accumulate

    @triton.jit
    def k_loop(a_ptr, b_ptr, c_ptr, K, PRECISION: tl.constexpr):
        rows = tl.arange(0, 64)
        acc = tl.zeros((64, 64), tl.float32)
        for k in range(0, K, 64):
            tile = rows[:, None] * K + rows[None, :] + k
            acc = dot_accumulate(tl.load(a_ptr + tile), tl.load(b_ptr + tile), acc, PRECISION)
        tl.store(c_ptr + rows[:, None] * 64 + rows[None, :], acc)

    for dtype, precision in (("fp32", "ieee"), ("fp32", "tf32"), ("bf16", "tf32")):
        source = ASTSource(k_loop, {"a_ptr": "*" + dtype, "b_ptr": "*" + dtype, "c_ptr": "*fp32", "K": "i32",
                                    "PRECISION": "constexpr"}, {"PRECISION": precision})
        ttir = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ttir"]
        (acc,) = re.findall(r"tt\.dot %[\w.]+, %[\w.]+, (%[\w.]+)", ttir)
        zero = re.search(re.escape(acc) + r" = arith\.constant dense<0\.0+e\+00>", ttir)
        print(dtype, precision, "from zero" if zero else "onto the running total")
''')


def test_exact_fp32_dots_sum_blocked_along_k(tmp_path):
    """Compiled for sm_90 (no GPU needed): in a loop over K, dot_accumulate's exact fp32 dot starts each K step
    from zero (its FMA chain is BLOCK_K long, then one add), not from the running total (one FMA chain over all
    of K, which Triton's combine pass makes of a plain acc + tl.dot); tensor-core dots accumulate in place."""
    probe = tmp_path / "probe.py"
    probe.write_text(ACCUMULATE_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:3] == ["fp32 ieee from zero", "fp32 tf32 onto the running total",
                                             "bf16 tf32 onto the running total"], result.stdout


def _fp32_matmul_precision(api: str):
    """Set PyTorch's fp32 matmul precision through one of its APIs: (set, restore) callables."""
    matmul = torch.backends.cuda.matmul
    if api == "fp32_precision":  # torch >= 2.9
        before = matmul.fp32_precision
        return (lambda tf32: setattr(matmul, "fp32_precision", "tf32" if tf32 else "ieee"),
                lambda: setattr(matmul, "fp32_precision", before))
    before = torch.get_float32_matmul_precision()
    return (lambda tf32: torch.set_float32_matmul_precision("high" if tf32 else "highest"),
            lambda: torch.set_float32_matmul_precision(before))


def _fp32_kernel_runs():
    """(name, run) for every matmul-type kernel through fastbert.ops: run() -> (fp32 result, float64 reference)."""
    gen = torch.Generator().manual_seed(2)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, w, b = randn(16, 256), randn(128, 256) / 16, randn(128)
    q, k, v = randn(1, 2, 40, 32), randn(1, 2, 40, 32), randn(1, 2, 40, 32)
    h, decoder, target = randn(8, 64), randn(100, 64), torch.arange(8) * 7

    def both(fn, *args):
        return fn(*(a.float() for a in args), backend="triton"), fn(*args, backend="torch")

    return [
        ("matmul (FFN up-projection)", lambda: both(ops.linear_bias_gelu, x, w, b)),
        ("matmul (QKV projection)", lambda: [t[0] for t in both(lambda *a, backend: ops.qkv_projection(
            *a, 2, backend=backend), x, randn(768, 256) / 16, randn(768))]),
        ("attention", lambda: both(ops.attention, q, k, v)),
        ("mlm_loss", lambda: [t[0] for t in both(lambda *a, backend: ops.linear_cross_entropy(
            *a, target, backend=backend), h, decoder, randn(100))]),
    ]


@pytest.mark.parametrize("api", ["fp32_precision", "set_float32_matmul_precision"])
@pytest.mark.parametrize("name,run", _fp32_kernel_runs(), ids=[name for name, _ in _fp32_kernel_runs()])
def test_fp32_dots_follow_torch_precision(api, name, run):
    """fp32 through every matmul-type kernel: exact fp32 products when PyTorch says "highest" / "ieee"
    (errors ~1e-6), TF32's 10-bit operands when it allows TF32 (errors ~1e-3), read at each call."""
    set_tf32, restore = _fp32_matmul_precision(api)
    try:
        errors = {}
        for tf32 in (False, True, False):
            set_tf32(tf32)
            out, exact = run()
            errors.setdefault(tf32, []).append((out.double() - exact).abs().max().item())
    finally:
        restore()
    assert max(errors[False]) < 2e-5 < 1e-4 < errors[True][0], errors


@pytest.mark.parametrize("api", ["fp32_precision", "set_float32_matmul_precision"])
def test_dot_precision_is_one_object_per_setting(api):
    """dot_precision hands the launches the same string object call after call, whichever API set the precision (the
    C launch's recent-call cache compares a constexpr by its address: a new string per call would miss it at every
    fp32 launch), and follows the setting."""
    set_tf32, restore = _fp32_matmul_precision(api)
    try:
        for tf32 in (True, False):
            set_tf32(tf32)
            first, second = dot_precision(torch.float32), dot_precision(torch.float32)
            assert first == ("tf32" if tf32 else "ieee") and first is second
    finally:
        restore()
