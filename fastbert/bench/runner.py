"""The suites, run item by item behind a progress bar, each measurement a JSON row.

Suites:
- "smoke": tiny fp32 shapes on the CPU, reference and torch providers only; seconds. CI runs it.
- "gpu": everything issues 3, 4, 5 and 7 ask for, bf16, on one CUDA GPU, within a time budget
  (default 480 s of measuring, so that with start-up the suite ends inside 10 minutes); items left when the budget is spent are
  written as rows with status "skipped", never silently dropped.
- "cpu-memory": issue 5's MLM head at full size, fp32 on the CPU: peak allocated bytes and time.
- "data": issue 13's input pipeline on the CPU: pretraining sequences built per CPU-second
  (fastbert.bench.data_suite).

Rows are written to the output file after every item, so an interrupted run keeps what it measured.
Each row: provenance (device, versions, commit, date, command), suite, case, op, shape, dtype,
provider, direction, status, and the figures (median_ms, p20_ms, p80_ms; for a GPU's op rows also device_ms,
device_p20_ms and device_p80_ms, the GPU's time alone, which tflops and gbps are computed from, and host_ms, the
host's; flops, tflops, bytes, gbps, their ratios to the measured peaks, peak memory; tokens/s, sequences/s and MFU
for whole models).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from fastbert.bench import model_cases, op_cases
from fastbert.bench.peaks import measure_peaks, peak_figures
from fastbert.bench.provenance import provenance
from fastbert.bench.timing import (comparable_ms, device_time_fields, memory_meter_name, peak_memory, time_ms,
                                   timer_name)
from fastbert.files import write_text

logger = logging.getLogger("fastbert.bench")

SUITES = ("smoke", "gpu", "cpu-memory", "data", "host")
GPU_BUDGET_S = 480.0
STATUS = ("ok", "oom", "error", "skipped")


# time_ms's keywords per suite. The smoke run checks that every path runs and reports, not what it
# costs: one warm-up call, three timed. cpu-memory's calls take tens of seconds: one warm-up, two timed.
SUITE_TIMING = {"smoke": {"warmup_ms": 0.0, "rep_ms": 0.0},
                "cpu-memory": {"warmup_ms": 0.0, "rep_ms": 0.0, "min_reps": 2},
                "gpu": {}}


class GPUUnavailable(RuntimeError):
    pass


@dataclass
class WorkItem:
    case: op_cases.OpCase | model_cases.ModelCase
    provider: str
    priority: int  # lower runs first: the budget cuts the least important items
    needs_s: float = 0.0  # not started with less budget left than this (a compile takes a minute or more)


def default_suite() -> str:
    """What `pytest benchmarks/` runs: the GPU suite's items on a CUDA machine, the smoke suite's elsewhere."""
    return "gpu" if torch.cuda.is_available() else "smoke"


def suite_device(suite: str) -> torch.device:
    if suite != "gpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GPUUnavailable(
            "the GPU suite needs a CUDA GPU and torch.cuda.is_available() is False on this machine; "
            "run `fastbert bench --smoke` (CPU smoke run) or `fastbert bench --suite cpu-memory` here, "
            "and `benchmarks/run_gpu.sh OUTDIR` on an H100 or H200")
    from fastbert.ops import TRITON_IMPORT_ERROR
    if TRITON_IMPORT_ERROR is not None:
        raise GPUUnavailable(f"the GPU suite runs fastbert's Triton kernels, but Triton does not import "
                             f"({TRITON_IMPORT_ERROR})")
    return torch.device("cuda")


def work_items(suite: str) -> list[WorkItem]:
    """The suite's (case, provider) pairs in the order they run."""
    if suite == "smoke":
        cases = [*op_cases.smoke_op_cases(), *model_cases.smoke_model_cases()]
        excluded = op_cases.GPU_PROVIDERS | model_cases.GPU_PROVIDERS
        return [WorkItem(c, p, 0) for c in cases for p in c.provider_names() if p not in excluded]
    if suite == "cpu-memory":
        return [WorkItem(c, p, 0) for c in op_cases.cpu_memory_cases() for p in (op_cases.EAGER, op_cases.TORCH)]
    items = [WorkItem(case, p, *GPU_ORDER["compiled op" if p == op_cases.COMPILE else "op"])
             for case in op_cases.gpu_op_cases() for p in case.provider_names()]
    items += [WorkItem(case, p, *GPU_ORDER[model_item_kind(case, p)])
              for case in model_cases.gpu_model_cases() for p in case.provider_names()]
    return sorted(items, key=lambda item: item.priority)  # stable: case order kept within a priority


