"""ModernBERT on fastbert against transformers' ModernBERT on the same tiny random weights.

Four layers (global, local, local, global: both attention types and both rotary bases) with a window of
local_attention = 4 (keys with |i - j| <= 2) that cuts a 13-token row; padded batches with a full row, a
6-token row, a fully padded row and a 1-token row. On the reference path (fp32): `fastbert.apply` on every
head transformers has, with eager and SDPA attention, and fastbert's own classes (from_pretrained /
save_pretrained both ways, from_hf / to_hf, the masked-LM loss, packed inputs); outputs on real tokens, losses
and every gradient within 1e-5. On the Triton path (the interpreter): fp32, fp16 and bf16 within DESIGN.md's
tolerance rule against transformers in float64, also with a window across key blocks; packed = padded.
What fastbert does not compute is an error naming the field.
"""
import contextlib
import copy
import json

import pytest
import torch
from family_models import (VOCAB, base_loss, flattened, named_outputs, padded_batch, randomize, real_tokens,
                           to_device)
from test_qkv import NoGather
from tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, assert_within_rule, pytorch_in

import fastbert
from fastbert.in_place import ACCELERATED
from fastbert.kernels import qkv

transformers = pytest.importorskip("transformers")

SEQ, NUM_LABELS, CHOICES = 13, 2, 2
LENGTHS = (13, 6, 0, 1)  # a fully padded row and a 1-token row
FILLED = (13, 6, 1)  # for the heads whose loss reads every row (mean pooling, multiple choice): no empty row
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
             local_attention=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             cls_token_id=1, sep_token_id=2)
TRITON_SIZES = dict(hidden_size=64, intermediate_size=96)  # head dim 32, which the Triton attention takes
BIASES = dict(norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True)
HEADS = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
         "ForMultipleChoice")
NATIVE = ("Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification")
MASK_ID = 4  # the [MASK] id of the masked-LM accuracy test (below the ids padded_batch draws)


def hf_config(**overrides):
    return transformers.ModernBertConfig(**{**SIZES, **overrides})


def hf_model(head="Model", seed=0, **overrides):
    """transformers' ModernBERT with the head, random weights (LayerNorm weights around 1, biases nonzero)."""
    torch.manual_seed(seed)
    return randomize(getattr(transformers, "ModernBert" + head)(hf_config(**overrides)), seed).eval()


def head_inputs(config, head, lengths=LENGTHS, seed=0):
    """The padded batch and the labels of `head`; padding (and the fully padded row's pooled label) -100."""
    generator = torch.Generator().manual_seed(seed + 1)
    inputs = padded_batch(config, lengths=lengths, seq=SEQ, seed=seed)
    mask = inputs["attention_mask"]
    batch, empty = mask.shape[0], mask.sum(1) == 0
    if head == "ForMaskedLM":
        inputs["labels"] = torch.randint(0, config.vocab_size, mask.shape, generator=generator).masked_fill(
            mask == 0, -100)
    elif head == "ForSequenceClassification":  # CrossEntropyLoss ignores -100: the empty row has no class
        inputs["labels"] = torch.randint(0, NUM_LABELS, (batch,), generator=generator).masked_fill(empty, -100)
    elif head == "ForTokenClassification":
        inputs["labels"] = torch.randint(0, NUM_LABELS, mask.shape, generator=generator).masked_fill(mask == 0, -100)
    elif head == "ForQuestionAnswering":
        # transformers' span loss is a softmax over every position, padding included, where fastbert's
        # outputs there are zero by design (README, differences): its loss runs on full rows, its padded
        # logits are compared on real tokens (test_apply_every_head_equals_transformers)
        inputs = padded_batch(config, lengths=(SEQ,) * batch, seq=SEQ, seed=seed)
        inputs["start_positions"] = torch.randint(0, SEQ, (batch,), generator=generator)
        inputs["end_positions"] = torch.minimum(inputs["start_positions"] + 1, torch.tensor(SEQ - 1))
    elif head == "ForMultipleChoice":  # [B, choices, S]: the batch and its rows reversed as a second choice
        inputs = {k: torch.stack([v, v.flip(0)], 1) for k, v in inputs.items()}
        inputs["labels"] = torch.randint(0, CHOICES, (batch,), generator=generator)
    return inputs


def loss_of(output, inputs, head):
    return base_loss(output, inputs["attention_mask"]) if head == "Model" else output.loss


