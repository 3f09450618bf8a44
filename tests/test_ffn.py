"""kernels/ffn.py: the fused FFN gelu(x W1^T + b1) W2^T + b2 against a float64 reference with the
tolerance rule (fp32/fp16/bf16, odd shapes, non-contiguous inputs), what its backward keeps (the
pre-activation, never the GELU output), recompute_pre, determinism, autocast, torch.compile, dispatch,
bad inputs, and the model's choice between the fused op and calling the modules."""
import pytest
import torch
from tolerance import GRADIENT_FACTOR, assert_within_rule

from fastbert import BertConfig, BertModel, ops, reference
from fastbert.kernels import ffn as kernel

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAMES = ["dx", "dw1", "db1", "dw2", "db2"]


def _inputs(rows, hidden, inner, dtype, device, seed=0):
    """x [rows, hidden], w1 [inner, hidden], b1 [inner], w2 [hidden, inner], b2 [hidden], scaled so the
    pre-activation is O(1) and the GELU works on both of its sides."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    return [randn(rows, hidden), randn(inner, hidden, scale=hidden ** -0.5), randn(inner),
            randn(hidden, inner, scale=inner ** -0.5), randn(hidden)]


def _run(fn, inputs, grad_out):
    """fn(*inputs) and the gradients of <fn(...), grad_out> w.r.t. every input."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def _check_against_reference(fn, inputs, grad_out, approximate):
    out, grads = _run(fn, inputs, grad_out)
    ref = lambda *t: reference.feed_forward(*t, approximate)  # noqa: E731
    torch_out, torch_grads = _run(ref, inputs, grad_out)
    exact_out, exact_grads = _run(ref, [t.double() for t in inputs], grad_out.double())
    assert_within_rule("forward", out, torch_out, exact_out)
    for name, g, tg, eg in zip(NAMES, grads, torch_grads, exact_grads):
        assert_within_rule(name, g, tg, eg, GRADIENT_FACTOR)


@pytest.mark.parametrize("recompute_pre", [False, True], ids=["keep_pre", "recompute_pre"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden, inner, approximate",
                         [(1, 64, 256, "none"), (7, 37, 97, "tanh"), (113, 129, 384, "none")])
def test_matches_reference(rows, hidden, inner, approximate, dtype, recompute_pre, device):
    inputs = _inputs(rows, hidden, inner, dtype, device, seed=rows)
    grad_out = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows + 1)).to(device, dtype)
    _check_against_reference(lambda *t: kernel.feed_forward(*t, approximate, recompute_pre), inputs, grad_out,
                             approximate)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_noncontiguous_inputs(dtype, device):
    """x [B, S, H] transposed from [S, B, H] (its rows do not merge: read through a copy), column-major
    weights, biases read every other element, a strided output gradient."""
    x, w1, b1, w2, b2 = _inputs(3 * 37, 64, 160, dtype, device, seed=5)
    inputs = [x.view(37, 3, 64).transpose(0, 1), w1.t().contiguous().t(), torch.stack([b1, b1], 1)[:, 0],
              w2.t().contiguous().t(), torch.stack([b2, b2], 1)[:, 0]]
    assert not any(t.is_contiguous() for t in inputs)
    grad_out = torch.randn(3, 37, 128, generator=torch.Generator().manual_seed(6)).to(device, dtype)[..., ::2]
    _check_against_reference(lambda *t: kernel.feed_forward(*t, "tanh"), inputs, grad_out, "tanh")


def saved_bytes(fn) -> tuple[dict[int, tuple], object]:
    """{storage pointer: (bytes, shape)} of every tensor autograd saves for the backward while fn() runs,
    each storage once, and fn's result."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved.setdefault(storage.data_ptr(), (storage.nbytes(), tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


@pytest.mark.parametrize("recompute_pre", [False, True], ids=["keep_pre", "recompute_pre"])
def test_backward_keeps_the_pre_activation_not_the_gelu_output(recompute_pre, device):
    """Saved: x, w1, w2 and the pre-activation [M, N] (recompute_pre: b1 instead of the pre-activation),
    each storage once: no [M, N] GELU output. bf16, BERT's 4H inner width."""
    rows, hidden, inner = 50, 64, 256
    inputs = [t.requires_grad_() for t in _inputs(rows, hidden, inner, torch.bfloat16, device)]
    x, w1, b1, w2, b2 = inputs
    saved, out = saved_bytes(lambda: kernel.feed_forward(*inputs, "none", recompute_pre))
    kept = [x, w1, w2] + ([b1] if recompute_pre else [])
    pre_bytes = 0 if recompute_pre else rows * inner * 2
    assert sum(size for size, _ in saved.values()) == sum(t.nbytes for t in kept) + pre_bytes
    assert sum(shape == (rows, inner) for _, shape in saved.values()) == (0 if recompute_pre else 1)
    out.sum().backward()  # the backward runs from what was kept
    assert all(t.grad is not None for t in inputs)


