"""kernels/layer_norm.py's pre-LN switches (issue 20, ModernBERT): bias=None (nn.LayerNorm(bias=False)) and
return_residual (the pre-LN residual stream summed = dropout(x) + residual returned beside its LayerNorm,
its gradient added in the backward), both backwards (save="output", save="input"), against a float64
reference with the tolerance rule in fp32, fp16 and bf16; odd sizes, non-contiguous inputs, dropout,
determinism, the ops dispatch and the argument checks. What each variant saves for the backward is counted
in tests/test_saved_tensors.py."""
import pytest
import torch
import torch.nn.functional as F
from layer_norm_yardstick import backward_from_rounded_output
from tolerance import GRADIENT_FACTOR, assert_within_rule, pytorch_in

from fastbert import ops, reference
from fastbert.kernels import layer_norm as ln

EPS = 1e-5  # ModernBERT's norm_eps
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# rows 1, 7, 37 and hidden sizes that are no power of two (the kernel's BLOCK_H masks the rest)
SHAPES = [(1, 37), (7, 129), (37, 768), (5, 7, 97)]


def _inputs(shape, dtype, device, seed=0, with_bias=True):
    """x, residual, weight (|w| >= MIN_WEIGHT: the backward from the output needs it), bias (or None),
    dy and dsummed."""
    generator = torch.Generator().manual_seed(seed)
    hidden = shape[-1]

    def rand(*size):
        return torch.randn(*size, generator=generator).to(device, dtype)

    weight = 1.0 + 0.5 * rand(hidden)
    weight = torch.where(weight < 0, -1.0, 1.0).to(dtype) * weight.abs().clamp(min=ln.MIN_WEIGHT)
    return rand(*shape), rand(*shape), weight, rand(hidden) if with_bias else None, rand(*shape), rand(*shape)


def _run(fn, x, residual, weight, bias, dy, dsummed):
    """fn's (normed, summed) and the gradients of <normed, dy> + <summed, dsummed> w.r.t. x, residual, weight
    and bias (when there is one): a loss that reads both outputs."""
    leaves = [t.detach().requires_grad_() for t in (x, residual, weight)]
    bias_leaf = None if bias is None else bias.detach().requires_grad_()
    normed, summed = fn(*leaves, bias_leaf)
    loss = (normed.double() * dy.double()).sum() + (summed.double() * dsummed.double()).sum()
    grads = torch.autograd.grad(loss, leaves + ([] if bias_leaf is None else [bias_leaf]))
    return (normed.detach(), summed.detach()), grads


def _reference(keep=None, dropout_p=0.0):
    """reference.layer_norm with return_residual; `keep` stands for the kernel's dropout mask."""
    def fn(x, residual, weight, bias):
        if keep is not None:
            x = x * (keep.to(x.dtype) / (1.0 - dropout_p))
        return reference.layer_norm(x, weight, bias, EPS, residual, return_residual=True)
    return fn


def _kernel(save, dropout_p=0.0):
    def fn(x, residual, weight, bias):
        return ln.layer_norm(x, weight, bias, EPS, residual, dropout_p, True, save=save, return_residual=True)
    return fn