def assert_same_results(ours, theirs, inputs, head, atol=1e-5):
    """Every tensor output on real tokens (rows with none: their pooled outputs are padding's), the loss and
    every parameter's gradient (tied ones under each name)."""
    mask = inputs["attention_mask"]
    expected, actual = theirs(**inputs), ours(**inputs)
    expected_fields, actual_fields = named_outputs(expected), named_outputs(actual)
    assert expected_fields.keys() <= actual_fields.keys()  # fastbert's masked-LM head adds its accuracy
    rows = mask.sum(-1) > 0  # [B] ([B, choices] for multiple choice)
    for name, value in expected_fields.items():
        got = actual_fields[name]
        if name == "logits" and head in ("ForSequenceClassification", "ForMultipleChoice"):
            got, value = got[rows], value[rows]
        torch.testing.assert_close(real_tokens(got, mask), real_tokens(value, mask), atol=atol, rtol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    loss_of(expected, inputs, head).backward()
    loss_of(actual, inputs, head).backward()
    grads = dict(ours.named_parameters(remove_duplicate=False))
    for name, param in theirs.named_parameters(remove_duplicate=False):
        assert (param.grad is None) == (grads[name].grad is None), name
        if param.grad is not None:
            torch.testing.assert_close(grads[name].grad, param.grad, atol=atol, rtol=1e-5,
                                       msg=lambda m: f"d {name}: {m}")
    layers = [(n, p) for n, p in grads.items() if n.startswith(("layers.", "model.layers."))]
    assert layers and all(p.grad is not None and p.grad.abs().max() > 0 for n, p in layers), \
        "a layer's parameter got no gradient"
    ours.zero_grad(), theirs.zero_grad()


def test_tiny_config_has_global_and_local_layers_and_a_window_that_cuts():
    config = hf_config()
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert config.sliding_window == 2 < SEQ - 1  # keys with |i - j| <= 2 of 13
    theta = {t: p["rope_theta"] for t, p in config.rope_parameters.items()}
    assert theta == {"full_attention": 160000.0, "sliding_attention": 10000.0}


CASES = [(head, pooling) for head in HEADS for pooling in (("cls", "mean") if head in (
    "ForSequenceClassification", "ForMultipleChoice") else ("cls",))]


@pytest.mark.parametrize("biases", [False, True], ids=["no-biases", "biases"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("head,pooling", CASES, ids=[f"{h}-{p}" for h, p in CASES])
def test_apply_every_head_equals_transformers(head, pooling, attn, biases):
    overrides = dict(classifier_pooling=pooling, attn_implementation=attn, **(BIASES if biases else {}))
    theirs = hf_model(head, **overrides)
    ours = copy.deepcopy(theirs)
    assert fastbert.apply(ours) is ours
    base = ours.base_model
    assert ACCELERATED in vars(base), f"{type(base).__name__} was not accelerated"
    assert type(base) is type(theirs.base_model) and type(ours) is type(theirs)  # the classes stay transformers'
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    if biases:
        assert theirs.base_model.layers[1].attn.Wqkv.bias is not None and theirs.base_model.final_norm.bias is not None
    # mean pooling divides by 0 on an empty row, and multiple choice's loss reads every choice: the empty row's
    # pooled values are NaN or padding's in transformers too
    empty_row_pools = pooling == "mean" or head == "ForMultipleChoice"
    inputs = head_inputs(theirs.config, head, FILLED if empty_row_pools else LENGTHS)
    assert_same_results(ours, theirs, inputs, head)
    if head == "ForQuestionAnswering":  # its loss ran on full rows (head_inputs); padded logits here
        padded = padded_batch(theirs.config, lengths=LENGTHS, seq=SEQ)
        real = padded["attention_mask"].bool()
        for name in ("start_logits", "end_logits"):
            torch.testing.assert_close(ours(**padded)[name][real], theirs(**padded)[name][real], atol=1e-5,
                                       rtol=1e-5, msg=lambda m: f"padded {name}: {m}")


def left_padded(inputs):
    """The batch with each row's padding moved to its left."""
    mask = inputs["attention_mask"]
    order = torch.argsort(mask, dim=1, stable=True)  # padding (0) first, then the tokens in their order
    return {k: v.gather(1, order) for k, v in inputs.items()}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padding_and_no_mask_equal_transformers(attn):
    """transformers' rotary positions are row indices, fastbert's offsets in the sequence: scores depend on
    i - j only, so a left-padded batch gives the same; without a mask every position is a token."""
    theirs = hf_model("ForTokenClassification", attn_implementation=attn)
    ours = fastbert.apply(copy.deepcopy(theirs))
    inputs = left_padded(head_inputs(theirs.config, "ForTokenClassification"))
    assert inputs["attention_mask"][1, :SEQ - 6].sum() == 0  # padding on the left
    assert_same_results(ours, theirs, inputs, "ForTokenClassification")
    expected, actual = (m(input_ids=inputs["input_ids"][:1]).logits for m in (theirs, ours))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)  # no mask: every position a token


@pytest.mark.parametrize("biases", [False, True], ids=["no-biases", "biases"])
def test_hidden_states_and_attentions_equal_transformers(biases):
    """Every layer's hidden state (the last after final_norm, as transformers') and the eager attention's
    probabilities, zero outside the window on local layers."""
    theirs = hf_model(attn_implementation="eager", **(BIASES if biases else {}))
    ours = fastbert.apply(copy.deepcopy(theirs))
    inputs = padded_batch(theirs.config, lengths=LENGTHS, seq=SEQ)
    real = inputs["attention_mask"].bool()
    expected, actual = (m(**inputs, output_hidden_states=True, output_attentions=True) for m in (theirs, ours))
    assert len(actual.hidden_states) == len(expected.hidden_states) == theirs.config.num_hidden_layers + 1
    for layer, (a, b) in enumerate(zip(actual.hidden_states, expected.hidden_states)):
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-5, msg=lambda m: f"hidden state {layer}: {m}")
    assert len(actual.attentions) == len(expected.attentions) == theirs.config.num_hidden_layers
    distance = (torch.arange(SEQ)[:, None] - torch.arange(SEQ)[None, :]).abs()
    for layer, (a, b) in enumerate(zip(actual.attentions, expected.attentions)):  # [B, heads, S, S]
        queries = real[:, None, :, None].expand_as(a)  # padded query rows are not meaningful
        torch.testing.assert_close(a[queries], b[queries], atol=1e-6, rtol=1e-5,
                                   msg=lambda m: f"attention {layer}: {m}")
        outside = (distance > theirs.config.sliding_window)[None, None] & queries
        local = theirs.config.layer_types[layer] == "sliding_attention"
        assert (a[outside] == 0).all() if local else (a[outside] > 0).any(), f"layer {layer}'s window"


def test_apply_twice_changes_nothing_and_shares_parameters():
    model = hf_model("ForSequenceClassification")
    before = dict(model.named_parameters())
    fastbert.apply(model)
    fast = vars(model.model)[ACCELERATED]
    fastbert.apply(model)
    assert vars(model.model)[ACCELERATED] is fast
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is p for n, p in before.items())