@pytest.mark.parametrize("case", ["inference", "recompute_pre", "keep_pre"])
def test_the_forward_writes_the_pre_activation_only_for_a_backward_that_reads_it(case, device):
    """The peak of the forward over its inputs (MemoryTracker, each storage once): the GELU output [M, N]
    and the result [M, K2], plus h [M, N] only when the backward keeps it. An inference forward that held
    h beside the GELU output while the second matmul runs peaked above transformers' BERT."""
    from fastbert.simulated.memory_tracker import MemoryTracker

    rows, hidden, inner = 50, 64, 256
    inputs = [t.requires_grad_(case != "inference") for t in _inputs(rows, hidden, inner, torch.bfloat16, device)]
    with torch.set_grad_enabled(case != "inference"):
        # Steady state: the first call of a shape runs Triton's autotuner on a GPU, whose benchmark allocates
        # a 256 MB buffer to flush L2 (the tracker saw a 268 MB peak); later calls only launch the tuned kernels.
        kernel.feed_forward(*inputs, "none", case == "recompute_pre")
        with MemoryTracker(inputs=inputs) as tracker:
            out = kernel.feed_forward(*inputs, "none", case == "recompute_pre")
    matrix = rows * inner * 2  # one bf16 [M, N]
    expected = matrix + out.nbytes + (matrix if case == "keep_pre" else 0)
    assert tracker.peak_bytes - tracker.start_bytes == expected


def test_recompute_pre_gives_bitwise_equal_gradients(device):
    """The backward reruns the forward's epilogue matmul on the same inputs: the same pre-activation
    bits, hence the same gradients, on the kernel path and on the reference's checkpoint."""
    inputs = _inputs(97, 64, 256, torch.bfloat16, device, seed=7)
    grad_out = torch.randn(97, 64, generator=torch.Generator().manual_seed(8)).to(device, torch.bfloat16)
    for backend in ("triton", "torch"):
        kept, recomputed = (_run(lambda *t: ops.feed_forward(*t, "tanh", recompute_pre=flag, backend=backend),
                                 inputs, grad_out) for flag in (False, True))
        assert torch.equal(kept[0], recomputed[0])
        assert all(torch.equal(a, b) for a, b in zip(kept[1], recomputed[1])), backend


def test_deterministic(device):
    inputs = _inputs(113, 64, 256, torch.float16, device, seed=9)
    grad_out = torch.randn(113, 64, generator=torch.Generator().manual_seed(10)).to(device, torch.float16)
    first, second = (_run(lambda *t: kernel.feed_forward(*t, "none"), inputs, grad_out) for _ in range(2))
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def test_autocast_casts_as_linear_does(device):
    """Under bf16 autocast with fp32 weights, ops.feed_forward runs the kernel on bf16 casts (as
    nn.Linear's matmuls would be cast) and the fp32 weights receive fp32 gradients; the output is what
    the kernel gives on the casts."""
    inputs = [t.requires_grad_() for t in _inputs(37, 64, 256, torch.float32, device, seed=11)]
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        out = ops.feed_forward(*inputs, backend="triton")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, kernel.feed_forward(*[t.detach().bfloat16() for t in inputs]))
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in inputs)


