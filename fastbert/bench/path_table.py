"""fastbert/paths.json, the table backend="auto" chooses from on a GPU (fastbert.paths), written from the GPU
suite's rows: `python benchmarks/choose_paths.py` after a GPU run has been copied into benchmarks/results/.

Per GPU architecture, every op row maps to the op fastbert.paths looks up, its shape class, dtype and direction
("fwd": inference, "fwd+bwd": training), and each provider to the implementation it runs (`implementation_of`);
the table keeps, per class and direction, the times of the op's candidates (fastbert.paths.CANDIDATES: those that
keep what the kernel keeps) and the fastest, `chosen`, all from one run: the newest that timed every candidate any
run timed there (a run cut short by its budget leaves an older, whole comparison standing), else the newest of those
that timed the most. A time is the GPU's alone where every row of the comparison has it, else the rows' medians
(fastbert.bench.timing.comparable_ms): in a model the host runs ahead of the GPU, so what a path costs there is its
GPU time. Which rows decide which op (row_class):
  layer_norm -> layer_norm; bias_gelu -> bias_gelu; ffn_up -> linear_bias_gelu (and the FFNs' up-projection);
  qkv_projection -> qkv_projection; attention without padding -> attention (padded attention keeps the kernel,
  see fastbert.paths); mlm_head (the MLM transform, LayerNorm and loss together) -> linear_cross_entropy.
The provider "torch" (PyTorch's own ops as a user writes them) is shown in PERF.md but chooses nothing: it is
not a path of fastbert.ops ("fastbert-eager", the reference that backend="torch" runs, is).
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os

import torch

from fastbert import paths
from fastbert.command import configure_logging
from fastbert.bench.runs import first_rows
from fastbert.bench.timing import comparable_ms
from fastbert.files import write_text

logger = logging.getLogger("fastbert.bench")
PROVIDER_IMPLEMENTATION = {"fastbert": "triton", "fastbert-eager": "torch", "fastbert-split": "cublas_then_bias_gelu"}
# "fastbert-split" is each op's cuBLAS form: the FFN's (cuBLAS's GEMM, then the bias + GELU kernel) or the QKV's
SPLIT_FORMS = {"qkv_projection": "cublas_forward"}
IMPLEMENTATION_PROVIDER = {implementation: provider for provider, implementation in PROVIDER_IMPLEMENTATION.items()}
IMPLEMENTATION_PROVIDER.update({implementation: "fastbert-split" for implementation in SPLIT_FORMS.values()})
# The compute capability of the GPUs whose rows predate the rows' "architecture" field (the first H100 run)
DEVICE_ARCHITECTURES = {"NVIDIA H100": "sm_90", "NVIDIA H200": "sm_90", "NVIDIA A100": "sm_80"}
REGENERATE = "python benchmarks/choose_paths.py"
SUITE_OPS = ("layer_norm", "bias_gelu", "ffn_up", "qkv_projection", "attention", "mlm_head")  # op_cases' ops


def architecture(row: dict) -> str:
    """The row's GPU architecture, e.g. "sm_90": its "architecture" field, else known from its device name.
    Raises ValueError for a device of neither."""
    if row.get("architecture"):
        return row["architecture"]
    for prefix, arch in DEVICE_ARCHITECTURES.items():
        if row["device"].startswith(prefix):
            return arch
    raise ValueError(f"the rows of {row['device']!r} name no architecture; rerun the suite (its rows record it) "
                     f"or add the device to DEVICE_ARCHITECTURES")


def row_class(row: dict) -> tuple[str, tuple[int, ...]] | None:
    """(fastbert.paths op, sizes in its SIZES order) that an op row of the GPU suite measures; None for rows no
    choice reads (peaks, models, padded attention)."""
    op, shape = row["op"], row["shape"]
    if op in ("layer_norm", "bias_gelu"):
        return op, (shape["rows"], shape["hidden" if op == "layer_norm" else "features"])
    if op == "ffn_up":
        return "linear_bias_gelu", (shape["rows"], shape["hidden"], shape["intermediate"])
    if op == "qkv_projection":
        return op, (shape["batch"] * shape["seqlen"], shape["hidden"])
    if op == "attention" and shape["padding"] == 0:
        return op, (shape["batch"] * shape["seqlen"], shape["seqlen"], shape["head_dim"])
    if op == "mlm_head":
        labelled = round(shape["batch"] * shape["seqlen"] * shape["labelled"])
        return "linear_cross_entropy", (labelled, shape["hidden"], shape["vocab"])
    return None


def gpu_rows_by_architecture(rows: list[dict]) -> dict[str, list[dict]]:
    """{architecture: its GPU-suite rows, of every run}."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        if row.get("suite") == "gpu":
            groups.setdefault(architecture(row), []).append(row)
    return dict(sorted(groups.items()))