# fastbert's own classes ------------------------------------------------------------------------------------

def assert_same_state(ours, theirs):
    ours, theirs = ours.state_dict(), theirs.state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


NATIVE_CASES = [(head, biases) for head in NATIVE for biases in (False, True)]


@pytest.mark.parametrize("head,biases", NATIVE_CASES, ids=[f"{h}-{'biases' if b else 'no-biases'}"
                                                           for h, b in NATIVE_CASES])
def test_from_pretrained_and_save_pretrained_both_ways(head, biases, tmp_path):
    theirs = hf_model(head, **(BIASES if biases else {}))
    inputs = head_inputs(theirs.config, head)
    theirs.save_pretrained(tmp_path / "transformers")
    ours = getattr(fastbert, "ModernBert" + head).from_pretrained(tmp_path / "transformers").eval()
    assert type(ours.config) is fastbert.ModernBertConfig
    assert_same_state(ours, theirs)
    assert_same_results(ours, theirs, inputs, head)
    if head == "ForMaskedLM":  # the decoder stays tied to the word embeddings, as in transformers
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight

    ours.save_pretrained(tmp_path / "fastbert")
    again = type(theirs).from_pretrained(tmp_path / "fastbert").eval()
    assert again.config.model_type == "modernbert"
    assert again.config.layer_types == theirs.config.layer_types
    assert again.config.rope_parameters == theirs.config.rope_parameters
    assert_same_state(again, theirs)
    assert_same_results(ours, again, inputs, head)


@pytest.mark.parametrize("head", NATIVE)
def test_from_hf_and_to_hf_round_trip(head):
    theirs = hf_model(head, classifier_pooling="mean")
    inputs = head_inputs(theirs.config, head, FILLED)
    ours = fastbert.from_hf(theirs)
    assert type(ours) is getattr(fastbert, "ModernBert" + head) and not ours.training
    assert_same_state(ours, theirs)
    assert_same_results(ours, theirs, inputs, head)
    back = ours.to_hf()
    assert type(back) is type(theirs)
    assert_same_state(back, theirs)
    assert_same_results(ours, back, inputs, head)


def test_resize_token_embeddings_as_transformers():
    """The tied decoder and its own bias (decoder_bias) resized with the embeddings, as transformers'."""
    theirs = hf_model("ForMaskedLM")
    ours = fastbert.from_hf(theirs)
    theirs.resize_token_embeddings(VOCAB + 6)
    ours.resize_token_embeddings(VOCAB + 6)
    assert ours.config.vocab_size == VOCAB + 6 and ours.decoder.bias.shape == (VOCAB + 6,)
    assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    state, their_state = ours.state_dict(), theirs.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in their_state.items()}
    ours.load_state_dict(their_state)  # the new rows are drawn at random: the same ones on both sides
    inputs = head_inputs(theirs.config, "ForMaskedLM")
    inputs["input_ids"][0, 2] = VOCAB + 4  # a new token
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(ours(**inputs).logits[real], theirs(**inputs).logits[real], atol=1e-5, rtol=1e-5)


