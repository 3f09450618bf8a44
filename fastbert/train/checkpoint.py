"""Checkpoint directories of a run: atomic, written in the background, pruned only within the run line.

<out>/checkpoints/step_00001000/ is written under a temporary name (.tmp-step_...), every file and
directory fsync'ed, then renamed: a crash or a full disk leaves the complete checkpoint or a
temporary directory that is removed (at once after an error, else by the next run); the previous
checkpoints are untouched until the new one is complete. A full disk is a message naming the
checkpoint, the space it needs and the previous checkpoint (fastbert.files.writing, as for every
output); a damaged one, when resumed, names the file and the previous checkpoint to resume from.
What a checkpoint holds is state.py's.

The run line: the checkpoints a run builds on. A run that starts afresh in a directory that has
checkpoints or metrics, or rolls back to an older checkpoint, first moves what does not belong to its
line (the newer checkpoints, the metrics they logged) to <out>/previous/N/ and says so; retention
then keeps the newest `keep` checkpoints of the directory, which are all of this line, and never the
checkpoint a run was explicitly resumed from.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable

from fastbert.files import replaced_file, writing

CHECKPOINT_DIR = "checkpoints"
RUN_FILE = "run.json"  # what a checkpoint's run was: its options, model and data (state.py writes it)
MODEL_DIR = "model"  # a checkpoint's weights in HF format (state.py writes it)
DIGESTS_FILE = "digests.json"  # the sha256 of each of the checkpoint's other files, written after them
PREVIOUS_DIR = "previous"
_NAME = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"
logger = logging.getLogger("fastbert.train")


def read_run_file(path: str) -> dict | None:
    """A checkpoint's run.json, or None for checkpoints written before fastbert recorded it."""
    file = os.path.join(path, RUN_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise damaged(path, file, exc) from None


def damaged(path: str, file: str, exc: BaseException) -> ValueError:
    """The error of a checkpoint whose `file` cannot be read (truncated, overwritten): naming it, and the
    previous checkpoint to resume from instead."""
    match = _NAME.match(os.path.basename(os.path.normpath(path)))
    previous = latest_checkpoint(os.path.dirname(os.path.normpath(path)), before=int(match.group(1))) if match else None
    instead = f"resume from the previous one with --resume {previous}" if previous else "there is no earlier one"
    reason = str(exc).split(". ")[0]  # torch's adds paragraphs of advice
    return ValueError(f"the checkpoint {path} is damaged: {file} cannot be read ({type(exc).__name__}: {reason}); "
                      f"{instead}, or start afresh with --resume never")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):  # 4 MiB at a time (hashlib.file_digest is Python 3.11's)
            digest.update(chunk)
    return digest.hexdigest()


def write_digests(directory: str) -> None:
    """digests.json: the sha256 of every file under `directory` (paths relative to it)."""
    digests = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            digests[os.path.relpath(path, directory)] = _sha256(path)
    digests.pop(DIGESTS_FILE, None)
    with open(os.path.join(directory, DIGESTS_FILE), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(digests.items())), f, indent=1)


def verify_digests(path: str) -> None:
    """Raise damaged() for a file of the checkpoint at `path` that is missing or whose sha256 is not the one
    written with it: a torn page, a bad disk or a copy cut short that kept the size, which torch.load and
    safetensors read without complaint. A checkpoint written before fastbert recorded digests is read unchecked."""
    file = os.path.join(path, DIGESTS_FILE)
    if not os.path.isfile(file):
        return
    try:
        with open(file, encoding="utf-8") as f:
            digests = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise damaged(path, file, exc) from None
    for name, digest in digests.items():
        target = os.path.join(path, name)
        try:
            if _sha256(target) != digest:
                raise ValueError("its sha256 is not the one written with it: its bytes changed after the save")
        except (OSError, ValueError) as exc:
            raise damaged(path, target, exc) from None


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root) if (m := _NAME.match(name))]
    return sorted(found)


def latest_checkpoint(root: str, before: int | None = None) -> str | None:
    """The newest complete checkpoint (of a step < before, if given), or None."""
    found = [path for step, path in complete_checkpoints(root) if before is None or step < before]
    return found[-1] if found else None


