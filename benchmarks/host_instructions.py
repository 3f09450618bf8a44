"""The host's instructions per call, counted by callgrind: fastbert against PyTorch and transformers, without noise.

Run from the repository root: `python benchmarks/host_instructions.py [--only REGEX] [--calls N] [--out DIR]`.
Needs valgrind (Debian's package). Every item of `fastbert bench --suite host` (each fused op against PyTorch's
same job, BERT-base and ModernBERT-base against transformers; "fwd" an inference call, "fwd+bwd" a training
call), built and called as that suite builds and calls it, with the Triton launches stubbed, runs in one Python
process under valgrind's callgrind: after warm-up calls, N calls inside `math.fsum`, the only code callgrind
counts (it collects inside that C function and writes one count each time it returns). An empty call
counted the same way is subtracted, so a row is the instructions the call itself executes.

Why instructions: the host suite's CPU times move by 10-50% between runs on a shared machine (PERF.md); the
instructions a call executes moved by at most 1.5% between three runs of the same code (the hash seed fixed, the
cyclic garbage collector off while counting; addresses still differ from run to run), so a change of a few percent
shows. They are not time (a cache miss costs more than an add), so the timed suite stays the figure the limits
are judged by.
Prints a table and writes the rows (with provenance) to DIR/host-instructions-<machine>-<time>.json.
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

from fastbert.bench import host_suite
from fastbert.bench.runner import cpu_script_parser, save_cpu_rows
from fastbert.command import LOG, run_command
from fastbert.simulated.host_time import one_thread, stubbed_launches

# The C function inside which callgrind counts: nothing on the measured paths calls it (torch's autograd calls
# functools.reduce); a call there would split its region in two, which `parse_counts` refuses
MARKER = "math_fsum"
EMPTY = "empty call"  # the item whose count is subtracted from every other
WARMUP = 3  # the first call of a signature compiles or stubs its kernels; later calls take the steady path
CALLS = {"op": 50, "model": 5}  # by kind: a model call is a hundred op calls
COMPARISONS = (host_suite.TORCH, host_suite.HF_SDPA)


def kind(case: host_suite.HostCase) -> str:
    return "model" if case.op == "model" else "op"


def items(only: str | None) -> list[tuple[str, str, str]]:
    """(case, provider, direction) of every host-suite item whose 'case provider direction' matches `only`."""
    selected = []
    for case in host_suite.host_cases():
        for provider in case.providers:
            for direction in host_suite.DIRECTIONS:
                if only is None or re.search(only, f"{case.name} {provider} {direction}"):
                    selected.append((case.name, provider, direction))
    return selected


def counted(call, calls: int) -> None:
    """`calls` calls of `call` inside math.fsum (MARKER), where callgrind counts, with Python's cyclic garbage
    collector off: when it runs depends on every allocation before, so it would move a count between runs and
    commits (reference counting still frees what the calls drop)."""
    def zero() -> float:
        call()
        return 0.0
    gc.collect()
    gc.disable()
    try:
        math.fsum(zero() for _ in range(calls))
    finally:
        gc.enable()


def count_in_this_process(selected: list[tuple[str, str, str]], calls: dict) -> None:
    """Make the calls that callgrind counts: the empty call, then each item's, in order (run under valgrind)."""
    cases = {case.name: case for case in host_suite.host_cases()}
    with one_thread(), stubbed_launches():
        counted(lambda: None, calls["op"])
        for name, provider, direction in selected:
            call = cases[name].providers[provider](direction)
            for _ in range(WARMUP):
                call()
            counted(call, calls[kind(cases[name])])
            print(name, provider, direction, flush=True)  # the parent's progress bar


def parse_counts(out_file: str, expected: int) -> list[int]:
    """The instructions of each marked region, in order, from callgrind's dumps `out_file`.1, .2, ... (a dump
    that counted nothing came from a call of the marker outside the regions: none is known)."""
    parts = sorted(glob.glob(out_file + ".*"), key=lambda path: int(path.rsplit(".", 1)[1]))
    counts = []
    for path in parts:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        total = int(re.search(r"^totals: (\d+)", text, re.M).group(1))
        if total and f"--dump-after={MARKER}" in text:
            counts.append(total)
    if len(counts) != expected:
        raise RuntimeError(f"callgrind wrote {len(counts)} counts for {expected} regions: something on the "
                           f"measured paths calls {MARKER} itself, so the regions cannot be told apart")
    return counts