def test_masked_lm_loss_and_mask_accuracy_equal_transformers():
    """The masked-only fused loss with labels on some positions, and the accuracy at the [MASK] positions
    computed from transformers' logits; in training mode the loss and gradients without logits."""
    theirs = hf_model("ForMaskedLM")
    ours = fastbert.from_hf(theirs)
    inputs = padded_batch(theirs.config, lengths=LENGTHS, seq=SEQ)
    ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
    generator = torch.Generator().manual_seed(3)
    chosen = (torch.rand(ids.shape, generator=generator) < 0.4) & mask
    shown = chosen & (torch.rand(ids.shape, generator=generator) < 0.7)  # the rest keep their token
    labels = ids.masked_fill(~chosen, -100)
    inputs["input_ids"] = ids.masked_fill(shown, MASK_ID)
    assert shown.sum() >= 3 and (chosen & ~shown).any()
    expected = theirs(**inputs, labels=labels)
    actual = ours(**inputs, labels=labels, mask_token_id=MASK_ID)
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-5, rtol=1e-5)
    predicted = expected.logits.argmax(-1)
    torch.testing.assert_close(actual.accuracy, (predicted == labels)[chosen].double().mean().to(actual.accuracy))
    torch.testing.assert_close(actual.mask_accuracy,
                               (predicted == labels)[shown].double().mean().to(actual.mask_accuracy))
    theirs.train(), ours.train()  # the training path: the same loss and gradients, no logits
    expected, actual = theirs(**inputs, labels=labels), ours(**inputs, labels=labels)
    assert actual.logits is None
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-5, rtol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    grads = dict(ours.named_parameters(remove_duplicate=False))
    for name, param in theirs.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(grads[name].grad, param.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"d {name}: {m}")


@pytest.mark.parametrize("native", [True, False], ids=["native", "applied"])
def test_packed_inputs_equal_the_padded_batch(native):
    """DataCollatorWithFlattening's layout (input_ids [1, T], cu_seq_lens, position ids restarting at 0) on the
    rows with tokens gives the padded batch's hidden states and gradients; wrong position ids are refused."""
    theirs = hf_model()
    model = fastbert.from_hf(theirs) if native else fastbert.apply(copy.deepcopy(theirs))
    inputs = padded_batch(theirs.config, lengths=FILLED, seq=SEQ)
    mask = inputs["attention_mask"]
    padded = model(**inputs)
    torch.testing.assert_close(padded.last_hidden_state[mask.bool()],
                               theirs(**inputs).last_hidden_state[mask.bool()], atol=1e-5, rtol=1e-5)
    base_loss(padded, mask).backward()
    expected_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    packed = flattened(inputs, 0)
    assert packed["cu_seq_lens_q"].tolist() == [0, *torch.tensor(FILLED).cumsum(0).tolist()]
    for with_positions in (True, False):
        model.zero_grad()
        given = packed if with_positions else {k: v for k, v in packed.items() if k != "position_ids"}
        out = model(**given)
        assert out.last_hidden_state.shape == (1, sum(FILLED), theirs.config.hidden_size)
        torch.testing.assert_close(out.last_hidden_state[0], padded.last_hidden_state[mask.bool()], atol=1e-5,
                                   rtol=1e-5)
        base_loss(out, torch.ones(out.last_hidden_state.shape[:2])).backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected_grads[name], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"d {name}: {m}")
    # positions from any start in each sequence rotate as the offsets do (only i - j counts); others are refused
    for start in (1, None):  # from 1 in each sequence; counting on across sequences
        positions = packed["position_ids"] + 1 if start else torch.arange(sum(FILLED))[None]
        torch.testing.assert_close(model(**dict(packed, position_ids=positions)).last_hidden_state[0],
                                   padded.last_hidden_state[mask.bool()], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="position_ids"):
        model(**dict(packed, position_ids=packed["position_ids"] * 2))


def test_packed_masked_lm_training_loss_equals_transformers_padded():
    """Pretraining's layout: packed examples (cu_seq_lens, labels [1, T]) through the masked-only fused loss in
    training mode; the loss and every gradient equal transformers' on the padded batch."""
    theirs = hf_model("ForMaskedLM").train()
    ours = fastbert.from_hf(theirs)
    inputs = head_inputs(theirs.config, "ForMaskedLM", FILLED)
    real = inputs["attention_mask"].bool()
    packed = dict(flattened(inputs, 0), labels=inputs["labels"][real][None])  # [1, T]
    expected, actual = theirs(**inputs), ours(**packed)
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-5, rtol=1e-5)
    expected.loss.backward()
    actual.loss.backward()
    grads = dict(ours.named_parameters(remove_duplicate=False))
    for name, param in theirs.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(grads[name].grad, param.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"d {name}: {m}")


