"""fastbert.ops dispatch (auto / triton / torch, FASTBERT_BACKEND), its argument checks, unpad/pad,
and torch.compile tracing a whole model on the reference path without graph breaks."""
import pytest
import torch

import fastbert
from fastbert import ops, reference


def test_auto_resolves_to_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("FASTBERT_BACKEND", raising=False)
    x = torch.zeros(2, 3)
    assert ops.resolve_backend(None, x) == "torch"
    assert ops.resolve_backend("auto", x) == "torch"
    assert ops.resolve_backend("torch", x) == "torch"


def test_environment_variable_sets_auto(monkeypatch):
    x = torch.zeros(2, 3)
    monkeypatch.setenv("FASTBERT_BACKEND", "torch")
    assert ops.resolve_backend("auto", x) == "torch"
    monkeypatch.setenv("FASTBERT_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.resolve_backend("auto", x) == "triton"
    assert ops.resolve_backend("torch", x) == "torch"  # an explicit choice wins over the variable
    monkeypatch.setenv("FASTBERT_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FASTBERT_BACKEND.*cuda"):
        ops.resolve_backend("auto", x)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(4, 128)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.layer_norm(x, torch.ones(128), torch.zeros(128), backend="triton")
    model = fastbert.BertModel(fastbert.BertConfig.tiny(backend="triton"))
    with pytest.raises(RuntimeError, match="backend='triton'"):  # never a silent fallback
        model(input_ids=torch.ones(1, 4, dtype=torch.long))


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of.*'gpu'"):
        ops.bias_gelu(torch.zeros(2, 4), torch.zeros(4), backend="gpu")


@pytest.mark.parametrize("call, words", [
    (lambda: ops.layer_norm(torch.zeros(2, 8), torch.ones(7), torch.zeros(8)), ["weight", "7", "8"]),
    (lambda: ops.layer_norm(torch.zeros(2, 8), torch.ones(8), torch.zeros(8), residual=torch.zeros(2, 4)),
     ["residual", "(2, 4)"]),
    (lambda: ops.layer_norm(torch.zeros(2, 8), torch.ones(8), torch.zeros(8), dropout_p=1.0), ["dropout_p", "1.0"]),
    (lambda: ops.layer_norm(torch.zeros(2, 8), torch.ones(8), torch.zeros(8), save="x"), ["save", "'x'"]),
    (lambda: ops.dropout(torch.zeros(2, 8), 1.5), ["p must be", "1.5"]),
    (lambda: ops.bias_gelu(torch.zeros(2, 8), torch.zeros(8), approximate="fast"), ["approximate", "fast"]),
    (lambda: ops.qkv_projection(torch.zeros(2, 3, 8), torch.zeros(24, 8), torch.zeros(24), 3), ["num_heads", "3"]),
    (lambda: ops.qkv_projection(torch.zeros(2, 3, 8), torch.zeros(16, 8), torch.zeros(24), 2), ["weight", "(16, 8)"]),
    (lambda: ops.attention(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8),
                           attention_mask=torch.ones(1, 5)), ["attention_mask", "(1, 5)"]),
    (lambda: ops.attention_varlen(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8),
                                  torch.tensor([0, 4]), 4), ["cu_seqlens", "int64"]),
    (lambda: ops.linear_cross_entropy(torch.zeros(3, 8), torch.zeros(10, 8), None, torch.zeros(3),
                                      ), ["target", "float32"]),
    (lambda: ops.linear_cross_entropy(torch.zeros(3, 8), torch.zeros(10, 8), None, torch.zeros(3, dtype=torch.long),
                                      reduction="none"), ["reduction", "none"]),
    # on the reference path too, where PyTorch's own errors named none of them, or broadcast silently
    (lambda: ops.attention_varlen(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8),
                                  torch.tensor([0, 4], dtype=torch.int32), -1), ["max_seqlen", "-1"]),
    (lambda: ops.attention_varlen(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(4, 2, 8),
                                  torch.tensor([0, 4], dtype=torch.int32), 4.0), ["max_seqlen", "4.0"]),
    (lambda: ops.bias_gelu(torch.zeros(4, 8), torch.zeros(4, 8)), ["bias", "(4, 8)", "(8,)"]),
    (lambda: ops.bias_gelu(torch.zeros(()), torch.zeros(1)), ["x", "0-d"]),
    (lambda: ops.layer_norm(torch.zeros(()), torch.ones(1), None), ["x", "0-d"]),
    (lambda: ops.linear_bias_gelu(torch.zeros(2, 8), torch.zeros(4, 8), None), ["bias", "None", "(4,)"]),
    (lambda: ops.feed_forward(torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(2, 4), torch.zeros(8, 4), None),
     ["b1", "(2, 4)", "(4,)"]),
    (lambda: ops.qkv_projection(torch.zeros(2, 3, 8), torch.zeros(24, 8), None, 2.0), ["num_heads", "2.0", "int"]),
])
def test_argument_errors_name_the_argument(call, words):
    with pytest.raises(ValueError) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_unpad_pad_round_trip():
    hidden = torch.randn(3, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    packed, indices, cu_seqlens, max_seqlen = ops.unpad(hidden, mask)
    # sizes from the shapes: the 8 real tokens first, then the 7 padding tokens, each row's padding a sequence
    assert packed.shape == (15, 4) and max_seqlen == 5
    assert torch.equal(packed[:8], hidden[mask.bool()]) and torch.equal(packed[8:], hidden[~mask.bool()])
    assert cu_seqlens.tolist() == [0, 3, 8, 8, 10, 10, 15] and cu_seqlens.dtype == torch.int32
    assert indices.tolist() == [0, 1, 2, 5, 6, 7, 8, 9] + [15] * 7  # padding rows: past the end, dropped by pad
    restored = ops.pad(packed, indices, 3, 5)
    assert torch.equal(restored, hidden * mask[..., None])


def test_varlen_reference_equals_padded_reference():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5])
    padded = reference.attention(q, k, v, mask)
    packed = [ops.unpad(t.transpose(1, 2), mask) for t in (q, k, v)]
    _, indices, cu_seqlens, max_seqlen = packed[0]
    out = reference.attention_varlen(packed[0][0], packed[1][0], packed[2][0], cu_seqlens, max_seqlen)
    torch.testing.assert_close(ops.pad(out, indices, 3, 6), padded.transpose(1, 2))


