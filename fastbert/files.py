"""Writing outputs so that a failed, interrupted or concurrent run never leaves a plausible partial one.

An output (a file or a directory) is written under a hidden partial name beside it,
`.NAME.partial-PID`, and renamed to NAME only when complete, so NAME holds the previous good output
or the new one, never a mix. A lock keeps two fastbert processes from writing the same output (the
filelock package: an OS lock that dies with its process); its file lives in the user's cache
(lock_path), not beside the output, so that a command leaves nothing but what was asked for. Partial
names left by a killed process are removed by the next run that takes the lock. Files get the
permissions the umask gives (0644 under the usual 022), as a plain open() would.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
from collections.abc import Iterator

logger = logging.getLogger("fastbert.files")


def file_mode() -> int:
    """0o666 less the process's umask: the mode open() gives a new file."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _sibling(path: str, suffix: str) -> str:
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{suffix}")


def partial_path(path: str) -> str:
    """Where this process writes `path` before renaming it into place."""
    return _sibling(path, f"partial-{os.getpid()}")


def cache_dir() -> str:
    """$FASTBERT_CACHE, else $XDG_CACHE_HOME/fastbert, else ~/.cache/fastbert."""
    return os.environ.get("FASTBERT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastbert")


def lock_path(path: str) -> str:
    """The lock file of the output `path`: in the cache's locks/, named by the output's real path (its
    name, then a hash of the whole path), so that every process writing `path` (through any symlink)
    meets the same lock, and the output's directory gets no file of ours. A lock file is never removed:
    a process waiting on a removed file would hold a lock nobody else sees."""
    real = os.path.realpath(path)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(real))[:64]
    digest = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(cache_dir(), "locks", f"{name}-{digest}.lock")


@contextlib.contextmanager
def output_lock(path: str, wait: bool = False) -> Iterator[None]:
    """Hold `path`'s lock (lock_path) for the block. wait=False: another holder is an error (OSError)
    saying so; wait=True: wait for it (logged), as for a shared cache that the other process is filling."""
    import filelock

    lock_file = lock_path(path)
    os.makedirs(os.path.dirname(lock_file), exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # the caller writes beside `path`
    lock = filelock.FileLock(lock_file, mode=file_mode())
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        if not wait:
            raise OSError(f"{path} is being written by another fastbert process (it holds {lock_file}); "
                          "wait for it to finish or choose another output") from None
        logger.info(f"waiting for another fastbert process writing {path} (it holds {lock_file})")
        lock.acquire()
    try:
        remove_leftovers(path)
        yield
    finally:
        lock.release()


def remove_leftovers(path: str) -> None:
    """What processes killed before their rename left (only called under the lock): partial outputs,
    and an old directory caught between the two renames of replaced_directory."""
    prefixes = tuple(os.path.basename(_sibling(path, kind)) for kind in ("partial-", "old-"))
    folder = os.path.dirname(os.path.abspath(path))
    for name in os.listdir(folder):
        if name.startswith(prefixes):
            _remove(os.path.join(folder, name))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def writing_error(exc: OSError, path: str) -> OSError:
    """The same error, naming the output it was writing (ENOSPC alone does not say where)."""
    message = f"{exc.strerror or exc} while writing {path} (the previous output, if any, is unchanged)"
    return OSError(message) if exc.errno is None else OSError(exc.errno, message)


@contextlib.contextmanager
def _removed_on_error(partial: str, path: str) -> Iterator[None]:
    """Remove `partial` if the block fails (Ctrl-C included); an OSError then names `path`."""
    try:
        yield
    except OSError as exc:
        _remove(partial)
        raise writing_error(exc, path) from exc
    except BaseException:
        _remove(partial)
        raise


@contextlib.contextmanager
def replaced_file(path: str) -> Iterator[str]:
    """Yield a partial path to write; on success it is fsynced and renamed to `path`, on any error removed."""
    partial = partial_path(path)
    with _removed_on_error(partial, path):
        yield partial
        with open(partial, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(partial, file_mode())
        os.replace(partial, path)


@contextlib.contextmanager
def replaced_directory(path: str) -> Iterator[str]:
    """Yield a new partial directory to fill; on success it takes `path`'s place (the old directory,
    if any, is removed after the swap), on any error it is removed and `path` is untouched."""
    partial = partial_path(path)
    _remove(partial)
    os.makedirs(partial)
    with _removed_on_error(partial, path):
        yield partial
        move_into_place(partial, path)


def move_into_place(partial: str, path: str) -> None:
    """Rename the complete directory `partial` to `path`; a directory already there is renamed aside
    first and removed after (a process killed between the two renames leaves nothing at `path`, and
    the old directory for remove_leftovers)."""
    old = _sibling(path, f"old-{os.getpid()}")
    if os.path.lexists(path):
        os.replace(path, old)
    os.replace(partial, path)
    _remove(old)


def write_text(path: str, text: str) -> None:
    """A whole text file, replaced atomically."""
    with replaced_file(path) as partial, open(partial, "w", encoding="utf-8") as f:
        f.write(text)
