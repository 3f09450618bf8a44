"""Bad input gets a ValueError naming the argument, the bad value and the limit, and the model keeps working."""
import pytest
import torch

import fastbert

CONFIG = fastbert.BertConfig.tiny(max_position_embeddings=16, num_labels=3)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {cls.__name__: cls(CONFIG).eval() for cls in (
        fastbert.BertModel, fastbert.BertForPreTraining, fastbert.BertForSequenceClassification,
        fastbert.BertForTokenClassification, fastbert.BertForMultipleChoice)} | {
        "BertForQuestionAnswering": fastbert.BertForQuestionAnswering(CONFIG.replace(num_labels=2)).eval()}


def good():
    return torch.randint(1, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))


BAD_INPUTS = [
    ("id above vocab", dict(input_ids=good().index_fill(1, torch.tensor([3]), 1024)), ["input_ids", "1024", "vocab_size"]),
    ("negative id", dict(input_ids=good().index_fill(1, torch.tensor([0]), -5)), ["input_ids", "-5"]),
    ("too long", dict(input_ids=torch.ones(1, 17, dtype=torch.long)), ["17", "max_position_embeddings", "16"]),
    ("float ids", dict(input_ids=good().float()), ["input_ids", "float32"]),
    ("1-D ids", dict(input_ids=torch.ones(8, dtype=torch.long)), ["input_ids", "(8,)"]),
    ("mask shape", dict(input_ids=good(), attention_mask=torch.ones(2, 7)), ["attention_mask", "(2, 7)", "(2, 8)"]),
    ("mask values", dict(input_ids=good(), attention_mask=torch.full((2, 8), 0.5)), ["attention_mask"]),
    ("type shape", dict(input_ids=good(), token_type_ids=torch.zeros(3, 8, dtype=torch.long)),
     ["token_type_ids", "(3, 8)"]),
    ("type value", dict(input_ids=good(), token_type_ids=torch.full((2, 8), 2)), ["token_type_ids", "2",
                                                                                   "type_vocab_size"]),
    ("no ids", dict(), ["input_ids"]),
]


@pytest.mark.parametrize("case, kwargs, words", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_model_inputs(models, case, kwargs, words):
    model = models["BertModel"]
    with pytest.raises(ValueError) as info:
        model(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    out = model(input_ids=good())  # the model keeps working after a rejected call
    assert torch.isfinite(out.last_hidden_state).all()


def labels_with(value, shape=(2, 8)):
    labels = torch.full(shape, -100)
    labels.view(-1)[1] = value
    return labels


BAD_LABELS = [
    ("BertForPreTraining", dict(labels=labels_with(1024)), ["labels", "1024", "vocab_size"]),
    ("BertForPreTraining", dict(labels=labels_with(-7)), ["labels", "-7", "-100"]),
    ("BertForPreTraining", dict(labels=torch.zeros(2, 7, dtype=torch.long)), ["labels", "(2, 7)"]),
    ("BertForPreTraining", dict(next_sentence_label=torch.tensor([0, 2])), ["next_sentence_label", "2"]),
    ("BertForSequenceClassification", dict(labels=torch.tensor([0, 3])), ["labels", "3", "num_labels"]),
    ("BertForTokenClassification", dict(labels=labels_with(5)), ["labels", "5", "num_labels"]),
    ("BertForTokenClassification", dict(labels=labels_with(1).float()), ["labels", "float32"]),
    ("BertForQuestionAnswering", dict(start_positions=torch.tensor([1.0, 2.0]), end_positions=torch.tensor([1, 2])),
     ["start_positions"]),
]


@pytest.mark.parametrize("name, kwargs, words", BAD_LABELS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_LABELS)])
def test_bad_labels(models, name, kwargs, words):
    with pytest.raises(ValueError) as info:
        models[name](input_ids=good(), **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_multiple_choice_needs_three_dims(models):
    with pytest.raises(ValueError, match="num_choices"):
        models["BertForMultipleChoice"](input_ids=good())


def test_validate_false_skips_value_checks_only(models):
    model = models["BertModel"]
    with pytest.raises(ValueError, match="attention_mask"):  # shape checks cost nothing: always on
        model(input_ids=good(), attention_mask=torch.ones(2, 7), validate=False)
    in_range = model(input_ids=good(), validate=False)  # value checks (a device sync) are skipped
    assert in_range.last_hidden_state.shape == (2, 8, CONFIG.hidden_size)


def test_question_answering_needs_two_labels():
    with pytest.raises(ValueError, match="num_labels == 2"):
        fastbert.BertForQuestionAnswering(CONFIG)  # CONFIG has num_labels=3
