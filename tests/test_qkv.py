"""kernels/qkv.py: x @ Wqkv.T + bias stored as q, k, v in the attention layout, forward and backward,
against a float64 reference with the tolerance rule; padded [B, S, H] and packed [T, H] inputs,
non-contiguous inputs and gradients, determinism, torch.compile tracing, bad inputs."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from strided import past_int32
from tolerance import GRADIENT_FACTOR, assert_within_rule

from fastbert import ops, reference
from fastbert.kernels import attention
from fastbert.kernels import qkv as kernel

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _run(fn, inputs, grads_out):
    """(q, k, v) = fn(*inputs) and the gradients of sum_i <out_i, grads_out_i> w.r.t. every input."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads_out)])
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _inputs(shape, dtype, device, seed):
    torch.manual_seed(seed)
    hidden = shape[-1]
    x = torch.randn(*shape, device=device, dtype=dtype)
    weight = torch.randn(3 * hidden, hidden, device=device, dtype=dtype) * hidden ** -0.5
    bias = torch.randn(3 * hidden, device=device, dtype=dtype)
    return x, weight, bias


def _strided_grads(like, dtype, device):
    """Three gradients shaped like q, k, v: [B, heads, S, d] made as [B, S, heads, d].transpose(1, 2),
    the layout an attention backward may hand back; packed [T, heads, d] as a stride-2 slice."""
    if like.dim() == 4:
        batch, heads, seqlen, head_dim = like.shape
        return [torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
                for _ in range(3)]
    return [torch.randn(*like.shape[:-1], 2 * like.shape[-1], device=device, dtype=dtype)[..., ::2]
            for _ in range(3)]


def _check_against_reference(x, weight, bias, num_heads, grads):
    fn = lambda *t: kernel.qkv_projection(*t, num_heads)  # noqa: E731
    ref = lambda *t: reference.qkv_projection(*t, num_heads)  # noqa: E731
    outs, in_grads = _run(fn, [x, weight, bias], grads)
    torch_outs, torch_grads = _run(ref, [x, weight, bias], grads)
    exact_outs, exact_grads = _run(ref, [x.double(), weight.double(), bias.double()], [g.double() for g in grads])
    for name, out, torch_out, exact in zip("qkv", outs, torch_outs, exact_outs):
        assert out.is_contiguous(), f"{name} is not contiguous"
        assert_within_rule(name, out, torch_out, exact)
    for name, g, tg, eg in zip(("dx", "dweight", "dbias"), in_grads, torch_grads, exact_grads):
        assert_within_rule(name, g, tg, eg, GRADIENT_FACTOR)
    return outs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, num_heads", [((1, 1, 384), 6), ((1, 7, 1000), 8), ((3, 37, 768), 12),
                                              ((2, 500, 384), 6)])
