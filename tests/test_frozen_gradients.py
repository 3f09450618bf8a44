"""The fused ops' backwards compute only the gradients autograd asks for: a frozen weight (LoRA's base model,
BitFit's frozen matrices, frozen word embeddings under the MLM head) costs no matmul and no column sum, as in
PyTorch's own linear backward. Each case freezes inputs and checks, against the same op with every input
trainable: the frozen inputs get no gradient, the others bitwise the same one, and the backward dispatches
one matmul fewer for each frozen matrix or input (counted by the profiler: nothing else changes the eager
path). Every case runs through both entrances of a fused op: the eager autograd.Function and the torch.library
custom op that torch.compile and torch.export trace."""
import functools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fastbert import BertConfig, BertModel
from fastbert.kernels import bias_gelu, ffn, layer_norm, mlm_loss, qkv
from fastbert.kernels.fused_op import always_custom_op


@pytest.fixture(autouse=True, params=["eager", "custom op"])
def entrance(request):
    if request.param == "eager":
        yield
    else:
        with always_custom_op():
            yield


def _randn(*shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _backward_ops(fn, inputs, trainable) -> tuple[list, dict]:
    """(gradient of each input, or None; aten op name -> calls in the backward) of sum(fn(*inputs) * weights),
    only the inputs named in `trainable` requiring grad."""
    leaves = [t.detach().requires_grad_(i in trainable) if t is not None else None for i, t in enumerate(inputs)]
    out = fn(*leaves)
    out = out if isinstance(out, torch.Tensor) else torch.stack([o.float().sum() for o in out])
    weights = _randn(*out.shape, seed=99).to(out.dtype)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (out * weights).sum().backward()
    calls = {event.key: event.count for event in prof.key_averages() if event.key.startswith("aten::")}
    return [t.grad if t is not None else None for t in leaves], calls


def _check(fn, inputs, frozen, matmuls_saved, sums_saved=0):
    """Freezing the inputs at positions `frozen` leaves the other gradients bitwise equal and saves
    `matmuls_saved` aten::mm calls and `sums_saved` aten::sum calls in the backward."""
    everything = {i for i, t in enumerate(inputs) if t is not None}
    full, full_calls = _backward_ops(fn, inputs, everything)
    grads, calls = _backward_ops(fn, inputs, everything - set(frozen))
    for i, (got, want) in enumerate(zip(grads, full)):
        if i in frozen or inputs[i] is None:
            assert got is None, i
        else:
            assert torch.equal(got, want), i
    assert full_calls.get("aten::mm", 0) - calls.get("aten::mm", 0) == matmuls_saved
    assert full_calls.get("aten::sum", 0) - calls.get("aten::sum", 0) == sums_saved


X, W1, B1, W2, B2 = range(5)


def _ffn_inputs(gated: bool, device) -> list[torch.Tensor]:
    hidden, inner = 16, 24 * (2 if gated else 1)
    return [_randn(5, hidden, seed=0).to(device), _randn(inner, hidden, seed=1).to(device),
            _randn(inner, seed=2).to(device), _randn(hidden, inner // (2 if gated else 1), seed=3).to(device),
            _randn(hidden, seed=4).to(device)]


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "geglu"])
@pytest.mark.parametrize("recompute_pre", [False, True], ids=["keep_pre", "recompute_pre"])
@pytest.mark.parametrize("frozen, matmuls_saved, sums_saved, gelus_saved", [
    ((W1, W2), 2, 0, 1),  # LoRA on the attention: the FFN's weights frozen
    ((W1, B1, W2, B2), 2, 2, 1),  # the whole FFN frozen: only dx (db1 sums the kernel's partial sums, db2 dout)
    ((X,), 1, 0, 0),  # the first layer over frozen embeddings
    ((W2, B2), 1, 1, 1),  # half the block frozen: no dw2, nor the GELU output recomputed for it, no db2
    ((X, W1, B1, W2), 4, 1, 1),  # db2 alone: no matmul at all, and no recomputed up-projection either
])
def test_feed_forward(gated, recompute_pre, frozen, matmuls_saved, sums_saved, gelus_saved, device, monkeypatch):
    """gelus_saved: recomputations of the GELU output g = gelu(h) (a Triton launch the profiler does not see,
    counted at the function the backward calls)."""
    gelus = []
    for name in ("bias_gelu_fwd", "geglu_fwd"):
        original = getattr(ffn, name)
        monkeypatch.setattr(ffn, name, lambda *args, original=original, **kwargs: gelus.append(1) or original(*args,
                                                                                                          **kwargs))
    fn = functools.partial(ffn.feed_forward, approximate="none", recompute_pre=recompute_pre, gated=gated)
    inputs = _ffn_inputs(gated, device)
    _backward_ops(fn, inputs, set(range(5)))
    every = len(gelus)
    _check(lambda *t: fn(*t), inputs, frozen, matmuls_saved, sums_saved)
    del gelus[:]
    _backward_ops(fn, inputs, set(range(5)) - set(frozen))
    assert every - len(gelus) == gelus_saved


