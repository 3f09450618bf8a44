"""`fastbert convert`: a legacy-format HF directory in, a clean one out, checked against transformers."""
import json

import pytest
import torch

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
    printed = capsys.readouterr().out
    assert "BertForMaskedLM" in printed and "OK" in printed
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
