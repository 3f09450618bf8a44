"""fastbert's own classes of the family (XModel, XForMaskedLM, ELECTRA's ForPreTraining) against transformers'
on the same tiny random weights: from_pretrained of a directory transformers saved, save_pretrained read back by
transformers' class (identical state_dicts, equal outputs, loss and gradients both ways), from_hf / to_hf."""
import pytest
import torch
from family_models import PREFIXES, head_inputs, hf_model, named_outputs, real_tokens

import fastbert
from fastbert.family import FAMILY_CLASSES

transformers = pytest.importorskip("transformers")

NATIVE = [(arch, head) for arch in PREFIXES for head in ("Model", "ForMaskedLM", "ForPreTraining")
          if PREFIXES[arch] + head in FAMILY_CLASSES]


def fast_class(arch, head):
    return getattr(fastbert, PREFIXES[arch] + head)


def assert_same_state(ours, theirs):
    ours, theirs = ours.state_dict(), theirs.state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def assert_same_results(ours, theirs, head):
    """Outputs (real tokens), the loss and every parameter's gradient on the head's batch."""
    inputs = head_inputs(theirs.config, head)
    mask = inputs["attention_mask"]
    expected, actual = theirs(**inputs), ours(**inputs)
    expected_fields, actual_fields = named_outputs(expected), named_outputs(actual)
    assert expected_fields.keys() <= actual_fields.keys()  # fastbert's MLM heads add their accuracy
    for name, value in expected_fields.items():
        torch.testing.assert_close(real_tokens(actual_fields[name], mask), real_tokens(value, mask), atol=1e-5,
                                   rtol=1e-5, msg=lambda m: f"{name}: {m}")
    if head == "Model":
        expected, actual = (out.last_hidden_state[mask.bool()].sum() for out in (expected, actual))
    else:
        assert expected.loss is not None
        expected, actual = expected.loss, actual.loss
    expected.backward()
    actual.backward()
    # tied parameters under every name: transformers' XLM-R lists lm_head before the embeddings it is tied to
    grads = dict(ours.named_parameters(remove_duplicate=False))
    for name, param in theirs.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(grads[name].grad, param.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"d {name}: {m}")
    ours.zero_grad(), theirs.zero_grad()


@pytest.mark.parametrize("arch,head", NATIVE, ids=[f"{a}-{h}" for a, h in NATIVE])
def test_from_pretrained_and_save_pretrained_both_ways(arch, head, tmp_path):
    theirs = hf_model(arch, head)
    theirs.save_pretrained(tmp_path / "transformers")
    ours = fast_class(arch, head).from_pretrained(tmp_path / "transformers").eval()
    assert type(ours.config) is getattr(fastbert, PREFIXES[arch] + "Config")
    assert_same_state(ours, theirs)
    assert_same_results(ours, theirs, head)
    if head == "ForMaskedLM":  # the decoder stays tied to the word embeddings, as in transformers
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight

    ours.save_pretrained(tmp_path / "fastbert")
    again = type(theirs).from_pretrained(tmp_path / "fastbert").eval()
    assert_same_state(again, theirs)
    assert_same_results(ours, again, head)
    assert again.config.model_type == theirs.config.model_type


@pytest.mark.parametrize("arch,head", NATIVE, ids=[f"{a}-{h}" for a, h in NATIVE])
def test_from_hf_and_to_hf_round_trip(arch, head):
    theirs = hf_model(arch, head)
    ours = fastbert.from_hf(theirs)
    assert type(ours) is fast_class(arch, head) and not ours.training
    assert_same_state(ours, theirs)
    assert_same_results(ours, theirs, head)
    back = ours.to_hf()
    assert type(back) is type(theirs)
    assert_same_state(back, theirs)
    assert_same_results(ours, back, head)


def test_distilbert_sinusoidal_positions_as_transformers(tmp_path):
    """sinusoidal_pos_embds: fastbert's model builds transformers' fixed table, and loads and saves it."""
    theirs = hf_model("distilbert", sinusoidal_pos_embds=True)
    fresh = fastbert.DistilBertModel(fastbert.DistilBertConfig(**theirs.config.to_dict()))
    table = fresh.embeddings.position_embeddings.weight
    assert table[1:].abs().max() > 0.5  # sin / cos values, not transformers' N(0, 0.02) initialisation
    torch.testing.assert_close(table, transformers.DistilBertModel(theirs.config).embeddings.position_embeddings.weight,
                               atol=1e-6, rtol=0)
    theirs.save_pretrained(tmp_path)
    ours = fastbert.DistilBertModel.from_pretrained(tmp_path).eval()
    assert_same_state(ours, theirs)
    assert_same_results(ours, theirs, "Model")


