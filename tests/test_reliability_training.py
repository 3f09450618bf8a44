"""Training faults from issue #14, each with what fastbert does about it (docs/reliability.md lists them):
checkpoints a new run cannot destroy, resumes that refuse a changed run, metrics that survive a crash,
non-finite runs that point at a good checkpoint. Small models on CPU."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from fastbert import BertForPreTraining
from fastbert.data import prepare
from fastbert.data.shards import ShardedDataset
from fastbert.files import output_lock
from fastbert.train import pretrain
from tests.full_disk import resize, run_fastbert, small_disk
from tests.test_data import write_corpus
from tests.test_pretrain import SMALL, config, data, losses  # noqa: F401  (data: the module's dataset fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def checkpoint_steps(out):
    return sorted(int(name.split("_")[1]) for name in os.listdir(os.path.join(out, "checkpoints"))
                  if name.startswith("step_"))


def test_first_metrics_line_after_a_resume_averages_the_uninterrupted_runs_steps(data, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    pretrain.train(config(data, whole, log_every=2), SMALL)
    pretrain.train(config(data, parts, log_every=2, stop_at=3), SMALL)  # stops between two metrics lines
    pretrain.train(config(data, parts, log_every=2), SMALL)
    assert [r["step"] for r in losses(parts)] == [2, 4, 6]
    assert losses(parts) == losses(whole)  # step 4's line averages steps 3 and 4, not 4 alone


def test_a_resume_from_a_checkpoint_at_a_logging_step_logs_the_uninterrupted_runs_lines(data, tmp_path):
    """A checkpoint saved at a step that also wrote a metrics line (the defaults: --log-every 10, --save-every
    1000) carries no window: the first line after a resume from it averages the steps after it alone."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    pretrain.train(config(data, whole, log_every=2, save_every=2, keep_checkpoints=10), SMALL)
    shutil.copytree(whole, parts)
    for step in checkpoint_steps(parts)[1:]:  # as a run killed once step 2's checkpoint was written
        shutil.rmtree(parts / "checkpoints" / f"step_{step:08d}")
    pretrain.train(config(data, parts, log_every=2, save_every=2, keep_checkpoints=10), SMALL)
    assert [r["step"] for r in losses(parts)] == [2, 4, 6]
    assert losses(parts) == losses(whole)  # step 4's line averages steps 3 and 4, not 1 to 4


def test_non_finite_stop_names_the_checkpoint_before_the_bad_steps_and_saves_none_during_them(
        data, tmp_path, monkeypatch):
    forward = BertForPreTraining.forward

    def diverging_forward(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        diverging_forward.calls = getattr(diverging_forward, "calls", 0) + 1
        if diverging_forward.calls >= 3:  # from step 3 on
            output.mlm_loss = output.mlm_loss * float("nan")
        return output

    monkeypatch.setattr(BertForPreTraining, "forward", diverging_forward)
    with pytest.raises(pretrain.TrainingError) as error:
        pretrain.train(config(data, tmp_path, save_every=1, keep_checkpoints=10, max_bad_steps=3), SMALL)
    assert "steps 3 to 5" in str(error.value)
    assert f"{os.path.join(tmp_path, 'checkpoints', 'step_00000002')}. Lower --lr" in str(error.value)
    assert checkpoint_steps(tmp_path) == [1, 2]


def test_a_run_that_ends_inside_non_finite_steps_fails_naming_the_learning_rate(data, tmp_path, capsys):
    """--lr 1e30: every step after the first is non-finite; fewer than --max-bad-steps, so the run reaches its
    end, where no checkpoint can be written: exit 1 and one message naming --lr, never 'done'."""
    argv = ["--data", data, "--out", str(tmp_path), "--steps", "5", "--batch-size", "8", "--seq-lengths", "16",
            "--no-progress", "--peak-tflops", "1", "--device", "cpu", "--lr", "1e30"]
    assert pretrain.main(argv + [x for k, v in SMALL.items() for x in (f"--model.{k}", str(v))]) == 1
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if ": error: " in line]
    assert errors == ["fastbert pretrain: error: 4 consecutive steps had a non-finite loss or gradient (steps 2 to 5); "
                      "the run ended inside them, unsaved; no checkpoint was saved before them. Lower --lr (it is "
                      "1e+30), use --precision bf16 or fp32, or check the data"]
    assert "done" not in captured.out + captured.err and not os.path.exists(tmp_path / "checkpoints")


