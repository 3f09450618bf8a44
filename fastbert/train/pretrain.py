"""`fastbert pretrain`: BERT pretraining (masked LM + next sentence prediction, or the masked LM alone with
--objective mlm), one process or many. DESCRIPTION below is the command's help; options.py holds the options
and the presets.

Loss normalisation: the MLM loss is the mean over all masked tokens of the global batch and the NSP
loss (mlm+nsp) the mean over its sequences, whatever the number of ranks and micro-batches: each micro-batch
contributes its sums divided by the global counts, so a run on N ranks with accumulation computes
the gradient of a 1-rank run on the same global batch.

The parts: options.py (the options), run.py (set-up), step.py (one step), metrics.py (accounting),
state.py and checkpoint.py (checkpoints and resume); this file holds the loop and the command.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
import threading

import torch
from tqdm import tqdm

from fastbert.data.loader import PretrainingLoader, prefetch
from fastbert.data.shards import VOCAB_FILE
from fastbert.hf import small_weight_layer_norms, small_weights_text
from fastbert.train import checkpoint, distributed, state
from fastbert.train.metrics import MetricsLog, Window, measure_peak_flops
from fastbert.train.options import PretrainConfig, parse_args
from fastbert.train.run import Run, build_run, write_run_config
from fastbert.train.step import HostStats, host_stats, train_step

__all__ = ["PretrainConfig", "TrainingError", "train", "main"]
logger = logging.getLogger("fastbert.train")

DESCRIPTION = """BERT pretraining (masked LM + next sentence prediction), one process or many.

    fastbert pretrain                                   # the demo: a small model learns on a CPU
    fastbert pretrain --data data/ --model base --steps 1000000 --batch-size 256
    fastbert pretrain --objective mlm --data mlm-data/ --model roberta/config.json   # no NSP, as RoBERTa
    torchrun --nproc_per_node=8 -m fastbert.cli pretrain --data data/ --model large --distributed fsdp
    fastbert pretrain --config run.json --lr 2e-4 --model.hidden_dropout_prob 0.0

