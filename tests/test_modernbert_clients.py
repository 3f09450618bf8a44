"""ModernBERT inside its clients, offline on CPU: a tiny random ModernBERT (global and local layers, a window
that cuts the longer sentences) saved with a tiny WordLevel tokenizer; SentenceTransformer (mean pooling)
encode and CrossEncoder predict with the encoder accelerated by `fastbert.apply` or swapped for fastbert's
ModernBertModel equal plain within 1e-5, and what either saves a plain load reads back the same; PEFT LoRA on
Wqkv and Wo (applied before or after) equals plain LoRA, only LoRA training; a Trainer step on an applied
or converted classifier gives transformers' loss and weights."""
import pytest
import torch
from test_clients_transformers import assert_same_parameters, trainer_for
from test_family_clients import PAIRS, SENTENCES, accelerated_bases, assert_lora_gradients_equal, tiny_tokenizer
from test_modernbert import head_inputs, hf_model

import fastbert
from fastbert.in_place import ACCELERATED

transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")
peft = pytest.importorskip("peft")

# the tiny tokenizer's BERT specials: [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4
SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=2, cls_token_id=2, eos_token_id=3, sep_token_id=3)


def saved(head: str, path, **overrides) -> str:
    """A tiny random ModernBERT with the head and its tokenizer, saved where transformers' Auto classes load them."""
    tokenizer = tiny_tokenizer("distilbert")  # BERT's special tokens, no token types
    assert tokenizer.pad_token_id == SPECIAL_IDS["pad_token_id"]
    assert tokenizer.cls_token_id == SPECIAL_IDS["cls_token_id"]
    model = hf_model(head, **SPECIAL_IDS, **overrides)
    assert len(tokenizer) <= model.config.vocab_size
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def sentence_transformer(path):
    modules = st.sentence_transformer.modules
    transformer = modules.Transformer(path)
    return st.SentenceTransformer(
        modules=[transformer, modules.Pooling(transformer.get_embedding_dimension(), "mean")], device="cpu")


