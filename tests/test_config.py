"""BertConfig: HF defaults, presets, validation naming the field, config.json round trips."""
import json

import pytest

from fastbert import BertConfig

transformers = pytest.importorskip("transformers")


def test_defaults_match_transformers():
    ours, theirs = BertConfig(), transformers.BertConfig()
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
                 "type_vocab_size", "initializer_range", "layer_norm_eps", "pad_token_id", "classifier_dropout"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.backend == "auto" and ours.gelu_approximate == "none"


def test_presets():
    large = BertConfig.large()
    assert (large.num_hidden_layers, large.hidden_size, large.num_attention_heads, large.intermediate_size) == \
        (24, 1024, 16, 4096)
    assert BertConfig.base() == BertConfig()
    assert BertConfig.tiny().hidden_size % BertConfig.tiny().num_attention_heads == 0
    assert BertConfig.large(num_hidden_layers=2).num_hidden_layers == 2
    assert BertConfig(hidden_act="gelu_new").gelu_approximate == "tanh"
    assert BertConfig(hidden_act="gelu_pytorch_tanh").gelu_approximate == "tanh"


@pytest.mark.parametrize("field, value, words", [
    ("hidden_size", 100, ["hidden_size", "100", "num_attention_heads"]),
    ("hidden_act", "relu", ["hidden_act", "relu"]),
    ("vocab_size", 0, ["vocab_size", "0"]),
    ("num_hidden_layers", -1, ["num_hidden_layers", "-1"]),
    ("hidden_dropout_prob", 1.0, ["hidden_dropout_prob", "1.0"]),
    ("attention_probs_dropout_prob", -0.1, ["attention_probs_dropout_prob", "-0.1"]),
    ("backend", "cuda", ["backend", "cuda"]),
])
def test_invalid_values_name_the_field(field, value, words):
    with pytest.raises(ValueError) as info:
        BertConfig(**{field: value})
    for word in words:
        assert word in str(info.value)


def test_json_round_trip_through_transformers(tmp_path):
    hf = transformers.BertConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, intermediate_size=99,
                                 hidden_act="gelu_new", layer_norm_eps=1e-7, num_labels=5)
    hf.save_pretrained(tmp_path)
    ours = BertConfig.from_json(tmp_path)
    assert (ours.hidden_size, ours.num_attention_heads, ours.num_hidden_layers, ours.intermediate_size) == (64, 4, 3, 99)
    assert ours.hidden_act == "gelu_new" and ours.layer_norm_eps == 1e-7 and ours.num_labels == 5
    out = tmp_path / "again"
    out.mkdir()
    ours.to_json(out)
    again = transformers.BertConfig.from_pretrained(out)
    assert again.hidden_size == 64 and again.num_labels == 5 and again.intermediate_size == 99
    written = json.loads((out / "config.json").read_text())
    assert "backend" not in written and "unpad" not in written and "extra" not in written


def test_unknown_keys_are_kept_and_overrides_apply(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "some_future_key": [1, 2],
                                "architectures": ["BertForMaskedLM"], "gradient_checkpointing": False}))
    config = BertConfig.from_json(path, backend="torch", num_hidden_layers=1)
    assert config.some_future_key == [1, 2]
    assert config.backend == "torch" and config.num_hidden_layers == 1
    assert config.to_dict()["some_future_key"] == [1, 2]
    with pytest.raises(ValueError, match="num_attention_heads"):
        BertConfig.from_json(path, num_attention_heads=5)


@pytest.mark.parametrize("key, value", [("position_embedding_type", "relative_key"), ("is_decoder", True),
                                        ("add_cross_attention", True)])
def test_architecture_changing_keys_are_refused(tmp_path, key, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, key: value}))
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        BertConfig.from_json(path)
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "position_embedding_type": "absolute",
                                "is_decoder": False, "add_cross_attention": False}))
    assert BertConfig.from_json(path).position_embedding_type == "absolute"
