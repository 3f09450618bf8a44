"""The GeGLU FFN (issue 20, ModernBERT): kernels/ffn.py gated, (gelu(a) * b) @ w2.T + b2 with [a, b] = x @ w1.T
+ b1, against a float64 reference with the tolerance rule in fp32 / fp16 / bf16 (odd sizes, with and without
biases, both GELUs, recompute_pre, non-contiguous inputs), equal to transformers' ModernBertMLP on the same
tensors, determinism, torch.compile, the ops dispatch and its argument checks; the residual the down-projection
adds (ModernBERT's stream); and the bias-less projections (qkv_projection and feed_forward with bias None) on both
paths. What the GeGLU saves for the backward is counted in tests/test_saved_tensors.py."""
import pytest
import torch
from dispatch_recording import RecordingMode
from tolerance import GRADIENT_FACTOR, assert_within_rule

from fastbert import ops, reference
from fastbert.kernels import bias_gelu, ffn as kernel, matmul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAMES = ["dx", "dw1", "db1", "dw2", "db2", "dresidual"]


def _inputs(rows, hidden, inner, dtype, device, seed=0, with_bias=True, gated=True):
    """x [rows, hidden], w1 [2 * inner, hidden] ([inner, hidden] not gated), b1, w2 [hidden, inner], b2 (None
    without bias), scaled so the pre-activation is O(1)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    projected = 2 * inner if gated else inner
    w1, b1 = randn(projected, hidden, scale=hidden ** -0.5), randn(projected)
    w2, b2 = randn(hidden, inner, scale=inner ** -0.5), randn(hidden)
    return [randn(rows, hidden), w1, b1 if with_bias else None, w2, b2 if with_bias else None]


def _run(fn, inputs, grad_out):
    """fn(*inputs) and the gradients of <fn(...), grad_out> w.r.t. every input that is not None."""
    leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [None if t is None else t.grad for t in leaves]


def _check_against_reference(fn, inputs, grad_out, approximate, ref=reference.feed_forward_geglu):
    out, grads = _run(fn, inputs, grad_out)
    exact = [None if t is None else t.double() for t in inputs]
    torch_out, torch_grads = _run(lambda *t: ref(*t, approximate), inputs, grad_out)
    exact_out, exact_grads = _run(lambda *t: ref(*t, approximate), exact, grad_out.double())
    assert out.dtype == inputs[0].dtype
    assert_within_rule("forward", out, torch_out, exact_out)
    for name, g, tg, eg in zip(NAMES, grads, torch_grads, exact_grads):
        assert (g is None) == (tg is None), name
        if g is not None:
            assert_within_rule(name, g, tg, eg, GRADIENT_FACTOR)


@pytest.mark.parametrize("recompute_pre", [False, True], ids=["keep_pre", "recompute_pre"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden, inner, approximate, with_bias",
                         [(1, 64, 96, "none", False), (7, 37, 29, "tanh", True), (37, 129, 97, "none", True),
                          (37, 48, 300, "tanh", False)])
def test_matches_reference(rows, hidden, inner, approximate, with_bias, dtype, recompute_pre, device):
    """Odd sizes: I not a multiple of any tile (the gate half then starts mid-tile in w1), K below and above
    one BLOCK_K."""
    inputs = _inputs(rows, hidden, inner, dtype, device, seed=rows, with_bias=with_bias)
    grad_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows + 1)).to(device, dtype)
    _check_against_reference(lambda *t: kernel.feed_forward_geglu(*t, approximate, recompute_pre), inputs,
                             grad_out, approximate)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_noncontiguous_inputs(dtype, device):
    """x [B, S, H] transposed from [S, B, H], column-major weights, biases read every other element, a
    strided output gradient."""
    x, w1, b1, w2, b2 = _inputs(3 * 37, 64, 80, dtype, device, seed=5)
    inputs = [x.view(37, 3, 64).transpose(0, 1), w1.t().contiguous().t(), torch.stack([b1, b1], 1)[:, 0],
              w2.t().contiguous().t(), torch.stack([b2, b2], 1)[:, 0]]
    assert not any(t.is_contiguous() for t in inputs)
    grad_out = torch.randn(3, 37, 128, generator=torch.Generator().manual_seed(6)).to(device, dtype)[..., ::2]
    _check_against_reference(lambda *t: kernel.feed_forward_geglu(*t, "none"), inputs, grad_out, "none")


@pytest.mark.parametrize("mlp_bias", [False, True], ids=["no_bias", "bias"])
def test_equals_transformers_modernbert_mlp(mlp_bias, device):
    """transformers' ModernBertMLP (Wi -> chunk(2) -> gelu(input) * gate -> Wo, dropout 0) on the same weights:
    the reference path gives its output and gradients bit for bit, the Triton path within the rule against it
    in float64, in fp32 and bf16."""
    from transformers import ModernBertConfig
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

    config = ModernBertConfig(hidden_size=64, intermediate_size=96, mlp_bias=mlp_bias, hidden_activation="gelu",
                              mlp_dropout=0.0)
    torch.manual_seed(7)
    mlp = ModernBertMLP(config).to(device).eval()
    params = [mlp.Wi.weight, mlp.Wi.bias, mlp.Wo.weight, mlp.Wo.bias]
    x = torch.randn(2, 37, 64, device=device)
    grad_out = torch.randn(2, 37, 64, device=device)

    def grads_of(fn, x_in, g_in):
        leaf = x_in.detach().requires_grad_()
        out = fn(leaf)
        present = [p for p in params if p is not None]
        grads = torch.autograd.grad(out, [leaf] + present, g_in)
        return out.detach(), grads

    mlp_out, mlp_grads = grads_of(mlp, x, grad_out)
    ref_out, ref_grads = grads_of(lambda t: ops.feed_forward_geglu(t, *params, backend="torch"), x, grad_out)
    assert torch.equal(ref_out, mlp_out) and all(torch.equal(a, b) for a, b in zip(ref_grads, mlp_grads))
    for dtype in (torch.float32, torch.bfloat16):
        mlp.to(dtype)
        params = [mlp.Wi.weight, mlp.Wi.bias, mlp.Wo.weight, mlp.Wo.bias]
        out, grads = grads_of(lambda t: ops.feed_forward_geglu(t, *params, backend="triton"), x.to(dtype),
                              grad_out.to(dtype))
        torch_out, torch_grads = grads_of(mlp, x.to(dtype), grad_out.to(dtype))
        mlp.double()
        params = [mlp.Wi.weight, mlp.Wi.bias, mlp.Wo.weight, mlp.Wo.bias]
        exact_out, exact_grads = grads_of(mlp, x.double(), grad_out.double())
        assert_within_rule(f"{dtype} output", out, torch_out, exact_out)
        for name, g, tg, eg in zip(NAMES, grads, torch_grads, exact_grads):
            assert_within_rule(f"{dtype} {name}", g, tg, eg, GRADIENT_FACTOR)


def test_recompute_pre_gives_bitwise_equal_gradients(device):
    """The backward reruns the forward's gated epilogue matmul on the same inputs: the same h, hence the
    same gradients, on the kernel path and on the reference's checkpoint."""
    inputs = _inputs(97, 64, 96, torch.bfloat16, device, seed=8, with_bias=False)
    grad_out = torch.randn(97, 64, generator=torch.Generator().manual_seed(9)).to(device, torch.bfloat16)
    for backend in ("triton", "torch"):
        kept, recomputed = (_run(lambda *t: ops.feed_forward_geglu(*t, "tanh", recompute_pre=flag, backend=backend),
                                 inputs, grad_out) for flag in (False, True))
        assert torch.equal(kept[0], recomputed[0])
        assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(kept[1], recomputed[1])), backend


