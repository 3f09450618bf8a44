"""What every result row records about where and how it was measured: the device, the library
versions, the git commit, the date and the exact command."""
from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys

import torch

from fastbert import paths

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one) and its logical core count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} logical cores)"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


@functools.lru_cache(maxsize=None)
def _static(device_type: str, device_label: str) -> dict:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "device": device_label,
        "device_type": device_type,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": _git("rev-parse", "HEAD"),
        # uncommitted changes to tracked files mean the commit alone does not say what ran
        "dirty": None if status is None else bool(status),
    }


def architecture(device: torch.device) -> str | None:
    """A CUDA device's architecture, e.g. "sm_90" (what fastbert.paths' table is keyed by); None elsewhere."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def paths_table() -> str | None:
    """The table backend="auto" chose from, where not the committed one (FASTBERT_PATHS): its path and the sha256 of
    its contents (the path of a session's table is gone once its rows are committed; the contents say what ran)."""
    if paths.TABLE_PATH == paths.COMMITTED_TABLE_PATH:
        return None
    with open(paths.TABLE_PATH, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return f"{os.path.abspath(paths.TABLE_PATH)} (sha256 {digest[:16]})"


def provenance(device: torch.device, command: list[str] | None = None) -> dict:
    """Fields shared by every row of one run."""
    command = sys.argv if command is None else command
    return {
        **_static(device.type, device_name(device)),
        "architecture": architecture(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # other work on the machine slows CPU timings; the load says how much there was
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "command": shlex.join(command),
        "paths_table": paths_table(),
    }
