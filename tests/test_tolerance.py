"""tolerance.pytorch_in: PyTorch's own error in bf16 and fp16, the rule's yardstick, is the same on every machine.
On CPUs ATen's vectorized kernels round differently by vector width (ModernBERT's masked-LM loss in bf16: torch's
error 4.1e-4 with AVX2, 9.4e-4 with AVX512), so the same bf16 ops run with ATEN_CPU_CAPABILITY=default, avx2 and
this machine's own choice must give the same bits under pytorch_in."""
import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent

# a bf16 block with the ops whose kernels are vectorized: matmul, softmax, LayerNorm, GELU, reductions, backward
BLOCK = """
import sys, torch
from tolerance import pytorch_in
generator = torch.Generator().manual_seed(0)
x, w = (torch.randn(64, 96, generator=generator).to(torch.{dtype}) for _ in range(2))
x.requires_grad_()
def block():
    h = torch.nn.functional.layer_norm(torch.softmax(x @ w.t(), dim=-1) * 96, (64,))
    loss = torch.nn.functional.gelu(h).float().pow(2).mean()
    loss.backward()
    return torch.cat([loss.detach().reshape(1).double(), x.grad.double().flatten()])
with pytorch_in(torch.{dtype}):
    values = block()
sys.stdout.write(values.numpy().tobytes().hex())
"""


def _bits(capability, dtype):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    result = subprocess.run([sys.executable, "-c", BLOCK.format(dtype=dtype)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow(
    reason="three fresh interpreters again; bf16 is the one whose bits differed"))])
def test_pytorch_in_gives_the_same_bits_on_every_cpu_capability(dtype):
    """(Without pytorch_in, this block's bf16 gradient already differs between default and avx2.)"""
    bits = {capability: _bits(capability, dtype) for capability in ("default", "avx2", None)}
    assert len(set(bits.values())) == 1, {k: v[:32] for k, v in bits.items()}