@pytest.mark.parametrize("unpad", [False, True])
def test_torch_compile_traces_the_model_without_graph_breaks(unpad):
    torch.manual_seed(0)
    config = fastbert.BertConfig.tiny(backend="torch", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      unpad=unpad)
    model = fastbert.BertForPreTraining(config).eval()
    ids = torch.randint(1, config.vocab_size, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    expected = model(input_ids=ids, attention_mask=mask)
    got = compiled(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got.prediction_logits, expected.prediction_logits)


def _autocast_cases():
    """(name, fn(backend) -> output) for every op, with fp32 parameters as an autocast model has them."""
    gen = torch.Generator().manual_seed(0)
    h, w, b = (torch.randn(2, 5, 128, generator=gen), torch.randn(384, 128, generator=gen) / 12,
               torch.randn(384, generator=gen))
    ln_w, ln_b = 1 + torch.randn(128, generator=gen) / 4, torch.randn(128, generator=gen)
    q = torch.randn(1, 2, 5, 64, generator=gen)
    return [
        ("layer_norm", lambda backend: ops.layer_norm(h, ln_w, ln_b, residual=h.flip(1), backend=backend)),
        ("layer_norm of bf16", lambda backend: ops.layer_norm(h.bfloat16(), ln_w, ln_b, backend=backend)),
        ("bias_gelu of bf16 and a fp32 bias", lambda backend: ops.bias_gelu(h.bfloat16(), ln_b, backend=backend)),
        ("linear_bias_gelu", lambda backend: ops.linear_bias_gelu(h, w, b, backend=backend)),
        ("qkv_projection", lambda backend: ops.qkv_projection(h, w, b, 2, backend=backend)[0]),
        ("attention", lambda backend: ops.attention(q, q, q, backend=backend)),
        ("linear_cross_entropy", lambda backend: ops.linear_cross_entropy(
            h[0], w, b, torch.tensor([1, 2, 3, 4, 5]), backend=backend)[0]),
    ], (h, ln_w, ln_b)


CASES, LAYER_NORM_INPUTS = _autocast_cases()


@pytest.mark.parametrize("name,fn", CASES, ids=[name for name, _ in CASES])
def test_triton_path_follows_autocast_policy_per_op(name, fn):
    """Custom ops are invisible to autocast, so ops casts their inputs as autocast would cast the PyTorch op
    each replaces: under CPU bf16 autocast the Triton path returns the reference path's dtype for every op."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        triton_out, torch_out = fn("triton"), fn("torch")
    assert triton_out.dtype == torch_out.dtype, (triton_out.dtype, torch_out.dtype)


def test_layer_norm_weights_keep_their_dtype_under_cpu_autocast():
    """CPU autocast leaves layer_norm alone, so fp32 LayerNorm weights are used as they are, not rounded
    to bf16: the bits of the kernel called on the inputs as they come."""
    x, weight, bias = LAYER_NORM_INPUTS
    layer_norm = ops.KERNELS["layer_norm"].layer_norm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x_ in (x, x.bfloat16()):
            assert torch.equal(ops.layer_norm(x_, weight, bias, backend="triton"), layer_norm(x_, weight, bias))


def test_layer_norm_under_cuda_autocast_returns_the_autocast_dtype(monkeypatch):
    """On CUDA, the Triton LayerNorm returns the autocast dtype (a 16-bit residual stream: fastbert's
    deviation from autocast's fp32 layer_norm, see ops.py), on CPU autocast leaves it alone; matmuls and
    attention take the autocast dtype on both. (No CUDA here: the policy lookup itself is checked.)"""
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type: True)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.bfloat16)
    assert ops.autocast_dtype("layer_norm", "cuda") == torch.bfloat16
    assert ops.autocast_dtype("layer_norm", "cpu") is None
    for device_type in ("cuda", "cpu"):
        assert ops.autocast_dtype("matmul", device_type) == torch.bfloat16


class _CountCats(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.cats = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.cats += func is torch.ops.aten.cat.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad", [False, True])
def test_pytorch_path_without_a_backward_on_a_cpu_projects_qkv_without_concatenating_weights(grad):
    # inference on PyTorch's path on a CPU runs query, key and value as three GEMMs on the Linears' weights, as
    # transformers does; a backward (or a kernel path, or a GPU: the test below) takes the concatenated weight, two
    # cats a layer
    torch.manual_seed(0)
    config = fastbert.BertConfig.tiny(backend="torch")
    model = fastbert.BertModel(config).eval()
    ids = torch.randint(5, 100, (2, 8))
    with torch.no_grad():
        expected = model(ids).last_hidden_state
    counter = _CountCats()
    with torch.set_grad_enabled(grad), counter:
        got = model(ids).last_hidden_state
    assert counter.cats == (2 * config.num_hidden_layers if grad else 0)
    torch.testing.assert_close(got, expected)


def test_inference_standing_for_a_gpu_projects_qkv_with_one_gemm():
    # on a GPU the host, not the copy, is what inference waits for: two cats and one GEMM a layer (fastbert.modeling's
    # SelfAttention.project); meta tensors of a memory plan stand for an H100's
    config = fastbert.BertConfig.tiny()
    with torch.device("meta"):
        model = fastbert.BertModel(config).eval().to(torch.bfloat16)
    ids = torch.randint(5, 100, (2, 8)).to("meta")
    counter = _CountCats()
    with fastbert.paths.planned_architecture(90), torch.no_grad(), counter:
        assert model(ids).last_hidden_state.shape == (2, 8, config.hidden_size)
    assert counter.cats == 2 * config.num_hidden_layers


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpadded"])
def test_auto_runs_the_reference_attention_for_a_head_dim_the_kernel_does_not_take(unpad, monkeypatch):
    """The Triton attention takes head dims 32, 64 and 128. For another (48 here), "auto" on a GPU (meta tensors of
    a memory plan standing for an H100's) runs the reference attention in a model's forward, and a training step
    leaves the attention sublayer's one node (whose kernel would refuse it) for the per-op path; both raised the
    kernel's head-dim error. "triton", asked for, stays the kernel, whose check refuses it by name."""
    calls = []
    monkeypatch.setattr(reference, "attention", lambda *args, _run=reference.attention: calls.append(1) or _run(*args))
    config = fastbert.BertConfig.tiny(hidden_size=96, num_attention_heads=2, intermediate_size=128, unpad=unpad)
    assert config.head_dim not in ops.ATTENTION_HEAD_DIMS
    with torch.device("meta"):
        model = fastbert.BertModel(config)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    mask = torch.ones(2, 16, dtype=torch.long, device="meta")
    with fastbert.paths.planned_architecture(90):
        with torch.no_grad():
            assert model(input_ids=ids, attention_mask=mask).last_hidden_state.shape == (2, 16, 96)
        assert len(calls) == config.num_hidden_layers
        attention = model.encoder.layer[0].attention
        hidden = torch.empty(2, 16, 96, device="meta", requires_grad=True)
        layout = fastbert.modeling.AttentionLayout(attention_mask=mask)
        output = attention.output
        assert attention.self.sublayer(hidden, layout, output.dense, output.LayerNorm, output.dropout) is None
        q = torch.empty(2, 2, 16, config.head_dim, device="meta")
        assert ops.resolve_backend("triton", q, kernel_fits=False) == "triton"  # asked for: the kernel's check refuses
        with pytest.raises(ValueError, match="head dim.*48"):
            ops.KERNELS["attention"].check_limits(q, q, q, mask, None, 16, None, None, None)
