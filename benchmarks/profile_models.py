"""Where a whole-model step's time goes: torch.profiler tables of the bench's own BERT cases, built and called
exactly as `fastbert bench --suite gpu` builds and calls them (fastbert/bench/model_cases.py).

    python benchmarks/profile_models.py OUT.txt [--case NAME PROVIDER]... [--steps N] [--size base]

For each (case, provider): the step's wall time with the device synchronised (median of the profiled steps),
then two tables, the ops by device time and by host time; then, outside torch.profiler, the step's wall time and
its host CPU time (whether the host bounds it), and cProfile's table of the Python functions by their own time
(torch.profiler's tables name the ops, not the Python around them, which is what an inference forward bound by
the host spends much of its time in). The default cases are issue 25's: BERT-base bf16 inference at 32 x 128
padded (fastbert, its captured graph, its PyTorch path, transformers SDPA) and the training step at 256 x 128
(fastbert, fastbert.apply(transformers), transformers SDPA). On a CPU (no CUDA) it profiles the tiny config's
host time, which is what its test runs.
"""
from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fastbert.bench import model_cases
from fastbert.command import configure_logging

logger = logging.getLogger("fastbert")

HOST_ROWS = 30  # Python functions listed per case, by own time
DEFAULT_CASES = (*(("inference/32,128,padded", provider)
                   for provider in (model_cases.FASTBERT, model_cases.GRAPH, model_cases.EAGER, model_cases.HF_SDPA)),
                 *(("train/256,128", provider) for provider in (model_cases.FASTBERT, model_cases.APPLY,
                                                                 model_cases.HF_SDPA)))


def parse_case(text: str, size: str) -> model_cases.ModelCase:
    """"mode/batch,seqlen[,padded]" -> the bench's ModelCase of that size."""
    mode, _, shape = text.partition("/")
    fields = shape.split(",")
    if mode not in ("train", "inference") or len(fields) not in (2, 3) or fields[2:] not in ([], ["padded"]):
        raise ValueError(f"--case must look like 'inference/32,128,padded' or 'train/256,128', got {text!r}")
    return model_cases.ModelCase(mode, size, int(fields[0]), int(fields[1]), fields[2:] == ["padded"], ())


def profile_case(case: model_cases.ModelCase, provider: str, device: torch.device, steps: int) -> str:
    """The case's step under the profiler: its wall time per step and the two tables, as text."""
    step, data = model_cases.prepare(case, provider, device)
    for _ in range(3):  # compile, autotune, capture: out of the profile
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    walls = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            sync()
            walls.append((time.perf_counter() - start) * 1e3)
    averages = prof.key_averages()
    device_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    batch = data["lengths"].numel()
    title = f"{case.mode} {case.size} batch {batch} x {case.seqlen}{' padded' if case.padded else ''} [{provider}]"
    return "\n".join([f"######## {title}: {statistics.median(walls):.2f} ms per step (median of {steps}, synchronised,"
                      f" under the profiler)",
                      f"#### by device time ({device_key}), totals over {steps} steps",
                      averages.table(sort_by=device_key, row_limit=25, max_name_column_width=70),
                      f"#### by host time (self_cpu_time_total), totals over {steps} steps",
                      averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70),
                      *host_attribution(step, sync, steps), ""])


def host_attribution(step, sync, steps: int) -> list[str]:
    """Lines on the host's part of a step, outside torch.profiler: the wall time and the host's CPU time in the
    step's call (the sync after it left out; median of `steps`), this thread's and the whole process's, then
    cProfile's table of this thread's Python functions by their own time over `steps` more steps. On a GPU a
    backward runs on autograd's device thread: its host work is in the process's time, not in this thread's or
    in the table. This thread's CPU time near the wall time means the host bounds the step (or that a full
    launch queue held the call). cProfile's tracing slows every Python call: read its rows against each other,
    not its total against the wall time."""
    walls, thread, process = [], [], []
    for _ in range(steps):
        start, start_thread, start_process = time.perf_counter(), time.thread_time(), time.process_time()
        step()
        thread.append((time.thread_time() - start_thread) * 1e3)
        process.append((time.process_time() - start_process) * 1e3)
        sync()
        walls.append((time.perf_counter() - start) * 1e3)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    sync()
    profiler.disable()
    rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: item[1][2], reverse=True)[:HOST_ROWS]
    return [f"#### outside the profiler: {statistics.median(walls):.2f} ms of wall time per step, "
            f"{statistics.median(thread):.2f} ms of it the host's CPU time in the step's call on this thread "
            f"({statistics.median(process):.2f} ms in all the process's threads; median of {steps})",
            f"#### this thread's Python functions by own time (cProfile, per step; {HOST_ROWS} rows)",
            f"{'calls':>8} {'own us':>10} {'with callees us':>16}  function",
            *(f"{calls / steps:8.1f} {own / steps * 1e6:10.1f} {total / steps * 1e6:16.1f}  {_where(function)}"
              for function, (_, calls, own, total, _) in rows)]


def _where(function: tuple) -> str:
    """cProfile's (file, line, name) as 'name (file:line)', the file from its package (torch/..., fastbert/...)."""
    path, line, name = function
    if path == "~":  # a built-in: the name says it all ("<method 'dim' of 'torch._C.TensorBase' objects>")
        return name
    parts = path.replace("\\", "/").split("/")
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            parts = parts[parts.index(anchor) + 1:]
            break
    else:
        parts = parts[-2:]
    return f"{name} ({'/'.join(parts)}:{line})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="text file the tables are written to (appended case by case)")
    p.add_argument("--case", nargs=2, action="append", metavar=("CASE", "PROVIDER"),
                   help="e.g. inference/32,128,padded fastbert-graph (repeatable; default: issue 25's seven)")
    p.add_argument("--size", default=None, help="model size of model_cases.SIZES (default: base on a GPU, tiny on "
                                                "a CPU)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per case (default 5)")
    args = p.parse_args(argv)
    configure_logging()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or ("base" if device.type == "cuda" else "tiny")
    if size not in model_cases.SIZES:
        p.error(f"--size must be one of {sorted(model_cases.SIZES)}, got {size!r}")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    try:
        cases = [(parse_case(text, size), provider) for text, provider in (args.case or DEFAULT_CASES)]
    except ValueError as exc:
        p.error(str(exc))
    with open(args.out, "w") as f:
        for case, provider in cases:
            logger.info(f"profiling {case.name} [{provider}]")
            try:
                f.write(profile_case(case, provider, device, args.steps) + "\n")
            except Exception as exc:  # one provider failing must not lose the others' tables
                logger.exception(f"{case.name} [{provider}] failed")
                f.write(f"######## {case.name} [{provider}]: {type(exc).__name__}: {exc}\n\n")
            f.flush()
            model_cases.free_memory(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
