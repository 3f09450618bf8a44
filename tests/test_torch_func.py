"""torch.func and higher derivatives through fastbert's ops and models: torch.func.grad gives autograd's own
gradients, on the Triton path and the PyTorch path, through models too, and vmap of grad gives per-sample
gradients on the PyTorch path; forward-mode AD (torch.func.jvp, torch.autograd.forward_ad), vmap and a second
derivative (create_graph=True, nested grad) through a fused op raise an error naming the op, never a tangent left
out or a second derivative missing the op's part (both came out wrong before, without an error). The Triton path
runs in Triton's interpreter on CPU, at small sizes."""
import pytest
import torch
import torch.autograd.forward_ad as forward_ad

import fastbert
from fastbert import ops

TOKENS, HIDDEN, HEADS, VOCAB = 6, 64, 2, 48  # the kernels' smallest head dim is 32
BACKENDS = ("triton", "torch")


def _leaves(device, *shapes):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=generator).to(device) for shape in shapes]


def _padded_mask(device):
    mask = torch.ones(2, TOKENS // 2, dtype=torch.long)
    mask[1, -1] = 0
    return mask.to(device)


# name -> (the differentiable inputs' shapes, the op on them): each op as the models call it, dropout off
OPS = {
    "layer_norm": ([(TOKENS, HIDDEN), (HIDDEN,), (HIDDEN,), (TOKENS, HIDDEN)],
                   lambda d, x, w, b, r, backend: ops.layer_norm(x, w, b, 1e-5, r, backend=backend)),
    "bias_gelu": ([(TOKENS, 4 * HIDDEN), (4 * HIDDEN,)],
                  lambda d, x, b, backend: ops.bias_gelu(x, b, backend=backend)),
    "linear_bias_gelu": ([(TOKENS, HIDDEN), (4 * HIDDEN, HIDDEN), (4 * HIDDEN,)],
                         lambda d, x, w, b, backend: ops.linear_bias_gelu(x, w, b, backend=backend)),
    "feed_forward": ([(TOKENS, HIDDEN), (4 * HIDDEN, HIDDEN), (4 * HIDDEN,), (HIDDEN, 4 * HIDDEN), (HIDDEN,)],
                     lambda d, *inputs, backend: ops.feed_forward(*inputs, backend=backend)),
    "feed_forward_geglu": ([(TOKENS, HIDDEN), (4 * HIDDEN, HIDDEN), (4 * HIDDEN,), (HIDDEN, 2 * HIDDEN), (HIDDEN,)],
                           lambda d, *inputs, backend: ops.feed_forward_geglu(*inputs, backend=backend)),
    "qkv_projection": ([(2, TOKENS // 2, HIDDEN), (3 * HIDDEN, HIDDEN), (3 * HIDDEN,)],
                       lambda d, x, w, b, backend: ops.qkv_projection(x, w, b, HEADS, backend=backend)),
    "attention": ([(2, HEADS, TOKENS // 2, HIDDEN // HEADS)] * 3,
                  lambda d, q, k, v, backend: ops.attention(q, k, v, _padded_mask(d), backend=backend)),
    "attention_rotary_window": ([(2, HEADS, TOKENS // 2, HIDDEN // HEADS)] * 3,
                                lambda d, q, k, v, backend: ops.attention(q, k, v, _padded_mask(d), backend=backend,
                                                                          rotary_base=10000.0, window=1)),
    "attention_varlen": ([(TOKENS, HEADS, HIDDEN // HEADS)] * 3,
                         lambda d, q, k, v, backend: ops.attention_varlen(
                             q, k, v, torch.tensor([0, 2, TOKENS], dtype=torch.int32, device=d), TOKENS - 2,
                             backend=backend)),
    "linear_cross_entropy": ([(TOKENS, HIDDEN), (VOCAB, HIDDEN), (VOCAB,)],
                             lambda d, x, w, b, backend: ops.linear_cross_entropy(
                                 x, w, b, torch.tensor([3, -100, 0, 47, 5, 9], device=d), backend=backend)[0]),
}


def _weighted_sum(outputs):
    """A scalar whose gradient reaches every output element with its own weight."""
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return sum((o * torch.linspace(-1.0, 1.0, o.numel(), device=o.device).view(o.shape)).sum() for o in outputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(OPS))
def test_torch_func_grad_gives_autograds_gradients(name, backend, device):
    """torch.func.grad w.r.t. every input: bitwise the gradients torch.autograd.grad gives, each nonzero (through
    a fused op it used to raise: PyTorch's custom-op autograd is an old-style Function, which torch.func refuses)."""
    shapes, op = OPS[name]
    inputs = _leaves(device, *shapes)

    def loss(*tensors):
        return _weighted_sum(op(device, *tensors, backend=backend))

    leaves = [t.clone().requires_grad_() for t in inputs]
    expected = torch.autograd.grad(loss(*leaves), leaves)
    got = torch.func.grad(loss, argnums=tuple(range(len(inputs))))(*inputs)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
        assert g.abs().sum() > 0  # a gradient that reached the input


@pytest.mark.parametrize("name", sorted(OPS))
def test_forward_mode_ad_through_a_fused_op_raises(name, device):
    """jvp w.r.t. the first input; every other input a constant, so the op takes its inference call (no input
    requires grad), which torch.func.jvp and forward_ad both used to leave without a tangent."""
    shapes, op = OPS[name]
    x, *rest = _leaves(device, *shapes)
    with pytest.raises(NotImplementedError, match="fastbert::.* has no forward-mode derivative"):
        torch.func.jvp(lambda x: op(device, x, *rest, backend="triton"), (x,), (torch.ones_like(x),))
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="has no forward-mode derivative"):
        op(device, forward_ad.make_dual(x, torch.ones_like(x)), *rest, backend="triton")


@pytest.mark.parametrize("name", ["feed_forward", "feed_forward_geglu"])
def test_forward_mode_ad_through_the_in_place_ffn_raises(name, device):
    """ModernBERT's inference FFN (grad mode off, the GEMM accumulating onto the stream in place, past the op's own
    call) refuses a tangent too, and leaves the stream as it was: it used to run on the primal, the tangent
    dropped without an error."""
    shapes, _ = OPS[name]
    x, *weights = _leaves(device, *shapes)
    stream = _leaves(device, (TOKENS, HIDDEN))[0].contiguous()
    kept = stream.clone()
    function = getattr(ops, name)
    with torch.no_grad(), forward_ad.dual_level(), pytest.raises(NotImplementedError,
                                                                  match="fastbert::feed_forward has no forward-mode"):
        function(forward_ad.make_dual(x, torch.ones_like(x)), *weights, residual=stream, residual_in_place=True,
                 backend="triton")
    assert torch.equal(stream, kept)


def test_forward_mode_ad_on_an_input_that_requires_grad_raises(device):
    """The training op, through the eager path's autograd.Function, refuses a tangent too."""
    x, weight, bias = _leaves(device, (TOKENS, HIDDEN), (HIDDEN,), (HIDDEN,))
    weight.requires_grad_()
    with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="layer_norm_fwd has no forward-mode"):
        ops.layer_norm(forward_ad.make_dual(x, torch.ones_like(x)), weight, bias, backend="triton")


def test_forward_mode_ad_without_a_tangent_runs_as_before(device):
    """Inside dual_level, inputs without a tangent give the eager call's numbers."""
    x, weight, bias = _leaves(device, (TOKENS, HIDDEN), (HIDDEN,), (HIDDEN,))
    expected = ops.layer_norm(x, weight, bias, backend="triton")
    with forward_ad.dual_level():
        got = ops.layer_norm(x, weight, bias, backend="triton")
        assert forward_ad.unpack_dual(got).tangent is None
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", sorted(OPS))
def test_a_second_derivative_through_a_fused_op_raises(name, device):
    """create_graph=True (a gradient penalty, a Hessian-vector product): the first derivatives are the usual
    ones, and differentiating them again towards an input, which would take the fused op's backward for a
    constant (a wrong result, given silently before), raises naming the op."""
    shapes, op = OPS[name]
    inputs = _leaves(device, *shapes)

    def first_derivatives(create_graph):
        leaves = [t.clone().requires_grad_() for t in inputs]
        loss = _weighted_sum(op(device, *leaves, backend="triton"))
        return leaves, torch.autograd.grad(loss, leaves, create_graph=create_graph)

    _, plain = first_derivatives(False)
    leaves, kept = first_derivatives(True)
    for a, b in zip(plain, kept):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="has no double backward"):
        torch.autograd.grad(sum((g * g).sum() for g in kept), leaves[0])


@pytest.mark.parametrize("backend, name", [("triton", "layer_norm"), ("torch", "linear_cross_entropy")])
def test_nested_torch_func_grad_through_a_fused_op_raises(backend, name, device):
    """grad of grad: the fused ops' backward kernels (and the reference cross entropy's gradient, computed in its
    forward) are not differentiable: an error naming the op, not a second derivative missing their part."""
    shapes, op = OPS[name]
    x, *rest = _leaves(device, *shapes)

    def gradient_norm(x):
        return (torch.func.grad(lambda x: _weighted_sum(op(device, x, *rest, backend=backend)))(x) ** 2).sum()

    with pytest.raises(RuntimeError, match="has no double backward"):
        torch.func.grad(gradient_norm)(x)


@pytest.mark.parametrize("nesting", ["vmap", "vmap(grad)", "grad(vmap)"])
def test_torch_func_vmap_over_a_fused_op_raises(nesting, device):
    """The fused ops have no batching rule: vmap, alone or around or inside grad, is an error, not a result."""
    x, weight, bias = _leaves(device, (3, TOKENS, HIDDEN), (HIDDEN,), (HIDDEN,))

    def norm(rows):
        return ops.layer_norm(rows, weight, bias, backend="triton")

    call = {"vmap": torch.func.vmap(norm),
            "vmap(grad)": torch.func.vmap(torch.func.grad(lambda rows: norm(rows).sum())),
            "grad(vmap)": torch.func.grad(lambda batch: torch.func.vmap(norm)(batch).sum())}[nesting]
    with pytest.raises((RuntimeError, NotImplementedError), match="[Bb]atching rule"):
        call(x)


def _model(kind: str, backend: str) -> torch.nn.Module:
    """One layer (two for ModernBERT: a global and a local one) of each kind, dropout off."""
    sizes = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, max_position_embeddings=16)
    torch.manual_seed(0)
    if kind == "bert":
        return fastbert.BertForPreTraining(fastbert.BertConfig.tiny(
            **sizes, intermediate_size=4 * HIDDEN, num_hidden_layers=1, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, backend=backend, unpad=True))
    if kind == "modernbert":
        return fastbert.ModernBertForMaskedLM(fastbert.ModernBertConfig.tiny(
            **sizes, intermediate_size=96, num_hidden_layers=2, local_attention=4, backend=backend))
    import transformers  # transformers' own model, accelerated in place

    model = transformers.BertForMaskedLM(transformers.BertConfig(
        **sizes, intermediate_size=4 * HIDDEN, num_hidden_layers=1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    return fastbert.apply(model, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bert", "modernbert", "transformers+apply"])
def test_torch_func_grad_through_a_model(kind, backend, device):
    """torch.func.functional_call + torch.func.grad over a masked-LM loss, padded batch (BERT's encoder
    unpadded): every parameter's gradient equal to loss.backward()'s."""
    model = _model(kind, backend).to(device)
    generator = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2])
    ids = torch.randint(1, VOCAB, mask.shape, generator=generator) * mask
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}
    if kind == "bert":
        inputs["next_sentence_label"] = torch.tensor([0, 1])
    inputs = {k: v.to(device) for k, v in inputs.items()}
    model(**inputs).loss.backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    parameters = {name: p.detach() for name, p in model.named_parameters()}
    got = torch.func.grad(lambda p: torch.func.functional_call(model, p, kwargs=inputs).loss)(parameters)
    assert len(expected) > 10
    for name, gradient in expected.items():
        torch.testing.assert_close(got[name], gradient, rtol=0, atol=0, msg=name)


# PyTorch's CPU flash SDPA has no batching rule: vmap runs it example by example, and says so
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented")
def test_per_sample_gradients_on_the_pytorch_path(device):
    """torch.func.vmap(torch.func.grad(...)) (per-sample gradients, as DP-SGD takes them) over a classifier on
    the PyTorch path, the input checks on: each example's gradients equal its own loss.backward()'s. The
    device value checks stand aside under vmap, whose batched values allow no assert (they used to report the
    vmap's refusal of .item() as a bad input)."""
    config = fastbert.BertConfig.tiny(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                      intermediate_size=4 * HIDDEN, max_position_embeddings=16, num_hidden_layers=1,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, backend="torch",
                                      num_labels=2)
    torch.manual_seed(0)
    model = fastbert.BertForSequenceClassification(config).to(device)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 5), generator=generator).to(device)
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 5], device=device)
    labels = torch.tensor([0, 1, 1], device=device)

    def loss(parameters, *example):
        one = dict(zip(("input_ids", "attention_mask", "labels"), (t[None] for t in example)))
        return torch.func.functional_call(model, parameters, kwargs=one).loss

    parameters = {name: p.detach() for name, p in model.named_parameters()}
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, 0))(parameters, ids, mask, labels)
    for k in range(len(ids)):
        model.zero_grad()
        model(input_ids=ids[k:k + 1], attention_mask=mask[k:k + 1], labels=labels[k:k + 1]).loss.backward()
        for name, p in model.named_parameters():
            if p.grad is not None:  # the pooler's and classifier's too
                torch.testing.assert_close(per_sample[name][k], p.grad, atol=1e-6, rtol=1e-5, msg=name)