def _assert_within_rule(kernel_fn, inputs, save, keep=None, dropout_p=0.0):
    """The rule against PyTorch's error as tolerance.pytorch_in models it (the same on every machine); for
    save="output" in fp16 and bf16 the gradients' against the exact backward from the rounded output
    (layer_norm_yardstick: what that mode keeps)."""
    (normed, summed), grads = _run(kernel_fn, *inputs)
    with pytorch_in(inputs[0].dtype):
        (torch_normed, torch_summed), torch_grads = _run(_reference(keep, dropout_p), *inputs)
    x, residual, weight, bias, dy, dsummed = inputs
    if save == "output" and x.dtype in (torch.float16, torch.bfloat16):
        rounded = backward_from_rounded_output(x, residual, weight, bias, dy, EPS, dsummed, keep, dropout_p,
                                               summed_as_stored=True)
        torch_grads = [rounded[name] for name in ("dx", "dresidual", "dweight", "dbias") if name in rounded]
    exact_inputs = [None if t is None else t.double() for t in inputs]
    (exact_normed, exact_summed), exact_grads = _run(_reference(keep, dropout_p), *exact_inputs)
    assert normed.dtype == summed.dtype == inputs[0].dtype
    assert_within_rule("normed", normed, torch_normed, exact_normed)
    assert_within_rule("summed", summed, torch_summed, exact_summed)
    if keep is None:  # the stream is x + residual rounded once, as PyTorch's own addition rounds it
        assert torch.equal(summed, torch_summed)
    for name, g, tg, eg in zip(("dx", "dresidual", "dweight", "dbias"), grads, torch_grads, exact_grads):
        assert_within_rule(name, g, tg, eg, GRADIENT_FACTOR)
    return (normed, summed), grads


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("save", ln.SAVE_CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_return_residual_matches_reference(shape, dtype, save, with_bias, device):
    inputs = _inputs(shape, dtype, device, seed=shape[0], with_bias=with_bias)
    _assert_within_rule(_kernel(save), inputs, save)


@pytest.mark.parametrize("save", ln.SAVE_CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 37), (37, 129), (3, 5, 768)], ids=str)
def test_no_bias_equals_layer_norm_without_bias(shape, dtype, save, device):
    """bias=None without a residual against nn.LayerNorm(bias=False) (float64 for the rule, and the module
    in the test dtype for PyTorch's own error, as _assert_within_rule bounds it): output, dx and dweight."""
    x, _, weight, _, dy, _ = _inputs(shape, dtype, device, seed=3)
    module = torch.nn.LayerNorm(shape[-1], eps=EPS, bias=False, dtype=dtype, device=device)
    assert module.bias is None
    with torch.no_grad():
        module.weight.copy_(weight)

    def run(fn, x_in, dy_in):
        leaf = x_in.detach().requires_grad_()
        y = fn(leaf)
        grads = torch.autograd.grad(y, [leaf] + [p for p in module.parameters() if p.dtype == x_in.dtype], dy_in)
        return y.detach(), grads

    y, (dx, dweight) = run(lambda t: ln.layer_norm(t, module.weight, None, EPS, save=save), x, dy)
    with pytorch_in(dtype):
        torch_y, (torch_dx, torch_dweight) = run(module, x, dy)
    if save == "output" and dtype in (torch.float16, torch.bfloat16):
        rounded = backward_from_rounded_output(x, None, module.weight.detach(), None, dy, EPS)
        torch_dx, torch_dweight = rounded["dx"], rounded["dweight"]
    module.double()
    exact_y, (exact_dx, exact_dweight) = run(module, x.double(), dy.double())
    assert_within_rule("y", y, torch_y, exact_y)
    assert_within_rule("dx", dx, torch_dx, exact_dx, GRADIENT_FACTOR)
    assert_within_rule("dweight", dweight, torch_dweight, exact_dweight, GRADIENT_FACTOR)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous(dtype, device):
    """x a column slice, the residual a transpose, weight and bias every other element, both upstream
    gradients strided (one with zero strides, as from summed.sum())."""
    rows, hidden = 37, 129
    x, residual, weight, bias, dy, _ = _inputs((rows, hidden), dtype, device, seed=5)
    x = torch.cat([x, x.flip(1)], dim=1)[:, :hidden]
    residual = residual.t().contiguous().t()
    weight, bias = (torch.stack([t, t.flip(0)], dim=1).flatten()[::2] for t in (weight, bias))
    dy = torch.cat([dy, dy], dim=1)[:, ::2]
    dsummed = torch.ones((), dtype=dtype, device=device).expand(rows, hidden)
    assert not any(t.is_contiguous() for t in (x, residual, weight, bias, dy, dsummed))
    for save in ln.SAVE_CHOICES:
        _assert_within_rule(_kernel(save), [x, residual, weight, bias, dy, dsummed], save)