def test_sentence_transformer_encode_save_reload(tmp_path, one_thread):
    path = saved("Model", tmp_path / "model")
    plain, applied, swapped = (sentence_transformer(path) for _ in range(3))
    assert type(plain[0].model).__name__ == "ModernBertModel" and plain[0].model.__module__.startswith("transformers")
    assert fastbert.apply(applied) is applied and len(accelerated_bases(applied)) == 1
    swapped[0].model = fastbert.ModernBertModel.from_pretrained(path)
    lengths = plain.tokenize(SENTENCES)["attention_mask"].sum(1)
    assert lengths.max() > 2 * plain[0].model.config.sliding_window + 1  # the window cuts the longest
    expected = plain.encode(SENTENCES, convert_to_tensor=True, batch_size=3)
    assert (expected - expected[0]).abs().max() > 1e-2  # the sentences (of other lengths: padded) differ
    for name, model in (("applied", applied), ("swapped", swapped)):
        torch.testing.assert_close(model.encode(SENTENCES, convert_to_tensor=True, batch_size=3), expected,
                                   atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        model.save(str(tmp_path / name))
        again = st.SentenceTransformer(str(tmp_path / name), device="cpu")  # a plain load
        assert again[0].model.__module__.startswith("transformers")
        assert again[0].model.state_dict().keys() == plain[0].model.state_dict().keys()
        torch.testing.assert_close(again.encode(SENTENCES, convert_to_tensor=True, batch_size=3), expected,
                                   atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} reloaded: {m}")


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_cross_encoder_predict_save_reload(pooling, tmp_path, one_thread):
    path = saved("ForSequenceClassification", tmp_path / "model", num_labels=1, classifier_pooling=pooling)
    plain, applied = (st.CrossEncoder(path, device="cpu") for _ in range(2))
    assert fastbert.apply(applied) is applied and len(accelerated_bases(applied)) == 1
    expected = plain.predict(PAIRS, convert_to_tensor=True)
    assert expected.std() > 1e-4  # the pairs score differently (10 times the tolerance)
    torch.testing.assert_close(applied.predict(PAIRS, convert_to_tensor=True), expected, atol=1e-5, rtol=1e-5)
    applied.save(str(tmp_path / "applied"))
    again = st.CrossEncoder(str(tmp_path / "applied"), device="cpu")  # a plain load
    assert not accelerated_bases(again)
    torch.testing.assert_close(again.predict(PAIRS, convert_to_tensor=True), expected, atol=1e-5, rtol=1e-5)
    fastbert.apply(again)  # and accelerated after the reload
    torch.testing.assert_close(again.predict(PAIRS, convert_to_tensor=True), expected, atol=1e-5, rtol=1e-5)


def lora(model):
    torch.manual_seed(1)  # init_lora_weights=False draws both LoRA matrices: the output changes at once
    config = peft.LoraConfig(target_modules=["Wqkv", "Wo"], r=4, lora_alpha=8, init_lora_weights=False)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("order", ["apply then lora", "lora then apply"])
def test_lora_on_wqkv_and_wo_equals_plain_lora(order):
    """peft has no default targets for ModernBERT: the attention's two Linears (Wo in the attention and in the
    MLP both match), wrapped, so fastbert calls them instead of its fused projection."""
    theirs = lora(hf_model("ForSequenceClassification"))
    ours = hf_model("ForSequenceClassification")
    if order == "apply then lora":
        ours = lora(fastbert.apply(ours))
    else:
        ours = lora(ours)
        assert fastbert.apply(ours) is ours
    assert len(accelerated_bases(ours)) == 1
    adapters = [name for name, module in ours.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)]
    assert len(adapters) == 3 * 4  # Wqkv, attn.Wo and mlp.Wo in each of the four layers, kept and called
    inputs = head_inputs(theirs.config, "ForSequenceClassification")
    rows = inputs["attention_mask"].sum(-1) > 0  # the fully padded row's logits are padding's
    plain = hf_model("ForSequenceClassification")(**inputs).logits
    expected, actual = theirs(**inputs), ours(**inputs)
    assert (expected.logits - plain)[rows].abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(actual.logits[rows], expected.logits[rows], atol=1e-5, rtol=1e-5)
    assert_lora_gradients_equal(ours, actual.loss, theirs, expected.loss)


@pytest.mark.parametrize("kind", ["fastbert model", "fastbert.apply"])
def test_trainer_step_on_a_modernbert_classifier(kind, tmp_path, one_thread):
    path = saved("ForSequenceClassification", tmp_path / "model", classifier_pooling="mean")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(path)
    if kind == "fastbert.apply":
        ours = fastbert.apply(transformers.AutoModelForSequenceClassification.from_pretrained(path))
    else:  # transformers' Auto class builds fastbert's model where it is given fastbert's config
        config = fastbert.ModernBertConfig.from_pretrained(path)
        ours = transformers.AutoModelForSequenceClassification.from_pretrained(path, config=config)
        assert type(ours) is fastbert.ModernBertForSequenceClassification
    before = dict(theirs.named_parameters())["model.layers.1.attn.Wqkv.weight"].detach().clone()
    # SGD at lr 1: the step moves each weight by its (clipped) gradient, compared to 1e-5 (test_family_clients)
    trainers = [trainer_for(model, tokenizer, tmp_path / name, max_steps=1, save_strategy="no", optim="sgd",
                            learning_rate=1.0) for model, name in ((theirs, "theirs"), (ours, "ours"))]
    for trainer in trainers:
        trainer.train()
    fast = vars(ours.model)[ACCELERATED] if kind == "fastbert.apply" else ours.model
    assert fast.layers.gradient_checkpointing  # the Trainer's switch reached fastbert's layers
    their_loss, loss = ([row["loss"] for row in t.state.log_history if "loss" in row] for t in trainers)
    assert len(loss) == 1 and loss == pytest.approx(their_loss, rel=1e-5)
    assert not torch.equal(dict(theirs.named_parameters())["model.layers.1.attn.Wqkv.weight"], before)
    assert_same_parameters(ours, theirs)
