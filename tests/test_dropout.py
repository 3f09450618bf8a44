"""kernels/dropout.py: seeded dropout with no stored mask. The observed rate is within 0.01 of p over 1e5
elements, the same seed gives the same mask and another seed another, the backward applies the forward's
mask (dx = dy * keep / (1 - p), exactly zero where dropped), the autograd keeps only the seed, bitwise
determinism, non-contiguous inputs, torch.compile, the custom op's registrations and bad input; fp32,
fp16 and bf16. Runs under Triton's interpreter on CPU (conftest sets TRITON_INTERPRET=1)."""
import pytest
import torch

from fastbert import ops
from fastbert.kernels import dropout as dk
from tolerance import assert_within_rule

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _randn(*shape, dtype=torch.float32, device="cpu", seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _seeded(x, p, seed):
    torch.manual_seed(seed)
    return dk.dropout(x, p)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_rate(p, device):
    x = torch.ones(100, 1024, device=device)  # 102400 elements
    dropped = (_seeded(x, p, seed=11) == 0).double().mean().item()
    assert abs(dropped - p) < 0.01, f"dropped fraction {dropped:.4f}, expected {p}"


def test_same_seed_same_mask(device):
    x = torch.ones(7, 768, device=device)
    first = _seeded(x, 0.3, seed=5) == 0
    assert torch.equal(first, _seeded(x, 0.3, seed=5) == 0)
    assert not torch.equal(first, _seeded(x, 0.3, seed=6) == 0)
    assert not torch.equal(first[0], first[1])  # rows do not share a mask: the element offset drives Philox


def test_each_philox_output_decides_its_own_column(device):
    """One Philox call decides four consecutive columns (numerics.keep_mask_rows): each of its outputs keeps its
    column at the rate, and the four decisions are independent (all four equal for p^4 + (1 - p)^4 of the
    groups: 1/8 at p = 1/2, where one output copied to four columns would make it 1); a width that is no
    multiple of 4 and several column tiles included."""
    rows, width = 50, 4 * 1025 + 3
    keep = _seeded(torch.ones(rows, width, device=device), 0.5, seed=7) != 0
    for position in range(4):
        assert abs(keep[:, position::4].double().mean().item() - 0.5) < 0.02, position
    groups = keep[:, :4 * 1025].reshape(rows, 1025, 4)
    all_equal = (groups.all(dim=-1) | ~groups.any(dim=-1)).double().mean().item()
    assert abs(all_equal - 0.125) < 0.02, all_equal
    assert not torch.equal(keep[:, :4], keep[:, 4:8])  # the groups of a row differ


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (113, 97), (3, 37, 129)], ids=str)
def test_forward_backward_use_one_mask(shape, dtype, device):
    """y = x * keep / (1 - p) and dx = dy * keep / (1 - p) with the same keep, against float64, within
    the tolerance rule (PyTorch's own error: the same expression in the test dtype)."""
    p = 0.3
    x = _randn(*shape, dtype=dtype, device=device).requires_grad_()
    dy = _randn(*shape, dtype=dtype, device=device, seed=1)
    y = _seeded(x, p, seed=1234)
    (dx,) = torch.autograd.grad(y, x, dy)
    keep = torch.ones(shape, device=device)
    keep = _seeded(keep, p, seed=1234) != 0
    if x.numel() > 1:
        assert not keep.all() and keep.any()
    for name, got, source in (("y", y, x.detach()), ("dx", dx, dy)):
        exact = torch.where(keep, source.double() / (1 - p), 0.0)
        in_dtype = torch.where(keep, source / (1 - p), 0.0)
        assert got.dtype == dtype
        assert_within_rule(name, got, in_dtype, exact)
        assert torch.equal(got == 0, ~keep | (source == 0))


