"""Writing outputs so that a failed, interrupted or concurrent run never leaves a plausible partial one.

An output (a file or a directory) is written under a hidden partial name beside it,
`.NAME.partial-PID`, and renamed to NAME only when complete, so NAME holds the previous good output
or the new one, never a mix. A lock keeps two fastbert processes from writing the same output (the
filelock package: an OS lock that dies with its process); its file lives in the user's cache
(lock_path), not beside the output, so that a command leaves nothing but what was asked for. Partial
names left by a killed process are removed by the next run that takes the lock. Files get the
permissions the umask gives (0644 under the usual 022), as a plain open() would.

Every write of fastbert's goes through `writing` (replaced_files, replaced_directory, write_text and
append_text use it; checkpoints, prepare-data and embed too), so a full disk is one message everywhere:
the errno and reason, the output, the space it needs and what is free there, and what was kept; the
partial files removed. A failed write reaches it as an OSError, or as what torch.save and safetensors
make of one (failed_write); torch.save is given a Python file, so that its OSError keeps the errno.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import math
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
def output_lock(path: str, wait: bool = False) -> Iterator[bool]:
    """Hold `path`'s lock (lock_path) for the block, which gets whether the folder of `path` was made for it (it
    did not exist once the lock was held). wait=False: another holder is an error (OSError) saying so; wait=True:
    wait for it (logged), as for a shared cache that the other process is filling."""
    import filelock

    lock_file = lock_path(path)
    os.makedirs(os.path.dirname(lock_file), exist_ok=True)
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
        # the caller writes beside `path`: made under the lock, as the holder waited for may have removed it (a
        # prepare-data run that created its --out removes it when its input proves bad)
        folder = os.path.dirname(os.path.abspath(path))
        made = not os.path.isdir(folder)
        os.makedirs(folder, exist_ok=True)
        remove_leftovers(path)
        yield made
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


# what a failed write left as it was, in its message (a checkpoint, metrics.jsonl say more precisely)
PREVIOUS_KEPT = "the previous output, if any, is unchanged"


class WriteError(OSError):
    """A write that failed (a full disk, a file size limit, ...): the message names the output, the space it
    needs and what is free there, and what was kept. Built as an OSError (errno, message), so that it pickles."""


def failed_write(exc: BaseException) -> OSError | None:
    """The OSError of a failed write behind `exc`: exc itself; the one torch.save's RuntimeError stands for
    (its context, when torch writes through a Python file; else its text); or a Rust library's (safetensors'
    SafetensorError, tokenizers' Exception), whose text ends in Rust's "(os error 28)". None when exc is not
    a failed write."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, RuntimeError) and isinstance(exc.__context__, OSError):  # torch's writer around f.write
        return exc.__context__
    text = str(exc)
    rust = re.search(r"\(os error (\d+)\)", text)
    if rust:
        return OSError(int(rust.group(1)), os.strerror(int(rust.group(1))))
    if isinstance(exc, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text):
        return OSError(f"torch.save stopped short ({text.splitlines()[0]})")
    return None


def write_error(exc: BaseException, path: str, need: int | None = None, written: int | None = None,
                kept: str = PREVIOUS_KEPT) -> WriteError | None:
    """A failed write (failed_write) as one WriteError naming `path`, the space it needs (`need` bytes, else
    the `written` bytes that fit), what is free there, and `kept`; None when exc is not a failed write. A
    WriteError of a file inside `path` (a checkpoint's weights) is named anew by `path`, with its reason (and
    its need, where `need` is not given)."""
    error = failed_write(exc)
    if error is None:
        return None
    reason = getattr(error, "reason", None) or (os.strerror(error.errno) if error.errno else str(error))
    need = need or getattr(error, "need", None)
    message = f"{reason} while writing {path} ({space_text(path, need, written)}); {kept}"
    result = WriteError(message) if error.errno is None else WriteError(error.errno, message)
    result.reason, result.need = reason, need  # for an enclosing output's message
    return result