@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_sparse_prediction_logits_of_the_labelled_tokens_as_transformers(ignore_index):
    """sparse_prediction=True: with labels, transformers' logits are the labelled tokens' only, [N, vocab], those
    labelled sparse_pred_ignore_index left out of the logits and the loss (-100 stays out of the loss too)."""
    theirs = hf_model("ForMaskedLM", sparse_prediction=True, sparse_pred_ignore_index=ignore_index)
    inputs = head_inputs(theirs.config, "ForMaskedLM")
    inputs["labels"][0, ::2] = ignore_index  # some real tokens unlabelled
    inputs["labels"][-1, :2] = -100  # with ignore_index 0: in the logits, out of the loss
    kept = inputs["labels"] != ignore_index
    labelled = int(kept.sum())
    ours = fastbert.from_hf(theirs)
    expected, actual = theirs(**inputs), ours(**inputs)
    assert expected.logits.shape == actual.logits.shape == (labelled, VOCAB)
    real = inputs["attention_mask"].bool()[kept]  # padding's logits differ by design (README, differences)
    torch.testing.assert_close(actual.logits[real], expected.logits[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual.loss, expected.loss, atol=1e-5, rtol=1e-5)
    assert ours(**inputs, return_dict=False)[1].shape == (labelled, VOCAB)
    # under Trainer's gradient accumulation (num_items_in_batch: its count of labels other than -100), the fused loss
    # of transformers' model after fastbert.apply sums over the same tokens as transformers'
    applied = fastbert.apply(copy.deepcopy(theirs)).train()
    items = torch.tensor(int((inputs["labels"] != -100).sum()) + 5)
    torch.testing.assert_close(applied(**inputs, num_items_in_batch=items).loss,
                               theirs.train()(**inputs, num_items_in_batch=items).loss, atol=1e-5, rtol=1e-5)
    theirs.eval()
    inputs.pop("labels")  # without labels every token's logits, as transformers
    assert theirs(**inputs).logits.shape == ours(**inputs).logits.shape == (len(LENGTHS), SEQ, VOCAB)


def test_checkpoint_config_with_the_older_rope_fields(tmp_path):
    """config.json as ModernBERT-base's on the hub: global_rope_theta / local_rope_theta /
    global_attn_every_n_layers instead of rope_parameters and layer_types (other values than the defaults, so
    a field left unread shows), and its fields transformers ignores; saved back, transformers reads it the same."""
    theirs = hf_model("ForMaskedLM")
    theirs.save_pretrained(tmp_path / "checkpoint")
    config_file = tmp_path / "checkpoint" / "config.json"
    values = json.loads(config_file.read_text())
    del values["rope_parameters"], values["layer_types"]
    values.update(global_rope_theta=20000.0, local_rope_theta=500.0, global_attn_every_n_layers=2,
                  position_embedding_type="absolute", reference_compile=True, repad_logits_with_grad=True)
    config_file.write_text(json.dumps(values))
    theirs = type(theirs).from_pretrained(tmp_path / "checkpoint").eval()
    assert theirs.config.layer_types == ["full_attention", "sliding_attention"] * 2
    assert theirs.config.rope_parameters["sliding_attention"]["rope_theta"] == 500.0
    ours = fastbert.ModernBertForMaskedLM.from_pretrained(tmp_path / "checkpoint").eval()
    assert ours.config.layer_types == theirs.config.layer_types
    assert [layer.attn.rotary_base for layer in ours.model.layers] == [20000.0, 500.0] * 2
    assert [layer.attn.window for layer in ours.model.layers] == [None, 2] * 2
    assert_same_results(ours, theirs, head_inputs(theirs.config, "ForMaskedLM"), "ForMaskedLM")
    ours.save_pretrained(tmp_path / "fastbert")
    again = type(theirs).from_pretrained(tmp_path / "fastbert").eval()
    assert again.config.layer_types == theirs.config.layer_types
    assert again.config.rope_parameters == theirs.config.rope_parameters
    assert_same_results(ours, again, head_inputs(theirs.config, "ForMaskedLM"), "ForMaskedLM")


@pytest.mark.parametrize("activations", [
    dict(hidden_activation="gelu_pytorch_tanh"),
    dict(hidden_activation="gelu_new", classifier_activation="gelu_pytorch_tanh"),
], ids=["tanh-encoder", "tanh-both"])
def test_tanh_gelus_equal_transformers(activations):
    """The GeGLU's GELU (hidden_activation) and the head's (classifier_activation) each as configured."""
    theirs = hf_model("ForMaskedLM", **activations)
    inputs = head_inputs(theirs.config, "ForMaskedLM")
    assert_same_results(fastbert.from_hf(theirs), theirs, inputs, "ForMaskedLM")
    assert_same_results(fastbert.apply(copy.deepcopy(theirs)), theirs, inputs, "ForMaskedLM")


@pytest.mark.parametrize("head", ["ForSequenceClassification", "ForMaskedLM"])
def test_dropout_off_in_eval_and_drawn_in_training(head):
    """Every dropout of ModernBERT's config set: in eval mode the outputs, loss and gradients equal
    transformers' (applied and native); in training mode each seed draws its own masks, the same seed the same."""
    theirs = hf_model(head, attention_dropout=0.2, embedding_dropout=0.2, mlp_dropout=0.2, classifier_dropout=0.2)
    inputs = head_inputs(theirs.config, head)
    for ours in (fastbert.apply(copy.deepcopy(theirs)), fastbert.from_hf(theirs)):
        assert_same_results(ours, theirs, inputs, head)
        evaluated = ours(**inputs).loss
        ours.train()
        losses = []
        for seed in (0, 0, 1):
            torch.manual_seed(seed)
            losses.append(ours(**inputs).loss)
        assert torch.equal(losses[0], losses[1]) and not torch.equal(losses[0], losses[2])
        assert not torch.equal(losses[0], evaluated)


def test_activation_checkpointing_enable_reaches_fastbert():
    theirs = hf_model("ForSequenceClassification").train()
    ours = fastbert.apply(copy.deepcopy(theirs))
    ours.activation_checkpointing_enable()  # transformers 5's name for gradient_checkpointing_enable
    assert vars(ours.model)[ACCELERATED].layers.gradient_checkpointing
    assert_same_results(ours, theirs, head_inputs(theirs.config, "ForSequenceClassification"),
                        "ForSequenceClassification")


# the Triton path (the interpreter) -------------------------------------------------------------------------

def run(model, inputs, mask):
    """The outputs with every hidden state, and the gradients of base_loss (all parameters)."""
    output = model(**inputs, output_hidden_states=True)
    base_loss(output, mask).backward()
    return output, {name: param.grad for name, param in model.named_parameters()}


def assert_triton_within_the_rule(exact, inputs, dtype):
    """`exact` (transformers' model in float64, SDPA) in `dtype`, plain and accelerated by
    `fastbert.apply(backend="triton")`: every hidden state and every parameter's gradient of the accelerated
    one within the rule, PyTorch's own error being transformers' in `dtype`."""
    in_dtype = copy.deepcopy(exact).to(dtype)
    kernels = fastbert.apply(copy.deepcopy(in_dtype), backend="triton")
    assert vars(kernels)[ACCELERATED].config.backend == "triton"
    mask = inputs["attention_mask"]
    real = mask.bool()
    with pytorch_in(dtype):  # both: the two models differ by the kernels alone
        out, grads = run(kernels, inputs, mask)
        torch_out, torch_grads = run(in_dtype, inputs, mask)
    exact_out, exact_grads = run(exact, inputs, mask)
    assert len(out.hidden_states) == exact.config.num_hidden_layers + 1
    for layer, states in enumerate(zip(out.hidden_states, torch_out.hidden_states, exact_out.hidden_states)):
        assert_within_rule(f"hidden state {layer}", *(state[real] for state in states), FORWARD_FACTOR)
    for name, grad in exact_grads.items():
        assert grad is not None and grads[name] is not None, name
        assert_within_rule(f"d {name}", grads[name], torch_grads[name], grad, GRADIENT_FACTOR)


# ModernBERT-base has no biases; the kernels' bias variants are in the masked-LM training test, fp32 and bf16
BIASES_AND_FP16 = pytest.mark.slow(reason="the rest of dtype x biases: biases are in "
                                          "test_triton_masked_lm_training_loss_within_the_rule in fp32 and bf16")
TRITON_CASES = [pytest.param(dtype, biases, id=f"{name}-{'biases' if biases else 'no-biases'}",
                             marks=BIASES_AND_FP16 if biases or name == "fp16" else ())
                for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16))
                for biases in (False, True)]


