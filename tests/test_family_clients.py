"""The family inside its clients, offline on CPU, on tiny random models saved with a tiny WordLevel tokenizer:
SentenceTransformer encode and CrossEncoder predict after `fastbert.apply` equal plain within 1e-5, one Trainer
step on an applied RoBERTa classifier gives transformers' loss and weights, and PEFT LoRA on each
architecture's default target modules (applied before or after) equals plain LoRA, only LoRA training."""
import copy

import pytest
import torch
from family_models import ARCHITECTURES, PREFIXES, head_inputs, hf_model
from test_clients_transformers import assert_same_parameters, trainer_for

import fastbert
from fastbert.in_place import ACCELERATED

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
st = pytest.importorskip("sentence_transformers")
peft = pytest.importorskip("peft")

SENTENCES = ["a man is eating food", "a man rides a horse", "someone is eating a meal",
             "the whole sentence is read in both directions at once with padding and all", "rain"]
PAIRS = [("a cat", "a kitten sleeps"), ("a dog barks", "sunlight on the water"), ("rain", "a shower of rain")]
# RoBERTa's special tokens at RoBERTa's ids (pad_token_id 1, the models' padding index); BERT's at DistilBERT's
ROBERTA_SPECIALS = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
                    "mask_token": "<mask>"}
BERT_SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                 "mask_token": "[MASK]"}