--objective mlm+nsp (the default, the paper's) trains BertForPreTraining on [CLS] A [SEP] B [SEP] pairs;
--objective mlm trains the masked-LM model alone (no NSP head or loss) on full sentences packed across
documents, from `fastbert prepare-data --objective mlm` (a dataset made for one objective is refused by the
other). Either way each example gets a new mask every epoch, drawn from the run's seed.

Options start from a preset (--preset: the demo on the built-in corpus, the paper's recipe on your --data),
then --config FILE (JSON of the options below), then flags; --model.<field> VALUE sets a field of the
model's config.json. Outputs go to ./runs/<model>-<data>/ (or --run-name, --out): metrics.jsonl (one JSON
object per logged step), config.json (the run's options) and checkpoints/step_N/model/ (HF format).
Running the same command again resumes from the newest checkpoint, exactly. The results (the last metrics,
the checkpoint, the command that fine-tunes it) go to stdout, progress and messages to stderr."""


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row); the message says why."""


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C stopped the run at once; the message says where it resumes from."""


# SIGTERM / SIGINT ask for a checkpoint at the next step boundary; a second SIGINT interrupts at once.
STOP = threading.Event()


def _request_stop(signum, frame):
    if STOP.is_set() and signum == signal.SIGINT:
        raise KeyboardInterrupt
    STOP.set()


@contextlib.contextmanager
def stop_signals():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class PhaseBatches:
    """This rank's micro-batches and their HostStats, step after step, prepared ahead in a background
    thread; a new phase starts reading its own dataset from the beginning."""

    def __init__(self, run: Run, progress: state.Progress):
        self.run, self.progress = run, progress
        self.phase_index: int | None = None
        self.stream = None

    def next(self) -> tuple[list[dict], HostStats]:
        run, progress = self.run, self.progress
        index = run.phase_of(progress.step)
        if index != self.phase_index:
            if self.phase_index is not None:
                progress.position = 0
                self.stream.close()
            self.phase_index = index
            phase = run.phases[index]
            loader = PretrainingLoader(phase.dataset, phase.collator, run.cfg.batch_size, phase.micro_batch_size,
                                       run.env.rank, run.env.world_size, run.cfg.seed, index)
            steps = ((batches, host_stats(batches, run.config, phase.collator.mask_id, run.cfg.objective))
                     for batches in loader.steps(progress.position))
            self.stream = prefetch(steps, run.cfg.prefetch, run.env.device.type == "cuda")
        micro_batches, host = next(self.stream)
        # a static number of MLM rows per sequence (no host sync); more for a batch whose whole-word masking
        # took a long first word
        run.model.config.max_predictions_per_seq = max(run.phases[index].label_budget, host.most_labelled)
        return micro_batches, host

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def _agree(run: Run, host: HostStats, step: int) -> tuple[float, float, str | None]:
    """The global batch's masked tokens and, of those, the ones shown as [MASK], and why the ranks stop
    before this step if they do: "signal" when any rank was sent one, "--stop-at" when the step is
    reached. A host collective, every step."""
    at_stop = bool(run.cfg.stop_at and step >= run.cfg.stop_at)
    masked, shown_masked, signals, stop_at = distributed.host_sum(
        [float(sum(host.masked)), float(sum(host.shown_masked)), float(STOP.is_set()), float(at_stop)], run.env)
    return masked, shown_masked, "signal" if signals else "--stop-at" if stop_at else None


def _take_reading(run: Run, progress: state.Progress, window: Window, saver: state.Saver):
    """Read the window (the loop's one wait for the device), count the skipped and bad steps, stop the run
    after --max-bad-steps bad steps in a row or when a checkpoint could not be written."""
    saver.check()
    reading = window.read()
    progress.skipped += reading.skipped
    for step, bad in reading.bad:
        progress.bad_in_row = progress.bad_in_row + 1 if bad else 0
        if progress.bad_in_row >= run.cfg.max_bad_steps:
            saver.wait()
            raise _non_finite_error(run, progress.bad_in_row, step, "stopping")
    bad_steps = [step for step, bad in reading.bad if bad]
    if bad_steps:
        run.warning(f"step{'s' if len(bad_steps) > 1 else ''} {', '.join(map(str, bad_steps))}: non-finite loss or "
                    f"gradient; update skipped ({progress.bad_in_row} in a row now, {progress.skipped} skipped in all)")
    return reading


def _non_finite_error(run: Run, bad_in_row: int, step: int, what_now: str) -> TrainingError:
    """The error of a run that cannot go on past `bad_in_row` non-finite steps ending at `step`: where the
    last good checkpoint is, and what to change."""
    first = step - bad_in_row + 1
    before = checkpoint.latest_checkpoint(run.checkpoints, before=first)
    saved = f"the last checkpoint saved before them is {before}" if before else "no checkpoint was saved before them"
    # training can push LayerNorm weights below what the default backward takes: then every gradient is NaN
    small = small_weight_layer_norms(run.model) if run.model.config.layer_norm_backward == "output" else {}
    cure = (f"; {small_weights_text(small)}: run again with --model.layer_norm_backward input "
            "(BertConfig layer_norm_backward='input')" if small else "")
    return TrainingError(f"{bad_in_row} consecutive steps had a non-finite loss or gradient (steps {first} to "
                         f"{step}); {what_now}; {saved}{cure}. Lower --lr (it is {run.cfg.lr:g}), use --precision "
                         "bf16 or fp32, or check the data")


def _save(run: Run, saver: state.Saver, progress: state.Progress, reading, last: bool = False) -> bool:
    """Checkpoint progress.step, unless inside a run of bad steps (its weights may be what made them bad)."""
    if progress.bad_in_row:
        run.warning(f"no checkpoint at step {progress.step}: the last {progress.bad_in_row} steps were non-finite")
        return False
    progress.window = Window.carry(reading)
    saver.save(progress, last)
    return True


def train(cfg: PretrainConfig, model_overrides: dict | None = None) -> dict:
    """Run (or resume) pretraining; returns {"step", "out", "checkpoint", "stopped", "skipped_steps", "model",
    "report"} (model: the trained model, run.model_class's, its parameters sharded under FSDP2; report: the lines
    the command prints as its result on rank 0, none elsewhere).

    Raises ValueError for bad options or data (OSError for files that cannot be written), TrainingError
    when the run cannot go on, Interrupted (a KeyboardInterrupt) at a second Ctrl-C.
    """
    STOP.clear()
    run = build_run(cfg, dict(model_overrides or {}))
    budget = run.model.config.max_predictions_per_seq  # the loop sets it per batch; the returned model keeps this
    try:
        progress = state.restore(run) if run.resume else state.start(run)
        write_run_config(run)
        if progress.step >= cfg.steps:  # the result is the finished run's: its model and how to fine-tune it
            report = [f"the run in {run.out} is already complete at step {progress.step}; use --run-name or --out "
                      "to start a new one", _finetune_hint(run, os.path.join(run.resume, state.MODEL_DIR))]
            return {**_result(run, progress, run.resume, stopped=None), "report": report if run.env.is_main else []}
        with contextlib.closing(state.Saver(run)) as saver, torch_threads(cfg.threads):
            return _train(run, progress, saver)
    except KeyboardInterrupt:  # a second Ctrl-C (the first asks for a checkpoint at the next step)
        path = checkpoint.latest_checkpoint(run.checkpoints)  # the saver's write in progress has been joined
        resume = f"the same command resumes from {path}" if path else "no checkpoint was saved"
        raise Interrupted(f"interrupted by a second Ctrl-C: stopped at once, without a checkpoint; {resume}") from None
    finally:
        run.model.config.max_predictions_per_seq = budget
        run.close()


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's intra-op threads set to `count` (0: left as they are) while the block runs, then restored."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count or previous)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _train(run: Run, progress: state.Progress, saver: state.Saver) -> dict:
    cfg = run.cfg
    metrics = MetricsLog(run.metrics_file, run.env.is_main, progress.step if run.resume else None)
    _log_start(run)
    peak = (cfg.peak_tflops * 1e12 or measure_peak_flops(run.env.device, run.dtype)) * run.env.world_size
    window = Window(run.env.device, lambda t: distributed.all_reduce_sum(t, run.env), progress.window,
                    cfg.objective)
    bar = tqdm(total=cfg.steps, initial=progress.step, disable=not (run.env.is_main and cfg.progress),
               dynamic_ncols=True)
    last_saved, stopped, batches = progress.step if run.resume else -1, None, PhaseBatches(run, progress)
    record = None
    with stop_signals(), contextlib.closing(bar), contextlib.closing(batches):
        while progress.step < cfg.steps:
            micro_batches, host = batches.next()
            masked_global, mask_global, stopped = _agree(run, host, progress.step)
            if stopped:
                break
            result = train_step(run, micro_batches, host, masked_global)
            progress.step, progress.position = progress.step + 1, progress.position + cfg.batch_size
            window.add(progress.step, result, masked_global, cfg.batch_size, mask_global, host.tokens, host.flops)
            bar.update(1)
            log_due = progress.step % cfg.log_every == 0 or progress.step == cfg.steps
            if log_due or progress.step % cfg.save_every == 0:
                reading = _take_reading(run, progress, window, saver)
                if log_due:
                    record = _metrics_line(run, progress, window, reading, peak)
                    metrics.write(record)
                    bar.set_postfix_str(_summary(record, run), refresh=False)
                if progress.step % cfg.save_every == 0 and progress.step < cfg.steps and \
                        _save(run, saver, progress, reading):
                    last_saved = progress.step
    if last_saved != progress.step:
        _save(run, saver, progress, _take_reading(run, progress, window, saver), last=progress.step == cfg.steps)
    saver.wait()
    if progress.bad_in_row and not stopped:  # the weights it ended with are not a result: no checkpoint of them
        raise _non_finite_error(run, progress.bad_in_row, progress.step, "the run ended inside them, unsaved")
    path = checkpoint.latest_checkpoint(run.checkpoints)
    if stopped:
        report = [f"stopped at step {progress.step} ({stopped}); checkpoint {path}; run the same command again to "
                  "resume"]
    else:
        last = f" (last logged: {_summary(record, run)})" if record else ""
        report = [f"done: {progress.step} steps{last}; checkpoint {path}; metrics in {run.metrics_file}"]
        if path:
            report.append(_finetune_hint(run, os.path.join(path, state.MODEL_DIR)))
    return {**_result(run, progress, path, stopped), "report": report if run.env.is_main else []}


def _finetune_hint(run: Run, model: str) -> str:
    """A finished run's last line: where the model is and the command that fine-tunes it, with the data's
    tokenizer (a checkpoint holds none)."""
    dataset = run.phases[0].dataset.directory
    tokenizer = os.path.join(os.path.dirname(dataset), "tokenizer.json")
    if not os.path.isfile(tokenizer):
        tokenizer = os.path.join(dataset, VOCAB_FILE)
    command = shlex.join(["fastbert", "finetune", "--task", "classification", "--model", model,
                          "--tokenizer", tokenizer, "--train", "train.tsv", "--eval", "dev.tsv"])
    return (f"the model (HF format) is {model}; fine-tune it with: {command} (train.tsv, dev.tsv: tables with "
            "the columns sentence and label; other tasks: docs/finetuning.md)")


def _metrics_line(run: Run, progress: state.Progress, window: Window, reading, peak: float) -> dict:
    index = run.phase_of(progress.step - 1)
    return window.record(reading, peak, step=progress.step, phase=index, seq_length=run.phases[index].seq_length,
                         lr=run.scheduler.get_last_lr()[0], skipped_steps=progress.skipped)


def _result(run: Run, progress: state.Progress, path: str | None, stopped: str | None) -> dict:
    return {"step": progress.step, "out": run.out, "checkpoint": path, "stopped": bool(stopped),
            "skipped_steps": progress.skipped, "model": run.model, "report": []}


def _log_start(run: Run) -> None:
    config, cfg = run.config, run.cfg
    run.info(f"pretraining {config.architecture} ({cfg.objective}, {type(run.model).__name__}; "
             f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}) on "
             f"{run.env.world_size} x {run.env.device.type}, {run.dtype}, {cfg.steps} steps of {cfg.batch_size} "
             f"sequences, phases {[(p.seq_length, p.end - p.start) for p in run.phases]}")
    run.info(f"output: {os.path.abspath(run.out)} (metrics.jsonl, checkpoints/)")


def _summary(record: dict, run: Run) -> str:
    """The progress bar's text for a metrics line; MFU on a GPU only (against a CPU's matmul rate it
    means nothing)."""
    if record["loss"] is None:
        return "every step skipped"
    mfu = f" MFU {record['mfu']:.1%}" if run.env.device.type == "cuda" else ""
    accuracies = "".join(f" {name} {record[key]:.3f}" for name, key in (
        ("mlm_acc", "mlm_accuracy"), ("[MASK]_acc", "mlm_mask_accuracy"), ("nsp_acc", "nsp_accuracy")) if key in record)
    return f"loss {record['loss']:.3f}{accuracies} tok/s {record['tokens_per_s']:.0f}{mfu}"


def main(argv: list[str] | None = None) -> int:
    from fastbert.command import run_command

    def body() -> int:
        try:
            result = train(*parse_args(sys.argv[1:] if argv is None else argv, DESCRIPTION))
            if result["report"]:  # the command's result: stdout (progress and messages go to stderr)
                print("\n".join(result["report"]), flush=True)
        except TrainingError as exc:  # the run went wrong, not the user's input
            logger.error("%s", exc)
            return 1
        except Interrupted as exc:  # the message, not a traceback
            logger.error("%s", exc)
            return 130
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        return 0

    return run_command("pretrain", body)


if __name__ == "__main__":
    sys.exit(main())