@pytest.mark.parametrize("recompute_pre", [False, True], ids=["keep_pre", "recompute_pre"])
def test_torch_compile_and_export(recompute_pre, device):
    """aot_eager traces the forward and the backward through the fake registrations; the compiled and
    the exported programs give the eager results bitwise."""
    inputs = [t.requires_grad_() for t in _inputs(7, 64, 256, torch.float32, device, seed=12)]

    def block(*t):
        return kernel.feed_forward(*t, "tanh", recompute_pre).square().sum()

    torch._dynamo.reset()
    torch.compile(block, backend="aot_eager", fullgraph=True)(*inputs).backward()
    compiled_grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    eager = block(*inputs)
    eager.backward()
    assert all(torch.equal(c, t.grad) for c, t in zip(compiled_grads, inputs))

    class Block(torch.nn.Module):
        def forward(self, *t):
            return block(*t)

    exported = torch.export.export(Block(), tuple(t.detach() for t in inputs))
    assert torch.equal(exported.module()(*[t.detach() for t in inputs]), eager.detach())


def test_ops_dispatch_and_bad_inputs(device):
    x, w1, b1, w2, b2 = _inputs(7, 64, 256, torch.float32, device, seed=13)
    assert torch.equal(ops.feed_forward(x, w1, b1, w2, b2, backend="triton"), kernel.feed_forward(x, w1, b1, w2, b2))
    assert torch.equal(ops.feed_forward(x, w1, b1, w2, b2, backend="torch"), reference.feed_forward(x, w1, b1, w2, b2))
    for args, message in [((x, w1[:, :60], b1, w2, b2), "w1 has last dimension 60"),
                          ((x, w1, b1[:9], w2, b2), "b1 has shape \\(9,\\)"),
                          ((x, w1, b1, w2[:, :200], b2), "w2 has last dimension 200"),
                          ((x, w1, b1, w2, b2[:3]), "b2 has shape \\(3,\\)")]:
        with pytest.raises(ValueError, match=message):
            ops.feed_forward(*args, backend="triton")
    with pytest.raises(ValueError, match="approximate must be one of"):
        ops.feed_forward(x, w1, b1, w2, b2, "sigmoid", backend="triton")
    with pytest.raises(ValueError, match="w2 has dtype torch.float16"):
        kernel.feed_forward(x, w1, b1, w2.half(), b2)


def _tiny_model(device):
    torch.manual_seed(14)
    config = BertConfig.tiny(hidden_size=64, num_attention_heads=2, intermediate_size=256, num_hidden_layers=1,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, backend="triton")
    return BertModel(config).to(device).train()


def test_model_fuses_plain_modules_and_calls_hooked_ones(monkeypatch, device):
    """BertLayer runs the fused FFN when BertIntermediate, BertOutput and their Linears are plain and
    unhooked, and calls the modules (their hooks run) otherwise; both give the reference's numbers."""
    model = _tiny_model(device)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(15)).to(device)
    calls = []
    fused = kernel.feed_forward_fwd  # what the fused op and the one-node sublayer (fastbert/sublayer.py) run
    monkeypatch.setattr(kernel, "feed_forward_fwd", lambda *a, **k: calls.append(1) or fused(*a, **k))
    plain = model(input_ids=ids).last_hidden_state
    assert calls == [1]
    layer = model.encoder.layer[0]
    for module in (layer.intermediate, layer.output, layer.intermediate.dense, layer.output.dense):
        seen = []
        handle = module.register_forward_hook(lambda *_: seen.append(1))
        hooked = model(input_ids=ids).last_hidden_state
        handle.remove()
        assert seen == [1] and calls == [1], type(module).__name__
        torch.testing.assert_close(hooked, plain, rtol=1e-5, atol=1e-5)


def test_gelu_backward_in_place_over_dy(device):
    """The FFN backward's dh = dg * gelu'(h) written over dg (one [M, N] buffer less at its peak): the
    out-of-place bits, in dg's storage; a strided dg is refused."""
    from fastbert.kernels import bias_gelu

    generator = torch.Generator().manual_seed(16)
    dg, pre = (torch.randn(37, 300, generator=generator).to(device, torch.bfloat16) for _ in range(2))
    expected = bias_gelu.bias_gelu_bwd(dg, pre, None, "tanh")
    overwritten = dg.clone()
    dh, dbias = bias_gelu.bias_gelu_bwd(overwritten, pre, None, "tanh", in_place=True)
    assert dh.data_ptr() == overwritten.data_ptr()
    assert torch.equal(dh, expected[0]) and torch.equal(dbias, expected[1])
    with pytest.raises(ValueError, match="in_place needs a contiguous dy"):
        bias_gelu.bias_gelu_bwd(dg.t().contiguous().t(), pre, None, "tanh", in_place=True)
