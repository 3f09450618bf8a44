"""`fastbert.apply` on every head transformers has for RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT, ELECTRA and
MPNet (tiny random models, padded batches with a length-1 row; the span loss on full rows, as README's
differences say): outputs on real tokens, the loss and every parameter's gradient equal transformers' on the
same weights (fp32, reference path); and what transformers
offers that fastbert does not implement is an error naming the field, at apply and at from_pretrained."""
import copy

import pytest
import torch
from family_models import (ARCHITECTURES, SIZES, VOCAB, arch_heads, base_loss, flattened, head_inputs, hf_config,
                           hf_model, named_outputs, padded_batch, real_tokens)

import fastbert
from fastbert.in_place import ACCELERATED

transformers = pytest.importorskip("transformers")


def loss_of(output, inputs, head):
    return base_loss(output, inputs["attention_mask"]) if head == "Model" else output.loss


@pytest.mark.parametrize("arch,head", arch_heads(), ids=[f"{a}-{h}" for a, h in arch_heads()])
def test_apply_every_head_equals_transformers(arch, head):
    theirs = hf_model(arch, head)
    ours = copy.deepcopy(theirs)
    assert fastbert.apply(ours) is ours
    base = ours.base_model
    assert ACCELERATED in vars(base), f"{type(base).__name__} was not accelerated"
    assert type(base) is type(theirs.base_model)  # the class and the head stay transformers'
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    inputs = head_inputs(theirs.config, head)
    mask = inputs["attention_mask"]
    expected, actual = theirs(**inputs), ours(**inputs)
    expected_fields, actual_fields = named_outputs(expected), named_outputs(actual)
    assert actual_fields.keys() == expected_fields.keys()
    for name, value in expected_fields.items():
        torch.testing.assert_close(real_tokens(actual_fields[name], mask), real_tokens(value, mask), atol=1e-5,
                                   rtol=1e-5, msg=lambda m: f"{name}: {m}")
    loss_of(expected, inputs, head).backward()
    loss_of(actual, inputs, head).backward()
    grads = dict(ours.named_parameters())
    for name, param in theirs.named_parameters():
        assert (param.grad is None) == (grads[name].grad is None), name
        if param.grad is not None:
            torch.testing.assert_close(grads[name].grad, param.grad, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"d {name}: {m}")
    assert any(p.grad is not None and p.grad.abs().max() > 0 for n, p in grads.items() if "layer" in n)
    if head == "ForQuestionAnswering":  # its loss ran on full rows (family_models.head_inputs); padded logits too
        padded = padded_batch(theirs.config)
        real = padded["attention_mask"].bool()
        for name in ("start_logits", "end_logits"):
            torch.testing.assert_close(ours(**padded)[name][real], theirs(**padded)[name][real], atol=1e-5,
                                       rtol=1e-5, msg=lambda m: f"padded {name}: {m}")


DECODERS = ["roberta", "xlm-roberta", "camembert", "electra"]  # the ones transformers runs as a decoder


@pytest.mark.parametrize("arch", DECODERS)
def test_apply_refuses_a_decoder_naming_the_field(arch):
    model = hf_model(arch, "ForCausalLM")
    model.config.is_decoder = True
    with pytest.raises(ValueError, match="is_decoder"):
        fastbert.apply(model)
    assert ACCELERATED not in vars(model.base_model)  # left as it was
    # cross-attention: transformers builds it only in a decoder; a config edited back to an encoder keeps it
    model = transformers.AutoModel.from_config(hf_config(arch, is_decoder=True, add_cross_attention=True))
    model.config.is_decoder = False
    with pytest.raises(ValueError, match="add_cross_attention"):
        fastbert.apply(model)


@pytest.mark.parametrize("arch", ["bert", "roberta", "electra"])
@pytest.mark.parametrize("kind", ["relative_key", "relative_key_query"])
def test_relative_key_positions_are_refused_at_apply_and_from_pretrained(arch, kind, tmp_path):
    if arch == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, **SIZES, position_embedding_type=kind)
    else:
        config = hf_config(arch, position_embedding_type=kind)
    model = transformers.AutoModelForMaskedLM.from_config(config)
    with pytest.raises(ValueError, match=f"position_embedding_type='{kind}'"):
        fastbert.apply(model)
    assert ACCELERATED not in vars(model.base_model)
    model.save_pretrained(tmp_path)
    fast_class = getattr(fastbert, type(model).__name__)  # fastbert's class of the same name
    with pytest.raises(ValueError, match=f"position_embedding_type='{kind}'"):
        fast_class.from_pretrained(tmp_path)