def remove_incomplete(root: str) -> None:
    """Temporary directories of interrupted saves."""
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def set_aside(out: str, metrics_file: str, resume: str | None) -> None:
    """Move what does not belong to the run line that starts at `resume` (None: a fresh start) to
    <out>/previous/N/: on a fresh start every checkpoint and metrics.jsonl; on a rollback to a
    checkpoint of <out>, the newer checkpoints and a copy of metrics.jsonl (the run keeps its lines up
    to the resume step); resuming from another directory, every checkpoint of <out> and metrics.jsonl."""
    root = os.path.join(out, CHECKPOINT_DIR)
    resumed_here = resume is not None and os.path.dirname(os.path.abspath(resume)) == os.path.abspath(root)
    start = int(_NAME.match(os.path.basename(resume)).group(1)) if resumed_here else -1
    foreign = [(step, path) for step, path in complete_checkpoints(root) if step > start]
    metrics = os.path.isfile(metrics_file)
    if not foreign and not (metrics and not resumed_here):
        return
    previous = _new_previous_dir(out)
    for _, path in foreign:
        os.rename(path, os.path.join(previous, CHECKPOINT_DIR, os.path.basename(path)))
    if metrics:
        if resumed_here:
            with replaced_file(os.path.join(previous, os.path.basename(metrics_file))) as partial:
                shutil.copy2(metrics_file, partial)
        else:
            os.rename(metrics_file, os.path.join(previous, os.path.basename(metrics_file)))
    steps = ", ".join(str(step) for step, _ in foreign) or "none"
    reason = f"rolling back to step {start}" if resumed_here else "a new run line starts"
    logger.warning(f"{reason} in {out}: checkpoints of other steps ({steps}) and the metrics of the run they "
                   f"belong to were moved to {previous}")


def _new_previous_dir(out: str) -> str:
    parent = os.path.join(out, PREVIOUS_DIR)
    os.makedirs(parent, exist_ok=True)
    number = 1 + max((int(n) for n in os.listdir(parent) if n.isdigit()), default=0)
    path = os.path.join(parent, str(number))
    os.makedirs(os.path.join(path, CHECKPOINT_DIR))
    return path


def _fsync_tree(path: str) -> None:
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(folder)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_path(root: str, step: int) -> str:
    """Where the checkpoint of `step` is written before it is complete (the same on every rank)."""
    return os.path.join(root, f"{TMP_PREFIX}{checkpoint_name(step)}")


def save_checkpoint(root: str, step: int, write: Callable[[str], None], keep: int, pinned: str | None = None,
                    need: int | None = None) -> str:
    """Call write(tmp_dir) to fill the step's temporary directory, make it durable, rename it to the
    step's name, and delete all but the newest `keep` complete checkpoints (never `pinned`). Returns
    the checkpoint's path. On any error the temporary directory is removed; a failed write (a full disk:
    fastbert.files.failed_write) is a WriteError naming the checkpoint, the space it needs (`need` bytes,
    if known) and the intact previous checkpoint."""
    final, tmp = os.path.join(root, checkpoint_name(step)), temporary_path(root, step)
    previous = latest_checkpoint(root)
    kept = (f"the checkpoint of step {step} was not saved; the previous checkpoint {previous} is intact, and the "
            "same command resumes from it" if previous else
            f"the checkpoint of step {step} was not saved, and there is no earlier one")
    with writing(final, [tmp], need, kept):
        os.makedirs(tmp, exist_ok=True)
        write(tmp)
        write_digests(tmp)
        _fsync_tree(tmp)
    if os.path.exists(final):  # the same step saved again (a resumed run stopped at once): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for _, old in complete_checkpoints(root)[:-keep]:
        if pinned is None or os.path.abspath(old) != os.path.abspath(pinned):
            shutil.rmtree(old, ignore_errors=True)
    return final


class BackgroundWriter:
    """One checkpoint write at a time in a background thread, so that the loop only waits for the copy
    to the host. An error in a write is raised by the next submit(), check() or wait()."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()

        def run():
            try:
                job()
            except BaseException as exc:  # raised in the training loop by check() / wait()
                self.error = exc

        self.thread = threading.Thread(target=run, name="fastbert-checkpoint")
        self.thread.start()

    def check(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def wait(self) -> None:
        self.join()
        self.check()
