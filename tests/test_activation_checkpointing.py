"""Selective activation checkpointing (BertConfig.activation_checkpointing, `fastbert pretrain
--activation-checkpointing`): each option's gradients are bitwise those of "none" (dropout included: the
recomputation draws the same seeds), each keeps for the backward what its formula says, each costs the
forward FLOPs fastbert.train.metrics.recompute_flops_per_token states, and a resume may change it."""
import copy
import os

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import fastbert
from fastbert import BertConfig, BertModel
from fastbert.config import ACTIVATION_CHECKPOINTING
from fastbert.hf import read_state_dict
from fastbert.modeling import AttentionLayout
from fastbert.train import pretrain
from fastbert.train.metrics import recompute_flops_per_token
from fastbert.train.options import parse_args
from tests.test_ffn import saved_bytes
from tests.test_pretrain import SMALL, config, data, losses  # noqa: F401 (data: the fixture)

BATCH, SEQ = 2, 16
# transformers 5 renames it activation_checkpointing_enable; the old name must keep meaning "full"
OLD_NAME_WARNING = "ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning"
# head_dim 32: the Triton attention's smallest
TINY = dict(hidden_size=64, num_attention_heads=2, intermediate_size=256, vocab_size=99)


def _model(backend, device="cpu", layers=2, dropout=0.1, **changes):
    torch.manual_seed(0)
    config = BertConfig.tiny(**TINY, num_hidden_layers=layers, backend=backend, hidden_dropout_prob=dropout,
                             attention_probs_dropout_prob=dropout, **changes)
    return BertModel(config).to(device).train()


def _batch(device="cpu"):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=generator)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 11:] = 0
    weights = torch.randn(BATCH, SEQ, TINY["hidden_size"], generator=generator)
    return ids.to(device), mask.to(device), weights.to(device)


def _step(model):
    """The output and every parameter's gradient of one forward + backward under bf16 autocast (as
    `fastbert pretrain` runs), from the same RNG state."""
    device = next(model.parameters()).device
    ids, mask, weights = _batch(device)
    torch.manual_seed(2)  # the dropout seeds
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    (out.float() * weights).sum().backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.filterwarnings(OLD_NAME_WARNING)
@pytest.mark.parametrize("backend, unpad", [("triton", False), pytest.param("triton", True, marks=pytest.mark.slow(
    reason="packed on the kernels: the recomputation's masks are padded's, the varlen layers test_model_triton's")),
    ("torch", False)])
def test_every_option_gives_the_gradients_of_none_bitwise(backend, unpad, device):
    """With dropout in the attention and after every sublayer, padded or packed: the recomputation
    redraws the same masks, so outputs and gradients equal the stored run's bit for bit;
    gradient_checkpointing_enable() is "full"."""
    expected_out, expected = _step(_model(backend, device, unpad=unpad))
    runs = {option: _model(backend, device, activation_checkpointing=option, unpad=unpad)
            for option in ACTIVATION_CHECKPOINTING[1:]}
    runs["gradient_checkpointing_enable"] = _model(backend, device, activation_checkpointing="ffn", unpad=unpad)
    runs["gradient_checkpointing_enable"].gradient_checkpointing_enable()
    for option, model in runs.items():
        out, grads = _step(model)
        assert torch.equal(out, expected_out), option
        assert grads.keys() == expected.keys(), option
        different = [name for name in expected if not torch.equal(grads[name], expected[name])]
        assert not different, f"{option}: gradients differ from 'none' in {different}"


def _kept_by_one_layer(option, device, gradient_checkpointing=False):
    """Bytes one bf16 BertLayer (Triton path, dropout on) keeps for the backward under `option`,
    parameters left out (each storage once), and the model."""
    model = _model("triton", device, layers=1, activation_checkpointing=option).to(torch.bfloat16)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    _, mask, hidden = _batch(device)
    hidden = hidden.to(torch.bfloat16).requires_grad_()
    return _activations(model, lambda: model.encoder(hidden, AttentionLayout(attention_mask=mask))), model


