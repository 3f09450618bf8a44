"""DESIGN.md's tolerance rule (flash-attention's): a kernel's error against a float64 reference is at
most `factor` times the error of PyTorch's own implementation in the same dtype, plus a small eps.
Forward outputs use factor 2, gradients factor 3."""
import contextlib

import torch
import torch.nn.attention
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

FORWARD_FACTOR = 2.0
GRADIENT_FACTOR = 3.0
EPS = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def max_error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return (actual.double() - exact.double()).abs().max().item() if actual.numel() else 0.0


def assert_within_rule(name, kernel_out, torch_out, exact, factor=FORWARD_FACTOR, dtype=None):
    """kernel_out and torch_out in the test dtype, exact in float64 (all the same shape). The eps is that of
    `dtype`, the dtype the computation ran in (default: torch_out's): a bf16 model's loss, returned in fp32, is a
    scalar computed from bf16 values, whose two errors are draws (PyTorch's is near 0 on some seeds), and fp32's
    eps would leave its rule to the seed."""
    assert kernel_out.shape == exact.shape, f"{name}: shape {tuple(kernel_out.shape)} != {tuple(exact.shape)}"
    assert torch.isfinite(kernel_out).all(), f"{name}: non-finite values"
    kernel_err = max_error(kernel_out, exact)
    torch_err = max_error(torch_out, exact)
    limit = factor * torch_err + EPS[dtype or torch_out.dtype]
    assert kernel_err <= limit, (
        f"{name}: kernel error {kernel_err:.3e} > {factor} x torch error {torch_err:.3e} + eps = {limit:.3e}")


# PyTorch's own error in a 16-bit dtype, the same on every machine ------------------------------------------
#
# What PyTorch's kernels compute in fp16 or bf16 depends on the machine: on a CPU, on its vector width (ATen's
# AVX2 and AVX512 kernels round a ModernBERT masked-LM loss differently: torch's error 4.1e-4 on an AMD EPYC
# without AVX512, 9.4e-4 with it, for the kernel's 1.4e-3), on a GPU on cuBLAS's and cuDNN's algorithms. So
# the yardstick is modelled instead of measured: every op computed in float64 from its inputs as they are
# (already rounded) and its outputs rounded once to the dtype PyTorch gives them. That is the error of an
# implementation that rounds where PyTorch's does (each op's output, fp32 accumulation inside an op being
# exact at 16-bit precision) and nowhere else, whatever the hardware. Attention runs on SDPA's math backend,
# whose ops are the eager path's. fp32 keeps PyTorch itself: its error is its accumulation's, which this
# model would leave out.

ROUNDED_DTYPES = (torch.float16, torch.bfloat16)


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class _RoundedOps(TorchDispatchMode):
    """Each op with a floating tensor other than float64, but fastbert's own: computed in float64, its floating
    outputs rounded to the dtypes the op itself gives them (found on meta tensors). View ops run as they are
    (they compute nothing); an op that has no float64 or meta form runs as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "fastbert":  # a fused op: the kernel under test, run as it is
            return func(*args, **kwargs)
        inputs = tree_flatten((args, kwargs))[0]
        if (not any(_floating(t) and t.dtype != torch.float64 for t in inputs)
                or any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)):
            return func(*args, **kwargs)
        try:
            shapes = func(*tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, args),
                          **tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, kwargs))
            wide_args, wide_kwargs = tree_map(lambda t: t.double() if _floating(t) else t, (args, kwargs))
            wide = func(*wide_args, **wide_kwargs)
        except (NotImplementedError, RuntimeError):
            return func(*args, **kwargs)
        if func._schema.is_mutable:  # in place (or out=): write the float64 results into the originals
            for argument, original, widened in zip(func._schema.arguments, args, wide_args):
                if argument.alias_info is not None and argument.alias_info.is_write:
                    original.copy_(widened)
            for name, original in kwargs.items():
                if isinstance(original, torch.Tensor) and original is not wide_kwargs[name]:
                    original.copy_(wide_kwargs[name])
            return args[0]
        return _rounded(wide, shapes)


def _rounded(wide, shapes):
    """wide's floating tensors rounded to the dtypes of `shapes` (its meta twin)."""
    flat, spec = tree_flatten(wide)
    flat_shapes = tree_flatten(shapes)[0]
    return tree_unflatten([w.to(s.dtype) if _floating(w) else w for w, s in zip(flat, flat_shapes)], spec)


@contextlib.contextmanager
def pytorch_in(dtype):
    """Inside, PyTorch's ops in `dtype` (fp16, bf16) give the machine-independent model of their rounding
    (above), the backward included; fp32 is left to PyTorch. fastbert's fused ops (its custom ops: the kernels
    under test) run as they are, so a model on the kernels run inside differs from the same model on PyTorch's
    ops only by its kernels (outside, its own PyTorch ops, a cross entropy in bf16 on a CPU, rounded where the
    model does not: a loss one bf16 step off on some seeds)."""
    if dtype not in ROUNDED_DTYPES:
        yield
        return
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), _RoundedOps():
        yield