def test_saves_only_the_seed(device):
    """What autograd keeps for the backward: the int64 seed (8 bytes), no mask and no copy of x."""
    x = _randn(64, 256, device=device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = dk.dropout(x, 0.1)
    assert [(t.dtype, t.numel()) for t in saved] == [(torch.int64, 1)]
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(dx == 0, y == 0)


def test_not_training_or_zero_p_is_identity(device):
    x = _randn(7, 384, device=device)
    assert dk.dropout(x, 0.5, training=False) is x
    assert dk.dropout(x, 0.0) is x


def test_non_contiguous_input_and_gradient(device):
    """A transposed x, and an expanded upstream gradient (zero strides, from y.sum()), give the mask of
    the same logical elements as their contiguous copies."""
    x = _randn(384, 37, device=device).t()
    assert not x.is_contiguous()
    y = _seeded(x, 0.2, seed=3)
    assert torch.equal(y, _seeded(x.contiguous(), 0.2, seed=3))
    leaf = x.detach().requires_grad_()
    torch.manual_seed(3)
    dk.dropout(leaf, 0.2).sum().backward()
    assert torch.equal(leaf.grad, torch.where(y != 0, 1.0 / 0.8, 0.0))


def test_bitwise_deterministic(device):
    x = _randn(113, 1000, dtype=torch.float16, device=device)

    def run():
        leaf = x.detach().requires_grad_()
        y = _seeded(leaf, 0.1, seed=21)
        return y, torch.autograd.grad(y, leaf, torch.ones_like(y))[0]

    (y1, dx1), (y2, dx2) = run(), run()
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2)


def test_ops_dispatch(device):
    """ops.dropout runs this kernel with backend="triton" (same seed draw, same bits) and F.dropout with
    backend="torch"."""
    x = _randn(7, 384, dtype=torch.bfloat16, device=device)
    torch.manual_seed(4)
    y_ops = ops.dropout(x, 0.2, True, backend="triton")
    assert torch.equal(y_ops, _seeded(x, 0.2, seed=4))
    torch.manual_seed(4)
    y_torch = ops.dropout(x, 0.2, True, backend="torch")
    torch.manual_seed(4)
    assert torch.equal(y_torch, torch.nn.functional.dropout(x, 0.2, True))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(backend, device):
    """torch.compile traces the op without graph breaks, through the fake and autograd registrations,
    and computes the same bits as eager with the same seed draw."""
    x = _randn(7, 384, device=device)

    def fn(x_):
        return dk.dropout(x_, 0.2) * 2.0

    def run(f):
        leaf = x.detach().requires_grad_()
        torch.manual_seed(3)
        y = f(leaf)
        return y, torch.autograd.grad(y, leaf, torch.ones_like(y))[0]

    torch._dynamo.reset()
    (y_c, dx_c), (y_e, dx_e) = run(torch.compile(fn, backend=backend, fullgraph=True)), run(fn)
    assert torch.equal(y_c, y_e) and torch.equal(dx_c, dx_e)


def test_custom_op_registrations(device):
    """opcheck: schema, fake (meta) implementation and autograd registration agree with the kernel."""
    x = _randn(4, 128, device=device).requires_grad_()
    seed = torch.tensor([123], dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.fastbert.dropout.default, (x, seed, 0.2))


@pytest.mark.parametrize("x,p,message", [
    (torch.ones(4, 8, dtype=torch.float64), 0.1, "x has dtype torch.float64"),
    (torch.ones(4, 8), 1.0, "p must be in [0, 1), got 1.0"),
    (torch.ones(4, 8), -0.1, "p must be in [0, 1), got -0.1"),
    (torch.ones(1, dk.MAX_LAST_DIM + 1, device="meta"), 0.1, f"x has last dimension {dk.MAX_LAST_DIM + 1}"),
], ids=["float64", "p=1", "p<0", "last_dim"])
def test_bad_input(x, p, message, monkeypatch):
    monkeypatch.setattr(dk, "_dropout_kernel", None)  # the check comes before any launch
    with pytest.raises(ValueError) as error:
        dk.dropout(x, p)
    assert message in str(error.value)