def _activations(model, fn):
    """What fn() saves for the backward, the model's parameters left out."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, _ = saved_bytes(fn)
    return {ptr: kept for ptr, kept in saved.items() if ptr not in parameters}


def _total(saved):
    return sum(size for size, _ in saved.values())


@pytest.mark.filterwarnings(OLD_NAME_WARNING)
def test_bytes_each_option_keeps_per_layer(device):
    """Against each option's formula, T tokens, H hidden, I inner, 2-byte elements:
    none: one [T, I] tensor (the FFN pre-activation), never the GELU output;
    ffn: none's bytes less that pre-activation, 2 T I;
    attention: the layer input (2 T H) and what the FFN block (FFN + its LayerNorm) keeps by itself;
    full (and gradient_checkpointing_enable()): the layer input alone, 2 T H."""
    tokens, hidden, inner = BATCH * SEQ, TINY["hidden_size"], TINY["intermediate_size"]
    layer_input = 2 * tokens * hidden
    none, model = _kept_by_one_layer("none", device)
    assert sum(shape[-1] == inner for _, shape in none.values()) == 1
    assert _total(_kept_by_one_layer("ffn", device)[0]) == _total(none) - 2 * tokens * inner
    attended = torch.randn(BATCH, SEQ, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    ffn_block = _activations(model, lambda: model.encoder.layer[0].feed_forward(attended))
    assert _total(_kept_by_one_layer("attention", device)[0]) == layer_input + _total(ffn_block)
    assert _total(_kept_by_one_layer("full", device)[0]) == layer_input
    assert _total(_kept_by_one_layer("none", device, gradient_checkpointing=True)[0]) == layer_input


@pytest.mark.parametrize("option", ACTIVATION_CHECKPOINTING[1:])
def test_extra_flops_are_the_stated_ones(option, device):
    """FLOPs counted by torch's FlopCounterMode in a forward + backward (reference path, no padding, no
    dropout) exceed those of "none" by recompute_flops_per_token x tokens; for "ffn" by twice that, as
    the reference has no fused op to rerun the up-projection alone and reruns the whole FFN.
    output_attentions puts the attention on matmuls, which the counter sees (CPU SDPA it does not)."""
    ids = _batch(device)[0]

    def counted(option):
        model = _model("torch", device, layers=2, dropout=0.0, activation_checkpointing=option)
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids, output_attentions=True).last_hidden_state.sum().backward()
        return counter.get_total_flops()

    stated = recompute_flops_per_token(_model("torch").config, option, SEQ) * BATCH * SEQ
    assert counted(option) - counted("none") == (2 if option == "ffn" else 1) * stated


def test_recompute_flops_per_token_bert_base():
    """BERT-base at S = 512, per token over its 12 layers: the up-projection (2 H I) is the cheapest."""
    base = BertConfig.base()
    flops = {option: recompute_flops_per_token(base, option, 512) for option in ACTIVATION_CHECKPOINTING}
    assert flops["none"] == 0 < flops["ffn"] < flops["attention"] < flops["full"]
    assert flops["full"] == pytest.approx(flops["attention"] + 2 * flops["ffn"])
    with pytest.raises(ValueError, match="activation_checkpointing must be one of"):
        recompute_flops_per_token(base, "layers", 512)


def test_bad_values_are_clear_errors():
    with pytest.raises(ValueError, match=r"BertConfig.activation_checkpointing must be one of .*got 'layer'"):
        BertConfig.tiny(activation_checkpointing="layer")
    cfg, _ = parse_args(["--activation-checkpointing", "ffn", "--model", "tiny"], "")
    assert cfg.activation_checkpointing == "ffn"
    with pytest.raises(SystemExit):  # argparse: invalid choice
        parse_args(["--activation-checkpointing", "layer"], "")
    cfg.activation_checkpointing = True  # a --config file of the days it was a switch
    with pytest.raises(ValueError, match=r"--activation-checkpointing must be one of .*got True"):
        cfg.validate()


def test_option_is_not_saved_in_config_json(tmp_path):
    model = _model("torch", activation_checkpointing="attention")
    model.save_pretrained(tmp_path)
    assert "activation_checkpointing" not in (tmp_path / "config.json").read_text()


def test_a_resume_may_change_the_option_and_stays_exact(data, tmp_path):  # noqa: F811
    """Not a math change (fingerprint.CHANGEABLE_OPTIONS): a run stopped under "full" and "ffn" and
    resumed under "attention" has the losses and weights of one uninterrupted run under "none" (fp32 on
    CPU, dropout on)."""
    whole = tmp_path / "whole"
    pretrain.train(config(data, whole), SMALL)
    parts = tmp_path / "parts"
    for option, stop_at in (("full", 2), ("ffn", 4), ("attention", 0)):
        result = pretrain.train(config(data, parts, stop_at=stop_at, activation_checkpointing=option), SMALL)
        assert result["model"].config.activation_checkpointing == option
    assert losses(parts) == losses(whole)
    final_whole, final_parts = (read_state_dict(os.path.join(out, "checkpoints", "step_00000006", "model"))
                                for out in (whole, parts))
    assert final_whole.keys() == final_parts.keys()
    assert all(torch.equal(final_whole[k], final_parts[k]) for k in final_whole)


def _counted_recomputes(model) -> list:
    """Wrap each encoder's checkpoint function to count the layers it recomputes."""
    calls = []
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if function is not None:
            module._gradient_checkpointing_func = lambda *args, f=function, **kwargs: (calls.append(1),
                                                                                       f(*args, **kwargs))[1]
    return calls