def counted_rows(selected: list[tuple[str, str, str]], calls: dict, progress: bool = True) -> list[dict]:
    """Run this script's child under callgrind and turn its counts into rows (instructions per call)."""
    from tqdm import tqdm

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise OSError("valgrind is not installed (Debian: apt-get install valgrind); it counts the instructions")
    cases = {case.name: case for case in host_suite.host_cases()}
    # one BLAS and OpenMP thread: a second thread spinning would be counted too; a fixed hash seed keeps the string
    # dicts' and sets' layouts, and so their probes, the same on every run
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "callgrind.out")
        command = [valgrind, "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={MARKER}",
                   f"--dump-after={MARKER}", f"--callgrind-out-file={out_file}", sys.executable, __file__,
                   "--child", json.dumps({"items": selected, "calls": calls})]
        # stderr to a file: valgrind's and the libraries' messages must not fill a pipe nobody reads yet
        with open(os.path.join(tmp, "stderr"), "w+", encoding="utf-8") as stderr, \
                subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True) as child, \
                tqdm(total=len(selected), desc="host instructions", unit="item", file=sys.stderr,
                     disable=not progress) as bar:
            for _ in child.stdout:
                bar.update()
            if child.wait() != 0:
                stderr.seek(0)
                raise RuntimeError(f"the counted run failed (exit {child.returncode}):\n{stderr.read()[-3000:]}")
        empty, *counts = parse_counts(out_file, len(selected) + 1)
    empty_per_call = empty / calls["op"]
    rows = []
    for (name, provider, direction), count in zip(selected, counts):
        number = calls[kind(cases[name])]
        rows.append({"case": name, "op": cases[name].op, "provider": provider, "direction": direction,
                     "instructions": round(count / number - empty_per_call), "calls": number})
    return rows


def table(rows: list[dict]) -> str:
    """Each fastbert row beside its comparison's (PyTorch's same job, or transformers), with their ratio."""
    by_key = {(r["case"], r["direction"], r["provider"]): r["instructions"] for r in rows}
    lines = [f"{'case':62s} {'provider':20s} {'dir':8s} {'instructions':>12s} {'ratio':>6s}"]
    for row in rows:
        other = next((by_key[(row["case"], row["direction"], p)] for p in COMPARISONS
                      if (row["case"], row["direction"], p) in by_key), None)
        ratio = f"{row['instructions'] / other:.2f}" if other and row["provider"] not in COMPARISONS else ""
        lines.append(f"{row['case']:62s} {row['provider']:20s} {row['direction']:8s} {row['instructions']:>12d} "
                     f"{ratio:>6s}")
    return "\n".join(lines)


def main() -> int:
    parser = cpu_script_parser(__doc__)
    parser.add_argument("--only", help="count only the items whose 'case provider direction' matches this regex")
    parser.add_argument("--calls", type=int, help="calls counted per item (default 50 an op, 5 a model)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the process valgrind runs
    args = parser.parse_args()
    if args.child:
        child = json.loads(args.child)
        count_in_this_process([tuple(item) for item in child["items"]], child["calls"])
        return 0
    return run_command("host-instructions", lambda: _write(args))


def _write(args) -> None:
    if args.calls is not None and args.calls < 1:
        raise ValueError(f"--calls must be at least 1, got {args.calls}")
    selected = items(args.only)
    if not selected:
        raise ValueError(f"--only {args.only!r} matches no item of the host suite")
    calls = dict.fromkeys(CALLS, args.calls) if args.calls else CALLS
    LOG.info("counting %d items under callgrind (minutes to start PyTorch under valgrind, then seconds an item)",
             len(selected))
    save_cpu_rows(args.out, "host-instructions",
                  f"none: instructions executed per call (valgrind's callgrind, {EMPTY} subtracted)",
                  counted_rows(selected, calls, not args.no_progress), table)


if __name__ == "__main__":
    sys.exit(main())