def tiny_tokenizer(arch: str):
    """A lower-casing whitespace WordLevel tokenizer over the test sentences, with the architecture's special
    tokens, single and pair templates, and no token types (RoBERTa's table has one row, MPNet and DistilBERT
    none)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    specials = BERT_SPECIALS if arch == "distilbert" else ROBERTA_SPECIALS
    words = sorted({w for text in SENTENCES + [t for pair in PAIRS for t in pair] for w in text.split()})
    vocab = {token: i for i, token in enumerate([*specials.values(), *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=specials["unk_token"]))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    first, last = ("[CLS]", "[SEP]") if arch == "distilbert" else ("<s>", "</s>")
    middle = "[SEP]" if arch == "distilbert" else "</s> </s>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}", pair=f"{first} $A {middle} $B {last}",
        special_tokens=[(token, vocab[token]) for token in {first, last}])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=32,
                                                model_input_names=["input_ids", "attention_mask"], **specials)


def saved(arch: str, head: str, path, **overrides) -> str:
    """A tiny random model of `arch` and its tokenizer saved where transformers' Auto classes load them."""
    tokenizer = tiny_tokenizer(arch)
    assert tokenizer.pad_token_id == (0 if arch == "distilbert" else 1)  # the models' pad_token_id
    hf_model(arch, head, **overrides).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def accelerated_bases(model) -> list:
    return [m for m in model.modules() if ACCELERATED in vars(m)]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sentence_transformer_encode_after_apply_equals_plain(arch, tmp_path, one_thread):
    path = saved(arch, "Model", tmp_path)
    modules = st.sentence_transformer.modules

    def build():
        transformer = modules.Transformer(path)
        return st.SentenceTransformer(
            modules=[transformer, modules.Pooling(transformer.get_embedding_dimension(), "mean")], device="cpu")

    plain, applied = build(), build()
    assert type(plain[0].model).__name__ == PREFIXES[arch] + "Model"  # transformers' class, not fastbert's
    assert fastbert.apply(applied) is applied and len(accelerated_bases(applied)) == 1
    expected = plain.encode(SENTENCES, convert_to_tensor=True, batch_size=3)
    assert (expected - expected[0]).abs().max() > 1e-2  # the sentences (of other lengths: padded) differ
    torch.testing.assert_close(applied.encode(SENTENCES, convert_to_tensor=True, batch_size=3), expected,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_cross_encoder_predict_after_apply_equals_plain(arch, tmp_path, one_thread):
    path = saved(arch, "ForSequenceClassification", tmp_path, num_labels=1)
    plain, applied = (st.CrossEncoder(path, device="cpu") for _ in range(2))
    assert fastbert.apply(applied) is applied and len(accelerated_bases(applied)) == 1
    expected = plain.predict(PAIRS, convert_to_tensor=True)
    assert expected.std() > 1e-4  # the pairs score differently (10 times the tolerance)
    torch.testing.assert_close(applied.predict(PAIRS, convert_to_tensor=True), expected, atol=1e-5, rtol=1e-5)


def test_trainer_step_on_an_applied_roberta_classifier(tmp_path, one_thread):
    path = saved("roberta", "ForSequenceClassification", tmp_path / "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(path)
    ours = fastbert.apply(copy.deepcopy(theirs))
    before = copy.deepcopy(theirs)
    # SGD at lr 1: the step moves each weight by its (clipped) gradient, which is compared to 1e-5; Adam's first
    # step would move each weight by ~lr whatever its gradient, turning rounding noise (the key biases' gradient
    # is 0 in exact arithmetic: softmax ignores a per-query constant) into differences of lr
    trainers = [trainer_for(model, tokenizer, tmp_path / name, max_steps=1, save_strategy="no", optim="sgd",
                            learning_rate=1.0) for model, name in ((theirs, "theirs"), (ours, "ours"))]
    for trainer in trainers:
        trainer.train()
    assert vars(ours.roberta)[ACCELERATED].encoder.gradient_checkpointing  # the Trainer's switch reached fastbert
    their_loss, loss = ([row["loss"] for row in t.state.log_history if "loss" in row] for t in trainers)
    assert len(loss) == 1 and loss == pytest.approx(their_loss, rel=1e-5)
    query = "roberta.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(dict(theirs.named_parameters())[query], dict(before.named_parameters())[query])
    assert_same_parameters(ours, theirs)


# peft's default LoRA targets (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING) where it has them; for the
# others the same choice (query and value) under the architecture's names
DEFAULT_TARGETS = {"roberta": None, "xlm-roberta": None, "electra": None, "camembert": ["query", "value"],
                   "distilbert": ["q_lin", "v_lin"], "mpnet": ["q", "v"]}


def lora(model, arch):
    torch.manual_seed(1)  # init_lora_weights=False draws both LoRA matrices: the output changes at once
    config = peft.LoraConfig(target_modules=DEFAULT_TARGETS[arch], r=4, lora_alpha=8, init_lora_weights=False)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("order", ["apply then lora", "lora then apply"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_on_the_default_targets_equals_plain_lora(arch, order):
    if DEFAULT_TARGETS[arch] is None:  # peft knows the architecture: its default is query and value
        mapping = peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
        assert set(mapping[hf_model(arch).config.model_type]) == {"query", "value"}
    theirs = lora(hf_model(arch, "ForSequenceClassification"), arch)
    ours = hf_model(arch, "ForSequenceClassification")
    if order == "apply then lora":
        ours = lora(fastbert.apply(ours), arch)
    else:
        ours = lora(ours, arch)
        assert fastbert.apply(ours) is ours
    assert len(accelerated_bases(ours)) == 1
    adapters = [name for name, module in ours.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)]
    assert len(adapters) == 2 * 2  # two target Linears in each of the two layers, kept and called
    inputs = head_inputs(theirs.config, "ForSequenceClassification")
    plain = hf_model(arch, "ForSequenceClassification")(**inputs).logits
    expected, actual = theirs(**inputs), ours(**inputs)
    assert (expected.logits - plain).abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(actual.logits, expected.logits, atol=1e-5, rtol=1e-5)
    assert_lora_gradients_equal(ours, actual.loss, theirs, expected.loss)


def assert_lora_gradients_equal(ours, our_loss, theirs, their_loss):
    """Backward through both LoRA models: only LoRA parameters train, the same ones, with equal gradients."""
    their_loss.backward()
    our_loss.backward()
    their_grads = {name: param.grad for name, param in theirs.named_parameters()}
    trained = {name for name, param in ours.named_parameters() if param.grad is not None}
    assert trained and all("lora_" in name for name in trained), sorted(trained)
    assert trained == {name for name, grad in their_grads.items() if grad is not None}
    for name, param in ours.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(param.grad, their_grads[name], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