@pytest.mark.parametrize("applied", [False, True])
def test_every_n_layers_checkpoints_the_layers_transformers_does(applied):
    """transformers' activation_checkpointing_enable(every_n_layers=n) checkpoints the 1st, (n+1)-th, ... layers;
    fastbert's encoders (its own models' and those apply puts in transformers') checkpointed every layer, since
    transformers counts only its own layer class. Gradients stay those of the model without checkpointing."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    theirs = transformers.BertForSequenceClassification(config).train()
    ours = fastbert.apply(copy.deepcopy(theirs)) if applied else fastbert.from_hf(theirs).train()
    ids, labels = torch.randint(0, 99, (2, 7), generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1])

    def gradients(model):
        model.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    expected = gradients(ours)
    for model in (theirs, ours):
        model.activation_checkpointing_enable(every_n_layers=2)
    counts = []
    for model in (theirs, ours):
        calls = _counted_recomputes(model)
        got = gradients(model)
        counts.append(len(calls))
    assert counts == [2, 2]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    ours.activation_checkpointing_disable()
    calls = _counted_recomputes(ours)
    gradients(ours)
    assert calls == []
    ours.activation_checkpointing_enable()
    calls = _counted_recomputes(ours)
    gradients(ours)
    assert len(calls) == 4
    ours.activation_checkpointing_enable(every_n_layers=np.int64(3))  # transformers takes a NumPy integer too
    calls = _counted_recomputes(ours)
    gradients(ours)
    assert len(calls) == 2  # layers 0 and 3
    ours.activation_checkpointing_disable()
    with pytest.raises(ValueError, match="every_n_layers must be an int >= 1, got 0"):
        ours.activation_checkpointing_enable(every_n_layers=0)
    assert not ours.is_gradient_checkpointing  # nothing was set


@pytest.mark.filterwarnings("ignore:You are using an old version of the checkpointing format")
def test_a_model_with_the_old_checkpointing_setter_keeps_it_after_apply():
    """Remote code of the format before transformers 4.35 overrides _set_gradient_checkpointing(module, value),
    which transformers detects by its signature: apply's every_n_layers setter hid it (a TypeError)."""
    transformers = pytest.importorskip("transformers")

    class OldFormat(transformers.BertPreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.bert = transformers.BertModel(config)
            self.post_init()

        def _set_gradient_checkpointing(self, module, value=False):
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = value

    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64)
    model = fastbert.apply(OldFormat(config))
    model.activation_checkpointing_enable()
    assert model.bert.encoder.gradient_checkpointing
