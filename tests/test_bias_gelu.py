"""kernels/bias_gelu.py: gelu(x + bias) and gelu(x @ weight.T + bias) (both forms), forward and
backward, against a float64 reference with the tolerance rule; non-contiguous inputs, determinism,
torch.compile tracing, bad inputs."""
import contextlib

import pytest
import torch
from strided import past_int32
from tolerance import GRADIENT_FACTOR, assert_within_rule

from fastbert import ops, reference
from fastbert.kernels import bias_gelu as kernel
from fastbert.kernels import matmul
from fastbert.kernels.fused_op import always_custom_op
from fastbert.kernels.numerics import INTERPRETER

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FULL_SIZE = pytest.mark.slow(reason="1000 rows of BERT-large's width in the interpreter; odd sizes and several "
                                    "row blocks are the smaller cases'")


def _run(fn, inputs, grad_out):
    """fn(*inputs) and the gradients of <fn(...), grad_out> w.r.t. every input."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def _check_against_reference(fn, ref_fn, inputs, grad_out, names):
    """fn on inputs vs ref_fn on the same inputs in their dtype (torch's own error) and in float64."""
    out, grads = _run(fn, inputs, grad_out)
    torch_out, torch_grads = _run(ref_fn, inputs, grad_out)
    exact_out, exact_grads = _run(ref_fn, [t.double() for t in inputs], grad_out.double())
    assert_within_rule("forward", out, torch_out, exact_out)
    for name, g, tg, eg in zip(names, grads, torch_grads, exact_grads):
        assert_within_rule(name, g, tg, eg, GRADIENT_FACTOR)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("rows, hidden", [(1, 384), (7, 1000), (113, 768), pytest.param(1000, 1024, marks=FULL_SIZE)])
def test_bias_gelu_matches_reference(rows, hidden, approximate, dtype, device):
    torch.manual_seed(rows + hidden)
    x = 3 * torch.randn(rows, hidden, device=device, dtype=dtype)
    bias = torch.randn(hidden, device=device, dtype=dtype)
    dy = torch.randn(rows, hidden, device=device, dtype=dtype)
    _check_against_reference(lambda a, b: kernel.bias_gelu(a, b, approximate),
                             lambda a, b: reference.bias_gelu(a, b, approximate), [x, bias], dy, ["dx", "dbias"])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_gelu_noncontiguous_and_batched(dtype, device):
    torch.manual_seed(0)
    # [S, B, H] transposed to [B, S, H]: the leading dims do not merge, so x is read through a copy;
    # a column slice keeps a 2-D view with row stride != H, read through its strides; bias every other.
    x_t = torch.randn(37, 3, 384, device=device, dtype=dtype).transpose(0, 1)
    x_slice = torch.randn(97, 1000, device=device, dtype=dtype)[:, 7:391]
    bias = torch.randn(768, device=device, dtype=dtype)[::2]
    for x in (x_t, x_slice):
        assert not x.is_contiguous()
        dy = torch.randn(*x.shape[:-1], 2 * x.shape[-1], device=device, dtype=dtype)[..., ::2]
        _check_against_reference(lambda a, b: kernel.bias_gelu(a, b, "tanh"),
                                 lambda a, b: reference.bias_gelu(a, b, "tanh"), [x, bias], dy, ["dx", "dbias"])


@pytest.mark.parametrize("form", kernel.LINEAR_BIAS_GELU_FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, in_features, out_features, approximate",
                         [(1, 384, 1536, "none"), (7, 1000, 384, "tanh"), (113, 768, 1000, "none"),
                          pytest.param(1000, 1024, 384, "tanh", marks=FULL_SIZE)])
def test_linear_bias_gelu_matches_reference(rows, in_features, out_features, approximate, dtype, form, device):
    torch.manual_seed(rows + in_features)
    x = torch.randn(rows, in_features, device=device, dtype=dtype)
    weight = torch.randn(out_features, in_features, device=device, dtype=dtype) * in_features ** -0.5
    bias = torch.randn(out_features, device=device, dtype=dtype)
    dy = torch.randn(rows, out_features, device=device, dtype=dtype)
    _check_against_reference(lambda a, w, b: kernel.linear_bias_gelu(a, w, b, approximate, form=form),
                             lambda a, w, b: reference.linear_bias_gelu(a, w, b, approximate),
                             [x, weight, bias], dy, ["dx", "dweight", "dbias"])


@pytest.mark.parametrize("form", kernel.LINEAR_BIAS_GELU_FORMS)
def test_linear_bias_gelu_noncontiguous_batched(form, device):
    torch.manual_seed(1)
    x = torch.randn(2, 400, 7, device=device).transpose(1, 2)[:, :, 3:387]  # [2, 7, 384], strided
    weight = torch.randn(384, 1000, device=device).t()  # [1000, 384], column-major
    bias = torch.randn(2000, device=device)[::2]
    dy = torch.randn(2, 7, 1000, device=device)
    _check_against_reference(lambda a, w, b: kernel.linear_bias_gelu(a, w, b, "none", form=form),
                             lambda a, w, b: reference.linear_bias_gelu(a, w, b, "none"),
                             [x, weight, bias], dy, ["dx", "dweight", "dbias"])


def test_linear_bias_gelu_form_switch(monkeypatch, device):
    """The module constant names the form linear_bias_gelu (the model's path) runs."""
    assert kernel.LINEAR_BIAS_GELU_FORM == "epilogue"
    torch.manual_seed(2)
    x, weight, bias = (torch.randn(7, 384, device=device), torch.randn(512, 384, device=device) / 20,
                       torch.randn(512, device=device))
    per_form = {form: kernel.linear_bias_gelu(x, weight, bias, "none", form=form)
                for form in kernel.LINEAR_BIAS_GELU_FORMS}
    # The forms round differently, so equality identifies which one ran.
    assert not torch.equal(per_form["epilogue"], per_form["cublas_then_bias_gelu"])
    for form in kernel.LINEAR_BIAS_GELU_FORMS:
        monkeypatch.setattr(kernel, "LINEAR_BIAS_GELU_FORM", form)
        assert torch.equal(kernel.linear_bias_gelu(x, weight, bias, "none"), per_form[form])


def test_deterministic(device):
    torch.manual_seed(3)
    x = torch.randn(113, 384, device=device, dtype=torch.float16)
    bias = torch.randn(384, device=device, dtype=torch.float16)
    weight = torch.randn(384, 384, device=device, dtype=torch.float16) / 20
    dy = torch.randn(113, 384, device=device, dtype=torch.float16)
    for fn, inputs in ((lambda a, b: kernel.bias_gelu(a, b, "none"), [x, bias]),
                       (lambda a, w, b: kernel.linear_bias_gelu(a, w, b, "tanh", form="epilogue"),
                        [x, weight, bias])):
        first, second = _run(fn, inputs, dy), _run(fn, inputs, dy)
        assert torch.equal(first[0], second[0])
        for g1, g2 in zip(first[1], second[1]):
            assert torch.equal(g1, g2)


def test_torch_compile_fullgraph(device):
    torch.manual_seed(4)
    x = torch.randn(7, 384, device=device, requires_grad=True)
    weight = torch.randn(1000, 384, device=device, requires_grad=True)
    bias = torch.randn(1000, device=device, requires_grad=True)

    def layer(x, weight, bias):
        return kernel.bias_gelu(kernel.linear_bias_gelu(x, weight, bias, "tanh"), bias, "none").sum()

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    compiled(x, weight, bias).backward()
    compiled_grads = [t.grad.clone() for t in (x, weight, bias)]
    for t in (x, weight, bias):
        t.grad = None
    layer(x, weight, bias).backward()
    for compiled_grad, t in zip(compiled_grads, (x, weight, bias)):
        assert torch.equal(compiled_grad, t.grad)


def test_ops_dispatch_to_kernel(device):
    torch.manual_seed(5)
    x, bias = torch.randn(7, 384, device=device), torch.randn(384, device=device)
    assert torch.equal(ops.bias_gelu(x, bias, backend="triton"), kernel.bias_gelu(x, bias))
    weight = torch.randn(384, 384, device=device)
    assert torch.equal(ops.linear_bias_gelu(x, weight, bias, backend="triton"),
                       kernel.linear_bias_gelu(x, weight, bias))


@pytest.mark.parametrize("entrance", ["eager", "custom op"])
@pytest.mark.parametrize("no_grad", [True, False], ids=["no_grad", "frozen inputs"])
def test_linear_bias_gelu_inference_keeps_no_pre_activation(entrance, no_grad, device, monkeypatch):
    """Where no backward can follow (grad mode off, or no input needing a gradient) the epilogue matmul is given no
    pre-activation h to store (only the backward reads it): [M, N] neither allocated nor written, and gelu(h) is the
    training forward's, through the eager call and the custom op: bitwise under the interpreter (one config); on a
    GPU STORE_PRE is in the matmul's autotune key, so the two may run other tiles and sum K in another order."""
    torch.manual_seed(6)
    x = torch.randn(2, 7, 64, device=device)
    weight, bias = torch.randn(96, 64, device=device) / 8, torch.randn(96, device=device)
    entered = contextlib.nullcontext if entrance == "eager" else always_custom_op
    context = torch.no_grad if no_grad else contextlib.nullcontext

    def forward(trainable):
        with entered(), (contextlib.nullcontext() if trainable else context()):
            return kernel.linear_bias_gelu(x, weight.requires_grad_(trainable), bias, "none", form="epilogue")

    stored = []
    with monkeypatch.context() as patch:
        patch.setattr(kernel, "matmul_fwd", lambda x, weight, bias, y, activation, pre, gated: stored.append(pre))
        forward(True), forward(False)
    assert stored[0].shape == (14, 96) and stored[1] is None
    trained, inferred = forward(True), forward(False)
    assert trained.requires_grad and not inferred.requires_grad
    if INTERPRETER:
        assert torch.equal(inferred, trained.detach())
    else:
        torch.testing.assert_close(inferred, trained.detach())


@pytest.mark.parametrize("entrance", ["eager", "custom op"])
def test_inference_ops_refuse_a_backward(entrance, device):
    """Called directly on an input that requires grad (their public functions never do), the inference ops'
    outputs raise at backward, naming what to call, through either entrance."""
    x = torch.randn(7, 64, device=device, requires_grad=True)
    weight, bias = torch.randn(96, 64, device=device), torch.randn(96, device=device)
    with contextlib.nullcontext() if entrance == "eager" else always_custom_op():
        y = kernel._linear_bias_gelu_infer_op(x, weight, bias, "none")
    with pytest.raises(RuntimeError, match="linear_bias_gelu_infer keeps no pre-activation.*call fastbert::linear_"):
        y.sum().backward()


HUGE_STRIDE = 2**30 + 1  # fits int32; two of it do not


def test_bias_gelu_column_offsets_past_int32(device):
    """x and dy [2, 3] whose column stride times 2 passes 2**31: the same results as contiguous copies."""
    torch.manual_seed(7)
    x, dy = torch.randn(2, 2, 3, device=device, dtype=torch.float16).unbind(0)
    bias = torch.randn(3, device=device, dtype=torch.float16)
    y = kernel.bias_gelu_fwd(x, bias)
    dx, dbias = kernel.bias_gelu_bwd(dy, x, bias)
    strided = past_int32(x, (1, HUGE_STRIDE))
    assert torch.equal(kernel.bias_gelu_fwd(strided, bias), y)
    del strided
    dx_strided, dbias_strided = kernel.bias_gelu_bwd(past_int32(dy, (1, HUGE_STRIDE)), x, bias)
    assert torch.equal(dx_strided, dx) and torch.equal(dbias_strided, dbias)


BLOCK_K = matmul._matmul_fwd_kernel.configs[0].kwargs["BLOCK_K"]  # the interpreter's one config


@pytest.mark.parametrize("operand", ["x", "weight"])
@pytest.mark.parametrize("inner,stride", [(3, HUGE_STRIDE), (BLOCK_K + 1, 2**31 // BLOCK_K + 1)],
                         ids=["offsets", "steps"])
def test_matmul_k_offsets_past_int32(operand, inner, stride, device):
    """x [2, K] or weight [4, K] whose K stride passes 2**31 within one K tile (K = 3), or only in the step
    from one K tile to the next (K = BLOCK_K + 1), in the epilogue matmul of kernels/matmul.py: the same
    output as with contiguous operands."""
    torch.manual_seed(8)
    x = torch.randn(2, inner, device=device, dtype=torch.float16)
    weight = torch.randn(4, inner, device=device, dtype=torch.float16)
    bias = torch.randn(4, device=device, dtype=torch.float16)
    expected = kernel.linear_bias_gelu(x, weight, bias, form="epilogue")
    if operand == "x":
        x = past_int32(x, (1, stride))
    else:
        weight = past_int32(weight, (1, stride))
    assert torch.equal(kernel.linear_bias_gelu(x, weight, bias, form="epilogue"), expected)


def test_bad_inputs(device):
    x = torch.randn(7, 384, device=device)
    bias = torch.randn(384, device=device)
    weight = torch.randn(512, 384, device=device)
    with pytest.raises(ValueError, match="bias has shape"):
        kernel.bias_gelu(x, bias[:100])
    with pytest.raises(ValueError, match="approximate must be one of"):
        kernel.bias_gelu(x, bias, "sigmoid")
    with pytest.raises(ValueError, match="dtype torch.int64"):
        kernel.bias_gelu(x.long(), bias.long())
    with pytest.raises(ValueError, match="bias is torch.float16"):
        kernel.bias_gelu(x, bias.half())
    with pytest.raises(ValueError, match="bias has shape"):
        kernel.linear_bias_gelu(x, weight, bias)
    with pytest.raises(ValueError, match=r"weight \[N, K\] must share K"):
        kernel.linear_bias_gelu(x, weight[:, :100], weight[:, 0])
    with pytest.raises(ValueError, match="weight has dtype torch.float16"):
        kernel.linear_bias_gelu(x, weight.half(), weight[:, 0])
    with pytest.raises(ValueError, match="form must be one of"):
        kernel.linear_bias_gelu(x, weight, weight[:, 0], "none", form="cudnn")


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bf16_full_size(approximate, device):
    """The FFN up-projection at BERT-large's width: 1000 x 1024 x 4096 (slow in the interpreter)."""
    torch.manual_seed(6)
    x = torch.randn(1000, 1024, device=device, dtype=torch.bfloat16)
    weight = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16) / 32
    bias = torch.randn(4096, device=device, dtype=torch.bfloat16)
    dy = torch.randn(1000, 4096, device=device, dtype=torch.bfloat16)
    for form in kernel.LINEAR_BIAS_GELU_FORMS:
        _check_against_reference(lambda a, w, b: kernel.linear_bias_gelu(a, w, b, approximate, form=form),
                                 lambda a, w, b: reference.linear_bias_gelu(a, w, b, approximate),
                                 [x, weight, bias], dy, ["dx", "dweight", "dbias"])
    _check_against_reference(lambda a, b: kernel.bias_gelu(a, b, approximate),
                             lambda a, b: reference.bias_gelu(a, b, approximate), [x @ weight.t(), bias], dy,
                             ["dx", "dbias"])