def test_a_fresh_start_moves_the_previous_run_aside_and_keeps_its_own_checkpoints(data, tmp_path):
    pretrain.train(config(data, tmp_path, save_every=2), SMALL)  # the old run: checkpoints 4 and 6 kept
    old_metrics = (tmp_path / "metrics.jsonl").read_text()
    result = pretrain.train(config(data, tmp_path, save_every=2, resume="never", stop_at=3), SMALL)
    assert result["checkpoint"].endswith("step_00000003")
    assert checkpoint_steps(tmp_path) == [2, 3]  # the new run's, not the old run's higher steps
    previous = tmp_path / "previous" / "1"
    assert checkpoint_steps(previous) == [4, 6] and (previous / "metrics.jsonl").read_text() == old_metrics
    assert [r["step"] for r in losses(tmp_path)] == [1, 2, 3]


def test_a_rollback_keeps_its_start_point_and_sets_the_later_steps_aside(data, tmp_path):
    pretrain.train(config(data, tmp_path, save_every=1, keep_checkpoints=3), SMALL)  # 4, 5 and 6 kept
    start = os.path.join(tmp_path, "checkpoints", "step_00000004")
    rolled = pretrain.train(config(data, tmp_path, save_every=1, resume=start, lr=5e-4), SMALL)
    assert rolled["step"] == 6
    assert checkpoint_steps(tmp_path) == [4, 5, 6]  # keep 2, and the start point
    assert checkpoint_steps(tmp_path / "previous" / "1") == [5, 6]
    assert [r["step"] for r in losses(tmp_path / "previous" / "1")] == [1, 2, 3, 4, 5, 6]
    again = pretrain.train(config(data, tmp_path, resume=start, lr=5e-4), SMALL)  # the start point still resumes
    assert again["step"] == 6


