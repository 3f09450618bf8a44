"""BertConfig.layer_norm_backward chosen from the weights: a LayerNorm with more than SIDE_COLUMNS weights of
|weight| < MIN_WEIGHT gets NaN gradients from the backward from the output (kernels/layer_norm.py), so
from_pretrained, from_hf, fastbert.apply and a pretraining resume choose "input" for it (one info line); an
explicit setting wins; config.json never holds the field; a pretraining run stopped by non-finite steps names
the cure. A one-layer model on the Triton kernels, interpreted on CPU."""
import copy
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tolerance import GRADIENT_FACTOR, assert_within_rule

import fastbert
from fastbert.kernels.layer_norm import MIN_WEIGHT, SIDE_COLUMNS
from fastbert.train import checkpoint, pretrain
from tests.test_pretrain import config as pretrain_config
from tests.test_pretrain import data  # noqa: F401  (the module's dataset fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

# one head of 32: the smallest the Triton attention takes
SHAPE = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=1, intermediate_size=64,
             max_position_embeddings=64)
CONFIG = fastbert.BertConfig.tiny(vocab_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **SHAPE)
NORM = "bert.encoder.layer.0.output.LayerNorm"  # the LayerNorm given small weights
WEIGHTS = "model.safetensors"


def small_weights(count: int) -> torch.Tensor:
    """[count] fp32 weights of |w| < MIN_WEIGHT, zero and both signs among them."""
    return torch.linspace(-MIN_WEIGHT, MIN_WEIGHT, count + 2)[1:-1]


def make_small(weight: torch.Tensor, count: int) -> None:
    with torch.no_grad():
        weight[:count] = small_weights(count)


def save_checkpoint(path, count: int) -> str:
    torch.manual_seed(0)
    model = fastbert.BertForMaskedLM(CONFIG)
    make_small(model.get_parameter(f"{NORM}.weight"), count)
    model.save_pretrained(path)
    return str(path)


def batch(device):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, CONFIG.vocab_size, (2, 12), generator=generator).to(device)
    return dict(input_ids=ids, labels=ids)


def gradients(model) -> dict[str, torch.Tensor]:
    model.train()
    model(**batch(next(model.parameters()).device)).loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def choices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fastbert" and "layer_norm_backward" in r.getMessage()]


@pytest.mark.parametrize("count,expected", [(SIDE_COLUMNS, "output"), (SIDE_COLUMNS + 1, "input")])
def test_from_pretrained_chooses_input_beyond_the_side_buffer_and_trains_within_the_rule(tmp_path, caplog, count,
                                                                                         expected, device):
    """SIDE_COLUMNS small weights stay "output" (the side buffer serves them); one more loads as "input", with
    one info line naming the LayerNorm, its count and the cost. Either way the Triton path's gradients are
    within the tolerance rule of the reference path's (fp32 against float64)."""
    path = save_checkpoint(tmp_path, count)
    with caplog.at_level(logging.INFO, logger="fastbert"):
        kernels = fastbert.BertForMaskedLM.from_pretrained(path, backend="triton").to(device)
    assert kernels.config.layer_norm_backward == expected
    assert kernels.bert.encoder.layer[0].output.config.layer_norm_backward == expected  # what the forward reads
    if expected == "input":
        assert choices(caplog) == [
            f"BertForMaskedLM: more than {SIDE_COLUMNS} weights with |weight| < {MIN_WEIGHT:g} in LayerNorm {NORM} "
            f"({count}), which the LayerNorm backward from the output cannot recover (NaN gradients); "
            "layer_norm_backward='input' chosen: each LayerNorm keeps x and the residual for its backward, "
            "2 more activations per LayerNorm"]
    else:
        assert choices(caplog) == []
    reference = fastbert.BertForMaskedLM.from_pretrained(path, backend="torch").to(device)
    exact = gradients(copy.deepcopy(reference).double())
    torch_grads, kernel_grads = gradients(reference), gradients(kernels)
    for name, grad in exact.items():
        assert_within_rule(name, kernel_grads[name], torch_grads[name], grad, GRADIENT_FACTOR)


def test_an_explicit_layer_norm_backward_wins_over_the_weights(tmp_path, caplog, device):
    """layer_norm_backward="output" given to from_pretrained is kept (no info line) where the weights would
    choose "input", and then the LayerNorm with one small weight too many has NaN gradients: what the choice
    protects against."""
    path = save_checkpoint(tmp_path, SIDE_COLUMNS + 1)
    assert fastbert.BertForMaskedLM.from_pretrained(path).config.layer_norm_backward == "input"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastbert"):
        model = fastbert.BertForMaskedLM.from_pretrained(path, backend="triton", layer_norm_backward="output")
    model.to(device)
    assert model.config.layer_norm_backward == "output" and choices(caplog) == []
    assert torch.isnan(gradients(model)[f"{NORM}.weight"]).any()


