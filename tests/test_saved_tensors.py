"""What the Triton path keeps for the backward, counted with torch.autograd.graph.saved_tensors_hooks (each
storage once) on CPU under Triton's interpreter (issue 18's reductions): one BertLayer keeps Q, K and V once,
in the QKV projection's own buffer, and BertForPreTraining's MLM head keeps no [tokens, vocab] tensor; and, for
ModernBERT (issue 20), each LayerNorm variant (no bias, return_residual) and the GeGLU FFN keep what their kernels'
headers say, to the byte."""
import pytest
import torch

import fastbert
from fastbert import modeling
from fastbert.kernels import qkv

VOCAB = 4099  # a prime that is no other size of the model, so a [rows, vocab] tensor cannot hide
CONFIG = fastbert.BertConfig.tiny(vocab_size=VOCAB, hidden_size=128, num_attention_heads=2, intermediate_size=256,
                                  max_position_embeddings=64, hidden_dropout_prob=0.1,
                                  attention_probs_dropout_prob=0.1, backend="triton")
LENGTHS, SEQ = (37, 20, 1), 37


def _mask(device):
    return (torch.arange(SEQ)[None, :] < torch.tensor(LENGTHS)[:, None]).long().to(device)  # [B, S]


def _saved_tensors(fn):
    """fn()'s result and the tensors autograd saved while it ran."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


def _storage(t):
    return t.untyped_storage().data_ptr()


def test_layer_keeps_q_k_v_once_in_the_projection_buffer(device, monkeypatch):
    """The attention saves q, k, v as the views of the QKV projection's one buffer it was handed, and no
    saved tensor elsewhere holds a copy of any of them (compared by value, in any layout)."""
    torch.manual_seed(0)
    layer = modeling.BertLayer(CONFIG).to(device).train()
    hidden = torch.randn(len(LENGTHS), SEQ, CONFIG.hidden_size, device=device, requires_grad=True)  # [B, S, H]
    projected = []
    project = qkv._project  # what the per-op QKV projection and the one-node sublayer (fastbert/sublayer.py) call

    def recording(*args, **kwargs):
        projected.extend(project(*args, **kwargs))
        return projected

    monkeypatch.setattr(qkv, "_project", recording)
    out, saved = _saved_tensors(lambda: layer(hidden, modeling.AttentionLayout(attention_mask=_mask(device))))
    assert len(projected) == 3 and len({_storage(t) for t in projected}) == 1, "q, k, v are not one buffer"
    buffer = _storage(projected[0])
    in_buffer = [t for t in saved if _storage(t) == buffer]
    assert len(in_buffer) == 3 and all(any(t is p or torch.equal(t, p) for p in projected) for t in in_buffer)
    values = [t.detach().flatten().sort().values for t in projected]
    for t in saved:
        if _storage(t) != buffer and t.numel() == projected[0].numel() and t.is_floating_point():
            sorted_t = t.detach().flatten().sort().values
            assert not any(torch.equal(sorted_t, v) for v in values), f"a copy of q, k or v: {tuple(t.shape)}"
    out[0].sum().backward()  # the saved views serve the backward
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpadded"])
def test_mlm_head_keeps_no_tokens_by_vocab_tensor(unpad, device):
    """BertForPreTraining with labels: besides the parameters (the tied decoder weight [V, H] and its bias
    [V]), no saved tensor has a vocabulary-sized dimension, and none (in any shape) is as large as the fp32
    logits of the labelled rows alone."""
    torch.manual_seed(0)
    model = fastbert.BertForPreTraining(CONFIG.replace(unpad=unpad)).to(device).train()
    generator = torch.Generator().manual_seed(0)
    mask = _mask(device)
    ids = torch.randint(1, VOCAB, mask.shape, generator=generator).to(device) * mask
    labels = torch.where((torch.rand(mask.shape, generator=generator).to(device) < 0.3) & mask.bool(), ids, -100)
    out, saved = _saved_tensors(lambda: model(input_ids=ids, attention_mask=mask, labels=labels,
                                              next_sentence_label=torch.tensor([0, 1, 0], device=device)))
    parameters = {_storage(p) for p in model.parameters()}
    activations = [t for t in saved if _storage(t) not in parameters]
    labelled = int((labels != -100).sum())
    assert labelled > 0
    assert not [tuple(t.shape) for t in activations if VOCAB in t.shape]
    largest = max(t.untyped_storage().nbytes() for t in activations)
    assert largest < labelled * VOCAB * 4, f"a saved storage of {largest} bytes"
    out.loss.backward()
    assert torch.isfinite(model.cls.predictions.bias.grad).all()


@pytest.mark.parametrize("head", ["BertForSequenceClassification", "BertForTokenClassification"])
def test_no_dropout_mask_is_kept(head, device):
    """Training with dropout everywhere (embeddings, attention, the sublayer outputs, the classifier head):
    the Triton path keeps seeds, never a mask: no saved tensor larger than the [B, S] attention mask is
    boolean or bytes (F.dropout's mask on CUDA) or holds only 0 and 1 / (1 - p) (its mask on CPU)."""
    torch.manual_seed(0)
    model = modeling.MODEL_CLASSES[head](CONFIG.replace(num_labels=3)).to(device).train()
    mask = _mask(device)
    ids = torch.randint(1, VOCAB, mask.shape, generator=torch.Generator().manual_seed(0)).to(device) * mask
    labels = torch.tensor([0, 1, 2], device=device) if head == "BertForSequenceClassification" else ids % 3
    out, saved = _saved_tensors(lambda: model(input_ids=ids, attention_mask=mask, labels=labels))
    scale = 1.0 / (1.0 - CONFIG.hidden_dropout_prob)

    def is_mask(t):
        if t.dtype in (torch.bool, torch.uint8):
            return True
        if not t.is_floating_point():
            return False
        kept = torch.isclose(t, torch.tensor(scale, dtype=t.dtype))
        return bool(kept.any() and (kept | (t == 0)).all())

    masks = [tuple(t.shape) for t in saved if t.numel() > mask.numel() and is_mask(t)]
    assert not masks, f"dropout masks kept: {masks}"
    seeds = [t for t in saved if t.dtype == torch.int64 and t.numel() == 1]
    # per layer the attention and both sublayer outputs' dropouts, then the embeddings' and the head's
    assert len(seeds) == 3 * CONFIG.num_hidden_layers + 2
    out.loss.backward()


def _saved_bytes(fn):
    """fn()'s result and {storage pointer: (bytes, shape)} of what autograd saved while it ran, each storage once."""
    out, saved = _saved_tensors(fn)
    return out, {_storage(t): (t.untyped_storage().nbytes(), tuple(t.shape)) for t in saved}


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("save", ["output", "input"])
@pytest.mark.parametrize("return_residual", [False, True], ids=["normed", "return_residual"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_layer_norm_saves_by_variant(with_bias, return_residual, save, dropout_p, device):
    """The pre-LN LayerNorm (issue 20) keeps, besides weight, bias (when there is one) and the int64 seed
    (with dropout): save="output" y, rstd and the side buffer whether or not summed is returned;
    save="input" x, the residual, mean and rstd, or with return_residual summed (one activation) instead
    of x and the residual. Counted in bytes, bf16 activations and fp32 statistics."""
    from fastbert.kernels import layer_norm as ln

    rows, hidden, element = 37, 96, 2
    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(rows, hidden, generator=generator).bfloat16().to(device).requires_grad_()
                   for _ in range(2))
    weight = torch.ones(hidden, device=device, requires_grad=True)
    bias = torch.zeros(hidden, device=device, requires_grad=True) if with_bias else None
    out, saved = _saved_bytes(lambda: ln.layer_norm(x, weight, bias, 1e-5, residual, dropout_p, True, save=save,
                                                    return_residual=return_residual))
    activation, stats = rows * hidden * element, rows * 4
    if save == "output":
        expected = activation + stats + rows * ln.SIDE_COLUMNS * 4
    else:
        expected = (1 if return_residual else 2) * activation + 2 * stats
    expected += hidden * 4 * (2 if with_bias else 1) + (8 if dropout_p else 0)
    assert sum(size for size, _ in saved.values()) == expected, sorted(saved.values())
    if return_residual and save == "input":
        assert _storage(out[1]) in saved and not {_storage(x), _storage(residual)} & set(saved)
    normed, summed = out if return_residual else (out, None)
    loss = normed.float().sum() + (0 if summed is None else summed.float().square().sum())
    loss.backward()  # the backward runs from what was kept
    assert x.grad is not None and residual.grad is not None and (bias is None or bias.grad is not None)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("recompute_pre", [False, True], ids=["keep_pre", "recompute_pre"])
def test_geglu_keeps_both_halves_of_the_pre_activation_not_its_output(recompute_pre, with_bias, device):
    """The GeGLU FFN keeps x, w1, w2 and h [M, 2I] (both halves, one storage), never the [M, I] GeGLU output;
    with recompute_pre x, w1, w2 and b1 (when there is one) and nothing of [M, I] or [M, 2I]."""
    from fastbert.kernels import ffn

    rows, hidden, inner = 50, 64, 96
    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return (torch.randn(*shape, generator=generator) * 0.1).bfloat16().to(device).requires_grad_()

    x, w1, b1, w2, b2 = leaf(rows, hidden), leaf(2 * inner, hidden), leaf(2 * inner), leaf(hidden, inner), leaf(hidden)
    b1, b2 = (b1, b2) if with_bias else (None, None)
    out, saved = _saved_bytes(lambda: ffn.feed_forward_geglu(x, w1, b1, w2, b2, "none", recompute_pre))
    kept = [x, w1, w2] + ([b1] if recompute_pre and with_bias else [])
    pre_bytes = 0 if recompute_pre else rows * 2 * inner * 2
    assert sum(size for size, _ in saved.values()) == sum(t.nbytes for t in kept) + pre_bytes
    shapes = [shape for _, shape in saved.values()]
    assert (rows, inner) not in shapes and shapes.count((rows, 2 * inner)) == (0 if recompute_pre else 1)
    out.float().sum().backward()
    assert all(t.grad is not None for t in (x, w1, w2, b1, b2) if t is not None)