def test_feed_forward_keeps_no_pre_activation_for_db2_alone(device):
    """h [M, N] is saved only for a backward that reads it: not when only b2 trains (db2 = column sums of dout)."""
    saved = []
    x, w1, b1, w2, b2 = _ffn_inputs(False, device)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        ffn.feed_forward(x, w1, b1, w2, b2.requires_grad_())
    assert (5, 24) not in saved and saved
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        ffn.feed_forward(x, w1, b1, w2.requires_grad_(), b2)
    assert (5, 24) in saved


def test_feed_forward_without_biases_needs_no_column_sums(device):
    inputs = [_randn(5, 16, seed=0).to(device), _randn(24, 16, seed=1).to(device), None,
              _randn(16, 24, seed=3).to(device), None]
    _check(lambda *t: ffn.feed_forward(*t), inputs, (W1,), 1)


@pytest.mark.parametrize("frozen, matmuls_saved, sums_saved", [((1,), 1, 0), ((2,), 0, 1), ((1, 2), 1, 1),
                                                               ((0,), 1, 0)])
def test_linear_bias_gelu(frozen, matmuls_saved, sums_saved, device):
    inputs = [_randn(6, 16, seed=0).to(device), _randn(24, 16, seed=1).to(device), _randn(24, seed=2).to(device)]
    _check(lambda *t: bias_gelu.linear_bias_gelu(*t, form="epilogue"), inputs, frozen, matmuls_saved, sums_saved)


def test_bias_gelu_frozen_bias_sums_no_columns(device):
    inputs = [_randn(6, 24, seed=0).to(device), _randn(24, seed=1).to(device)]
    _check(lambda *t: bias_gelu.bias_gelu(*t), inputs, (1,), 0, 1)


@pytest.mark.parametrize("frozen, matmuls_saved, sums_saved", [((1,), 1, 0), ((1, 2), 1, 1), ((0,), 1, 0)])
def test_qkv_projection(frozen, matmuls_saved, sums_saved, device):
    """Gradients autograd hands over separately (the gather launch, which sums dbias's columns in it)."""
    inputs = [_randn(2, 5, 64, seed=0).to(device), _randn(192, 64, seed=1, scale=0.125).to(device),
              _randn(192, seed=2).to(device)]
    _check(lambda *t: qkv.qkv_projection(*t, num_heads=2), inputs, frozen, matmuls_saved, sums_saved)


