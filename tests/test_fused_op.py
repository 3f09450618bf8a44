"""kernels/fused_op.py: a fused op's eager call runs its host function directly, not through the
torch.library custom op (whose Python machinery cost hundreds of microseconds a call), while whatever traces
(torch.compile, a dispatch mode) goes through the custom op; both give the same outputs and gradients.
Checked on kernels/bias_gelu.py's op (small, differentiable) in Triton's interpreter."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastbert.kernels import bias_gelu


class _CountingCustomOp:
    """Stands in for FusedOp.custom_op: counts the calls that reach it, then makes them."""

    def __init__(self, custom_op):
        self.custom_op, self.calls = custom_op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.custom_op(*args)


class _RecordingMode(TorchDispatchMode):
    """A dispatch mode (as fastbert's memory tracker is one) that records the ops it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """(forward op's counter, backward op's counter) around bias_gelu's two fused ops."""
    counters = []
    for op in (bias_gelu._bias_gelu_op, bias_gelu._bias_gelu_bwd_op):
        counter = _CountingCustomOp(op.custom_op)
        monkeypatch.setattr(op, "custom_op", counter)
        counters.append(counter)
    return counters


def _inputs(device):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=generator).to(device).requires_grad_()
    bias = torch.randn(96, generator=generator).to(device).requires_grad_()
    return x, bias


def _forward_backward(fn, x, bias):
    x, bias = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    y = fn(x, bias)
    y.backward(torch.linspace(-1.0, 1.0, y.numel(), device=y.device).view_as(y))
    return y.detach(), x.grad, bias.grad


def test_eager_calls_bypass_the_custom_op(counted, device):
    forward, backward = counted
    x, bias = _inputs(device)
    _forward_backward(bias_gelu.bias_gelu, x, bias)
    with torch.no_grad():
        bias_gelu.bias_gelu(x, bias)
    assert (forward.calls, backward.calls) == (0, 0)


def test_a_dispatch_mode_sees_the_custom_op_and_the_same_numbers(counted, device):
    forward, backward = counted
    x, bias = _inputs(device)
    eager = _forward_backward(bias_gelu.bias_gelu, x, bias)
    with _RecordingMode() as mode:
        traced = _forward_backward(bias_gelu.bias_gelu, x, bias)
    assert (forward.calls, backward.calls) == (1, 1)
    assert "fastbert.bias_gelu.default" in mode.seen and "fastbert.bias_gelu_bwd.default" in mode.seen
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)


def test_torch_compile_traces_the_custom_op_and_gives_the_same_numbers(counted, device):
    forward, backward = counted
    x, bias = _inputs(device)
    eager = _forward_backward(bias_gelu.bias_gelu, x, bias)
    torch._dynamo.reset()
    compiled = torch.compile(bias_gelu.bias_gelu, backend="aot_eager", fullgraph=True)
    traced = _forward_backward(compiled, x, bias)
    assert forward.calls >= 1 and backward.calls >= 1  # traced once (calls at trace time), run from the graph
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)