def test_distilbert_activation_other_than_gelu_is_an_error_naming_activation(tmp_path):
    """transformers' DistilBERT also takes activation="relu"; fastbert's FFN fuses GELU only."""
    model = hf_model("distilbert", activation="relu")
    with pytest.raises(ValueError, match="activation"):
        fastbert.apply(model)
    assert ACCELERATED not in vars(model)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="activation"):
        fastbert.DistilBertModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_apply_twice_changes_nothing_and_shares_parameters(arch):
    model = hf_model(arch, "ForSequenceClassification")
    before = {name: param for name, param in model.named_parameters()}
    fastbert.apply(model)
    fast = vars(model.base_model)[ACCELERATED]
    fastbert.apply(model)
    assert vars(model.base_model)[ACCELERATED] is fast
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is p for n, p in before.items())


def test_apply_again_sets_switches_and_refuses_other_fields():
    """A second call's switches were ignored without a word (unpad stayed False)."""
    model = hf_model("roberta", "ForSequenceClassification")
    expected = model(**padded_batch(model.config)).logits
    fastbert.apply(model)
    fastbert.apply(model, unpad=True, backend="torch")
    config = vars(model.base_model)[ACCELERATED].config
    assert config.unpad is True and config.backend == "torch"
    torch.testing.assert_close(model(**padded_batch(model.config)).logits, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"accelerated already and \['hidden_size'\] shaped the modules"):
        fastbert.apply(model, hidden_size=64, unpad=False)
    with pytest.raises(ValueError, match="backend"):
        fastbert.apply(model, backend="cuda", unpad=False)
    assert config.unpad is True and config.backend == "torch"  # a refused call changes nothing
    ours = fastbert.BertModel(fastbert.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, intermediate_size=64))
    assert fastbert.apply(ours, unpad=True) is ours and ours.config.unpad is True


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hidden_states_attentions_inputs_embeds_and_no_mask_equal_transformers(arch):
    """transformers' eager attention returns the probabilities (MPNet's with its relative-position bias)."""
    theirs = hf_model(arch, attn_implementation="eager")
    ours = fastbert.apply(copy.deepcopy(theirs))
    inputs = padded_batch(theirs.config)
    real = inputs["attention_mask"].bool()
    expected, actual = (model(**inputs, output_hidden_states=True, output_attentions=True) for model in (theirs, ours))
    assert len(actual.hidden_states) == len(expected.hidden_states) == theirs.config.num_hidden_layers + 1
    for layer, (a, b) in enumerate(zip(actual.hidden_states, expected.hidden_states)):
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"hidden state {layer}: {m}")
    assert len(actual.attentions) == len(expected.attentions) == theirs.config.num_hidden_layers
    for layer, (a, b) in enumerate(zip(actual.attentions, expected.attentions)):  # [B, heads, S, S]
        queries = real[:, None, :, None].expand_as(a)  # padded query rows are not meaningful
        torch.testing.assert_close(a[queries], b[queries], atol=1e-6, rtol=1e-5,
                                   msg=lambda m: f"attention {layer}: {m}")
    # inputs_embeds at the embedding width (ELECTRA's narrower tables), positions counted without input_ids
    embeds = theirs.get_input_embeddings()(inputs["input_ids"]).detach()
    expected, actual = (model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).last_hidden_state
                        for model in (theirs, ours))
    torch.testing.assert_close(actual[real], expected[real], atol=1e-5, rtol=1e-5)
    expected, actual = (model(input_ids=inputs["input_ids"]).last_hidden_state for model in (theirs, ours))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)  # no mask: every position a token


