"""Dropout switches as transformers has them (issue 28): after `fastbert.apply`, and in fastbert's own models,
each Dropout module's p and training mode (ModernBERT's attention also its float attention_dropout) are read at
each forward, and the config's rates only where the modules are built, as in transformers. Each case sets the
same switches on transformers' model, the applied one and fastbert's own class, and asserts that training-mode
forwards are random or repeatable in all three alike; on BERT's family the reference path draws transformers'
masks from the same seed, so the outputs at a rate of 0.3 equal transformers' too."""
import copy

import pytest
import torch
from family_models import hf_model, padded_batch

import fastbert

transformers = pytest.importorskip("transformers")

RATES = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
MODERNBERT_RATES = dict(attention_dropout=0.1, embedding_dropout=0.1, mlp_dropout=0.1)
FLOAT_SWITCH = "attention_dropout"  # ModernBERT's attention keeps its probabilities' rate as a float


def bert_model(head: str):
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=40, **RATES)
    torch.manual_seed(0)
    return getattr(transformers, "Bert" + head)(config).eval()


def modernbert_model(head: str):
    from test_modernbert import hf_model as modernbert
    return modernbert(head, **MODERNBERT_RATES)


MODELS = {"bert": bert_model, "bert-classifier": lambda head: bert_model("ForSequenceClassification"),
          "roberta": lambda head: hf_model("roberta", head, **RATES),
          "distilbert": lambda head: hf_model("distilbert", head, **RATES),
          "electra": lambda head: hf_model("electra", head, **RATES),
          "mpnet": lambda head: hf_model("mpnet", head, **RATES), "modernbert": modernbert_model}


def switches(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """Every dropout switch of `model` by its path: "path.p" of each nn.Dropout, "path.attention_dropout"."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout):
            found[f"{name}.p"] = (module, "p")
        if isinstance(getattr(module, FLOAT_SWITCH, None), float):
            found[f"{name}.{FLOAT_SWITCH}"] = (module, FLOAT_SWITCH)
    return found


def set_rates(model: torch.nn.Module, rates: dict[str, float], default: float) -> None:
    for key, (module, attribute) in switches(model).items():
        setattr(module, attribute, rates.get(key, default))


def three_models(arch: str):
    """transformers' model, the same accelerated by fastbert.apply, and fastbert's own class from it, in
    training mode."""
    theirs = MODELS[arch]("Model").train()
    return {"transformers": theirs, "applied": fastbert.apply(copy.deepcopy(theirs)),
            "fastbert": fastbert.from_hf(theirs)}


def first_output(model, inputs, seed=None) -> torch.Tensor:
    """The first output (hidden states or logits) on the real tokens, without gradients."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        output = model(**inputs)[0]
    mask = inputs["attention_mask"].bool()
    return output[mask] if output.shape[:2] == mask.shape else output


def repeatable(model, inputs) -> bool:
    """Whether two forwards give the same outputs (no dropout active)."""
    return torch.equal(first_output(model, inputs), first_output(model, inputs))


def inputs_for(model) -> dict:
    return padded_batch(model.config, lengths=(13, 6, 1))


@pytest.mark.parametrize("arch", list(MODELS))
def test_fastbert_has_transformers_dropout_switches(arch):
    """The same switches at the same paths: apply takes transformers' own modules, fastbert builds its own."""
    theirs = MODELS[arch]("Model")
    expected = switches(theirs)
    assert expected, arch
    assert switches(fastbert.from_hf(theirs)).keys() == expected.keys()
    applied = switches(fastbert.apply(theirs))
    assert applied.keys() == expected.keys()
    # transformers' Dropout modules themselves (ModernBERT's float is copied onto fastbert's attention)
    assert all(applied[key][0] is module for key, (module, attribute) in expected.items() if attribute == "p")


@pytest.mark.parametrize("arch", list(MODELS))
def test_dropout_set_to_zero_through_the_modules_gives_equal_training_forwards(arch):
    """sentence-transformers' way to switch dropout off (every nn.Dropout's p and attention_dropout to 0, the
    model in training mode): two forwards equal each other and transformers', in all three."""
    models = three_models(arch)
    inputs = inputs_for(models["transformers"])
    for name, model in models.items():
        assert not repeatable(model, inputs), name  # dropout on as configured
        set_rates(model, {}, 0.0)
        assert repeatable(model, inputs), name
    for name in ("applied", "fastbert"):
        torch.testing.assert_close(first_output(models[name], inputs), first_output(models["transformers"], inputs),
                                   atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch", list(MODELS))
def test_each_dropout_switch_alone_is_followed(arch):
    """One switch at 0.5, every other at 0: a training forward is random in transformers, and so in fastbert."""
    models = three_models(arch)
    inputs = inputs_for(models["transformers"])
    for key in switches(models["transformers"]):
        for name, model in models.items():
            set_rates(model, {key: 0.5}, 0.0)
            assert not repeatable(model, inputs), (key, name)


@pytest.mark.parametrize("arch", list(MODELS))
def test_the_config_rates_after_the_build_change_nothing_as_in_transformers(arch):
    """transformers reads hidden_dropout_prob / attention_probs_dropout_prob (ModernBERT's dropouts) when it
    builds its modules only: set to 0 afterwards, the modules' rates still drop; the modules at 0 with the config
    unchanged drop nothing."""
    models = three_models(arch)
    inputs = inputs_for(models["transformers"])
    fields = MODERNBERT_RATES if arch == "modernbert" else RATES
    for name, model in models.items():
        for field in fields:
            setattr(model.config, field, 0.0)
        assert not repeatable(model, inputs), name
        for field, rate in fields.items():
            setattr(model.config, field, rate)
        set_rates(model, {}, 0.0)
        assert repeatable(model, inputs), name


@pytest.mark.parametrize("arch", ["bert", "bert-classifier", "mpnet", "modernbert"])
def test_dropout_modules_in_eval_mode_as_transformers(arch):
    """Dropout modules put in eval mode inside a training model: transformers' BERT still drops the attention
    probabilities (its attention reads its own training mode and the Dropout's p), MPNet calls its Dropout
    there, ModernBERT reads the float; fastbert does the same."""
    models = three_models(arch)
    inputs = inputs_for(models["transformers"])
    outcomes = {}
    for name, model in models.items():
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.eval()
        outcomes[name] = repeatable(model, inputs)
    assert outcomes["applied"] == outcomes["fastbert"] == outcomes["transformers"], outcomes
    assert outcomes["transformers"] is (arch == "mpnet")


@pytest.mark.parametrize("arch", ["bert", "bert-classifier", "roberta", "distilbert", "electra", "mpnet"])
def test_training_outputs_at_another_rate_equal_transformers(arch):
    """Every Dropout's p set to 0.3: the same seed gives transformers' masks on the reference path, so the
    training-mode outputs equal transformers' (the rate is the modules', not the config's 0.1)."""
    models = three_models(arch)
    inputs = inputs_for(models["transformers"])
    for model in models.values():
        set_rates(model, {}, 0.3)
    expected = first_output(models["transformers"], inputs, seed=3)
    assert not torch.allclose(expected, first_output(models["transformers"], inputs, seed=4))
    for name in ("applied", "fastbert"):
        torch.testing.assert_close(first_output(models[name], inputs, seed=3), expected, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
