"""`fastbert.apply` on every head transformers has for RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT, ELECTRA and
MPNet (tiny random models, padded batches with a length-1 row): outputs on real tokens, the loss and every
parameter's gradient equal transformers' on the same weights (fp32, reference path); and what transformers
offers that fastbert does not implement is an error naming the field, at apply and at from_pretrained."""
import copy

import pytest
import torch
from family_models import (ARCHITECTURES, SIZES, VOCAB, arch_heads, base_loss, head_inputs, hf_config, hf_model, named_outputs,
                           real_tokens)

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
