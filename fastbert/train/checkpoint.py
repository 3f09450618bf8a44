"""Atomic checkpoint directories: a checkpoint counts only once it is complete.

<out>/checkpoints/step_00001000/ holds model/ (HF format: config.json + model.safetensors, loadable
by fastbert's and transformers' from_pretrained) and trainer.pt (optimizer, LR scheduler, loss
scaler, RNG states of every rank, data position, counters). It is written under a temporary name
(.tmp-step_...), every file and directory fsync'ed, then renamed: a crash leaves either the complete
checkpoint or a temporary directory that is ignored and removed by the next run. The newest `keep`
complete checkpoints are kept.
"""
from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"


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


def save_checkpoint(root: str, step: int, write: Callable[[str], None], keep: int) -> str:
    """Call write(tmp_dir) to fill a temporary directory, make it durable, rename it to the step's name,
    and delete all but the newest `keep` complete checkpoints. Returns the checkpoint's path."""
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, checkpoint_name(step))
    tmp = os.path.join(root, f"{TMP_PREFIX}{checkpoint_name(step)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    _fsync_tree(tmp)
    if os.path.exists(final):  # the same step saved again (a resumed run stopped at once): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for _, old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final