@pytest.mark.parametrize("dtype, biases", TRITON_CASES)
def test_triton_path_within_the_rule_against_float64(dtype, biases, device, monkeypatch):
    """Also: each layer's QKV backward reads the attention backward's one buffer, never gathering (test_qkv.py)."""
    monkeypatch.setattr(qkv, "_qkv_bwd_kernel", NoGather())
    exact = hf_model(**TRITON_SIZES, **(BIASES if biases else {})).double().to(device)
    assert_triton_within_the_rule(exact, to_device(padded_batch(exact.config, lengths=LENGTHS, seq=SEQ), device),
                                  dtype)


def test_triton_left_padding_within_the_rule(device):
    """Left padding on the kernels: rotary positions from each sequence's first token (transformers' from the
    row's first position), the window on offsets; the same result."""
    exact = hf_model(**TRITON_SIZES).double().to(device)
    inputs = left_padded(padded_batch(exact.config, lengths=LENGTHS, seq=SEQ))
    assert_triton_within_the_rule(exact, to_device(inputs, device), torch.float32)


@pytest.mark.slow(reason="S = 150 on the kernels; the band across key blocks is test_attention_rotary_window's (S = "
                         "129) in fp32 and bf16, the local layers on the kernels test_triton_path_within_the_rule's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_window_across_blocks_within_the_rule(dtype, device):
    """Rows of 150 and 77 tokens with a window of 16 keys either side: the local layers' kernels skip the key
    blocks outside the band and mask its edges inside blocks; rotary positions past the first block."""
    exact = hf_model(**TRITON_SIZES, local_attention=32, max_position_embeddings=160).double().to(device)
    assert exact.config.sliding_window == 16
    inputs = padded_batch(exact.config, lengths=(150, 77, 0, 1), seq=150)
    assert_triton_within_the_rule(exact, to_device(inputs, device), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_masked_lm_training_loss_within_the_rule(dtype, device):
    """fastbert's ModernBertForMaskedLM in training mode on the kernels (the masked-only fused loss through the
    tied decoder with its bias, no logits): the loss and every gradient (tied ones under each name) within the
    rule against transformers' in float64, with every bias present."""
    exact = hf_model("ForMaskedLM", **TRITON_SIZES, **BIASES).double().train().to(device)
    in_dtype = copy.deepcopy(exact).to(dtype)
    kernels = fastbert.from_hf(in_dtype, backend="triton")
    assert kernels.training and kernels.config.backend == "triton"
    inputs = to_device(head_inputs(exact.config, "ForMaskedLM"), device)
    outputs = []
    for model in (kernels, in_dtype, exact):
        with pytorch_in(dtype) if model is not exact else contextlib.nullcontext():
            outputs.append(model(**inputs))
            outputs[-1].loss.backward()
    assert outputs[0].logits is None  # the training path materialises no [B, S, V] logits
    assert_within_rule("loss", *(out.loss.reshape(1) for out in outputs), FORWARD_FACTOR)
    grads = [dict(model.named_parameters(remove_duplicate=False)) for model in (kernels, in_dtype, exact)]
    assert grads[0].keys() == grads[2].keys()
    for name, param in grads[2].items():
        assert_within_rule(f"d {name}", grads[0][name].grad, grads[1][name].grad, param.grad, GRADIENT_FACTOR)


@pytest.mark.parametrize("native", [True, False], ids=["native", "applied"])
def test_triton_packed_inputs_equal_the_padded_batch(native, device):
    """Packed (each sequence's rotary positions and window from its own start) = padded on the kernels:
    hidden states and every gradient."""
    theirs = hf_model(**TRITON_SIZES).to(device)
    model = fastbert.from_hf(theirs, backend="triton") if native else fastbert.apply(theirs, backend="triton")
    inputs = to_device(padded_batch(theirs.config, lengths=FILLED, seq=SEQ), device)
    mask = inputs["attention_mask"]
    padded = model(**inputs)
    base_loss(padded, mask).backward()
    expected_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    packed = model(**to_device(flattened(inputs, 0), device))
    torch.testing.assert_close(packed.last_hidden_state[0], padded.last_hidden_state[mask.bool()], atol=1e-5,
                               rtol=1e-5)
    base_loss(packed, torch.ones(packed.last_hidden_state.shape[:2], device=device)).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"d {name}: {m}")


def test_triton_stream_joins_the_unhooked_mlp_op(monkeypatch, device):
    """Each layer hands its residual stream to an unhooked ModernBertMLP's fused op, whose down-projection adds
    it (in inference onto the stream in place); a hooked MLP is called as a module, its hook sees the MLP's own
    output (no stream) and the layer adds the stream after it: the same hidden states and gradients within
    1e-5."""
    from fastbert import reference
    from fastbert.kernels import ffn

    model = fastbert.from_hf(hf_model(**TRITON_SIZES).to(device), backend="triton")
    inputs = to_device(padded_batch(model.config, lengths=FILLED, seq=SEQ), device)
    residuals = []
    fused = ffn.feed_forward_fwd
    monkeypatch.setattr(ffn, "feed_forward_fwd",
                        lambda *a, **k: residuals.append(a[9] if len(a) > 9 else None) or fused(*a, **k))

    def run():
        residuals.clear()
        output = model(**inputs)
        base_loss(output, inputs["attention_mask"]).backward()
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        model.zero_grad()
        return output.last_hidden_state.detach(), grads

    plain, plain_grads = run()
    assert len(residuals) == 4 and all(r is not None for r in residuals)
    mlp = model.layers[1].mlp
    seen = []

    def hook(module, args, output):
        expected = reference.feed_forward_geglu(args[0], module.Wi.weight, module.Wi.bias, module.Wo.weight,
                                                module.Wo.bias, module.config.gelu_approximate)
        seen.append(torch.allclose(output, expected, atol=1e-5, rtol=1e-5))

    handle = mlp.register_forward_hook(hook)
    hooked, hooked_grads = run()
    assert seen == [True] and [r is None for r in residuals] == [False, True, False, False]
    torch.testing.assert_close(hooked, plain, atol=1e-5, rtol=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(hooked_grads[name], grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"d {name}: {m}")
    # inference: the unhooked layers' GEMMs accumulate onto their streams in place; every hidden state as in
    # training's forward
    in_place = []
    accumulate = ffn._add_in_place
    monkeypatch.setattr(ffn, "_add_in_place", lambda *a: in_place.append(1) or accumulate(*a))
    with torch.no_grad():
        inferred = model(**inputs, output_hidden_states=True)
    assert len(in_place) == 3  # the hooked layer's MLP is called as a module, its stream added after it
    handle.remove()
    trained = model(**inputs, output_hidden_states=True)
    for got, expected in zip(inferred.hidden_states, trained.hidden_states, strict=True):
        torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=1e-5)


# what fastbert does not compute: errors naming the field ----------------------------------------------------

LINEAR_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "rope_theta": 160000.0, "factor": 2.0}}


