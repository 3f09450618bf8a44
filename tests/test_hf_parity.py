"""Parity with transformers' BERT classes on the same weights: outputs and gradients, fp32, padded batches."""
import pytest
import torch

import fastbert

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 99, 11
LENGTHS = (11, 6, 1)  # one full, one half, one single-token sequence
CLASSES = ["BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForNextSentencePrediction",
           "BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering",
           "BertForMultipleChoice"]


def hf_config(**overrides):
    values = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, num_labels=3)
    return transformers.BertConfig(**{**values, **overrides})


def make_batch(name, generator):
    """Inputs and labels for one class; labels only touch real (non-padding) tokens."""
    batch = len(LENGTHS)
    ids = torch.randint(1, VOCAB, (batch, SEQ), generator=generator)
    mask = (torch.arange(SEQ)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    types = (torch.arange(SEQ)[None, :] >= 3).long().expand(batch, SEQ).clone()
    inputs = dict(input_ids=ids * mask, attention_mask=mask, token_type_ids=types * mask)
    token_labels = torch.where((torch.rand(batch, SEQ, generator=generator) < 0.5) & mask.bool(),
                               torch.randint(0, VOCAB, (batch, SEQ), generator=generator), -100)
    token_labels[:, 0] = ids[:, 0]  # at least one label per sequence
    if name == "BertForPreTraining":
        inputs.update(labels=token_labels, next_sentence_label=torch.tensor([0, 1, 1]))
    elif name == "BertForMaskedLM":
        inputs.update(labels=token_labels)
    elif name == "BertForNextSentencePrediction":
        inputs.update(labels=torch.tensor([1, 0, 1]))
    elif name == "BertForSequenceClassification":
        inputs.update(labels=torch.tensor([2, 0, 1]))
    elif name == "BertForTokenClassification":
        inputs.update(labels=torch.where(mask.bool(), token_labels % 3, -100))
    elif name == "BertForQuestionAnswering":
        # transformers' QA loss is a softmax over every position, padding included, and fastbert's
        # padded positions differ by design (their attention output is zero): compare on full rows.
        inputs.update(attention_mask=torch.ones_like(mask), start_positions=torch.tensor([1, 4, 0]),
                      end_positions=torch.tensor([3, 7, 0]))
    elif name == "BertForMultipleChoice":
        inputs = {k: v[None].repeat(2, 1, 1) for k, v in inputs.items()}
        inputs["input_ids"][1] = inputs["input_ids"][1].flip(0)
        inputs.update(labels=torch.tensor([2, 0]))
    return inputs


def compare_outputs(name, theirs, ours, mask):
    real = mask.bool()
    for key in ours.keys():
        if key not in theirs or not torch.is_tensor(ours[key]) or key in ("loss",):
            continue
        a, b = theirs[key], ours[key]
        if a.dim() >= 2 and tuple(a.shape[: mask.dim()]) == tuple(mask.shape):
            a, b = a[real], b[real]  # per-token outputs: padded positions are not meaningful
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}.{key}: {m}")