def test_deterministic(device):
    inputs = _inputs(113, 64, 96, torch.float16, device, seed=10)
    grad_out = torch.randn(113, 64, generator=torch.Generator().manual_seed(11)).to(device, torch.float16)
    first, second = (_run(lambda *t: kernel.feed_forward_geglu(*t, "none"), inputs, grad_out) for _ in range(2))
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def test_gated_elementwise_kernels(device):
    """bias_gelu.py's GATED kernels alone: geglu_fwd is gelu(a) * b, geglu_bwd gives [dg * b * gelu'(a),
    dg * gelu(a)] and their column sums (None without sum_columns), against float64 autograd within the rule;
    h strided (a column slice)."""
    generator = torch.Generator().manual_seed(12)
    for dtype in DTYPES:
        h = torch.randn(37, 2 * 301, generator=generator).to(device, dtype)
        h = torch.cat([h, h], dim=1)[:, :2 * 301]
        dg = torch.randn(37, 301, generator=generator).to(device, dtype)

        def torch_geglu(t):
            a, b = t.chunk(2, dim=-1)
            return torch.nn.functional.gelu(a) * b

        def grads(fn, t, g):
            leaf = t.detach().requires_grad_()
            out = fn(leaf)
            return out.detach(), torch.autograd.grad(out, leaf, g)[0]

        torch_y, torch_dh = grads(torch_geglu, h, dg)
        exact_y, exact_dh = grads(torch_geglu, h.double(), dg.double())
        assert_within_rule(f"{dtype} y", bias_gelu.geglu_fwd(h), torch_y, exact_y)
        dh, sums = bias_gelu.geglu_bwd(dg, h)
        assert_within_rule(f"{dtype} dh", dh, torch_dh, exact_dh, GRADIENT_FACTOR)
        assert_within_rule(f"{dtype} sums", sums, torch_dh.sum(0), exact_dh.sum(0), GRADIENT_FACTOR)
        # Without the sums (SUM_COLUMNS is a constexpr) the same source is another compiled kernel, whose FMA
        # contraction of da = dy * b * gelu'(a) the compiler may choose differently: on an H100 (Triton 3.6)
        # 251 of the 11,137 fp32 da values were 1 ulp from the summed kernel's (db and fp16/bf16 equal). What
        # is promised is the same gradient, so it is held to the same rule.
        unsummed, none = bias_gelu.geglu_bwd(dg, h, sum_columns=False)
        assert none is None
        assert_within_rule(f"{dtype} unsummed dh", unsummed, torch_dh, exact_dh, GRADIENT_FACTOR)


