"""The masked-LM heads after `fastbert.apply` (issue 25 item 4): transformers' BertForPreTraining, BertForMaskedLM
and the family's *ForMaskedLM, in training mode with labels, compute fastbert's fused masked-only loss (no
[B, S, V] logits: they come back None) equal to transformers' loss and gradients (reference path, fp32, within
1e-5); with return_logits=True, in eval mode, or without the labels transformers needs for its loss, they are
transformers' own forward."""
import copy

import pytest
import torch
from family_models import head_inputs, hf_model

import fastbert
import fastbert.ops
from fastbert.in_place import ACCELERATED_HEAD

transformers = pytest.importorskip("transformers")

BERT_SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def bert_model(head: str, tied: bool = True):
    """transformers' BERT with the head, random weights (LayerNorms around 1, biases nonzero)."""
    from family_models import randomize
    config = transformers.BertConfig(**BERT_SIZES, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = randomize(getattr(transformers, "Bert" + head)(config))
    if not tied:  # transformers 5's untied decoder has a bias of its own, which its logits add
        assert model.cls.predictions.decoder.bias is not model.cls.predictions.bias
    return model


def modernbert_model():
    from test_modernbert import hf_model as modernbert
    return modernbert("ForMaskedLM")


MODELS = {"bert-pretraining": lambda: bert_model("ForPreTraining"), "bert": lambda: bert_model("ForMaskedLM"),
          "bert-untied": lambda: bert_model("ForMaskedLM", tied=False),
          "roberta": lambda: hf_model("roberta", "ForMaskedLM"),
          "roberta-untied": lambda: hf_model("roberta", "ForMaskedLM", tie_word_embeddings=False),
          "distilbert": lambda: hf_model("distilbert", "ForMaskedLM"),
          "electra": lambda: hf_model("electra", "ForMaskedLM"), "mpnet": lambda: hf_model("mpnet", "ForMaskedLM"),
          "modernbert": modernbert_model}


def inputs_for(model) -> dict:
    """A padded batch with half of the real tokens labelled (BertForPreTraining: and next-sentence labels)."""
    inputs = head_inputs(model.config, "ForMaskedLM")
    labels = inputs["labels"]
    labels[:, ::2] = -100
    if type(model).__name__ == "BertForPreTraining":
        inputs["next_sentence_label"] = torch.tensor([0, 1, 1])
    return inputs


@pytest.fixture
def fused_calls(monkeypatch):
    """How many times the fused decoder + cross entropy ran."""
    calls = []
    original = fastbert.ops.linear_cross_entropy
    monkeypatch.setattr(fastbert.ops, "linear_cross_entropy", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("arch", list(MODELS))
def test_training_loss_is_fused_and_equals_transformers(arch, fused_calls):
    theirs = MODELS[arch]().train()
    ours = fastbert.apply(copy.deepcopy(theirs))
    assert ACCELERATED_HEAD in vars(ours) and type(ours) is type(theirs)
    inputs = inputs_for(theirs)
    expected, got = theirs(**inputs), ours(**inputs)
    assert fused_calls, "the fused loss did not run"
    logits = "prediction_logits" if arch == "bert-pretraining" else "logits"
    assert getattr(got, logits) is None and getattr(expected, logits) is not None
    assert type(got) is type(expected)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    expected.loss.backward()
    got.loss.backward()
    ours_grads = gradients(ours)
    for name, grad in gradients(theirs).items():
        assert (grad is None) == (ours_grads[name] is None), name
        if grad is not None:
            torch.testing.assert_close(ours_grads[name], grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"d {name}: {m}")


@pytest.mark.parametrize("arch", ["bert-pretraining", "bert-untied", "roberta", "modernbert"])
def test_logits_come_back_where_asked_for_as_transformers(arch, fused_calls):
    """return_logits=True in training, eval mode with labels, and BertForPreTraining without next-sentence labels
    (transformers computes no loss then) are transformers' forward: its logits and loss; return_logits=False
    fuses in eval mode too; return_dict=False gives the tuple."""
    theirs = MODELS[arch]().train()
    ours = fastbert.apply(copy.deepcopy(theirs))
    inputs = inputs_for(theirs)
    logits = "prediction_logits" if arch == "bert-pretraining" else "logits"
    with torch.no_grad():
        cases = [({"return_logits": True}, True), ({}, False)]
        if arch == "bert-pretraining":
            cases.append(({"next_sentence_label": None}, True))
        for changes, training in cases:
            theirs.train(training), ours.train(training)
            called = {k: v for k, v in {**inputs, **changes}.items() if k != "return_logits"}
            expected, got = theirs(**called), ours(**{**inputs, **changes})
            real = inputs["attention_mask"].bool()  # padding's outputs differ by design (README, differences)
            torch.testing.assert_close(getattr(got, logits)[real], getattr(expected, logits)[real], atol=1e-5,
                                       rtol=1e-5)
            assert (got.loss is None) == (expected.loss is None), changes
            if expected.loss is not None:
                torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
        assert not fused_calls
        fused = ours(**inputs, return_logits=False)  # eval mode
        assert fused_calls and getattr(fused, logits) is None
        torch.testing.assert_close(fused.loss, theirs(**inputs).loss, atol=1e-5, rtol=1e-5)
        ours.train()
        as_tuple = ours(**inputs, return_dict=False)
        assert isinstance(as_tuple, tuple)
        torch.testing.assert_close(as_tuple[0], fused.loss, atol=1e-5, rtol=1e-5)


def test_modernbert_loss_divides_by_num_items_in_batch_as_transformers(fused_calls):
    """transformers' ModernBERT loss is its loss_function: with Trainer's num_items_in_batch, the sum over the
    labels divided by it; the fused loss too (BERT's CrossEntropyLoss ignores it, and so does the fused one)."""
    for make in (modernbert_model, lambda: bert_model("ForMaskedLM")):
        theirs = make().train()
        ours = fastbert.apply(copy.deepcopy(theirs))
        inputs = inputs_for(theirs)
        with torch.no_grad():
            expected, got = theirs(**inputs, num_items_in_batch=torch.tensor(40)), ours(**inputs,
                                                                                         num_items_in_batch=40)
        torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    assert len(fused_calls) == 2


def test_apply_twice_and_state_dict_unchanged():
    theirs = bert_model("ForPreTraining")
    ours = fastbert.apply(copy.deepcopy(theirs))
    head = vars(ours)[ACCELERATED_HEAD]
    assert fastbert.apply(ours) is ours and vars(ours)[ACCELERATED_HEAD] is head
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert {id(p) for p in head.parameters()} == {id(p) for p in ours.parameters()}


@pytest.mark.parametrize("arch", ["bert-pretraining", "bert-untied", "roberta-untied", "modernbert"])
def test_fused_loss_after_resize_and_with_a_hooked_head_equals_transformers(arch, fused_calls):
    """resize_token_embeddings after apply puts new decoder modules and biases into transformers' head: the fused
    loss reads them. A hook on a module of the head (not a leaf) runs only in transformers' forward, which is
    then taken."""
    theirs = MODELS[arch]().train()
    ours = fastbert.apply(copy.deepcopy(theirs))
    size = theirs.config.vocab_size + 4
    for model in (theirs, ours):
        torch.manual_seed(1)
        model.resize_token_embeddings(size)
    inputs = inputs_for(theirs)
    inputs["labels"][0, 1] = size - 1  # a new token
    with torch.no_grad():
        expected = theirs(**inputs).loss
        torch.testing.assert_close(ours(**inputs).loss, expected, atol=1e-5, rtol=1e-5)
        assert len(fused_calls) == 1
        seen = []
        head = ours.get_output_embeddings()
        parent = next(m for m in ours.modules() if head in m.children())
        if parent is not ours:
            parent.register_forward_hook(lambda *args: seen.append(1))
            torch.testing.assert_close(ours(**inputs).loss, expected, atol=1e-5, rtol=1e-5)
            assert seen and len(fused_calls) == 1
