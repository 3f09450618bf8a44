"""DESIGN.md's tolerance rule (flash-attention's): a kernel's error against a float64 reference is at
most `factor` times the error of PyTorch's own implementation in the same dtype, plus a small eps.
Forward outputs use factor 2, gradients factor 3."""
import torch

FORWARD_FACTOR = 2.0
GRADIENT_FACTOR = 3.0
EPS = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def max_error(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return (actual.double() - exact.double()).abs().max().item() if actual.numel() else 0.0


def assert_within_rule(name, kernel_out, torch_out, exact, factor=FORWARD_FACTOR):
    """kernel_out and torch_out in the test dtype, exact in float64 (all the same shape)."""
    assert kernel_out.shape == exact.shape, f"{name}: shape {tuple(kernel_out.shape)} != {tuple(exact.shape)}"
    assert torch.isfinite(kernel_out).all(), f"{name}: non-finite values"
    kernel_err = max_error(kernel_out, exact)
    torch_err = max_error(torch_out, exact)
    limit = factor * torch_err + EPS[torch_out.dtype]
    assert kernel_err <= limit, (
        f"{name}: kernel error {kernel_err:.3e} > {factor} x torch error {torch_err:.3e} + eps = {limit:.3e}")