def test_torch_compile(device):
    """aot_eager traces forward and backward through the fake registrations: the eager bits."""
    inputs = [t.requires_grad_() for t in _inputs(7, 64, 96, torch.float32, device, seed=13, with_bias=False)
              if t is not None]

    def block(x, w1, w2):
        return kernel.feed_forward_geglu(x, w1, None, w2, None, "tanh").square().sum()

    torch._dynamo.reset()
    torch.compile(block, backend="aot_eager", fullgraph=True)(*inputs).backward()
    compiled = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    block(*inputs).backward()
    assert all(torch.equal(c, t.grad) for c, t in zip(compiled, inputs))


def test_ops_dispatch_and_bad_inputs(device):
    x, w1, b1, w2, b2 = _inputs(7, 64, 96, torch.float32, device, seed=14)
    assert torch.equal(ops.feed_forward_geglu(x, w1, b1, w2, b2, backend="triton"),
                       kernel.feed_forward_geglu(x, w1, b1, w2, b2))
    assert torch.equal(ops.feed_forward_geglu(x, w1, b1, w2, b2, backend="torch"),
                       reference.feed_forward_geglu(x, w1, b1, w2, b2))
    for args, message in [((x, w1[:, :60], b1, w2, b2), "w1 has last dimension 60"),
                          ((x, w1[:191], b1, w2, b2), "w1 has 191 rows"),
                          ((x, w1, b1[:9], w2, b2), "b1 has shape \\(9,\\)"),
                          ((x, w1, b1, torch.cat([w2, w2], 1), b2), r"w2 has last dimension 192, expected 96"),
                          ((x, w1, b1, w2, b2[:3]), "b2 has shape \\(3,\\)")]:
        for backend in ("triton", "torch"):
            with pytest.raises(ValueError, match=message):
                ops.feed_forward_geglu(*args, backend=backend)
    with pytest.raises(ValueError, match="approximate must be one of"):
        ops.feed_forward_geglu(x, w1, b1, w2, b2, "sigmoid", backend="triton")
    with pytest.raises(ValueError, match="w1 has 191 rows"):
        kernel.feed_forward_geglu(x, w1[:191], None, w2, None)
    with pytest.raises(ValueError, match="b1 has dtype torch.float16"):
        kernel.feed_forward_geglu(x, w1, b1.half(), w2, b2)
    out = x.new_empty(7, 96)
    with pytest.raises(ValueError, match=r"a gated matmul needs a GELU activation \(got 'none'\)"):
        matmul.matmul_fwd(x, w1, None, out, "none", gated=True)
    with pytest.raises(ValueError, match=r"an even number of weight rows \(got 191\)"):
        matmul.matmul_fwd(x, w1[:191], None, out, "gelu", gated=True)
    with pytest.raises(ValueError, match=r"pre must be a contiguous \(7, 192\) tensor, got \(7, 96\)"):
        matmul.matmul_fwd(x, w1, None, out, "gelu", pre=x.new_empty(7, 96), gated=True)