@pytest.fixture(scope="module")
def stopped_run(data, tmp_path_factory):
    """A run stopped at step 2 (of 6, two phases)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    pretrain.train(config(data, out, stop_at=2), SMALL)
    return out


@pytest.fixture
def resumable(stopped_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(stopped_run, copy)
    return copy


@pytest.fixture(scope="module")
def other_data(tmp_path_factory):
    """The same corpus prepared again with another seed: the same vocabulary size, other examples."""
    root = tmp_path_factory.mktemp("other")
    corpus = write_corpus(root / "corpus.txt", documents=20, sentences=10)
    prepare.prepare_dataset([corpus], str(root / "data"), vocab_size=120, max_seq_lengths=(16, 32), seed=7)
    return str(root / "data")


def cli(data, out, *extra):
    args = ["--data", data, "--out", str(out), "--model", "tiny", "--steps", "6", "--batch-size", "8", "--seq-lengths",
            "16,32", "--phase-fractions", "0.5,0.5", "--log-every", "1", "--no-progress", "--peak-tflops", "1",
            "--device", "cpu", "--lr", "0.001", *extra]
    return args + [x for k, v in SMALL.items() if f"--model.{k}" not in extra for x in (f"--model.{k}", str(v))]


@pytest.mark.parametrize("change,message", [
    (["--batch-size", "16"], "--batch-size: checkpoint 8, now 16"),
    (["--seed", "7"], "--seed: checkpoint 12345, now 7"),
    (["--optimizer", "lamb"], "--optimizer: checkpoint 'adamw', now 'lamb'"),
    (["--model.hidden_dropout_prob", "0.2"], "--model.hidden_dropout_prob: checkpoint 0.1, now 0.2"),
    (["--model.hidden_size", "64"], "the model differs in shape (--model.hidden_size: checkpoint 32, now 64)"),
    (["--model.num_hidden_layers", "2"], "--model.num_hidden_layers: checkpoint 1, now 2"),
    # a tied checkpoint holds no decoder to load (an untied resume trained uninitialised memory: NaN)
    (["--model.tie_word_embeddings", "false"], "--model.tie_word_embeddings: checkpoint True, now False"),
])
def test_a_resume_that_would_not_continue_the_run_is_refused_naming_the_option(data, resumable, capsys, change,
                                                                               message):
    options = (resumable / "config.json").read_text()
    assert pretrain.main(cli(data, resumable, *change)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert checkpoint_steps(resumable) == [2] and not (resumable / "previous").exists()  # nothing touched
    assert (resumable / "config.json").read_text() == options


def test_a_resume_on_other_data_is_refused(data, other_data, resumable, capsys):
    lengths = (16, 32)
    assert [ShardedDataset(f"{other_data}/seq{n}").vocab_size for n in lengths] == \
        [ShardedDataset(f"{data}/seq{n}").vocab_size for n in lengths]  # the model fits either
    assert pretrain.main(cli(other_data, resumable)) == 2
    assert "--data: the length-16 dataset is not the one the checkpoint's run read" in capsys.readouterr().err


def test_accept_changes_resumes_anyway_and_says_what_changed(data, resumable, caplog):
    assert pretrain.main(cli(data, resumable, "--batch-size", "16", "--accept-changes")) == 0
    assert "resuming with a change (--accept-changes): --batch-size: checkpoint 8, now 16" in caplog.text
    assert [r["step"] for r in losses(resumable)] == [1, 2, 3, 4, 5, 6]


def test_a_changed_learning_rate_or_length_is_honoured_and_logged(data, resumable, caplog):
    assert pretrain.main(cli(data, resumable, "--lr", "0.002", "--steps", "8")) == 0
    assert "resuming with --lr 0.002 (the checkpoint's run had 0.001)" in caplog.text
    assert "resuming with --steps 8 (the checkpoint's run had 6)" in caplog.text
    records = {r["step"]: r for r in losses(resumable)}
    assert sorted(records) == list(range(1, 9))
    warmup = max(round(0.01 * 8), 1)  # linear decay to 0 at the new last step, from the new peak
    assert records[3]["lr"] == pytest.approx(0.002 * (8 - 3) / (8 - warmup))  # the line of step s shows factor(s)
    assert json.load(open(resumable / "config.json"))["lr"] == 0.002


def test_a_longer_run_that_would_go_back_a_phase_is_refused(data, tmp_path, capsys):
    """Stopped in phase 2 (step 4 of 6, phases ending at step 3), resumed with --steps 12: phase 1 would now end at
    step 6, so steps 5 and 6 would read phase 1's examples again from its start, and the length go back to 16. It is
    refused naming the options, nothing touched; with phase fractions that end phase 1 by step 4 it resumes."""
    out = tmp_path / "run"
    pretrain.train(config(data, out, stop_at=4), SMALL)
    assert pretrain.main(cli(data, out, "--steps", "12")) == 2
    err = capsys.readouterr().err
    assert "with --steps 12 and --phase-fractions '0.5,0.5': step 5 would fall in phase 1 (length 16)" in err
    assert checkpoint_steps(out) == [4] and not (out / "previous").exists()
    assert pretrain.main(cli(data, out, "--steps", "12", "--phase-fractions", "0.25,0.75")) == 0
    assert [(r["step"], r["seq_length"]) for r in losses(out)][3:6] == [(4, 32), (5, 32), (6, 32)]


def test_two_runs_cannot_share_a_run_directory(data, tmp_path, capsys):
    out = tmp_path / "run"
    with output_lock(str(out)):  # as another run holds it
        assert pretrain.main(cli(data, out)) == 2
    err = capsys.readouterr().err
    assert f"{out} is being written by another fastbert process" in err
    assert not out.exists() or not os.listdir(out)


# the command, with files past a size limit refused (EFBIG, as a full disk refuses them with ENOSPC) from the end
# of the first checkpoint on
LIMITED_AFTER_THE_FIRST_CHECKPOINT = textwrap.dedent("""
    import resource, sys
    from fastbert.train import checkpoint, pretrain
    save, limit = checkpoint.save_checkpoint, int(sys.argv[1])

    def save_then_limit(*args, **kwargs):
        path = save(*args, **kwargs)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        return path

    checkpoint.save_checkpoint = save_then_limit
    sys.exit(pretrain.main(sys.argv[2:]))