def selected_items(suite: str, only: str | None) -> list[WorkItem]:
    """The suite's work items whose "case provider" `only` (a regular expression; None or "": all) matches."""
    items = work_items(suite)
    names = [f"{item.case.name} {item.provider}" for item in items]
    check_selection(only, names, suite)
    return [item for item, name in zip(items, names) if not only or re.search(only, name)]


def check_selection(only: str | None, names: list[str], suite: str) -> None:
    """Refuse an --only that selects none of a suite's items (names: what it is matched against), before anything
    is measured or written: otherwise the run measures nothing (the smoke suite: its two peak rows, which are not
    items) and exits 0 as if it had."""
    if only and not any(re.search(only, name) for name in names):
        raise ValueError(f"--only {only!r} matches no item of the {suite} suite (it is searched for in each of "
                         f"its {len(names)} item names, e.g. {names[0]!r})" if names else
                         f"--only {only!r} matches no item of the {suite} suite: it has none")


# The GPU suite's order, what a short budget keeps first: what users compare first (BERT-base training and
# inference, fastbert against transformers' SDPA, then against SDPA + torch.compile), then every op's
# providers, then the other models and providers, then the ops' compiles. kind -> (priority, needs_s).
GPU_ORDER = {"headline model": (0, 20.0), "headline compiled model": (1, 120.0), "op": (2, 5.0),
             "other model": (3, 20.0), "compiled op": (4, 30.0), "other compiled model": (5, 120.0)}
HEADLINE_SIZE = "base"  # BERT-base, the model of issue 26's whole-model targets
HEADLINE_PROVIDERS = frozenset({model_cases.FASTBERT, model_cases.UNPAD, model_cases.HF_SDPA, model_cases.APPLY,
                                model_cases.GRAPH})


def model_item_kind(case: model_cases.ModelCase, provider: str) -> str:
    """The GPU_ORDER kind of a whole-model item."""
    # a case that freezes parameters (BitFit) answers a narrower question than the headline's
    headline = case.size == HEADLINE_SIZE and case.mode in ("train", "inference") and case.trainable == "all"
    if provider == model_cases.HF_COMPILE:
        return "headline compiled model" if headline else "other compiled model"
    return "headline model" if headline and provider in HEADLINE_PROVIDERS else "other model"


def derived(row: dict, peaks: dict) -> dict:
    seconds = comparable_ms(row)[0] * 1e-3
    if row.get("flops"):
        row["tflops"] = row["flops"] / seconds / 1e12
        if peaks.get("tflops"):
            row["tflops_vs_peak"] = row["tflops"] / peaks["tflops"]
    if row.get("bytes"):
        row["gbps"] = row["bytes"] / seconds / 1e9
        if peaks.get("gbps"):
            row["gbps_vs_peak"] = row["gbps"] / peaks["gbps"]
    return row


def op_runs(case: op_cases.OpCase, provider: str, device: torch.device):
    """(make_run, leaves): make_run(direction) returns the callable that one timed call runs, the
    way Liger-Kernel's benchmarks time them: the backward alone replays one forward's graph
    (retain_graph); leaves are the inputs whose .grad is cleared between calls."""
    inputs = case.make_inputs(device)
    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    fn = case.provider(provider)

    def forward():
        return fn(**inputs)

    outputs = forward()
    grad_outputs = (case.grad_outputs(outputs) if case.grad_outputs is not None
                    else [torch.randn_like(o) if o.dim() else torch.ones_like(o) for o in outputs])
    del outputs

    def make_run(direction: str):
        if direction == "fwd":
            return forward
        if direction == "bwd":
            outputs = forward()
            return lambda: torch.autograd.backward(outputs, grad_outputs, retain_graph=True)
        return lambda: torch.autograd.backward(forward(), grad_outputs)
    return make_run, leaves


