"""BertConfig: HF defaults, presets, validation naming the field, config.json round trips."""
import json

import pytest

from fastbert import BertConfig, BertModel

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
])
def test_invalid_values_name_the_field(field, value, words):
    config = BertConfig(**{field: value})  # as transformers: the config takes it, building a model refuses it
    with pytest.raises(ValueError) as info:
        BertModel(config)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": "384"}, "BertConfig.hidden_size must be an integer, got '384' (str)"),
    ({"num_attention_heads": None}, "BertConfig.num_attention_heads must be an integer, got null"),
    ({"num_hidden_layers": 2.0}, "BertConfig.num_hidden_layers must be an integer, got 2.0 (float)"),
    ({"vocab_size": True}, "BertConfig.vocab_size must be an integer, got True (bool)"),
    ({"hidden_dropout_prob": "0.1"}, "BertConfig.hidden_dropout_prob must be a number, got '0.1' (str)"),
    ({"pad_token_id": "0"}, "BertConfig.pad_token_id must be an integer or null, got '0' (str)"),
    ({"tie_word_embeddings": "yes"}, "BertConfig.tie_word_embeddings must be true or false, got 'yes' (str)"),
    ({"model_type": "modernbert", "norm_eps": "1e-5"}, "ModernBertConfig.norm_eps must be a number, got '1e-5'"),
])
def test_wrong_types_in_config_json_name_the_file_and_the_field(tmp_path, changes, message):
    """As transformers' strict config refuses them, with the file, the field as config.json spells it, the
    type it must have and the value; never a TypeError from inside transformers' validators."""
    from fastbert.architectures import load_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, **changes}))
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: {message}")
    # as transformers: an integer where a float goes, null where the field may be None
    taken = BertConfig.from_dict({"layer_norm_eps": 1, "initializer_range": 1, "classifier_dropout": None,
                                  "pad_token_id": None})
    assert taken.layer_norm_eps == 1 and taken.pad_token_id is None


def test_fastbert_switches_are_checked_on_construction():
    """transformers never sees fastbert's own switches: a bad one is refused at once."""
    with pytest.raises(ValueError, match="BertConfig.backend must be one of .*got 'cuda'"):
        BertConfig(backend="cuda")


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
    heads = BertConfig.from_json(path, num_attention_heads=5)  # transformers loads it too (tests/test_drop_in.py)
    with pytest.raises(ValueError, match="num_attention_heads"):
        BertModel(heads)


@pytest.mark.parametrize("key, value", [("position_embedding_type", "relative_key"), ("is_decoder", True),
                                        ("add_cross_attention", True)])
def test_architecture_changing_keys_are_refused(tmp_path, key, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, key: value}))
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        BertModel(BertConfig.from_json(path))
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "position_embedding_type": "absolute",
                                "is_decoder": False, "add_cross_attention": False}))
    assert BertConfig.from_json(path).position_embedding_type == "absolute"


def test_transformers_reads_it_as_its_own_config():
    config = BertConfig.tiny()
    assert isinstance(config, transformers.PreTrainedConfig) and config.model_type == "bert"
    assert config.get_text_config() is config and config.return_dict and not config.output_hidden_states
    assert config.num_labels == 2 and config.id2label == {0: "LABEL_0", 1: "LABEL_1"}
    config.num_labels = 3
    assert config.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"} and config.label2id["LABEL_2"] == 2
    theirs = transformers.BertConfig.from_dict(config.to_dict())
    for name in ("hidden_size", "num_hidden_layers", "vocab_size", "num_labels", "id2label", "tie_word_embeddings"):
        assert getattr(theirs, name) == getattr(config, name), name
    assert "BertConfig(" in repr(config) and "hidden_size=128" in repr(config)
    assert config.replace(unpad=True).unpad and not config.unpad


def test_a_subclass_with_aliases_reads_and_writes_them_as_transformers_does():
    # BertConfig reads its fields with object's own lookup (no attribute_map); a subclass that declares aliases
    # gets transformers' lookup back, and an alias then reads and writes its target
    class Aliased(BertConfig):
        attribute_map = {"d_model": "hidden_size"}

    config = Aliased(hidden_size=64, num_attention_heads=4)
    assert config.d_model == 64 and config.hidden_size == 64 and config.backend == "auto"
    config.d_model = 128
    assert config.hidden_size == 128 and config.d_model == 128
    with pytest.raises(AttributeError, match="no_such_field"):
        BertConfig.tiny().no_such_field


@pytest.mark.parametrize("model_type", ["gpt2", "roberta", "distilbert"])
def test_other_model_types_are_refused(model_type):
    with pytest.raises(ValueError, match=f"model_type '{model_type}' is not BERT"):
        BertConfig.from_dict({"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4})


def test_overrides_follow_transformers(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "id2label": {"0": "neg", "1": "pos"}}))
    assert BertConfig.from_json(path).id2label == {0: "neg", 1: "pos"}
    assert BertConfig.from_json(path, num_labels=3).id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
    with pytest.raises(TypeError, match="unknown argument.*'device_map'"):
        BertConfig.from_json(path, device_map="auto")  # a loader argument is not a config key
    with pytest.raises(ValueError, match="max_predictions_per_seq"):
        BertConfig(max_predictions_per_seq=-1)
    written = BertConfig.from_json(path, backend="torch", unpad=True, max_predictions_per_seq=20).to_dict()
    assert not {"backend", "unpad", "max_predictions_per_seq"} & set(written)


def test_an_architectures_own_spelling_sets_the_field():
    """transformers' attribute_map sets a field through its alias: ModernBERT's norm_eps is layer_norm_eps,
    DistilBERT's dropout hidden_dropout_prob. replace(), --model.<name> (update_known) and attribute assignment set
    the field the model reads; they set a stray attribute, which config.json wrote and the model never read."""
    from fastbert.family_config import DistilBertConfig, ModernBertConfig
    config = ModernBertConfig.tiny().replace(norm_eps=0.5, attention_dropout=0.25)
    assert config.layer_norm_eps == 0.5 and config.attention_probs_dropout_prob == 0.25
    assert "norm_eps" not in vars(config) and config.to_dict()["norm_eps"] == 0.5
    distilbert = DistilBertConfig()
    distilbert.dropout = 0.3
    assert distilbert.hidden_dropout_prob == 0.3 and distilbert.to_dict()["dropout"] == 0.3