@pytest.mark.parametrize("save", ln.SAVE_CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout(dtype, save, device):
    """summed = dropout(x) + residual under the seed's mask (read off summed itself with x = 1, residual =
    0), the rule against the reference under that mask, and dx zero exactly where the forward dropped."""
    shape, dropout_p, seed = (113, 768), 0.3, 1234
    torch.manual_seed(seed)
    ones = torch.ones(shape, device=device)
    _, keep_summed = ln.layer_norm(ones, ones[0], None, EPS, torch.zeros_like(ones), dropout_p, True,
                                   return_residual=True)
    keep = keep_summed > 0
    assert torch.equal(keep_summed[keep], torch.full_like(keep_summed[keep], 1.0 / (1.0 - dropout_p)))
    dropped = 1.0 - keep.double().mean().item()
    assert abs(dropped - dropout_p) < 0.01

    def seeded(*args):
        torch.manual_seed(seed)
        return _kernel(save, dropout_p)(*args)

    _, grads = _assert_within_rule(seeded, list(_inputs(shape, dtype, device, seed=6)), save, keep, dropout_p)
    assert torch.equal(grads[0] == 0, ~keep)


def test_summed_gradient_reaches_x_and_residual(device):
    """With dy = 0 the only gradient is summed's: dresidual equals dsummed and dx equals it too (no dropout),
    bit for bit, from either backward."""
    x, residual, weight, bias, _, dsummed = _inputs((7, 129), torch.float32, device, seed=7)
    for save in ln.SAVE_CHOICES:
        _, (dx, dresidual, dweight, dbias) = _run(_kernel(save), x, residual, weight, bias, torch.zeros_like(x),
                                                  dsummed)
        assert torch.equal(dresidual, dsummed) and torch.equal(dx, dsummed), save
        assert not dweight.any() and not dbias.any()


def test_normed_is_the_layer_norm_of_summed_as_stored(device):
    """In bf16, normed equals the kernel's own LayerNorm of the returned summed (the stream as stored, as
    transformers' `hidden = hidden + out; norm(hidden)` reads it), bit for bit."""
    x, residual, weight, _, _, _ = _inputs((37, 768), torch.bfloat16, device, seed=8)
    normed, summed = ln.layer_norm(x, weight, None, EPS, residual, return_residual=True)
    assert torch.equal(normed, ln.layer_norm(summed, weight, None, EPS))


def test_bitwise_deterministic(device):
    x, residual, weight, bias, dy, dsummed = _inputs((113, 768), torch.bfloat16, device, seed=9)

    def run(save):
        torch.manual_seed(21)
        return _run(_kernel(save, 0.1), x, residual, weight, None, dy, dsummed)

    for save in ln.SAVE_CHOICES:
        (first_out, first_grads), (second_out, second_grads) = run(save), run(save)
        assert all(torch.equal(a, b) for a, b in zip(first_out + first_grads, second_out + second_grads)), save


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_ops_dispatch(backend, device):
    """ops.layer_norm with return_residual and bias=None: the kernel's bits on "triton", the reference's
    (transformers' pre-LN arithmetic: an addition, then F.layer_norm without a bias) on "torch"."""
    x, residual, weight, _, _, _ = _inputs((3, 7, 129), torch.bfloat16, device, seed=10)
    normed, summed = ops.layer_norm(x, weight, None, EPS, residual, backend=backend, return_residual=True)
    if backend == "triton":
        expected = ln.layer_norm(x, weight, None, EPS, residual, return_residual=True)
    else:
        stream = x + residual
        expected = (F.layer_norm(stream, (129,), weight, None, EPS), stream)
    assert torch.equal(normed, expected[0]) and torch.equal(summed, expected[1])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_arguments(backend, device, monkeypatch):
    """Refused before any kernel runs, naming the argument."""
    monkeypatch.setattr(ln, "_layer_norm_fwd_kernel", None)  # a launch would raise TypeError, not ValueError
    x, residual, weight, _, _, _ = _inputs((4, 64), torch.float32, device)
    with pytest.raises(ValueError, match="return_residual=True needs a residual"):
        ops.layer_norm(x, weight, None, EPS, None, backend=backend, return_residual=True)
    with pytest.raises(ValueError, match="bias has last dimension 63"):
        ops.layer_norm(x, weight, weight[:63], EPS, residual, backend=backend)
    # the right last dimension, one too many dimensions: fastbert.ops checks the shapes, the kernel its limits only
    with pytest.raises(ValueError, match=r"weight has shape \(2, 64\), expected \(64,\)"):
        ops.layer_norm(x, weight.expand(2, 64), None, EPS, residual, backend=backend)
    with pytest.raises(ValueError, match=r"bias has shape \(1, 64\), expected \(64,\)"):
        ops.layer_norm(x, weight, weight[None], EPS, residual, backend=backend)
    with pytest.raises(ValueError, match="return_residual=True needs a residual"):
        ln.layer_norm(x, weight, None, EPS, None, return_residual=True)
    with pytest.raises(ValueError, match=r"bias has shape \(63,\), expected \(64,\)"):
        ln.layer_norm(x, weight, weight[:63], EPS)


def test_custom_op_registrations(device):
    """opcheck over the new arguments: schema, fake implementation and autograd agree with the kernel."""
    x, residual, weight, _, _, _ = _inputs((4, 128), torch.float32, device, seed=11)
    seed = torch.tensor([123], dtype=torch.int64, device=device)
    for save_output in (True, False):
        for dropout in (False, True):
            args = (x.clone().requires_grad_(), weight.clone().requires_grad_(), None,
                    residual.clone().requires_grad_(), seed if dropout else None, EPS, 0.2 if dropout else 0.0,
                    torch.float32, save_output, True)
            torch.library.opcheck(torch.ops.fastbert.layer_norm_fwd.default, args)
