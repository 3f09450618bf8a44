"""Tools that replace or hook the encoder's Linears: PEFT LoRA (train, save, load, on fastbert models and on
models accelerated by fastbert.apply), forward hooks and module-swapping quantizers. A wrapped or hooked
Linear is called, never bypassed by a fused op that reads its weight."""
import copy
import json

import pytest
import torch
from torch import nn

import fastbert
from fastbert.modeling import is_plain_linear

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def hf_config():
    return transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0, num_labels=3)


def batch():
    ids = torch.randint(1, 99, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return dict(input_ids=ids * mask, attention_mask=mask, labels=torch.tensor([0, 2, 1]))


def lora(model):
    torch.manual_seed(1)  # init_lora_weights=False draws both LoRA matrices: the output changes at once
    config = peft.LoraConfig(target_modules=["query", "value"], r=4, lora_alpha=8, init_lora_weights=False,
                             modules_to_save=["classifier"])
    return peft.get_peft_model(model, config)


def train(model, steps=2):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        model(**batch()).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.mark.parametrize("kind", ["fastbert", "apply before peft", "apply after peft"])
def test_lora_on_query_and_value_trains_saves_and_loads(tmp_path, kind):
    torch.manual_seed(0)
    theirs = transformers.BertForSequenceClassification(hf_config())
    if kind == "fastbert":
        base = fastbert.from_hf(theirs)
    else:
        base = transformers.BertForSequenceClassification(hf_config())
        base.load_state_dict(theirs.state_dict())
    if kind == "apply before peft":
        fastbert.apply(base)
    plain = base(**batch()).logits.detach()
    ours, theirs = lora(base), lora(theirs)
    if kind == "apply after peft":  # the adapters already in place are kept and called
        assert fastbert.apply(ours) is ours
    assert type(ours.base_model.model.bert.encoder) is fastbert.modeling.BertEncoder
    targeted = [name for name, _ in ours.named_modules() if name.endswith(("query", "value"))]
    assert len(targeted) == 4 and all(not is_plain_linear(ours.get_submodule(n)) for n in targeted)
    out = ours(**batch()).logits
    assert (out - plain).abs().max() > 1e-4  # the adapters are called (logits are ~0.02: a 2% change)
    torch.testing.assert_close(out, theirs(**batch()).logits, atol=1e-5, rtol=1e-5)
    train(ours), train(theirs)
    trained = ours(**batch()).logits.detach()
    torch.testing.assert_close(trained, theirs(**batch()).logits, atol=1e-5, rtol=1e-4)
    frozen = dict(ours.named_parameters())["base_model.model.bert.encoder.layer.0.attention.self.query.base_layer.weight"]
    assert not frozen.requires_grad

    ours.save_pretrained(tmp_path / "adapter")
    torch.manual_seed(0)
    fresh = fastbert.from_hf(transformers.BertForSequenceClassification(hf_config()))
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    torch.testing.assert_close(loaded(**batch()).logits, trained, atol=1e-6, rtol=1e-6)
    torch.manual_seed(0)  # and the adapter fastbert saved loads onto transformers' own model
    hf_loaded = peft.PeftModel.from_pretrained(transformers.BertForSequenceClassification(hf_config()),
                                               tmp_path / "adapter")
    torch.testing.assert_close(hf_loaded(**batch()).logits, trained, atol=1e-5, rtol=1e-4)


def test_forward_hooks_and_module_swaps_are_honoured():
    torch.manual_seed(0)
    model = fastbert.from_hf(transformers.BertForSequenceClassification(hf_config())).eval()
    inputs = {k: v for k, v in batch().items() if k != "labels"}
    reference = model.bert(**inputs).last_hidden_state
    layer = model.bert.encoder.layer[0]
    calls = []

    def double(module, inputs, output):
        calls.append(module)
        return output * 2.0

    for linear in (layer.attention.self.value, layer.attention.output.dense, layer.intermediate.dense):
        handle = linear.register_forward_hook(double)
        hooked = model.bert(**inputs).last_hidden_state
        handle.remove()
        assert calls[-1] is linear and (hooked - reference).abs().max() > 1e-2
    torch.testing.assert_close(model.bert(**inputs).last_hidden_state, reference)  # hooks gone: fused again

    class RoundedLinear(nn.Linear):  # what a weight-quantizing tool swaps in: another module, same interface
        def forward(self, x):
            calls.append(self)
            return nn.functional.linear(x, torch.round(self.weight * 8) / 8, self.bias)

    swapped = RoundedLinear(32, 64)
    swapped.load_state_dict(layer.intermediate.dense.state_dict())
    layer.intermediate.dense = swapped
    out = model(**batch()).logits
    assert calls[-1] is swapped
    theirs = model.to_hf().eval()  # transformers runs the same swapped module: the results agree
    theirs.bert.encoder.layer[0].intermediate.dense = swapped
    torch.testing.assert_close(out, theirs(**batch()).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton: the one-node sublayers' paths too, in training
@pytest.mark.parametrize("kind", ["fastbert", "apply"])
def test_layer_norm_hooks_and_ln_tuning_are_honoured(kind, backend):
    """A hooked or wrapped LayerNorm is called, never bypassed by the fused op that reads its weight: a forward hook
    on each of BERT's three LayerNorms runs and changes the output as transformers' does, and PEFT's LN tuning (which
    wraps them) trains the same parameters with the same gradients as on transformers' model."""
    torch.manual_seed(0)
    config = hf_config()
    config.num_attention_heads = 1  # head dim 32, which the Triton attention takes
    theirs = transformers.BertForSequenceClassification(config)
    if kind == "fastbert":
        ours = fastbert.from_hf(theirs, backend=backend)
    else:
        ours = transformers.BertForSequenceClassification(config)
        ours.load_state_dict(theirs.state_dict())
        fastbert.apply(ours, backend=backend)
    inputs = {k: v for k, v in batch().items() if k != "labels"}
    real = inputs["attention_mask"].bool()

    def norms(model):
        layer = model.bert.encoder.layer[0]
        return model.bert.embeddings.LayerNorm, layer.attention.output.LayerNorm, layer.output.LayerNorm

    calls = []

    def shift(module, args, output):
        calls.append(module)
        return output + 0.5

    for ours_norm, their_norm in zip(norms(ours), norms(theirs)):
        handles = [ours_norm.register_forward_hook(shift), their_norm.register_forward_hook(shift)]
        expected = theirs.bert(**inputs).last_hidden_state[real]
        torch.testing.assert_close(ours.bert(**inputs).last_hidden_state[real], expected, atol=1e-5, rtol=1e-5)
        assert calls[-2] is their_norm and calls[-1] is ours_norm
        for handle in handles:
            handle.remove()
    tuned = [peft.get_peft_model(model, peft.LNTuningConfig(target_modules=["LayerNorm"])).train()
             for model in (ours, theirs)]
    for model in tuned:
        model(**batch()).loss.backward()
    trained = {name: p.grad for name, p in tuned[1].named_parameters() if p.requires_grad}
    assert len(trained) == 10  # the weight and bias of each of the five LayerNorms
    for name, param in tuned[0].named_parameters():
        assert param.requires_grad == (name in trained), name
        if param.requires_grad:
            torch.testing.assert_close(param.grad, trained[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_plain_linear_check():
    linear = nn.Linear(4, 4)
    assert is_plain_linear(linear)
    handle = linear.register_forward_pre_hook(lambda module, args: None)
    assert not is_plain_linear(linear)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    assert not is_plain_linear(linear)  # a global hook must see every Linear's call too
    handle.remove()
    assert is_plain_linear(linear) and not is_plain_linear(type("Sub", (nn.Linear,), {})(4, 4))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("kind", ["fastbert", "apply"])
def test_prefix_tuning_trains_saves_and_loads_as_on_transformers(tmp_path, kind):
    """PEFT's prefix tuning (P-Tuning v2) hands the model its learned prefix keys and values as past_key_values
    (fastbert.prefix): its output and its prompt encoder's gradients are those on transformers' own BertModel
    and the saved adapter loads back (PEFT's inference mode reads the prefix without the encoder). PEFT refuses
    prefix tuning under activation checkpointing (tests/test_prefix_keys.py checks fastbert's)."""
    config = peft.PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=4)
    inputs = {key: value for key, value in batch().items() if key != "labels"}
    real = inputs["attention_mask"].bool()
    torch.manual_seed(0)
    theirs = transformers.BertModel(hf_config()).train()
    base = copy.deepcopy(theirs)
    base = fastbert.from_hf(base) if kind == "fastbert" else fastbert.apply(base)

    def run(model):
        torch.manual_seed(1)  # the prompt encoder's initial prefix
        tuned = peft.get_peft_model(model, config)
        output = tuned(**inputs).last_hidden_state
        output[real].square().sum().backward()
        grads = [p.grad for p in tuned.parameters() if p.requires_grad]
        assert grads and all(g is not None for g in grads)
        return tuned, output.detach()[real], grads

    _, expected, expected_grads = run(theirs)
    tuned, actual, grads = run(base)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-4)
    tuned.save_pretrained(tmp_path)
    fresh = copy.deepcopy(base).eval()
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    tuned.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).last_hidden_state[real], tuned(**inputs).last_hidden_state[real],
                                   atol=1e-6, rtol=1e-5)


def test_peft_model_card_names_the_base_model_as_for_transformers(tmp_path):
    """PEFT's model card takes its base_model line from config.to_dict()["_name_or_path"] (PEFT's own tests
    check it: 92 of them failed on fastbert's classes, whose to_dict left it out); config.json leaves it out,
    as transformers' does."""
    transformers.BertForSequenceClassification(hf_config()).save_pretrained(tmp_path / "base")
    cards = []
    for cls in (transformers.BertForSequenceClassification, fastbert.BertForSequenceClassification):
        model = cls.from_pretrained(tmp_path / "base")
        assert model.config.to_dict()["_name_or_path"] == str(tmp_path / "base")
        lora(model).save_pretrained(tmp_path / cls.__module__)
        card = (tmp_path / cls.__module__ / "README.md").read_text()
        cards.append([line for line in card.splitlines() if line.startswith("base_model")])
    assert cards[0] == cards[1] == [f"base_model: {tmp_path / 'base'}"]
    model.save_pretrained(tmp_path / "again")
    assert "_name_or_path" not in json.loads((tmp_path / "again" / "config.json").read_text())
    model.config.save_pretrained(tmp_path / "config")
    assert "_name_or_path" not in json.loads((tmp_path / "config" / "config.json").read_text())