def test_layer_norm_backward_is_never_written_to_config_json(tmp_path):
    """A model loaded as "input" saves a config.json without the field; loading that again chooses "input"
    again, from the weights."""
    model = fastbert.BertForMaskedLM.from_pretrained(save_checkpoint(tmp_path / "a", SIDE_COLUMNS + 1))
    assert model.config.layer_norm_backward == "input"
    model.save_pretrained(tmp_path / "b")
    with open(tmp_path / "b" / "config.json", encoding="utf-8") as f:
        assert "layer_norm_backward" not in json.load(f)
    assert fastbert.BertForMaskedLM.from_pretrained(tmp_path / "b").config.layer_norm_backward == "input"
    with pytest.raises(ValueError, match=r"BertConfig.layer_norm_backward must be one of \('output', 'input'\), "
                                         "got 'inputs'"):
        CONFIG.replace(layer_norm_backward="inputs")


def transformers_model(count: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.BertConfig(**CONFIG.to_dict(), attn_implementation="eager")
    model = transformers.BertForMaskedLM(hf_config)
    make_small(model.get_parameter(f"{NORM}.weight"), count)
    return model


def test_apply_chooses_input_for_a_transformers_model_and_trains_within_the_rule(device):
    """fastbert.apply on a transformers BertForMaskedLM with one small weight too many: "input", and its
    gradients within the tolerance rule of transformers' own (fp32 against float64); from_hf does the same;
    an explicit layer_norm_backward="output" is kept."""
    original = transformers_model(SIDE_COLUMNS + 1).to(device)
    exact = gradients(copy.deepcopy(original).double())
    accelerated = fastbert.apply(copy.deepcopy(original), backend="triton")
    assert accelerated.bert.encoder.layer[0].output.config.layer_norm_backward == "input"
    kernel_grads, torch_grads = gradients(accelerated), gradients(original)
    for name, grad in exact.items():
        assert_within_rule(name, kernel_grads[name], torch_grads[name], grad, GRADIENT_FACTOR)
    assert fastbert.from_hf(original).config.layer_norm_backward == "input"
    kept = fastbert.apply(transformers_model(SIDE_COLUMNS + 1), layer_norm_backward="output")
    assert kept.bert.encoder.layer[0].output.config.layer_norm_backward == "output"


def test_pretraining_resume_chooses_input_and_a_non_finite_stop_names_the_cure(data, tmp_path):  # noqa: F811
    """A checkpoint whose LayerNorm holds one small weight too many: resumed with an explicit
    --model.layer_norm_backward output, every step is non-finite and the stop names the cure; resumed
    without it, the run chooses "input" and finishes."""
    overrides = {**SHAPE, "backend": "triton"}
    options = dict(steps=4, seq_lengths="16", phase_fractions="1", max_bad_steps=2)
    pretrain.train(pretrain_config(data, tmp_path, stop_at=1, **options), overrides)
    weights_file = os.path.join(tmp_path, "checkpoints", "step_00000001", "model", WEIGHTS)
    weights = load_file(weights_file)
    make_small(weights[f"{NORM}.weight"], SIDE_COLUMNS + 1)
    save_file(weights, weights_file, metadata={"format": "pt"})
    # the checkpoint a run that trained these weights writes: its digests are of them
    checkpoint.write_digests(os.path.join(tmp_path, "checkpoints", "step_00000001"))
    with pytest.raises(pretrain.TrainingError) as error:
        pretrain.train(pretrain_config(data, tmp_path, **options), {**overrides, "layer_norm_backward": "output"})
    assert (f"in LayerNorm {NORM} ({SIDE_COLUMNS + 1}), which the LayerNorm backward from the output cannot recover "
            "(NaN gradients): run again with --model.layer_norm_backward input (BertConfig layer_norm_backward='input')"
            ". Lower --lr") in str(error.value)
    result = pretrain.train(pretrain_config(data, tmp_path, **options), overrides)
    assert result["step"] == 4 and result["skipped_steps"] == 0
    assert result["model"].config.layer_norm_backward == "input"


@pytest.mark.parametrize("name,norm", [("ModernBertForMaskedLM", "model.layers.1.mlp_norm"),
                                       ("DistilBertForMaskedLM", "distilbert.transformer.layer.0.sa_layer_norm")])
def test_every_layer_norm_is_read_whatever_its_name(name, norm):
    """The choice reads every nn.LayerNorm, not only those BERT names `LayerNorm`: ModernBERT's and DistilBERT's
    norms with one small weight too many choose "input" too (their backward from the output would give NaN)."""
    transformers = pytest.importorskip("transformers")
    config_class = getattr(transformers, name.replace("ForMaskedLM", "Config"))
    sizes = (dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
             if name.startswith("ModernBert") else dict(dim=32, hidden_dim=48, n_layers=2, n_heads=2))
    torch.manual_seed(0)
    model = getattr(transformers, name)(config_class(vocab_size=64, max_position_embeddings=32, **sizes))
    assert fastbert.from_hf(model).config.layer_norm_backward == "output"
    make_small(model.get_parameter(f"{norm}.weight"), SIDE_COLUMNS + 1)
    assert fastbert.from_hf(model).config.layer_norm_backward == "input"