@pytest.mark.parametrize("needs", [(True, False, True), (True, False, False), (False, True, True)])
def test_qkv_projection_reading_attention_layout(needs, device):
    """dq, dk, dv as the column blocks of one buffer (attention's backward): the same gradients as with every
    one needed, None for the others."""
    x, weight = _randn(13, 64, seed=0).to(device), _randn(192, 64, seed=1, scale=0.125).to(device)
    dqkv = _randn(13, 3, 2, 32, seed=2).to(device)
    full = qkv.qkv_projection_bwd(*dqkv.unbind(1), x, weight)
    for name, got, want, needed in zip(("dx", "dweight", "dbias"), qkv.qkv_projection_bwd(*dqkv.unbind(1), x, weight,
                                                                                           needs), full, needs):
        assert (torch.equal(got, want) if needed else got is None), name


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("frozen, matmuls_per_chunk, sums_per_chunk", [
    ((1, 2), 1, 1),  # a frozen decoder (tied word embeddings): no dW, no column sums for db
    ((1,), 1, 0),
    ((0,), 1, 0),  # a frozen encoder under a trained head
])
def test_linear_cross_entropy(chunks, frozen, matmuls_per_chunk, sums_per_chunk, device, monkeypatch):
    """Per vocabulary chunk, dW = dz^T x and dx += dz W are a matmul each, and db an fp32 torch.sum."""
    rows, vocab, hidden = 8, 96, 16
    plan = functools.lru_cache(maxsize=None)(mlm_loss._backward_plan.__wrapped__)
    monkeypatch.setattr(mlm_loss, "_backward_plan", plan)
    monkeypatch.setattr(mlm_loss, "BACKWARD_CHUNK_ELEMENTS", rows * vocab // chunks)
    monkeypatch.setattr(mlm_loss, "INTERPRETER_BLOCK_V", 32)
    assert vocab // plan(torch.float32, rows, vocab, True, True, "ieee")[1] == chunks
    target = torch.arange(rows).to(device) * 7 % vocab
    target[2] = -100
    inputs = [_randn(rows, hidden, seed=0).to(device), _randn(vocab, hidden, seed=1).to(device),
              _randn(vocab, seed=2).to(device)]
    _check(lambda *t: mlm_loss.linear_cross_entropy(*t, target)[0], inputs, frozen, matmuls_per_chunk * chunks,
           sums_per_chunk * chunks)


@pytest.mark.parametrize("save", ["output", "input"])
@pytest.mark.parametrize("frozen, sums_saved", [((1, 2), 1), ((1,), 0), ((0, 3), 0)])
def test_layer_norm(save, frozen, sums_saved, device):
    """A frozen LayerNorm (LoRA's) leaves its kernel's partial sums unreduced: one torch sum fewer."""
    x, weight, bias, residual = (_randn(6, 32, seed=0).to(device), (1 + 0.1 * _randn(32, seed=1)).to(device),
                                 _randn(32, seed=2).to(device), _randn(6, 32, seed=3).to(device))
    _check(lambda x, weight, bias, residual: layer_norm.layer_norm(x, weight, bias, residual=residual, save=save),
           [x, weight, bias, residual], frozen, 0, sums_saved)


def test_bitfit_model_runs_as_many_backward_matmuls_as_pytorch(device):
    """BERT with every weight matrix frozen and its biases and LayerNorms trained (BitFit): the Triton path's
    backward dispatches exactly as many matmuls as the PyTorch path's, whose autograd skips each frozen
    weight's gradient, and gives gradients to the same parameters."""
    config = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    ids = (torch.arange(2 * 12).view(2, 12) * 5 % 64).to(device)
    results = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        model = BertModel(config.replace(backend=backend)).to(device)
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(not name.endswith("weight") or "LayerNorm" in name)
        out = model(input_ids=ids).last_hidden_state
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            (out * _randn(*out.shape, seed=5).to(device)).sum().backward()
        matmuls = sum(event.count for event in prof.key_averages() if event.key in ("aten::mm", "aten::addmm"))
        results[backend] = matmuls, sorted(n for n, p in model.named_parameters() if p.grad is not None)
    assert results["triton"] == results["torch"]
    assert results["torch"][0] == 4 * config.num_hidden_layers  # dx of Q K V, the attention output, and the FFN's two
