"""The `fastbert` command's papercuts (issue 12, item 8): --version, one-phase pretraining without
--phase-fractions, messages through the `fastbert` logger with argparse-style error lines."""
import logging
import subprocess
import sys

import pytest

from fastbert import __version__, cli
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