def space_text(path: str, need: int | None, written: int | None) -> str:
    """"it needs about N, F free there" (or what was written before the failure where N is not known)."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    stats = os.statvfs(folder)
    free = f"{human_size(stats.f_bavail * stats.f_frsize)} free there"
    if need:
        return f"it needs about {human_size(need)}, {free}; free some space or choose another output"
    wrote = f"{human_size(written)} written before it failed, " if written else ""
    return f"{wrote}{free}; free some space or choose another output"


def human_size(count: int) -> str:
    """Bytes as df -h counts them: 512 bytes, 3.4 KiB, 1.2 MiB, 5.0 GiB."""
    if count < 1024:
        return f"{count} bytes"
    exponent = min(int(math.log(count, 1024)), 4)
    return f"{count / 1024 ** exponent:.1f} {'KMGT'[exponent - 1]}iB"


def disk_bytes(path: str) -> int:
    """Bytes a file or a directory tree occupies on disk (blocks: a sparse file counts what it holds)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return os.lstat(path).st_blocks * 512 if os.path.lexists(path) else 0
    return sum(os.lstat(os.path.join(folder, name)).st_blocks * 512
               for folder, _, names in os.walk(path) for name in names)


@contextlib.contextmanager
def writing(path: str, partials: list[str] = (), need: int | None = None, kept: str = PREVIOUS_KEPT,
            remove: bool = True) -> Iterator[None]:
    """The block writes `path` through the `partials` (files or directories; removed if it fails, Ctrl-C
    included, unless remove=False keeps them for a rerun): a failed write (failed_write) is raised as
    write_error's WriteError naming `path`, `need` bytes (else the partials' size) and `kept`; other errors as
    they are."""
    try:
        yield
    except BaseException as exc:
        written = sum(disk_bytes(partial) for partial in partials)
        for partial in partials if remove else ():
            _remove(partial)
        error = write_error(exc, path, need, written, kept) if isinstance(exc, Exception) else None
        if error is None:
            raise
        raise error from exc


def preallocate(path: str) -> None:
    """Give the file at `path` real blocks for its whole size now: a file created at its size by a seek is
    sparse, and a memory map writing into its holes on a full disk dies of SIGBUS; this raises ENOSPC
    instead. A file system that cannot preallocate (EOPNOTSUPP, EINVAL) is left as it is."""
    if not hasattr(os, "posix_fallocate"):  # macOS, Windows
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def replaced_files(paths: list[str], need: int | None = None, name: str | None = None) -> Iterator[list[str]]:
    """Yield a partial path for each of `paths` to write; when the block completes, each is fsynced and renamed
    to its path, after all are written (a failure leaves every previous file). On any error they are removed;
    a failed write is a WriteError naming `name` (default: the one path, or their folder) and `need` bytes."""
    partials = [partial_path(path) for path in paths]
    name = name or (paths[0] if len(paths) == 1 else os.path.dirname(os.path.abspath(paths[0])))
    with writing(name, partials, need):
        yield partials
        for partial in partials:
            with open(partial, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(partial, file_mode())
    for partial, path in zip(partials, paths):
        os.replace(partial, path)


@contextlib.contextmanager
def replaced_file(path: str, need: int | None = None) -> Iterator[str]:
    """replaced_files of one path: yield its partial path to write."""
    with replaced_files([path], need) as (partial,):
        yield partial


@contextlib.contextmanager
def replaced_directory(path: str) -> Iterator[str]:
    """Yield a new partial directory to fill; on success it takes `path`'s place (the old directory,
    if any, is removed after the swap), on any error it is removed and `path` is untouched."""
    partial = partial_path(path)
    _remove(partial)
    os.makedirs(partial)
    with writing(path, [partial]):
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


def check_output_parent(out: str, flag: str = "--out") -> None:
    """ValueError naming `flag` when a directory above `out` is a file: nothing can be created there, found before
    the work rather than as a bare [Errno 17] or [Errno 20] when the output is written."""
    parent = os.path.dirname(os.path.normpath(out))
    while parent and not os.path.exists(parent):  # a path through a file does not exist either
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise ValueError(f"{flag} {out}: {parent} is a file, so nothing can be written under it")


def write_text(path: str, text: str) -> None:
    """A whole text file, replaced atomically."""
    with replaced_file(path, len(text.encode("utf-8"))) as partial, open(partial, "w", encoding="utf-8") as f:
        f.write(text)


def append_text(path: str, text: str, kept: str = "its earlier contents are unchanged") -> None:
    """Add `text` at the end of `path` (created if missing); a failed write cuts the file back to what it
    held, never half a line, and is a WriteError naming it."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    with writing(path, need=len(text.encode("utf-8")), kept=kept):
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(text)
        except BaseException:
            with contextlib.suppress(OSError):
                os.truncate(path, size)
            raise
