"""`fastbert convert`: a legacy-format HF directory in, a clean one out, checked against transformers; every
damaged or wrong source is a message (exit code 2) and leaves DST as it was."""
import json
import shutil

import pytest
import torch

import fastbert
from fastbert import cli

transformers = pytest.importorskip("transformers")


def test_convert_cleans_and_checks(tmp_path, capsys):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=48, max_position_embeddings=40)
    hf_model = transformers.BertForMaskedLM(config)
    src = tmp_path / "src"
    hf_model.save_pretrained(src)
    (src / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    assert cli.main(["convert", str(src), str(tmp_path / "dst"), "--check"]) == 0
    printed = capsys.readouterr()
    assert "BertForMaskedLM: " in printed.err and f"wrote {tmp_path / 'dst'}" in printed.err
    assert printed.out.startswith("check against transformers: ") and printed.out.rstrip().endswith("OK")
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    assert (tmp_path / "dst" / "vocab.txt").read_text() == "[PAD]\n[UNK]\n"
    again = transformers.BertForMaskedLM.from_pretrained(tmp_path / "dst")
    for key, value in hf_model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_unknown_command_and_help(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "convert" in capsys.readouterr().out


def small_checkpoint(path, **config):
    torch.manual_seed(0)
    values = dict(vocab_size=90, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
                  max_position_embeddings=40)
    transformers.BertModel(transformers.BertConfig(**{**values, **config})).save_pretrained(path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])


# each case damages a good checkpoint in src (a Path); the message the command must print
BAD_SOURCES = {
    "missing directory": (shutil.rmtree, "no such directory"),
    "a file": (lambda src: (shutil.rmtree(src), src.write_text("x")), "is a file"),
    "no config": (lambda src: (src / "config.json").unlink(), "has no config.json"),
    "garbage config": (lambda src: (src / "config.json").write_text("{nope"), "config.json: not a JSON config"),
    "no weights": (lambda src: (src / "model.safetensors").unlink(), "no model.safetensors or pytorch_model.bin"),
    "garbage weights": (lambda src: (src / "model.safetensors").write_bytes(b"\x00" * 64),
                        "model.safetensors: cannot read the weights"),
    "truncated weights": (lambda src: truncate(src / "model.safetensors", -100),
                          "model.safetensors: cannot read the weights"),
    "shape mismatch": (lambda src: edit_config(src, intermediate_size=64), "tensor shapes do not match the config"),
    "model_type gpt2": (lambda src: edit_config(src, model_type="gpt2"),
                        "model_type 'gpt2' is not an architecture fastbert builds"),
    "model_type t5": (lambda src: edit_config(src, model_type="t5"), "model_type 't5' is not an architecture"),
    "hidden_size a string": (lambda src: edit_config(src, hidden_size="32"),
                             "src/config.json: BertConfig.hidden_size must be an integer, got '32' (str)"),
    "num_attention_heads null": (lambda src: edit_config(src, num_attention_heads=None),
                                 "src/config.json: BertConfig.num_attention_heads must be an integer, got null"),
    "more layers than weights": (lambda src: edit_config(src, num_hidden_layers=3),
                                 "num_hidden_layers=3 but the weights hold 1 layer(s) (0); missing encoder.layer.1, "
                                 "encoder.layer.2"),
}


@pytest.mark.parametrize("case", sorted(BAD_SOURCES))
def test_convert_errors_are_messages_and_leave_dst(tmp_path, capsys, case):
    src = small_checkpoint(tmp_path / "src")
    dst = tmp_path / "dst"
    assert cli.main(["convert", str(src), str(dst)]) == 0
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    capsys.readouterr()
    damage, message = BAD_SOURCES[case]
    damage(src)
    assert cli.main(["convert", str(src), str(dst), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastbert convert: error:") and message in err and "Traceback" not in err, err
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before


def test_convert_refuses_to_write_over_its_source(tmp_path, capsys):
    src = small_checkpoint(tmp_path / "src")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    assert cli.main(["convert", str(src), str(src) + "/"]) == 2
    assert "DST" in capsys.readouterr().err and {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_convert_refuses_to_drop_a_head_that_config_json_does_not_name(tmp_path, capsys):
    """A classifier checkpoint whose config.json lost its architectures converted as BertModel (the default class)
    and dropped the classifier with a warning, --check printing OK: now refused naming the tensors, unless the
    class is given."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=48, max_position_embeddings=40, num_labels=3)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "src")
    values = json.loads((tmp_path / "src" / "config.json").read_text())
    del values["architectures"]
    (tmp_path / "src" / "config.json").write_text(json.dumps(values))
    assert cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--check"]) == 2
    err = capsys.readouterr().err
    assert "holds 2 tensors that BertModel has no place for (classifier.bias, classifier.weight)" in err
    assert not (tmp_path / "dst").exists()
    argv = ["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--model-class", "BertForSequenceClassification"]
    assert cli.main([*argv, "--check"]) == 0


def test_a_checkpoint_that_names_its_class_is_copied_as_that_class(tmp_path):
    """bert-base-uncased's config.json names BertForMaskedLM while its weights also hold the pooler and the NSP head:
    the class named is what is copied (the weights it has no place for left, as transformers leaves them)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=48, max_position_embeddings=40)
    transformers.BertForPreTraining(config).save_pretrained(tmp_path / "src")
    values = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**values, "architectures": ["BertForMaskedLM"]}))
    assert cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--check"]) == 0
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]


def test_a_base_model_saved_without_its_pooler_converts_and_loads_without_one(tmp_path, capsys):
    """transformers' BertModel(add_pooling_layer=False) checkpoint: convert refused it (the pooler's weights
    missing), and from_pretrained(add_pooling_layer=False), which transformers takes, was a TypeError."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=48, max_position_embeddings=40)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(tmp_path / "src")
    assert cli.main(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--check"]) == 0
    assert "OK" in capsys.readouterr().out
    for source in ("src", "dst"):
        model, info = fastbert.BertModel.from_pretrained(tmp_path / source, add_pooling_layer=False,
                                                         output_loading_info=True)
        assert model.pooler is None and not info["missing_keys"] and not info["unexpected_keys"]
    with pytest.raises(TypeError, match="BertForMaskedLM does not take"):
        fastbert.BertForMaskedLM.from_pretrained(tmp_path / "src", add_pooling_layer=False)


def test_convert_copies_added_tokens(tmp_path):
    """added_tokens.json is a tokenizer file transformers reads beside vocab.txt: DST lost the added tokens."""
    src = small_checkpoint(tmp_path / "src")
    (src / "added_tokens.json").write_text(json.dumps({"[NEW]": 89}))
    assert cli.main(["convert", str(src), str(tmp_path / "dst")]) == 0
    assert (tmp_path / "dst" / "added_tokens.json").read_text() == (src / "added_tokens.json").read_text()


def test_convert_keeps_the_dtype_the_weights_are_stored_in(tmp_path):
    """A config.json whose dtype is not its weights' (fp32 tensors under "dtype": "bfloat16", as checkpoints saved
    after a cast of the config alone have it): dtype="auto" loads in the config's, and convert wrote bf16, rounding
    every weight; it copies them as stored."""
    from safetensors.torch import load_file
    src = small_checkpoint(tmp_path / "src")
    edit_config(src, dtype="bfloat16")
    assert cli.main(["convert", str(src), str(tmp_path / "dst")]) == 0
    written, stored = (load_file(path / "model.safetensors") for path in (tmp_path / "dst", src))
    assert all(written[key].dtype == torch.float32 and torch.equal(written[key], stored[key]) for key in stored)