def measure_op(case: op_cases.OpCase, provider: str, device: torch.device, peaks: dict,
               directions: tuple[str, ...], timing: dict) -> list[dict]:
    """One row per direction: median time (on a GPU also the GPU's time alone, device_ms), peak memory, TFLOP/s and
    GB/s. timing: time_ms's keywords."""
    make_run, leaves = op_runs(case, provider, device)
    rows = []
    for direction in directions:
        run = make_run(direction)
        row = {"direction": direction, **time_ms(run, device, leaves, **timing)}  # clears .grad before each call
        if device.type == "cuda":
            row.update(device_time_fields(run, device, leaves))
        for t in leaves:
            t.grad = None
        row.update(peak_memory(run, device))
        row["flops"] = case.flops(direction) if case.flops else None
        row["bytes"] = case.bytes(direction) if case.bytes else None
        rows.append(derived(row, peaks))
        del run
    return rows


def release(device: torch.device, compiled: bool) -> None:
    if compiled:
        torch._dynamo.reset()  # each case compiles once; a shared cache would hit the recompile limit
    model_cases.free_memory(device)


def case_fields(case) -> dict:
    dtype = getattr(case, "dtype", None)
    fields = {"case": case.name, "op": case.op, "shape": case.shape,
              "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None}
    if getattr(case, "notes", None):
        fields["notes"] = case.notes
    return fields


def run_suite(suite: str, out_dir: str, only: str | None = None, budget_s: float | None = None,
              progress: bool = True, command: list[str] | None = None, quick: bool = False) -> tuple[str, list[dict]]:
    """Run a suite; return the path of the JSON file written under out_dir and its rows. quick (host suite):
    a few calls per row, to check that every row runs (CI), not to measure."""
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}, got {suite!r}")
    device = suite_device(suite)
    if suite == "host":
        from fastbert.bench import host_suite
        check_selection(only, [f"{case.name} {provider}" for case in host_suite.host_cases()
                               for provider in case.providers], suite)
    items = [] if suite in ("data", "host") else selected_items(suite, only)
    budget_s = (GPU_BUDGET_S if suite == "gpu" else None) if budget_s is None else budget_s
    common = {**provenance(device, command), "suite": suite, "timer": timer_name(device),
              "memory_meter": memory_meter_name(device)}
    os.makedirs(out_dir, exist_ok=True)
    path = result_path(out_dir, suite, common)
    if suite == "data":
        from fastbert.bench import data_suite
        rows = [{**common, "timer": data_suite.CPU_CLOCK, "memory_meter": None, **row}
                for row in data_suite.measure(progress)]
        write_rows(path, rows)
        return path, rows
    if suite == "host":
        from fastbert.bench import host_suite
        rows = [{**common, "timer": host_suite.CPU_CLOCK, "memory_meter": None, **row}
                for row in host_suite.measure(quick, progress, only)]
        write_rows(path, rows)
        return path, rows
    start = time.monotonic()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [{**common, "status": "ok", **r} for r in measure_peaks(device, dtype, quick=suite == "smoke")]
    peaks = peak_figures(rows)
    directions = ("fwd+bwd",) if suite == "cpu-memory" else op_cases.DIRECTIONS
    timing = SUITE_TIMING[suite]
    write_rows(path, rows)

    from tqdm import tqdm
    bar = tqdm(items, desc=f"fastbert bench {suite}", unit="item", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    for item in bar:
        bar.set_postfix_str(f"{item.case.name} [{item.provider}]", refresh=False)
        base = {**common, **case_fields(item.case), "provider": item.provider}
        if isinstance(item.case, model_cases.ModelCase):
            base["backend"] = model_cases.provider_backend(item.provider, item.case.config)
        if budget_s is not None and budget_s - (time.monotonic() - start) < item.needs_s:
            rows.append({**base, "status": "skipped", "error": f"time budget of {budget_s:.0f} s spent"})
            continue
        try:
            if isinstance(item.case, model_cases.ModelCase):
                measured = model_cases.measure_model(item.case, item.provider, device, peaks, timing)
            else:
                measured = measure_op(item.case, item.provider, device, peaks, directions, timing)
            rows += [{**base, "status": "ok", **m} for m in measured]
        except model_cases.oom_errors() as exc:
            rows.append({**base, "status": "oom", "error": str(exc).splitlines()[0]})
        except Exception as exc:  # one provider failing must not lose the rest of the run
            logger.exception(f"{item.case.name} [{item.provider}] failed; the run goes on")
            rows.append({**base, "status": "error", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                         if str(exc) else type(exc).__name__})
        release(device, item.provider in (op_cases.COMPILE, model_cases.HF_COMPILE))
        write_rows(path, rows)
    rows_total = time.monotonic() - start
    for row in rows:
        row["suite_seconds"] = round(rows_total, 1)
    write_rows(path, rows)
    return path, rows


def result_path(out_dir: str, suite: str, common: dict) -> str:
    """The JSON file of one run: suite, device and the run's start, e.g. gpu-NVIDIA-H100-20260101T000000Z.json."""
    stamp = common["date"].replace(":", "").replace("-", "").replace("+0000", "Z")
    return os.path.join(out_dir, f"{suite}-{re.sub(r'[^A-Za-z0-9]+', '-', common['device']).strip('-')}-{stamp}.json")


def write_rows(path: str, rows: list[dict]) -> None:
    """The results JSON, replaced whole (fastbert.files.write_text: a full disk leaves the previous rows)."""
    write_text(path, json.dumps(rows, indent=1, default=str) + "\n")


def cpu_script_parser(doc: str, sizes: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The arguments every CPU-side benchmark script (benchmarks/host_*.py) takes: --out, and with `sizes`
    --size (repeatable; default all of them). `doc` is the script's docstring, whose first line describes it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"),
                        help="directory of the JSON rows (default benchmarks/results)")
    if sizes:
        parser.add_argument("--size", choices=sizes, action="append", help="a model (repeatable; default all)")
    return parser


def save_cpu_rows(out_dir: str, suite: str, timer: str, rows: list[dict],
                  table: Callable[[list[dict]], str]) -> str:
    """A CPU-side benchmark script's run (benchmarks/host_*.py): the rows under this machine's provenance and
    the timer's name, their table printed, written to out_dir/<suite>-<machine>-<time>.json. Returns the path."""
    common = {"suite": suite, **provenance(torch.device("cpu")), "timer": timer}
    rows = [{**common, **row} for row in rows]
    print(table(rows))
    os.makedirs(out_dir, exist_ok=True)
    path = result_path(out_dir, suite, common)
    write_rows(path, rows)
    logger.info("%d rows written to %s", len(rows), path)
    return path


# what the smoke suite's figures are: one warm-up call and three timed, at shapes of a few kilobytes, on a
# CPU that other work shares: a time there is overhead and noise, not an op's cost
SMOKE_CAVEAT = ("smoke run: tiny shapes, 3 timed calls on the CPU; it checks that every provider runs and reports, "
                "its times are noise, not costs (compare providers with --suite gpu on a GPU)")


def summary(rows: list[dict]) -> str:
    """A plain-text table of the rows, for the terminal; a smoke run's says first that its times are noise.
    Column "auto": * on the op rows of the path backend="auto" runs there (fastbert.paths' committed table)."""
    from fastbert.bench.path_table import chosen_provider

    lines = [SMOKE_CAVEAT] if any(r.get("suite") == "smoke" for r in rows) else []
    lines += [f"{'case':<58} {'provider':<16} {'auto':<4} {'dir':<10} {'status':<7} {'ms':>9} {'GPU ms':>9} "
              f"{'host ms':>9} {'TFLOP/s':>8} {'GB/s':>8} {'peak MB':>9}"]
    for r in rows:
        mem = r.get("peak_mem_extra_bytes") if r.get("peak_mem_bytes") is None else r.get("peak_mem_bytes")
        cells = [f"{r.get('median_ms', float('nan')):9.3f}", _fmt(r.get("device_ms"), 9, 3),
                 _fmt(r.get("host_ms"), 9, 3), _fmt(r.get("tflops"), 8, 1), _fmt(r.get("gbps"), 8, 0),
                 _fmt(None if mem is None else mem / 2 ** 20, 9, 1)]
        chosen = "*" if chosen_provider(r) == r["provider"] else ""
        lines.append(f"{r['case'][:58]:<58} {r['provider']:<16} {chosen:<4} {str(r.get('direction', '')):<10} "
                     f"{r['status']:<7} " + " ".join(cells))
    return "\n".join(lines)


def _fmt(value, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if isinstance(value, (int, float)) else " " * (width - 1) + "-"