@pytest.mark.parametrize("arch", PREFIXES)
def test_masked_lm_heads_with_a_tanh_gelu_encoder_equal_transformers(arch):
    """hidden_act="gelu_new" sets the encoder's GELU; transformers' RoBERTa-type, MPNet and ELECTRA-generator
    heads keep the exact GELU, DistilBERT's follows its activation."""
    theirs = hf_model(arch, "ForMaskedLM", **{"activation" if arch == "distilbert" else "hidden_act": "gelu_new"})
    ours = fastbert.from_hf(theirs)
    assert ours.config.gelu_approximate == "tanh"
    assert_same_results(ours, theirs, "ForMaskedLM")


@pytest.mark.parametrize("arch", PREFIXES)
def test_untied_masked_lm_heads_both_ways(arch, tmp_path):
    """tie_word_embeddings=False: the decoder has its own weight (and for RoBERTa-type models and MPNet its own
    bias, the head's `bias` then unused by transformers' forward), drawn apart from what they would be tied to."""
    theirs = hf_model(arch, "ForMaskedLM", tie_word_embeddings=False)
    assert theirs.get_output_embeddings().weight is not theirs.get_input_embeddings().weight
    theirs.save_pretrained(tmp_path / "transformers")
    ours = fast_class(arch, "ForMaskedLM").from_pretrained(tmp_path / "transformers").eval()
    assert ours.get_output_embeddings().weight is not ours.get_input_embeddings().weight
    assert_same_state(ours, theirs)
    assert_same_results(ours, theirs, "ForMaskedLM")
    ours.save_pretrained(tmp_path / "fastbert")
    assert_same_state(type(theirs).from_pretrained(tmp_path / "fastbert"), theirs)
    converted = fastbert.from_hf(theirs)
    assert_same_results(converted, theirs, "ForMaskedLM")
    assert_same_state(converted.to_hf(), theirs)


@pytest.mark.parametrize("applied", [False, True], ids=["fastbert", "applied"])
@pytest.mark.parametrize("arch", ["bert", *PREFIXES])
def test_base_outputs_have_transformers_fields_and_tuples(arch, applied):
    """With output_attentions, transformers' BERT, RoBERTa-type and ELECTRA base models return cross_attentions=()
    (an encoder attends to no other sequence), DistilBERT's and MPNet's none: fastbert's and an applied model's
    outputs have the same fields, and their return_dict=False tuples the same length, where `outputs[-1]` or a
    count of the fields read another entry."""
    import copy
    if arch == "bert":
        theirs = transformers.BertModel(transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2,
                                                                num_attention_heads=2, intermediate_size=37)).eval()
    else:
        theirs = hf_model(arch, "Model")
    ours = fastbert.apply(copy.deepcopy(theirs)) if applied else fastbert.from_hf(theirs)
    ids = torch.randint(3, 60, (2, 6), generator=torch.Generator().manual_seed(0))
    for flags in (dict(output_attentions=True), dict(output_attentions=True, output_hidden_states=True),
                  dict(output_hidden_states=True)):
        with torch.no_grad():
            expected, actual = (model.eval()(input_ids=ids, **flags) for model in (theirs, ours))
            expected_tuple, actual_tuple = (model(input_ids=ids, **flags, return_dict=False)
                                            for model in (theirs, ours))
        assert list(actual.keys()) == list(expected.keys())
        assert [type(value) for value in actual_tuple] == [type(value) for value in expected_tuple]
        if "cross_attentions" in expected:
            assert actual.cross_attentions == expected.cross_attentions == ()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", PREFIXES)
def test_state_dicts_load_strictly_both_ways(arch, tied):
    """transformers' state_dict() names the decoder's bias as well as the head's (tied, or two parameters with
    tie_word_embeddings=False): a strict load_state_dict from either library's object into the other's works and
    gives the same results."""
    theirs = hf_model(arch, "ForMaskedLM", tie_word_embeddings=tied)
    ours = fast_class(arch, "ForMaskedLM")(fast_class(arch, "Config")(**theirs.config.to_dict()))
    ours.load_state_dict(theirs.state_dict())
    assert_same_results(ours.eval(), theirs, "ForMaskedLM")
    back = type(theirs)(theirs.config)
    back.load_state_dict(ours.state_dict())
    assert_same_state(back, theirs)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", PREFIXES)
def test_resize_token_embeddings_as_transformers(arch, tied):
    """transformers resizes MPNet's head bias beside an untied decoder (set_output_embeddings takes the new
    decoder's), unused then, and leaves RoBERTa's as it was: fastbert alike, so their state dicts fit."""
    theirs = hf_model(arch, "ForMaskedLM", tie_word_embeddings=tied)
    ours = fastbert.from_hf(theirs)
    theirs.resize_token_embeddings(70)
    ours.resize_token_embeddings(70)
    assert ours.config.vocab_size == ours.vocab_size == 70
    state, their_state = ours.state_dict(), theirs.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in their_state.items()}
    ours.load_state_dict(their_state)  # the new rows are drawn at random: the same ones on both sides
    inputs = head_inputs(theirs.config, "ForMaskedLM")
    inputs["input_ids"][0, 2] = 68  # a new token
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(ours(**inputs).logits[real], theirs(**inputs).logits[real], atol=1e-5, rtol=1e-5)