def implementation_of(row: dict) -> str | None:
    """The fastbert.paths implementation a GPU-suite row's provider ran; None for providers that are none."""
    if row["provider"] == "fastbert-split" and row["op"] in SPLIT_FORMS:
        return SPLIT_FORMS[row["op"]]
    return PROVIDER_IMPLEMENTATION.get(row["provider"])


def build_table(rows: list[dict], sources: dict[str, str] | None = None) -> dict:
    """The table fastbert.paths loads, from GPU-suite rows: per architecture, op, class, dtype and direction,
    each candidate's ms and the fastest, from one run: the newest that timed every candidate any run timed there
    (a run cut short by its budget leaves an older, whole comparison standing), else the newest of those that timed
    the most candidates, then cases. sources: {date: file} of the runs read, recorded with each architecture."""
    table = {"generated_by": REGENERATE, "architectures": {}}
    for arch, arch_rows in gpu_rows_by_architecture(rows).items():
        by_key: dict[tuple, dict[str, list[dict]]] = {}  # (op, class, dtype, direction) -> run date -> rows
        for row in arch_rows:
            measured = row_class(row) if row["status"] == "ok" else None
            implementation = implementation_of(row)
            if measured is None or implementation not in paths.CANDIDATES.get(measured[0], ()) \
                    or row.get("direction") not in paths.DIRECTIONS:
                continue
            op, sizes = measured
            key = (op, paths.class_name(op, sizes), row["dtype"], row["direction"])
            by_key.setdefault(key, {}).setdefault(row["date"], []).append(row)
        ops: dict = {}
        used: set[str] = set()
        for (op, name, dtype, direction), by_run in by_key.items():
            timed = {date: _run_times(run_rows) for date, run_rows in by_run.items()}
            every = set().union(*timed.values())  # the candidates any run timed
            cases = {date: len({row["case"] for row in run_rows}) for date, run_rows in by_run.items()}
            date = max(timed, key=lambda d: (set(timed[d]) == every, len(timed[d]), cases[d], d))
            if not timed[date]:
                continue
            if set(timed[date]) != every:
                logger.warning("%s %s %s %s: no run timed every candidate (%s); chosen from the run of %s, which "
                               "timed %s", op, name, dtype, direction, sorted(every), date, sorted(timed[date]))
            used.add(date)
            ops.setdefault(op, {}).setdefault(name, {}).setdefault(dtype, {})[direction] = {
                "chosen": min(timed[date], key=timed[date].get),
                "ms": {i: round(t, 4) for i, t in timed[date].items()}}
        if not ops:  # no op rows of this architecture decide anything: no entry to be its nearest measured one
            continue
        firsts = first_rows(arch_rows)
        table["architectures"][arch] = {
            "sources": [{"device": r["device"], "date": r["date"], "commit": r.get("commit"), "torch": r.get("torch"),
                         "triton": r.get("triton"), "command": r.get("command"), "file": (sources or {}).get(r["date"])}
                        for date, r in firsts.items() if date in used],
            "ops": ops}
    return table


def _run_times(rows: list[dict]) -> dict[str, float]:
    """{implementation: ms} of one run's rows of one class and direction: the sum over the class's cases, for the
    implementations that timed every one; the GPU's time alone where every row has it, else the medians, so that
    a comparison never sets one against the other (a call that syncs has no GPU time alone)."""
    cases = {row["case"] for row in rows}
    times: dict[str, list[float]] = {}
    for row, ms in zip(rows, comparable_ms(*rows)):
        times.setdefault(implementation_of(row), []).append(ms)
    return {i: sum(t) for i, t in times.items() if len(t) == len(cases)}


def chosen_provider(row: dict, table: dict | None = None) -> str | None:
    """The provider whose path backend="auto" runs for this op row's case on the row's device (CPU: the
    reference, "fastbert-eager"), by `table` (a fastbert.paths.load result; default the one "auto" reads now,
    fastbert.paths.TABLE); None for rows of no op (peaks, models, other suites)."""
    if row["op"] not in SUITE_OPS:
        return None
    if row.get("device_type") != "cuda":
        return IMPLEMENTATION_PROVIDER["torch"]
    measured = row_class(row)
    if measured is None:  # padded attention: the kernel
        return IMPLEMENTATION_PROVIDER["triton"]

    op, sizes = measured
    direction = "fwd" if row.get("direction") == "fwd" else "fwd+bwd"
    implementation = paths.lookup(paths.TABLE if table is None else table, int(architecture(row).removeprefix("sm_")),
                                  op, getattr(torch, row["dtype"]), direction, paths.buckets(sizes))
    return IMPLEMENTATION_PROVIDER[implementation]