@pytest.mark.parametrize("overrides,field", [
    (dict(rope_parameters=LINEAR_ROPE), "rope_type"),
    (dict(classifier_activation="relu"), "classifier_activation"),
    (dict(hidden_activation="silu"), "hidden_activation"),
], ids=["rope_type", "classifier_activation", "hidden_activation"])
def test_unsupported_configs_are_errors_naming_the_field(overrides, field, tmp_path):
    model = hf_model("ForSequenceClassification", **overrides)
    with pytest.raises(ValueError, match=field):
        fastbert.apply(model)
    assert ACCELERATED not in vars(model.model)  # left as it was
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=field):
        fastbert.ModernBertForSequenceClassification.from_pretrained(tmp_path)


def test_unpad_false_is_an_error_naming_unpad(tmp_path):
    model = hf_model()
    with pytest.raises(ValueError, match="unpad"):
        fastbert.apply(model, unpad=False)
    assert ACCELERATED not in vars(model)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unpad"):
        fastbert.ModernBertModel.from_pretrained(tmp_path, unpad=False)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_encoder_unpads_where_the_kernels_run(backend, monkeypatch, device):
    """A padded batch is unpadded once on the kernels; on the PyTorch path it stays padded (as transformers'
    SDPA ModernBERT), where the reference's varlen attention would pad each layer back, to twice the batch (each
    sequence's padding a sequence of its own). Both give transformers' outputs on the real tokens."""
    unpads, varlen = [], []
    monkeypatch.setattr(fastbert.ops, "unpad", lambda *args, real=fastbert.ops.unpad, **kwargs:
                        unpads.append(1) or real(*args, **kwargs))
    # the packed attention, recognised where the kernels run by their limit check, which the per-op call and the
    # one-node sublayer (fastbert/sublayer.py, in training) both make; on the PyTorch path by the op
    if backend == "triton":
        kernel = fastbert.ops.KERNELS["attention"]
        monkeypatch.setattr(kernel, "check_limits", lambda q, k, v, mask, cu_seqlens, *args, real=kernel.check_limits:
                            (cu_seqlens is not None and varlen.append(1)) or real(q, k, v, mask, cu_seqlens, *args))
    else:
        monkeypatch.setattr(fastbert.ops, "attention_varlen", lambda *args, real=fastbert.ops.attention_varlen, **kw:
                            varlen.append(1) or real(*args, **kw))
    theirs = hf_model(**TRITON_SIZES).to(device)
    ours = fastbert.apply(copy.deepcopy(theirs), backend=backend)
    inputs = to_device(head_inputs(theirs.config, "Model"), device)
    real = inputs["attention_mask"].bool()
    got = ours(**inputs).last_hidden_state
    on_kernels = backend == "triton"
    assert (len(unpads), len(varlen)) == ((1, theirs.config.num_hidden_layers) if on_kernels else (0, 0))
    torch.testing.assert_close(got[real], theirs(**inputs).last_hidden_state[real], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native", [True, False], ids=["native", "applied"])
def test_position_ids_other_than_offsets_are_an_error_naming_them(native):
    """fastbert rotates by each token's offset in its sequence, which rotates as any positions counting up by
    one from another start do (transformers' row indices with left padding, offsets from the first real token,
    a shift): those equal transformers' given the same position_ids. Others would rotate otherwise: refused,
    never silently ignored. Padding positions are free."""
    theirs = hf_model()
    model = fastbert.from_hf(theirs) if native else fastbert.apply(copy.deepcopy(theirs))
    for layout in (dict, left_padded):
        inputs = layout(padded_batch(theirs.config, lengths=LENGTHS, seq=SEQ))
        real = inputs["attention_mask"].bool()
        rows = torch.arange(SEQ).expand(len(LENGTHS), SEQ)
        offsets = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        for positions in (rows, offsets, offsets + 3, rows.masked_fill(~real, 7)):
            torch.testing.assert_close(model(**inputs, position_ids=positions).last_hidden_state[real],
                                       theirs(**inputs, position_ids=positions).last_hidden_state[real], atol=1e-5,
                                       rtol=1e-5)
        for wrong in (rows * 2, rows.flip(-1)):
            with pytest.raises(ValueError, match="position_ids"):
                model(**inputs, position_ids=wrong)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hooked_norms_are_called_and_keep_what_they_saw(backend):
    """A forward hook on each of ModernBERT's norms (the embeddings', a pre-LayerNorm, the MLP's, the final one)
    runs and changes the output as on transformers' model; a hook that keeps its norm's input finds it unchanged
    after the forward, though the stream beside the MLP's norm is added onto in place in inference."""
    theirs = hf_model(**TRITON_SIZES)
    ours = fastbert.from_hf(theirs, backend=backend).eval()
    inputs = padded_batch(theirs.config)
    real = inputs["attention_mask"].bool()

    def norms(model):
        return (model.embeddings.norm, model.layers[1].attn_norm, model.layers[2].mlp_norm, model.final_norm)

    kept = []

    def shift(module, args, output):
        kept.append((args[0], args[0].clone()))
        return output + 0.5

    with torch.no_grad():
        for ours_norm, their_norm in zip(norms(ours), norms(theirs)):
            handles = [ours_norm.register_forward_hook(shift), their_norm.register_forward_hook(shift)]
            expected = theirs(**inputs).last_hidden_state[real]
            exact = theirs.double()(**inputs).last_hidden_state[real]
            theirs.float()
            actual = ours(**inputs).last_hidden_state[real]
            seen, copy_when_seen = kept[-1]  # what our norm's hook kept, after our forward
            assert torch.equal(seen, copy_when_seen)
            assert_within_rule("hooked norm's output", actual, expected, exact, FORWARD_FACTOR)
            for handle in handles:
                handle.remove()