@pytest.mark.parametrize("name", CLASSES)
def test_outputs_and_gradients_match_transformers(name):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    hf_model = getattr(transformers, name)(hf_config(num_labels=2 if name == "BertForQuestionAnswering" else 3))
    hf_model.train()
    ours = fastbert.from_hf(hf_model, backend="torch")
    assert type(ours).__name__ == name and ours.training
    inputs = make_batch(name, generator)
    theirs_out, ours_out = hf_model(**inputs), ours(**inputs)
    compare_outputs(name, theirs_out, ours_out, inputs["attention_mask"])
    if name == "BertModel":  # no loss of its own: a random projection of the real tokens and the pooler
        weight = torch.randn(ours_out.last_hidden_state.shape, generator=generator)
        keep = inputs["attention_mask"][..., None]

        def loss_of(out):
            return (out.last_hidden_state * weight * keep).sum() + out.pooler_output.sum()
        loss_theirs, loss_ours = loss_of(theirs_out), loss_of(ours_out)
    else:
        loss_theirs, loss_ours = theirs_out.loss, ours_out.loss
    torch.testing.assert_close(loss_ours, loss_theirs, atol=1e-5, rtol=1e-5)
    loss_theirs.backward()
    loss_ours.backward()
    ours_grads = {name: param.grad for name, param in ours.named_parameters()}
    for key, param in hf_model.named_parameters():
        if param.grad is None:
            continue
        torch.testing.assert_close(ours_grads[key], param.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")


def test_regression_and_multilabel_heads():
    """The loss of each problem type as transformers': regression of one output and of several (problem_type given),
    and multi-labels (float labels)."""
    torch.manual_seed(0)
    inputs = make_batch("BertModel", torch.Generator().manual_seed(2))
    multi = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    for num_labels, labels, problem_type in ((1, torch.tensor([0.5, -1.0, 2.0]), None), (3, multi, None),
                                             (3, multi * 2 - 0.5, "regression")):
        hf_model = transformers.BertForSequenceClassification(
            hf_config(num_labels=num_labels, problem_type=problem_type)).eval()
        ours = fastbert.from_hf(hf_model).eval()
        a, b = hf_model(**inputs, labels=labels), ours(**inputs, labels=labels)
        assert hf_model.config.problem_type == ours.config.problem_type
        torch.testing.assert_close(b.loss, a.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    # integer labels of another dtype than int64 and int32 are multi-labels, by transformers' rule (whose BCE then
    # refuses them)
    hf_model = transformers.BertForSequenceClassification(hf_config(num_labels=3)).eval()
    ours = fastbert.from_hf(hf_model).eval()
    with pytest.raises(RuntimeError):
        hf_model(**inputs, labels=multi.to(torch.int16))
    ours(**inputs, labels=multi.to(torch.int16))
    assert hf_model.config.problem_type == ours.config.problem_type == "multi_label_classification"


def test_pretraining_heads_without_logits_and_accuracies():
    torch.manual_seed(0)
    hf_model = transformers.BertForPreTraining(hf_config()).train()
    ours = fastbert.from_hf(hf_model)
    inputs = make_batch("BertForPreTraining", torch.Generator().manual_seed(3))
    out = ours(**inputs)  # training with labels: the default skips the [B, S, V] logits
    assert out.prediction_logits is None and out.mlm_accuracy is not None
    full = ours(**inputs, return_logits=True)
    labels = inputs["labels"]
    labelled = labels != -100
    expected = (full.prediction_logits.argmax(-1)[labelled] == labels[labelled]).float().mean()
    torch.testing.assert_close(out.mlm_accuracy, expected)
    expected_nsp = (full.seq_relationship_logits.argmax(-1) == inputs["next_sentence_label"]).float().mean()
    torch.testing.assert_close(out.nsp_accuracy, expected_nsp)
    torch.testing.assert_close(out.loss, out.mlm_loss + out.nsp_loss)
    # a tuple holds transformers' fields only (the losses and accuracies are fastbert's), the skipped logits not
    loss, seq_relationship_logits = ours(**inputs, return_dict=False)
    torch.testing.assert_close(loss, out.loss)
    torch.testing.assert_close(seq_relationship_logits, out.seq_relationship_logits)
    loss, prediction_logits, seq_relationship_logits = ours.eval()(**inputs, return_dict=False)
    torch.testing.assert_close(prediction_logits, full.prediction_logits)
    assert seq_relationship_logits.shape == (labels.shape[0], 2)


def test_unpad_matches_padded():
    torch.manual_seed(0)
    hf_model = transformers.BertForPreTraining(hf_config()).eval()
    padded = fastbert.from_hf(hf_model).eval()
    unpadded = fastbert.from_hf(hf_model, unpad=True).eval()
    inputs = make_batch("BertForPreTraining", torch.Generator().manual_seed(4))
    a, b = padded(**inputs, output_hidden_states=True), unpadded(**inputs, output_hidden_states=True)
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(b.prediction_logits[real], a.prediction_logits[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.loss, a.loss, atol=1e-5, rtol=1e-5)
    assert len(b.hidden_states) == len(a.hidden_states) == 3
    assert (b.hidden_states[-1][~real] == 0).all()  # padding restored as zeros


def test_output_attentions_matches_transformers():
    torch.manual_seed(0)
    hf_model = transformers.BertModel(hf_config(attn_implementation="eager")).eval()
    ours = fastbert.from_hf(hf_model).eval()
    inputs = make_batch("BertModel", torch.Generator().manual_seed(5))
    a = hf_model(**inputs, output_attentions=True)
    b = ours(**inputs, output_attentions=True)
    real = inputs["attention_mask"].bool()
    for x, y in zip(a.attentions, b.attentions):
        torch.testing.assert_close(y.transpose(1, 2)[real], x.transpose(1, 2)[real], atol=1e-6, rtol=1e-5)


def test_weight_init_follows_transformers():
    """Linear/Embedding weights N(0, initializer_range), biases 0, LayerNorm 1/0, padding row 0, decoder bias 0."""
    torch.manual_seed(0)
    config = fastbert.BertConfig.tiny(hidden_size=256, num_attention_heads=4, initializer_range=0.05)
    model = fastbert.BertForPreTraining(config)
    for name, param in model.named_parameters():
        if "LayerNorm.weight" in name:
            assert torch.equal(param, torch.ones_like(param)), name
        elif name.endswith("bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
        else:
            std = param.detach().std().item()
            assert abs(std - 0.05) < 0.005, (name, std)
    assert torch.equal(model.bert.embeddings.word_embeddings.weight[config.pad_token_id], torch.zeros(256))
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_question_answering_on_padded_batches():
    """Padding is never an answer: start/end logits there are the dtype's lowest value, so the loss is
    transformers' loss with the padded positions left out of the softmax; real positions equal theirs."""
    torch.manual_seed(0)
    hf_model = transformers.BertForQuestionAnswering(hf_config(num_labels=2)).eval()
    ours = fastbert.from_hf(hf_model).eval()
    inputs = {k: v for k, v in make_batch("BertModel", torch.Generator().manual_seed(6)).items()}
    positions = dict(start_positions=torch.tensor([1, 4, 0]), end_positions=torch.tensor([3, 5, 11]))  # 11 = S
    theirs, got = hf_model(**inputs, **positions), ours(**inputs, **positions)
    real = inputs["attention_mask"].bool()
    lowest = torch.finfo(torch.float32).min
    for key in ("start_logits", "end_logits"):
        torch.testing.assert_close(got[key][real], theirs[key][real], atol=1e-5, rtol=1e-5)
        assert (got[key][~real] == lowest).all()
    masked = [theirs[key].masked_fill(~real, float("-inf")) for key in ("start_logits", "end_logits")]
    expected = sum(torch.nn.functional.cross_entropy(logits, target, ignore_index=11)
                   for logits, target in zip(masked, positions.values())) / 2
    torch.testing.assert_close(got.loss, expected, atol=1e-5, rtol=1e-5)
    full = {**inputs, "attention_mask": torch.ones_like(inputs["attention_mask"])}  # no padding: transformers' loss
    torch.testing.assert_close(ours(**full, **positions).loss, hf_model(**full, **positions).loss, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"end_positions points at padding in example\(s\) \[1\]"):
        ours(**inputs, start_positions=torch.tensor([1, 4, 0]), end_positions=torch.tensor([3, 8, 0]))


def test_token_classification_ignores_labels_on_padding():
    torch.manual_seed(0)
    hf_model = transformers.BertForTokenClassification(hf_config()).eval()
    ours = fastbert.from_hf(hf_model).eval()
    inputs = make_batch("BertModel", torch.Generator().manual_seed(7))
    real = inputs["attention_mask"].bool()
    labels = torch.randint(0, 3, real.shape, generator=torch.Generator().manual_seed(8))  # padding labelled too
    expected = hf_model(**inputs, labels=labels.masked_fill(~real, -100)).loss
    torch.testing.assert_close(ours(**inputs, labels=labels).loss, expected, atol=1e-5, rtol=1e-5)


def test_four_dimensional_masks_and_transformers_keyword_arguments(caplog, monkeypatch):
    torch.manual_seed(0)
    hf_model = transformers.BertModel(hf_config()).eval()
    ours = fastbert.from_hf(hf_model).eval()
    inputs = make_batch("BertModel", torch.Generator().manual_seed(9))
    mask = inputs["attention_mask"]
    expected = ours(**inputs).last_hidden_state
    lowest = torch.finfo(torch.float32).min
    additive = ((1 - mask[:, None, None, :].float()) * lowest)  # [B, 1, 1, S], as transformers builds it
    for four_d in (additive, additive.expand(-1, 1, SEQ, -1), mask[:, None, None, :].bool()):
        got = ours(**{**inputs, "attention_mask": four_d}).last_hidden_state
        torch.testing.assert_close(got[mask.bool()], expected[mask.bool()])
    block = additive.expand(-1, 1, SEQ, -1).clone()
    block[0, 0, 0, 1] = lowest  # one query row masks another key: not a padding mask
    with pytest.raises(ValueError, match="query rows mask different keys"):
        ours(**{**inputs, "attention_mask": block})
    accepted = ours(**inputs, use_cache=False, encoder_hidden_states=None, past_key_values=None,
                    num_items_in_batch=torch.tensor(3), cache_position=None)
    torch.testing.assert_close(accepted.last_hidden_state, expected)
    with pytest.raises(ValueError, match="encoder_hidden_states is not supported"):
        ours(**inputs, encoder_hidden_states=torch.zeros(3, SEQ, 64))
    # a misspelt name is ignored as transformers' **kwargs ignores it, and named in a warning
    monkeypatch.setattr(fastbert.validation, "_REPORTED_UNKNOWN", set())
    with caplog.at_level("WARNING", logger="fastbert"):
        ours(input_ids=inputs["input_ids"], attention_maks=mask)
    assert any("attention_maks" in record.getMessage() for record in caplog.records)


def test_outputs_behave_as_transformers_model_outputs():
    torch.manual_seed(0)
    model = fastbert.BertForSequenceClassification(fastbert.BertConfig.tiny(num_labels=3)).eval()
    out = model(input_ids=torch.ones(2, 5, dtype=torch.long), labels=torch.tensor([0, 2]))
    assert isinstance(out, transformers.utils.ModelOutput)
    assert list(out) == list(out.keys()) == ["loss", "logits"] and "logits" in out and "hidden_states" not in out
    assert out["logits"] is out.logits is out[1] and out.to_tuple()[0] is out.loss
    flat, spec = torch.utils._pytree.tree_flatten(out)
    assert torch.utils._pytree.tree_unflatten(flat, spec).keys() == out.keys()
    out["input_ids"] = 7  # pipelines add their inputs to the outputs
    assert out.input_ids == 7
    hidden = model(input_ids=torch.ones(2, 5, dtype=torch.long), output_hidden_states=True, return_dict=False)
    assert isinstance(hidden, tuple) and len(hidden) == 2 and len(hidden[1]) == 3
    model.config.output_hidden_states = True  # transformers' config defaults are read at forward time
    assert len(model(input_ids=torch.ones(2, 5, dtype=torch.long)).hidden_states) == 3


def test_an_untied_mlm_heads_bias_loads_and_saves_as_transformers(tmp_path):
    """transformers 5's BertLMPredictionHead adds its decoder's own bias: tied to cls.predictions.bias, or with
    tie_word_embeddings=False a separate parameter (cls.predictions.bias then unused). fastbert's head must add the
    decoder's bias of an untied checkpoint, and a checkpoint fastbert writes must give transformers that bias back."""
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(hf_config(tie_word_embeddings=False)).eval()
    with torch.no_grad():
        hf.cls.predictions.decoder.bias.normal_()
        hf.cls.predictions.bias.normal_()  # unused by transformers' forward: must not be what fastbert adds
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = hf(input_ids=ids).logits
    hf.save_pretrained(tmp_path / "hf")
    for ours in (fastbert.from_hf(hf), fastbert.BertForMaskedLM.from_pretrained(tmp_path / "hf")):
        with torch.no_grad():
            torch.testing.assert_close(ours.eval()(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
    ours.save_pretrained(tmp_path / "ours")
    back = transformers.BertForMaskedLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", ["BertForPreTraining", "BertForMaskedLM"])
def test_mlm_state_dicts_load_strictly_both_ways(name, tied):
    """transformers' state_dict() holds cls.predictions.decoder.bias beside cls.predictions.bias (one tied
    parameter, or two with tie_word_embeddings=False): a strict load_state_dict works from either library's object
    into the other's, with or without assign=True, and the logits stay transformers'."""
    torch.manual_seed(0)
    theirs = getattr(transformers, name)(hf_config(tie_word_embeddings=tied)).eval()
    with torch.no_grad():
        for bias in (theirs.cls.predictions.decoder.bias, theirs.cls.predictions.bias):
            bias.normal_()  # untied: two values, of which the logits add the decoder's
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = lambda model: model(input_ids=ids)[0]  # noqa: E731  (prediction_logits / logits)
    for assign in (False, True):
        ours = getattr(fastbert, name)(fastbert.BertConfig(**theirs.config.to_dict())).eval()
        ours.load_state_dict(theirs.state_dict(), assign=assign)
        back = getattr(transformers, name)(theirs.config).eval()
        back.load_state_dict(ours.state_dict(), assign=assign)
        with torch.no_grad():
            torch.testing.assert_close(logits(ours), logits(theirs), rtol=0, atol=1e-5)
            torch.testing.assert_close(logits(back), logits(theirs), rtol=0, atol=0)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_state_dict_without_the_decoder_bias_loads_with_the_heads(tied, tmp_path):
    """fastbert's state dicts before its decoder had a bias, and transformers 4's files (which linked the decoder's
    bias to the head's and saved that), hold cls.predictions.bias alone, the bias their logits added: it loads
    strictly into the decoder's too (a missing key before), and from a file (the decoder's bias left at zeros)."""
    torch.manual_seed(0)
    model = fastbert.BertForMaskedLM(fastbert.BertConfig(**hf_config(tie_word_embeddings=tied).to_dict())).eval()
    with torch.no_grad():
        model.cls.predictions.bias.normal_()
        model.cls.predictions.decoder.bias.copy_(model.cls.predictions.bias)
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids).logits
    old = {k: v for k, v in model.state_dict().items() if k != "cls.predictions.decoder.bias"}
    fresh = fastbert.BertForMaskedLM(model.config).eval()
    fresh.load_state_dict(old)
    model.save_pretrained(tmp_path, state_dict=old)
    for loaded in (fresh, fastbert.BertForMaskedLM.from_pretrained(tmp_path)):
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["BertForPreTraining", "BertForMaskedLM", "BertForNextSentencePrediction",
                                  "BertForSequenceClassification", "BertForTokenClassification"])
def test_labels_in_another_layout_are_read_in_order_as_transformers(name):
    """transformers' heads read labels.view(-1): flattened token labels [B*S] and sentence labels [B, 1] give
    the loss of [B, S] and [B]; a wrong element count stays an error naming the shape fastbert expects."""
    torch.manual_seed(0)
    theirs = getattr(transformers, name)(hf_config()).eval()
    ours = fastbert.from_hf(theirs).eval()
    inputs = make_batch(name, torch.Generator().manual_seed(6))
    for key in ("labels", "next_sentence_label"):
        if key in inputs:
            inputs[key] = inputs[key].reshape(-1) if inputs[key].dim() == 2 else inputs[key][:, None]
    torch.testing.assert_close(ours(**inputs).loss, theirs(**inputs).loss, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="labels has shape"):
        ours(**{**inputs, "labels": inputs["labels"][:-1]})