def load_results(results_dir: str) -> tuple[list[dict], dict[str, str]]:
    """(rows of every gpu-*.json under results_dir, {run date: file path})."""
    rows, sources = [], {}
    for path in sorted(glob.glob(os.path.join(results_dir, "gpu-*.json"))):
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
        rows += run
        sources.update({row["date"]: path for row in run})
    return rows, sources


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="choose_paths", description="Write fastbert/paths.json, the table "
                                "backend='auto' chooses from on a GPU, from the GPU suite's rows.")
    p.add_argument("--results", default="benchmarks/results", help="directory of the gpu-*.json result files")
    p.add_argument("--out", default=paths.COMMITTED_TABLE_PATH, help="the table to write (default fastbert/paths.json)")
    args = p.parse_args(argv)
    configure_logging("choose_paths")
    rows, sources = load_results(args.results)
    table = build_table(rows, sources)
    if not table["architectures"]:
        raise SystemExit(f"no GPU-suite rows under {args.results}: nothing to choose from")
    write_text(args.out, json.dumps(table, indent=1) + "\n")
    chosen = sum(len(d) for a in table["architectures"].values() for c in a["ops"].values() for t in c.values()
                 for d in t.values())
    logger.info(f"wrote {args.out}: {chosen} choices for {', '.join(table['architectures'])}")
    return 0


# What the first H100 run's op rows measured (its README's profile): say so next to a table built from them.
HOST_BOUND_RUNS = {"2026-11-26T11:06:58+00:00": (
    "**Read with care:** this run's op rows were taken while each fused op cost 300-450 us of host time per "
    "call (the torch.profiler tables of the same session, profile-bert-base.txt beside its rows): where an op's "
    "GPU time is below that, its Triton rows time the host, not the kernel, so the table chooses PyTorch's path "
    "for most ops. Rerun the GPU suite once the launchers' host cost is down, then "
    "`python benchmarks/choose_paths.py` and `python benchmarks/make_perf.py`.")}


def table_section(path: str = paths.COMMITTED_TABLE_PATH) -> list[str]:
    """PERF.md's section on the committed table: per architecture, op, class and dtype, what "auto" runs for
    inference (fwd) and training (fwd+bwd), with the times it chose from."""
    with open(path, encoding="utf-8") as f:
        table = json.load(f)
    lines = ["## The faster path per op (issue 26)", "",
             'On CUDA tensors, backend="auto" runs each fused op\'s implementation measured fastest at its shape class '
             "on the nearest measured GPU architecture (fastbert/paths.py: the shape classes, the fallbacks): "
             "`triton` (the kernel, what backend=\"triton\" runs), `torch` (the PyTorch reference: cuBLAS, SDPA, "
             "PyTorch's LayerNorm and GELU), `cublas_then_bias_gelu` (cuBLAS's GEMM, then the Triton bias + GELU "
             "kernel) or `cublas_forward` (the QKV projection: PyTorch's forward, the kernel's backward). "
             f"The table is fastbert/paths.json, written by `{REGENERATE}` from the GPU suite's rows; the "
             "chosen implementation is in bold, with the ms of each measured one (the GPU's time alone where the rows "
             "have it, else their medians). The per-op tables below "
             "mark the chosen provider \"(auto)\" (a choice may rest on an older run than a table's row: the runs "
             "it read are named here).", ""]
    if not table["architectures"]:
        return lines + ["No GPU run has been measured yet: \"auto\" runs the kernels.", ""]
    for arch, entry in table["architectures"].items():
        sources = entry["sources"]
        runs = "; ".join(f"{s.get('file') or 'a run'} ({s['date']}, commit {(s['commit'] or 'unknown')[:12]}, "
                         f"torch {s['torch']}, triton {s['triton']}): `{s['command']}`" for s in sources)
        each_case = (" (each class and direction from the newest run that timed the most of its candidates)"
                     if len(sources) > 1 else "")
        lines += [f"### {arch}: {sources[0]['device']}", "", f"*From {runs}{each_case}.*", ""]
        lines += [line for s in sources if s["date"] in HOST_BOUND_RUNS for line in (HOST_BOUND_RUNS[s["date"]], "")]
        lines += ["| op | shape class | dtype | inference (fwd) | training (fwd+bwd) |", "|---|---|---|---|---|"]
        for op, classes in entry["ops"].items():
            for name, dtypes in classes.items():
                for dtype, directions in dtypes.items():
                    cells = [_choice_cell(directions.get(d)) for d in paths.DIRECTIONS]
                    lines.append(f"| {op} | {name} | {dtype} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _choice_cell(measured: dict | None) -> str:
    if measured is None:
        return "not yet measured"
    return " · ".join(f"**{i} {ms:.3f}**" if i == measured["chosen"] else f"{i} {ms:.3f}"
                      for i, ms in measured["ms"].items())