def test_long_position_table_padded_unpadded_and_packed():
    """bge-m3's table: 8,194 positions from the padding index, a sequence past 1,024 tokens."""
    theirs = hf_model("xlm-roberta", max_position_embeddings=8194)
    inputs = padded_batch(theirs.config, lengths=(1100, 517, 1), seq=1100)
    real = inputs["attention_mask"].bool()
    expected = theirs(**inputs).last_hidden_state[real]
    for unpad in (False, True):
        ours = fastbert.apply(copy.deepcopy(theirs), unpad=unpad)
        torch.testing.assert_close(ours(**inputs).last_hidden_state[real], expected, atol=1e-5, rtol=1e-5)
    packed = flattened(inputs, theirs.config.pad_token_id + 1)
    torch.testing.assert_close(ours(**packed).last_hidden_state[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["roberta", "mpnet"])
def test_sequence_past_the_position_table_is_an_error_naming_it(arch):
    model = fastbert.apply(hf_model(arch))  # 40 positions, the first token at pad_token_id + 1 = 2: 38 tokens
    model(**padded_batch(model.config, lengths=(38,), seq=38))
    with pytest.raises(ValueError, match=r"sequence length 39 is longer than max_position_embeddings \(40 less"):
        model(**padded_batch(model.config, lengths=(39,), seq=39))


def test_mpnet_counts_positions_from_index_1_whatever_pad_token_id_says(tmp_path):
    """transformers' MPNet pads its tables at index 1 and counts positions from it whatever
    config.pad_token_id says; fastbert's MPNet does the same, applied and loaded."""
    theirs = hf_model("mpnet", pad_token_id=3)
    inputs = padded_batch(theirs.config)
    real = inputs["attention_mask"].bool()
    expected = theirs(**inputs).last_hidden_state[real]
    applied = fastbert.apply(copy.deepcopy(theirs))
    torch.testing.assert_close(applied(**inputs).last_hidden_state[real], expected, atol=1e-5, rtol=1e-5)
    theirs.save_pretrained(tmp_path)
    loaded = fastbert.MPNetModel.from_pretrained(tmp_path)
    assert loaded.embeddings.word_embeddings.padding_idx == loaded.embeddings.position_embeddings.padding_idx == 1
    torch.testing.assert_close(loaded(**inputs).last_hidden_state[real], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,overrides,seq", [
    ("mpnet", dict(relative_attention_num_buckets=64, max_position_embeddings=260), 200),  # distances past 128
    ("roberta", dict(pad_token_id=3, type_vocab_size=2), 13),  # positions from 4; two token types
    ("electra", dict(embedding_size=32), 13),  # tables as wide as the hidden size: no embeddings_project
], ids=["mpnet-64-buckets-long", "roberta-pad-3-two-types", "electra-no-projection"])
def test_other_configurations_equal_transformers(arch, overrides, seq):
    theirs = hf_model(arch, **overrides)
    ours = fastbert.apply(copy.deepcopy(theirs))
    inputs = padded_batch(theirs.config, lengths=(seq, seq // 2 + 1, 1), seq=seq)
    if getattr(theirs.config, "type_vocab_size", 0) == 2:
        inputs["token_type_ids"] = ((torch.arange(seq) > seq // 3).long() * inputs["attention_mask"]).contiguous()
    real = inputs["attention_mask"].bool()
    expected, actual = theirs(**inputs), ours(**inputs)
    torch.testing.assert_close(actual.last_hidden_state[real], expected.last_hidden_state[real], atol=1e-5, rtol=1e-5)
    base_loss(expected, inputs["attention_mask"]).backward()
    base_loss(actual, inputs["attention_mask"]).backward()
    grads = dict(ours.named_parameters())
    for name, param in theirs.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"d {name}: {m}")


@pytest.mark.parametrize("arch", [arch for arch in ARCHITECTURES if arch != "mpnet"])  # transformers' MPNet has none
def test_gradient_checkpointing_enable_reaches_fastbert(arch):
    theirs = hf_model(arch, "ForSequenceClassification").train()
    ours = fastbert.apply(copy.deepcopy(theirs))
    ours.gradient_checkpointing_enable()
    fast = vars(ours.base_model)[ACCELERATED]
    assert getattr(fast, fast.encoder_name).gradient_checkpointing
    inputs = head_inputs(theirs.config, "ForSequenceClassification")
    theirs(**inputs).loss.backward()
    ours(**inputs).loss.backward()
    grads = dict(ours.named_parameters())
    for name, param in theirs.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"d {name}: {m}")


@pytest.mark.parametrize("name", ["RobertaModel", "XLMRobertaModel", "CamembertModel", "ElectraModel",
                                  "DistilBertModel", "MPNetModel"])
def test_base_models_take_add_pooling_layer_where_transformers_does(name):
    """DistilBERT's and ELECTRA's took BertModel's add_pooling_layer, and had no pooler to add."""
    import transformers
    from fastbert.hf import takes_add_pooling_layer
    assert takes_add_pooling_layer(getattr(fastbert, name)) == takes_add_pooling_layer(getattr(transformers, name))
