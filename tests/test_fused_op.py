"""kernels/fused_op.py: a fused op's eager call runs its host function directly, not through the
torch.library custom op (whose Python machinery cost hundreds of microseconds a call), while whatever traces
(torch.compile, a dispatch mode) goes through the custom op; both give the same outputs and gradients.
Checked on kernels/bias_gelu.py's op (small, differentiable) in Triton's interpreter."""
import pytest
import torch
from dispatch_recording import RecordingMode

from fastbert.kernels import bias_gelu


class _CountingCustomOp:
    """Stands in for FusedOp.custom_op: counts the calls that reach it, then makes them."""

    def __init__(self, custom_op):
        self.custom_op, self.calls = custom_op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.custom_op(*args)


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
    with RecordingMode() as mode:
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


def test_meta_tensors_and_tensors_without_grad_take_their_entrances(counted):
    forward, backward = counted
    x, bias = _inputs("meta")
    y = bias_gelu.bias_gelu(x, bias)  # meta: the custom op's shape-only registration
    assert (y.shape, y.device.type, forward.calls) == (x.shape, "meta", 1)
    x, bias = _inputs("cpu")
    y = bias_gelu.bias_gelu(x.detach(), bias.detach())  # nothing requires grad: the host function, no autograd
    assert (y.grad_fn, forward.calls) == (None, 1)


def test_runs_directly_agrees_with_the_ops_own_entrance(counted, monkeypatch, device):
    """fused_op.runs_directly (what a shortcut past an op, the in-place inference FFN, asks) is True exactly where
    the op's call runs its host function itself: False for meta tensors, a tensor subclass, a dispatch mode and
    forward-mode AD, where the call takes the custom op or the Function that refuses a tangent."""
    from fastbert.kernels.fused_op import runs_directly

    class Subclass(torch.Tensor):
        pass

    forward, _ = counted
    op = bias_gelu._bias_gelu_op
    differentiable = _CountingCustomOp(op._differentiable_apply)
    monkeypatch.setattr(op, "_differentiable_apply", differentiable)
    x, bias = (t.detach() for t in _inputs(device))
    situations = {"plain": (x, bias, None), "bias missing": (x, None, None),
                  "meta": (x.to("meta"), bias.to("meta"), None), "subclass": (x.as_subclass(Subclass), bias, None),
                  "dispatch mode": (x, bias, RecordingMode),
                  "dual level": (x, bias, torch.autograd.forward_ad.dual_level)}
    for name, (tensor, second, context) in situations.items():
        calls = forward.calls + differentiable.calls
        with torch.no_grad(), (context() if context is not None else torch.no_grad()):
            direct = runs_directly(tensor, second)
            bias_gelu.bias_gelu(tensor, second)
        assert direct == (forward.calls + differentiable.calls == calls), name
        assert direct == (name in ("plain", "bias missing")), name


def _accumulators(output):
    """The inputs whose gradients output's node hands on directly (AccumulateGrad nodes' variables)."""
    return {id(node.variable) for node, _ in output.grad_fn.next_functions if hasattr(node, "variable")}


def test_n_d_activations_record_one_node_per_op(device):
    # [B, S, H] in and out with one autograd node: the op flattens its activations inside, so no reshape of
    # an input and no view of the output joins autograd's graph (a node each, forward and backward)
    from fastbert.kernels import ffn, layer_norm

    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).to(device).requires_grad_()

    x, residual, weight, bias = leaf(2, 3, 32), leaf(2, 3, 32), leaf(32), leaf(32)
    y = layer_norm.layer_norm(x, weight, bias, residual=residual, dropout_p=0.1)
    assert y.shape == x.shape and _accumulators(y) == {id(x), id(weight), id(bias), id(residual)}
    w1, b1, w2, b2 = leaf(64, 32), leaf(64), leaf(32, 64), leaf(32)
    out = ffn.feed_forward(x, w1, b1, w2, b2)
    assert out.shape == x.shape and _accumulators(out) == {id(x), id(w1), id(b1), id(w2), id(b2)}
    (y.sum() + out.sum()).backward()
    assert x.grad.shape == x.shape and residual.grad.shape == x.shape