def test_padded_layout_matches_reference(shape, num_heads, dtype, device):
    x, weight, bias = _inputs(shape, dtype, device, seed=sum(shape))
    batch, seqlen, hidden = shape
    grads = _strided_grads(torch.empty(batch, num_heads, seqlen, hidden // num_heads), dtype, device)
    q, k, v = _check_against_reference(x, weight, bias, num_heads, grads)
    assert q.shape == (batch, num_heads, seqlen, hidden // num_heads)
    # Three slices of one [3, B, heads, S, d] buffer: written in place by the matmul, never copied.
    assert k.data_ptr() - q.data_ptr() == v.data_ptr() - k.data_ptr() == q.numel() * q.element_size()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, hidden, num_heads", [(1, 1024, 16), (7, 384, 12), (113, 1024, 16),
                                                       (113, 1000, 8)])
def test_packed_layout_matches_reference(tokens, hidden, num_heads, dtype, device):
    x, weight, bias = _inputs((tokens, hidden), dtype, device, seed=tokens + hidden)
    grads = _strided_grads(torch.empty(tokens, num_heads, hidden // num_heads), dtype, device)
    q, _, _ = _check_against_reference(x, weight, bias, num_heads, grads)
    assert q.shape == (tokens, num_heads, hidden // num_heads)


def test_each_gradient_its_own_layout(device):
    """One launch gathers dq, dk and dv: each read with its own strides (contiguous, transposed heads, a stride-2
    slice of the head dim)."""
    batch, seqlen, hidden, num_heads = 2, 9, 96, 3
    head_dim = hidden // num_heads
    x, weight, bias = _inputs((batch, seqlen, hidden), torch.float32, device, seed=5)
    grads = [torch.randn(batch, num_heads, seqlen, head_dim, device=device),
             torch.randn(batch, seqlen, num_heads, head_dim, device=device).transpose(1, 2),
             torch.randn(batch, num_heads, seqlen, 2 * head_dim, device=device)[..., ::2]]
    assert len({g.stride() for g in grads}) == 3
    _check_against_reference(x, weight, bias, num_heads, grads)


class NoGather:
    """In place of the gather kernel: launching it fails the test, through Triton's own launch (the interpreter
    indexes the kernel with its grid) or fastbert's launch cache (which reads the kernel's attributes)."""

    def __getitem__(self, grid):
        raise AssertionError("the gradients were gathered, not read in place")

    def __getattr__(self, name):
        raise AssertionError("the gradients were gathered, not read in place")


def _attention_layout_grads(like: torch.Tensor, dtype, device) -> list[torch.Tensor]:
    """dq, dk, dv as fastbert's attention backward hands them over: views of one [B, S, 3, heads, d] buffer
    (packed: [T, 3, heads, d])."""
    buffer_shape = ((like.shape[0], 3, *like.shape[1:]) if like.dim() == 3
                    else (like.shape[0], like.shape[2], 3, like.shape[1], like.shape[3]))
    return list(attention.qkv_grads(torch.randn(buffer_shape, device=device, dtype=dtype)))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_attention_layout_gradients_are_read_in_place(layout, device, monkeypatch):
    """dq, dk and dv as the column blocks of one [tokens, 3H] buffer, as the attention backward writes them:
    no gather launch; dx and dweight bitwise those the gather gives for the same values in three tensors of
    their own (the same matmuls of the same matrix), dbias (a torch sum there) within the tolerance rule."""
    shape = (2, 9, 96) if layout == "padded" else (13, 96)
    x, weight, bias = _inputs(shape, torch.float32, device, seed=7)
    like = torch.empty(2, 3, 9, 32) if layout == "padded" else torch.empty(13, 3, 32)
    grads = _attention_layout_grads(like, torch.float32, device)
    gathered = kernel.qkv_projection_bwd(*[g.clone() for g in grads], x, weight)
    monkeypatch.setattr(kernel, "_qkv_bwd_kernel", NoGather())
    for name, got, want in zip(("dx", "dweight"), kernel.qkv_projection_bwd(*grads, x, weight), gathered):
        assert torch.equal(got, want), name
    _check_against_reference(x, weight, bias, 3, grads)
    # the same buffer's blocks in another order (dk first) are not dQKV: gathered
    with pytest.raises(AssertionError, match="gathered"):
        kernel.qkv_projection_bwd(grads[1], grads[0], grads[2], x, weight)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_projection_then_attention_gathers_nothing(layout, device, monkeypatch):
    """fastbert's QKV projection then its attention, as a model's layer runs them: the attention backward's
    gradients reach the projection's backward as one buffer, which it reads without the gather kernel."""
    shape = (2, 9, 96) if layout == "padded" else (13, 96)
    x, weight, bias = _inputs(shape, torch.float32, device, seed=8)
    cu_seqlens = torch.tensor([0, 6, 13], dtype=torch.int32, device=device)

    def layer(x, weight, bias):
        q, k, v = kernel.qkv_projection(x, weight, bias, 3)
        if layout == "padded":
            return attention.attention(q, k, v)
        return attention.attention_varlen(q, k, v, cu_seqlens, 7)

    def reference_layer(x, weight, bias):
        q, k, v = reference.qkv_projection(x, weight, bias, 3)
        if layout == "padded":
            return reference.attention(q, k, v)
        return reference.attention_varlen(q, k, v, cu_seqlens, 7)

    monkeypatch.setattr(kernel, "_qkv_bwd_kernel", NoGather())
    dout = torch.randn(*shape[:-1], 3, 32, device=device)
    if layout == "padded":
        dout = dout.transpose(1, 2)
    (out,), grads = _run(lambda *t: (layer(*t),), [x, weight, bias], [dout])
    (torch_out,), torch_grads = _run(lambda *t: (reference_layer(*t),), [x, weight, bias], [dout])
    (exact_out,), exact_grads = _run(lambda *t: (reference_layer(*t),), [t.double() for t in (x, weight, bias)],
                                     [dout.double()])
    assert_within_rule("out", out, torch_out, exact_out)
    for name, g, tg, eg in zip(("dx", "dweight", "dbias"), grads, torch_grads, exact_grads):
        assert_within_rule(name, g, tg, eg, GRADIENT_FACTOR)


class _CopiedBytes(TorchDispatchMode):
    """The bytes that the ops which only move data (stack, cat, clone, copy_, ...) write while entered."""
    MOVERS = ("aten.stack", "aten.cat", "aten.clone", "aten.copy_", "aten._to_copy", "aten.contiguous")

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func).startswith(self.MOVERS):
            self.bytes += sum(t.numel() * t.element_size() for t in (out if isinstance(out, (tuple, list)) else [out]))
        return out


@pytest.mark.parametrize("shape", [(2, 9, 96), (1, 9, 96), (2, 1, 96)], ids=str)
def test_reference_inference_views_are_those_autograd_gets(shape, device):
    """Without grad mode the reference projection makes q, k, v of a padded [B, S, H] with fewer view ops (one
    permute, no three transposes): the same values, shapes and strides of the same [B, S, 3H] buffer as the form
    whose backward stacks the gradients in place (test below)."""
    x, weight, bias = _inputs(shape, torch.float32, device, seed=10)
    with torch.no_grad():
        inferred = reference.qkv_projection(x, weight, bias, 3)
    trained = reference.qkv_projection(x, weight.requires_grad_(), bias, 3)
    for got, expected in zip(inferred, trained):
        assert torch.equal(got, expected) and got.stride() == expected.stride() and got.shape == expected.shape
        assert got.storage_offset() == expected.storage_offset()


@pytest.mark.parametrize("attention_layout", [True, False], ids=["one-buffer", "three-tensors"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_reference_backward_copies_the_gradients_once(layout, attention_layout, device):
    """The reference projection's backward (PyTorch's autograd of its views; the path fastbert.paths chooses for
    the QKV projection on an H100) writes one copy of dQKV, the stack of the three gradients that its matmuls
    read: unbound after a permute, it also copied that stack back to [tokens, 3H] (a pass over dQKV a layer)."""
    shape = (2, 9, 96) if layout == "padded" else (13, 96)
    x, weight, bias = (t.requires_grad_() for t in _inputs(shape, torch.float32, device, seed=9))
    like = torch.empty(2, 3, 9, 32) if layout == "padded" else torch.empty(13, 3, 32)
    grads = (_attention_layout_grads(like, torch.float32, device) if attention_layout
             else _strided_grads(like, torch.float32, device))
    outs = reference.qkv_projection(x, weight, bias, 3)
    copied = _CopiedBytes()
    with copied:
        torch.autograd.backward(outs, grads)
    assert copied.bytes == x.numel() * 3 * x.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout, has_bias", [("padded", True), ("packed", True), ("padded", False)])
def test_cublas_form_through_ops(layout, has_bias, dtype, device, monkeypatch):
    """Where fastbert.paths chooses "cublas_forward", ops.qkv_projection runs PyTorch's forward (q, k, v bitwise
    the reference's, no Triton projection launched) and this module's backward: attention's one-buffer gradients
    read in place (no gather; autograd's unbind backward would stack them), gradients laid out otherwise
    gathered; both within the tolerance rule against float64; with a bias and without (ModernBERT's)."""
    monkeypatch.setattr(ops, "resolve_backend", lambda backend, *tensors, op=None, **kw: "cublas_forward")

    def no_kernel_forward(*args):
        raise AssertionError("the Triton projection ran where the cuBLAS form was chosen")

    monkeypatch.setattr(kernel, "_qkv_projection_op", no_kernel_forward)
    shape = (2, 9, 96) if layout == "padded" else (13, 96)
    x, weight, bias = _inputs(shape, dtype, device, seed=11)
    inputs = [x, weight, bias] if has_bias else [x, weight]
    like = torch.empty(2, 3, 9, 32) if layout == "padded" else torch.empty(13, 3, 32)

    def projection(project):
        return lambda x, weight, bias=None: project(x, weight, bias, 3)

    for grads, gather in ((_attention_layout_grads(like, dtype, device), NoGather()),
                          (_strided_grads(like, dtype, device), kernel._qkv_bwd_kernel)):
        monkeypatch.setattr(kernel, "_qkv_bwd_kernel", gather)
        outs, in_grads = _run(projection(ops.qkv_projection), inputs, grads)
        torch_outs, torch_grads = _run(projection(reference.qkv_projection), inputs, grads)
        _, exact_grads = _run(projection(reference.qkv_projection), [t.double() for t in inputs],
                              [g.double() for g in grads])
        for name, out, torch_out in zip("qkv", outs, torch_outs):
            assert torch.equal(out, torch_out), name
        for name, g, tg, eg in zip(("dx", "dweight", "dbias"), in_grads, torch_grads, exact_grads):
            assert_within_rule(name, g, tg, eg, GRADIENT_FACTOR)


@pytest.mark.slow(reason="Inductor generates and compiles C++ for the CPU: ~25 s")
@pytest.mark.parametrize("cublas_forward", [False, True], ids=["kernel", "cublas"])
def test_compiled_projection_then_attention_gathers_nothing(cublas_forward, device, monkeypatch):
    """Under torch.compile's Inductor, which hands a custom op views of its buffers made without `_base`, the
    attention backward's buffer still reaches the projection's backward as one matrix: no gather launch, and the
    eager gradients; with the Triton forward and with the cuBLAS form's."""
    x, weight, bias = (t.requires_grad_() for t in _inputs((2, 9, 96), torch.float32, device, seed=9))

    def layer(x, weight, bias):
        q, k, v = kernel.qkv_projection(x, weight, bias, 3, cublas_forward=cublas_forward)
        return attention.attention(q, k, v).square().sum()

    layer(x, weight, bias).backward()
    eager_grads = [t.grad.clone() for t in (x, weight, bias)]
    for t in (x, weight, bias):
        t.grad = None
    monkeypatch.setattr(kernel, "_qkv_bwd_kernel", NoGather())
    torch._dynamo.reset()
    torch.compile(layer, backend="inductor", fullgraph=True)(x, weight, bias).backward()
    for name, eager, t in zip(("dx", "dweight", "dbias"), eager_grads, (x, weight, bias)):
        torch.testing.assert_close(t.grad, eager, msg=name)


def test_noncontiguous_inputs(device):
    # x [B, S, H] as the transpose of [S, B, H] (its leading dims do not merge), and a column-major weight.
    x = torch.randn(37, 3, 384, device=device).transpose(0, 1)
    weight = torch.randn(384, 3 * 384, device=device).t() / 20
    bias = torch.randn(3 * 1152, device=device)[::3]
    assert not (x.is_contiguous() or weight.is_contiguous() or bias.is_contiguous())
    grads = [torch.randn(3, 6, 37, 64, device=device)] * 3
    _check_against_reference(x, weight, bias, 6, grads)


def test_gradient_offsets_past_int32(device):
    """dq, dk, dv [1, 1, 2, 3] whose head-dim stride times 2 passes 2**31: the same gradients as from
    contiguous copies."""
    x, weight, _ = _inputs((1, 2, 3), torch.float16, device, seed=5)
    grads = [torch.randn(1, 1, 2, 3, device=device, dtype=torch.float16) for _ in range(3)]
    expected = kernel.qkv_projection_bwd(*grads, x, weight)
    strided = [past_int32(g, (1, 1, 1, 2**30 + 1)) for g in grads]
    for got, want in zip(kernel.qkv_projection_bwd(*strided, x, weight), expected):
        assert torch.equal(got, want)


def test_deterministic(device):
    x, weight, bias = _inputs((2, 113, 384), torch.float16, device, seed=0)
    grads = _strided_grads(torch.empty(2, 6, 113, 64), torch.float16, device)
    fn = lambda *t: kernel.qkv_projection(*t, 6)  # noqa: E731
    first, second = _run(fn, [x, weight, bias], grads), _run(fn, [x, weight, bias], grads)
    for a, b in zip(first[0] + first[1], second[0] + second[1]):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph(device):
    x, weight, bias = (t.requires_grad_() for t in _inputs((2, 7, 384), torch.float32, device, seed=1))

    def project(x, weight, bias):
        q, k, v = kernel.qkv_projection(x, weight, bias, 6)
        return (q * k + v).sum()

    torch._dynamo.reset()
    compiled = torch.compile(project, backend="eager", fullgraph=True)
    compiled(x, weight, bias).backward()
    compiled_grads = [t.grad.clone() for t in (x, weight, bias)]
    for t in (x, weight, bias):
        t.grad = None
    project(x, weight, bias).backward()
    for compiled_grad, t in zip(compiled_grads, (x, weight, bias)):
        assert torch.equal(compiled_grad, t.grad)


def test_ops_dispatch_to_kernel(device):
    x, weight, bias = _inputs((7, 384), torch.float32, device, seed=2)
    kernel_outs = kernel.qkv_projection(x, weight, bias, 6)
    for a, b in zip(ops.qkv_projection(x, weight, bias, 6, backend="triton"), kernel_outs):
        assert torch.equal(a, b)


def test_bad_inputs(device):
    x, weight, bias = _inputs((2, 7, 384), torch.float32, device, seed=3)
    with pytest.raises(ValueError, match="x must be"):
        kernel.qkv_projection(x[None], weight, bias, 6)
    with pytest.raises(ValueError, match=r"num_heads \(5\) must be a positive int that divides"):
        kernel.qkv_projection(x, weight, bias, 5)
    with pytest.raises(ValueError, match="weight has shape"):
        kernel.qkv_projection(x, weight[:384], bias, 6)
    with pytest.raises(ValueError, match="bias has shape"):
        kernel.qkv_projection(x, weight, bias[:384], 6)
    with pytest.raises(ValueError, match="weight is torch.float16"):
        kernel.qkv_projection(x, weight.half(), bias, 6)
    with pytest.raises(ValueError, match="x has dtype torch.float64"):
        kernel.qkv_projection(x.double(), weight.double(), bias.double(), 6)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, num_heads", [((4, 512, 768), 12), ((1000, 1024), 16)])
def test_bf16_full_size(shape, num_heads, device):
    """BERT-base and -large widths at full batch (slow in the interpreter)."""
    x, weight, bias = _inputs(shape, torch.bfloat16, device, seed=4)
    like = (torch.empty(shape[0], num_heads, shape[1], shape[-1] // num_heads) if len(shape) == 3
            else torch.empty(shape[0], num_heads, shape[-1] // num_heads))
    _check_against_reference(x, weight, bias, num_heads, _strided_grads(like, torch.bfloat16, device))