# ---- the residual (ModernBERT's stream), added by the down-projection ----

def _with_residual(ref):
    return lambda x, w1, b1, w2, b2, residual, approximate: residual + ref(x, w1, b1, w2, b2, approximate)


@pytest.mark.parametrize("gated", [True, False], ids=["geglu", "gelu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_residual_matches_reference(with_bias, dtype, gated, device):
    """residual + FFN(x) with x and residual [B, S, H] (the residual a transposed view): the output and all six
    gradients (the residual's is dout) within the rule against residual + the reference, on both paths."""
    x, w1, b1, w2, b2 = _inputs(3 * 13, 48, 40, dtype, device, seed=18, with_bias=with_bias, gated=gated)
    residual = torch.randn(13, 3, 48, generator=torch.Generator().manual_seed(19)).to(device, dtype).transpose(0, 1)
    inputs = [x.view(3, 13, 48), w1, b1, w2, b2, residual]
    grad_out = torch.randn(3, 13, 48, generator=torch.Generator().manual_seed(20)).to(device, dtype)
    name = "feed_forward_geglu" if gated else "feed_forward"
    ref = _with_residual(getattr(reference, name))
    for backend in ("triton", "torch"):
        _check_against_reference(lambda x, w1, b1, w2, b2, r: getattr(ops, name)(
            x, w1, b1, w2, b2, "tanh", backend=backend, residual=r), inputs, grad_out, "tanh", ref=ref)


def test_residual_joins_the_fused_op_where_dtypes_match(device):
    """On the Triton path a residual of the output's dtype runs no add of its own (only the custom op), so
    under autocast it must be 16-bit to join; one of another dtype is added after the op and promotes as `+`
    does, as the unfused layer would."""
    x, w1, b1, w2, _ = _inputs(9, 32, 24, torch.float32, device, seed=21, with_bias=True)
    residual = torch.randn(9, 32, generator=torch.Generator().manual_seed(22)).to(device)
    with RecordingMode() as mode:
        out = ops.feed_forward_geglu(x, w1, b1, w2, None, backend="triton", residual=residual)
    assert mode.seen == ["fastbert.feed_forward.default"]
    unfused = residual + kernel.feed_forward_geglu(x, w1, b1, w2, None)
    exact = residual.double() + reference.feed_forward_geglu(*(t.double() for t in (x, w1, b1, w2)), None)
    assert_within_rule("residual added by the op", out, unfused, exact)
    wider = residual.double()
    with RecordingMode() as mode:
        out = ops.feed_forward_geglu(x, w1, b1, w2, None, backend="triton", residual=wider)
    assert mode.seen == ["fastbert.feed_forward.default", "aten.add.Tensor"]
    assert out.dtype == torch.float64 and torch.equal(out, wider + kernel.feed_forward_geglu(x, w1, b1, w2, None))


def test_residual_alone_trained_runs_no_backward_op(device):
    """Frozen weights and input, a trainable residual: its gradient is dout itself and no FFN backward runs."""
    x, w1, b1, w2, b2 = _inputs(9, 32, 24, torch.float32, device, seed=23)
    residual = torch.randn(9, 32, generator=torch.Generator().manual_seed(24)).to(device).requires_grad_()
    out = ops.feed_forward_geglu(x, w1, b1, w2, b2, backend="triton", residual=residual)
    grad_out = torch.randn(9, 32, generator=torch.Generator().manual_seed(25)).to(device)
    with RecordingMode() as mode:
        out.backward(grad_out)
    assert not any("feed_forward_bwd" in name for name in mode.seen), mode.seen
    assert torch.equal(residual.grad, grad_out)


def test_residual_under_torch_compile(device):
    """aot_eager traces the residual through the fake registration and the autograd; same gradients as eager."""
    inputs = [t.requires_grad_() for t in _inputs(7, 64, 96, torch.float32, device, seed=26, with_bias=False)
              if t is not None]
    residual = torch.randn(7, 64, generator=torch.Generator().manual_seed(27)).to(device).requires_grad_()

    def block(x, w1, w2, residual):
        return kernel.feed_forward_geglu(x, w1, None, w2, None, "tanh", residual=residual).square().sum()

    torch._dynamo.reset()
    torch.compile(block, backend="aot_eager", fullgraph=True)(*inputs, residual).backward()
    compiled = [t.grad.clone() for t in (*inputs, residual)]
    for t in (*inputs, residual):
        t.grad = None
    block(*inputs, residual).backward()
    assert all(torch.equal(c, t.grad) for c, t in zip(compiled, (*inputs, residual)))


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_residual_in_place_only_where_nothing_is_differentiated_or_traced(with_bias, device):
    """residual_in_place: an inference call (grad mode off) on the Triton path returns the residual itself,
    holding the result (within the rule); a non-contiguous residual, a call in grad mode (with or without a
    gradient to compute), a traced call (a dispatch mode) and the PyTorch path leave the residual as it was, and
    meta tensors get their shapes (test_torch_func: forward-mode AD gets an error naming the op)."""
    x, w1, b1, w2, b2 = _inputs(9, 32, 24, torch.float32, device, seed=29, with_bias=with_bias)
    original = torch.randn(9, 32, generator=torch.Generator().manual_seed(30)).to(device)
    exact = original.double() + reference.feed_forward_geglu(*(None if t is None else t.double()
                                                               for t in (x, w1, b1, w2, b2)))
    unfused = original + kernel.feed_forward_geglu(x, w1, b1, w2, b2)

    def call(residual, backend="triton", **inputs):
        arguments = {"x": x, "w1": w1, "b1": b1, "w2": w2, "b2": b2, **inputs}
        return ops.feed_forward_geglu(*arguments.values(), backend=backend, residual=residual,
                                      residual_in_place=True)

    residual = original.clone()
    with torch.no_grad():
        out = call(residual)
    assert out is residual
    assert_within_rule("in place", out, unfused, exact)
    transposed = original.t().contiguous().t()
    with torch.no_grad():
        out = call(transposed)
    assert out is not transposed and torch.equal(transposed, original)
    assert_within_rule("not contiguous", out, unfused, exact)
    residual = original.clone()
    out = call(residual, x=x.detach().requires_grad_())
    assert out is not residual and torch.equal(residual, original) and out.grad_fn is not None
    out = call(residual)
    assert out is not residual and torch.equal(residual, original)
    with torch.no_grad(), RecordingMode() as mode:
        out = call(residual)
    assert mode.seen == ["fastbert.feed_forward.default"] and torch.equal(residual, original)
    with torch.no_grad():
        out = call(residual, backend="torch")
    assert out is not residual and torch.equal(residual, original)
    # meta tensors (shapes alone) take the op's shape-only registration: nothing to launch, nothing written
    on_meta = {name: None if t is None else t.to("meta") for name, t in (("x", x), ("w1", w1), ("b1", b1),
                                                                          ("w2", w2), ("b2", b2))}
    meta_residual = original.to("meta")
    with torch.no_grad():
        out = call(meta_residual, **on_meta)
    assert out is not meta_residual and out.is_meta and out.shape == original.shape


def test_residual_bad_inputs(device):
    x, w1, b1, w2, b2 = _inputs(7, 64, 96, torch.float32, device, seed=28)
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match=r"residual has shape \(7, 63\), expected the output's \(7, 64\)"):
            ops.feed_forward_geglu(x, w1, b1, w2, b2, backend=backend, residual=x[:, :63])
    with pytest.raises(ValueError, match="residual has dtype torch.float16"):
        kernel.feed_forward_geglu(x, w1, b1, w2, b2, residual=x.half())
    with pytest.raises(ValueError, match=r"residual has shape \(1, 7, 64\)"):
        kernel.feed_forward_geglu(x, w1, b1, w2, b2, residual=x[None])


# ---- the bias-less projections ----

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_feed_forward_without_biases(dtype, device):
    """BERT's FFN with b1 = b2 = None: within the rule, both recompute settings, no bias gradients."""
    inputs = _inputs(37, 48, 97, dtype, device, seed=15, with_bias=False, gated=False)
    grad_out = torch.randn(37, 48, generator=torch.Generator().manual_seed(16)).to(device, dtype)
    for recompute_pre in (False, True):
        _check_against_reference(lambda *t: ops.feed_forward(*t, "tanh", recompute_pre, backend="triton"), inputs,
                                 grad_out, "tanh", ref=reference.feed_forward)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_qkv_projection_without_bias(packed, dtype, device):
    """qkv_projection(bias=None): q, k, v and dx, dweight within the rule against the reference; no bias
    gradient; the torch path takes None too."""
    generator = torch.Generator().manual_seed(17)
    shape = (37, 96) if packed else (3, 7, 96)
    x = torch.randn(*shape, generator=generator).to(device, dtype)
    weight = (torch.randn(288, 96, generator=generator) * 96 ** -0.5).to(device, dtype)
    grads_out = [torch.randn(*shape[:-1], 96, generator=generator).to(device, dtype) for _ in range(3)]

    def run(backend, x_in, w_in):
        x_leaf, w_leaf = x_in.detach().requires_grad_(), w_in.detach().requires_grad_()
        q, k, v = ops.qkv_projection(x_leaf, w_leaf, None, 6, backend=backend)
        outs = [t.transpose(-3, -2) if not packed else t for t in (q, k, v)]  # [..., S, heads, d]
        outs = [t.reshape(*shape[:-1], 96) for t in outs]
        loss = sum((o.double() * g.double()).sum() for o, g in zip(outs, grads_out))
        return [o.detach() for o in outs], torch.autograd.grad(loss, [x_leaf, w_leaf])

    outs, grads = run("triton", x, weight)
    torch_outs, torch_grads = run("torch", x, weight)
    exact_outs, exact_grads = run("torch", x.double(), weight.double())
    for name, o, t, e in zip("qkv", outs, torch_outs, exact_outs):
        assert_within_rule(name, o, t, e)
    for name, g, t, e in zip(("dx", "dweight"), grads, torch_grads, exact_grads):
        assert_within_rule(name, g, t, e, GRADIENT_FACTOR)
