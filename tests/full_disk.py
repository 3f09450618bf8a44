"""Full disks for the reliability tests, two ways: a small tmpfs (the real ENOSPC, where this machine lets a
test mount one: root, or CAP_SYS_ADMIN), and a file size limit (RLIMIT_FSIZE: the kernel fails the write with
EFBIG at the same point, anywhere, without privileges). Each full-disk case has a test of each kind, so CI
checks the path even where it cannot mount."""
import contextlib
import os
import resource
import signal
import subprocess
import sys

import pytest

FASTBERT = "import sys; from fastbert import cli; sys.exit(cli.main(sys.argv[1:]))"


def _mount(*args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # no mount command
        return None


@contextlib.contextmanager
def small_disk(path, size: str):
    """A tmpfs of `size` ("400k", "1m") mounted at `path` (created) for the block, unmounted after;
    pytest.skip, with the reason, where this machine cannot mount one."""
    os.makedirs(path, exist_ok=True)
    result = _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    if result is None or result.returncode:
        reason = "no mount command" if result is None else (result.stderr.strip() or f"exit {result.returncode}")
        pytest.skip(f"cannot mount a tmpfs here ({reason.splitlines()[0]}); this case's test without a mount "
                    "covers the same path")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # a child still holding a file


def resize(path, size: str) -> None:
    """Grow (or shrink) the tmpfs mounted at `path`: the space freed for a rerun."""
    result = _mount("-o", f"remount,size={size}", str(path))
    assert result is not None and result.returncode == 0, result


def fill(path, leave: int) -> None:
    """Take the free space of the file system at `path` but `leave` bytes, with a file named .filler."""
    stats = os.statvfs(path)
    with open(os.path.join(path, ".filler"), "wb") as f:
        f.write(b"\0" * max(stats.f_bavail * stats.f_frsize - leave, 0))


def run_fastbert(argv: list[str], file_size_limit: int | None = None, code: str = FASTBERT):
    """`code` (by default the fastbert command with argv) in a child process, optionally unable to write files
    larger than file_size_limit bytes (the write fails with EFBIG, as a full disk fails with ENOSPC)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          preexec_fn=limit if file_size_limit else None, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()})
