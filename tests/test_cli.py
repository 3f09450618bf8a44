"""The `fastbert` command's papercuts (issue 12, item 8): --version, one-phase pretraining without
--phase-fractions, messages through the `fastbert` logger with argparse-style error lines, --model that
is not a checkpoint directory, --device cuda without CUDA, any positive --learning-rate."""
import logging
import os
import subprocess
import sys

import pytest
import torch

from fastbert import __version__, cli
from fastbert.finetune import cli as finetune_cli
from fastbert.train import options, run


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


def test_run_command_reports_user_errors_through_the_fastbert_logger(capsys):
    def body():
        logging.getLogger("fastbert.data").info("progress line")
        raise ValueError("--thing 3 is wrong")

    assert cli.run_command("prepare-data", body) == 2
    assert capsys.readouterr().err.splitlines() == ["progress line", "fastbert prepare-data: error: --thing 3 is wrong"]

    def bug():
        raise KeyError("a programming error keeps its traceback")

    with pytest.raises(KeyError):
        cli.run_command("prepare-data", bug)


@pytest.mark.parametrize("command", ["finetune", "embed"])
@pytest.mark.parametrize("model, message", [("bert-base-uncased", "bert-base-uncased: no such directory; it takes a "
                                                                  "local BERT checkpoint directory"),
                                            ("FILE", "is a file; it takes a local BERT checkpoint directory")])
def test_model_that_is_not_a_checkpoint_directory_says_what_is_accepted(tmp_path, capsys, command, model, message):
    data = tmp_path / "data.tsv"
    data.write_text("sentence\tlabel\na b\t1\nc d\t0\n")
    model = str(data) if model == "FILE" else model
    argv = {"finetune": ["--task", "classification", "--train", str(data), "--out", str(tmp_path / "out")],
            "embed": ["--input", str(data), "--out", str(tmp_path / "f.npy")]}[command]
    assert cli.main([command, "--model", model, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastbert {command}: error: --model ") and message in err and "hub id" in err
    assert os.listdir(tmp_path) == ["data.tsv"]


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
        with pytest.raises(ValueError, match="learning_rate must be a positive number"):
            config.validate()