""")


def assert_checkpoint_not_saved(result, reason, out):
    """The message of a checkpoint that did not fit (step 4, after step 2's), exit 2, and nothing of it left."""
    checkpoints = os.path.join(out, "checkpoints")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    space = r"it needs about [\d.]+ KiB, [\d.]+ \w+ free there; free some space or choose another output"
    previous = re.escape(os.path.join(checkpoints, "step_00000002"))
    assert re.search(rf"error: \[Errno \d+\] {reason} while writing {re.escape(checkpoints)}/step_00000004 \({space}\); "
                     rf"the checkpoint of step 4 was not saved; the previous checkpoint {previous} is intact, and the "
                     "same command resumes from it", result.stderr), result.stderr
    assert os.listdir(checkpoints) == ["step_00000002"]  # no partial checkpoint left behind
    assert torch.load(os.path.join(checkpoints, "step_00000002", "trainer.pt"), weights_only=False)["step"] == 2


@pytest.mark.parametrize("limit", [30_000, 100_000], ids=["model.safetensors", "trainer.pt"])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_says_so(data, tmp_path, limit):
    """Without a mount: from step 4's checkpoint on, files past `limit` bytes fail as on a full disk, in
    safetensors' writer (its own error type) or in torch.save's (a RuntimeError, 'unexpected pos')."""
    out = tmp_path / "run"
    argv = cli(data, out, "--save-every", "2", "--threads", "1")
    assert_checkpoint_not_saved(run_fastbert([str(limit), *argv], code=LIMITED_AFTER_THE_FIRST_CHECKPOINT),
                                "File too large", out)
    assert pretrain.main(argv) == 0 and checkpoint_steps(out) == [4, 6]  # and the run resumes from it


def test_a_full_tmpfs_during_a_save_keeps_the_previous_checkpoint_and_says_so(data, tmp_path):
    """The issue's case: step 2's checkpoint (about 260 KiB) fits, step 4's trainer.pt does not."""
    with small_disk(tmp_path / "disk", "400k") as disk:
        argv = cli(data, disk / "run", "--save-every", "2", "--threads", "1")
        assert_checkpoint_not_saved(run_fastbert(["pretrain", *argv]), "No space left on device", disk / "run")
        resize(disk, "4m")
        assert pretrain.main(argv) == 0 and checkpoint_steps(disk / "run") == [4, 6]


def zero_inside(data: bytes) -> bytes:
    """4 KiB zeroed in the middle, the size kept: a torn page, which torch.load and safetensors read."""
    middle = len(data) // 2
    return data[:middle] + bytes(4096) + data[middle + 4096:]


@pytest.mark.parametrize("file,damage", [("trainer.pt", lambda data: data[:300]),
                                         ("model/model.safetensors", lambda data: data[:300]),
                                         ("run.json", lambda data: data[:300]),
                                         ("trainer.pt", zero_inside), ("model/model.safetensors", zero_inside)],
                         ids=["trainer-truncated", "model-truncated", "run-truncated", "trainer-torn",
                              "model-torn"])
def test_a_damaged_newest_checkpoint_names_the_file_and_the_previous_one(data, tmp_path, capsys, file, damage):
    argv = cli(data, tmp_path, "--save-every", "2")
    assert pretrain.main([*argv, "--stop-at", "4"]) == 0
    damaged = tmp_path / "checkpoints" / "step_00000004" / file
    damaged.write_bytes(damage(damaged.read_bytes()))
    capsys.readouterr()
    assert pretrain.main(argv) == 2
    err = capsys.readouterr().err
    previous = tmp_path / "checkpoints" / "step_00000002"
    assert f"the checkpoint {damaged.parents[1 if '/' in file else 0]} is damaged: {damaged} cannot be read (" in err
    assert f"; resume from the previous one with --resume {previous}, or start afresh with --resume never" in err
    assert "Traceback" not in err
    assert pretrain.main([*argv, "--resume", str(previous)]) == 0 and checkpoint_steps(tmp_path)[-1] == 6


def test_a_checkpoint_without_digests_resumes_unchecked(data, tmp_path):
    """Checkpoints written before fastbert recorded digests.json resume as before."""
    argv = cli(data, tmp_path, "--save-every", "2")
    assert pretrain.main([*argv, "--stop-at", "4"]) == 0
    (tmp_path / "checkpoints" / "step_00000004" / "digests.json").unlink()
    assert pretrain.main(argv) == 0 and checkpoint_steps(tmp_path)[-1] == 6
    assert (tmp_path / "checkpoints" / "step_00000006" / "digests.json").is_file()


def test_a_second_ctrl_c_stops_at_once_with_a_message_not_a_traceback(data, tmp_path, capsys, monkeypatch):
    step = pretrain.train_step

    def interrupted_twice_in_step_4(*args, **kwargs):
        interrupted_twice_in_step_4.calls = getattr(interrupted_twice_in_step_4, "calls", 0) + 1
        if interrupted_twice_in_step_4.calls == 4:
            os.kill(os.getpid(), signal.SIGINT)  # asks for a checkpoint at the next step
            os.kill(os.getpid(), signal.SIGINT)  # stops at once
        return step(*args, **kwargs)

    monkeypatch.setattr(pretrain, "train_step", interrupted_twice_in_step_4)
    # restored afterwards: Python's default_int_handler, or SIG_IGN in a process started in the background
    handler = signal.getsignal(signal.SIGINT)
    try:
        assert pretrain.main(cli(data, tmp_path, "--save-every", "2")) == 130
    except KeyboardInterrupt:  # which would stop pytest itself
        pytest.fail("the KeyboardInterrupt reached the command's caller: a traceback")
    previous = tmp_path / "checkpoints" / "step_00000002"
    assert capsys.readouterr().err.endswith("error: interrupted by a second Ctrl-C: stopped at once, without a "
                                            f"checkpoint; the same command resumes from {previous}\n")
    assert checkpoint_steps(tmp_path) == [2] and signal.getsignal(signal.SIGINT) is handler


def test_a_truncated_last_metrics_line_is_dropped_with_a_warning(data, resumable, caplog):
    metrics = resumable / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "loss": 5.')  # a crash while writing step 3's line
    assert pretrain.main(cli(data, resumable)) == 0
    assert "dropped its last line, cut short" in caplog.text
    assert [r["step"] for r in losses(resumable)] == [1, 2, 3, 4, 5, 6]


def test_after_a_kill_and_a_resume_each_step_has_one_metrics_row_the_resumed_runs(data, tmp_path):
    """kill -9 while rows past the newest checkpoint are written; the resumed run replaces those rows."""
    out, args = tmp_path / "run", ["--steps", "100000", "--save-every", "3", "--seq-lengths", "16", "--phase-fractions",
                                   "1"]
    killed = subprocess.Popen([sys.executable, "-m", "fastbert.cli", "pretrain", *cli(data, out, *args)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        # wait for a checkpoint and rows past a multiple of --save-every
        while time.time() < deadline and not (saved_steps(out) and len(metrics_rows(out)) >= 8
                                               and len(metrics_rows(out)) % 3):
            time.sleep(0.05)
    finally:
        killed.kill()
        killed.wait()
    before = losses(out)
    saved = max(checkpoint_steps(out))
    assert before[-1]["step"] > saved, "the kill came too late to leave rows past the checkpoint"
    last = before[-1]["step"] + 2
    assert pretrain.main(cli(data, out, *args, "--stop-at", str(last))) == 0
    after = losses(out)
    assert [r["step"] for r in after] == list(range(1, last + 1))  # one row per step
    assert after[:saved] == before[:saved]


def saved_steps(out):
    return checkpoint_steps(out) if os.path.isdir(os.path.join(out, "checkpoints")) else []


def metrics_rows(out):
    """The complete lines of a running run's metrics.jsonl."""
    try:
        return [line for line in open(os.path.join(out, "metrics.jsonl")) if line.endswith("\n")]
    except FileNotFoundError:
        return []


def test_a_corrupt_metrics_line_is_an_error_naming_the_file_and_line(data, resumable, capsys):
    metrics = resumable / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("garbage\n" + "".join(lines))
    assert pretrain.main(cli(data, resumable)) == 2
    assert f"{metrics}, line 1: not a metrics record" in capsys.readouterr().err


SIGNALLED_RANK = textwrap.dedent("""
    import json, os, signal, sys, torch.distributed as dist
    from fastbert.command import configure_logging
    from fastbert.train import pretrain
    data, out, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    configure_logging("pretrain")
    dist.init_process_group("gloo")
    step = pretrain.train_step

    def signalled_at_step_2(*args, **kwargs):  # rank 1 alone gets a SIGTERM during its second step
        signalled_at_step_2.calls = getattr(signalled_at_step_2, "calls", 0) + 1
        if signalled_at_step_2.calls == 2 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*args, **kwargs)

    pretrain.train_step = signalled_at_step_2
    result = pretrain.train(pretrain.PretrainConfig(data=data, out=out, model="tiny", steps=50, batch_size=8,
                                                    seq_lengths="16", log_every=1, progress=False, peak_tflops=1.0,
                                                    device="cpu"), overrides)
    print("\\n".join(result["report"]))  # as the command prints its result: rank 0's lines, none from rank 1
    dist.destroy_process_group()
""")


@pytest.mark.slow(reason="end-to-end pretraining runs under torchrun, two processes")
def test_sigterm_to_one_rank_stops_every_rank_and_rank_0_names_the_signal(data, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(SIGNALLED_RANK)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(worker), data, str(tmp_path / "run"), json.dumps(SMALL)],
                         capture_output=True, text=True, env=env, timeout=280)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert run.stdout.count("stopped at step 2 (signal)") == 1 and "--stop-at" not in output
    assert checkpoint_steps(tmp_path / "run") == [2]
