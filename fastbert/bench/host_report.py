"""PERF.md's section on host time: the newest `fastbert bench --suite host` run, op by op and model by model, the
newest `benchmarks/host_census.py` run, what those model calls do, counted, the newest
`benchmarks/host_instructions.py` run, the instructions each call executes, and the host's time of the GPU suite's
calls on a real GPU (their rows' host_ms)."""
from __future__ import annotations

from fastbert.bench.runs import newest_per_case, run_labels

HOST_COMMAND = "fastbert bench --suite host --out benchmarks/results"
# The done-when of issue 25: a fused op's host time at most this many times PyTorch's same job
OP_LIMIT = 1.5
COMPARISONS = ("torch", "hf-sdpa")  # an op's: PyTorch's same job; a model's: transformers with SDPA
# a model's also on an H100's path (backend "auto" as an H100 runs it) and on its PyTorch path (backend "torch")
FASTBERT_PROVIDERS = ("fastbert", "fastbert-h100", "fastbert-eager")


CENSUS_COMMAND = "python benchmarks/host_census.py"
CENSUS_COLUMNS = (("python_calls", "Python calls"), ("c_calls", "calls into C"), ("launches", "launches"),
                  ("backward_launches", "of them in the backward"), ("autograd_nodes", "autograd nodes"),
                  ("python_nodes", "of them Python"), ("view_nodes", "of them views"), ("host_syncs", "syncs"))


def _comparison(by_key: dict, case: str, direction: str) -> dict | None:
    """The row a fastbert row of (case, direction) is judged against: PyTorch's same job or transformers' model."""
    return next((by_key[(case, direction, p)] for p in COMPARISONS if (case, direction, p) in by_key), None)


def _within(row: dict, ratio: float) -> str:
    """Whether a fastbert row's ratio to its comparison holds issue 25's limit: OP_LIMIT for an op, 1 for a model."""
    return "yes" if ratio <= (OP_LIMIT if row["op"] != "model" else 1.0) else "**no**"


def _newest(rows: list[dict], suite: str = "host") -> list[dict]:
    runs: dict[str, list[dict]] = {}
    for row in rows:
        if row.get("suite") == suite:
            runs.setdefault(row["date"], []).append(row)
    return runs[max(runs)] if runs else []


def census_lines(rows: list[dict], provenance_line) -> list[str]:
    """The newest `benchmarks/host_census.py` run as a table: what each model call does, counted."""
    run = _newest(rows, "host-census")
    out = ["### Host work per call, counted", ""]
    if not run:
        return out + [f"Not yet counted: `{CENSUS_COMMAND}`.", ""]
    out += ["The same model calls as the rows above, counted rather than timed (`benchmarks/host_census.py`): "
            "exact on any machine, so a change shows here even where the timings' noise hides it. Python calls "
            "and calls into C as sys.setprofile sees them; launches of Triton kernels; the training step's "
            "autograd graph (parameter accumulators left out); host syncs.", "",
            "| case | provider | direction | " + " | ".join(title for _, title in CENSUS_COLUMNS) + " |",
            "|---|---|---|" + "---|" * len(CENSUS_COLUMNS)]
    for row in run:
        out.append(f"| {row['case']} | {row['provider']} | {row['direction']} | "
                   + " | ".join(str(row.get(key, "-")) for key, _ in CENSUS_COLUMNS) + " |")
    return out + ["", provenance_line(run), ""]


INSTRUCTIONS_COMMAND = "python benchmarks/host_instructions.py"


def instruction_lines(rows: list[dict], provenance_line) -> list[str]:
    """The newest `benchmarks/host_instructions.py` run as a table: each fastbert call's instructions beside its
    comparison's, and their ratio."""
    run = _newest(rows, "host-instructions")
    out = ["### Host instructions per call, counted", ""]
    if not run:
        return out + [f"Not yet counted: `{INSTRUCTIONS_COMMAND}`.", ""]
    out += ["The timed calls above, each run under valgrind's callgrind (`benchmarks/host_instructions.py`): the "
            "instructions one call executes, an empty call's subtracted. They move by at most 1.5% between runs of "
            "the same code, where the times above move by 10-50%, so a change of a few percent shows; they are not "
            "time (a cache miss costs more than an add), and the limits above are judged on time.", "",
            "| case | direction | fastbert | through the custom op | PyTorch / transformers | ratio |",
            "|---|---|---|---|---|---|"]
    by_key = {(r["case"], r["direction"], r["provider"]): r["instructions"] for r in run}
    for (case, direction, provider), count in by_key.items():
        if provider not in FASTBERT_PROVIDERS:
            continue
        other = next(((p, by_key[(case, direction, p)]) for p in COMPARISONS if (case, direction, p) in by_key), None)
        if other is None:
            continue
        custom = by_key.get((case, direction, "fastbert-custom-op"))
        label = case if provider == "fastbert" else f"{case} [{provider}]"
        out.append(f"| {label} | {direction} | {count:,} | {'-' if custom is None else f'{custom:,}'} "
                   f"| {other[1]:,} ({other[0]}) | {count / other[1]:.2f} |")
    return out + ["", provenance_line(run), ""]


GPU_HOST_COMMAND = "benchmarks/gpu_session.sh OUT"


def gpu_host_lines(rows: list[dict], provenance_line) -> list[str]:
    """The host's time per call on a GPU, from the GPU suite's rows that carry it (host_ms, fastbert/bench/timing.py's
    device_time_ms) on the GPU that ran the newest, each case from its newest run: an op's fastbert paths beside
    PyTorch's same job, a model's inference forward beside transformers', as the stand-in's rows above compare them."""
    out = ["### Host time per call on a GPU", ""]
    timed = [r for r in rows if r.get("suite") == "gpu" and r.get("host_ms") is not None]
    if timed:
        device = max(timed, key=lambda r: r["date"])["device"]
        timed = newest_per_case([r for r in timed if r["device"] == device])
    if not timed:
        return out + [f"Not yet measured: the GPU suite's rows record it since 2026-12-01 (`{GPU_HOST_COMMAND}`).", ""]
    out += ["What the host spends launching one call on a real GPU: the GPU suite's calls timed by the host's clock "
            "while a sleep kernel holds the GPU, so that no call waits for it (host_ms, `fastbert/bench/timing.py`). "
            f"The limit for an op is {OP_LIMIT}x PyTorch's same job; for a model, transformers' own time.", "",
            "| case | direction | provider | host us | PyTorch / transformers host us | ratio | within | GPU us |",
            "|---|---|---|---|---|---|---|---|"]
    labels = run_labels(timed)
    by_key = {(r["case"], r["direction"], r["provider"]): r for r in timed}
    for (case, direction, provider), row in by_key.items():
        other = _comparison(by_key, case, direction)
        if other is None or not provider.startswith("fastbert"):
            continue
        ratio = row["host_ms"] / other["host_ms"]
        label = f"{case} ({labels[row['date']]})" if labels else case
        out.append(f"| {label} | {direction} | {provider} | {1e3 * row['host_ms']:,.1f} "
                   f"| {1e3 * other['host_ms']:,.1f} ({other['provider']}) | {ratio:.2f} | {_within(row, ratio)} "
                   f"| {1e3 * row['device_ms']:,.1f} |")
    return out + ["", provenance_line(timed), ""]


def host_section(rows: list[dict], provenance_line) -> list[str]:
    """The section's lines: every op's and model's host microseconds per call, fastbert beside the comparison
    (PyTorch's same job for an op, transformers with SDPA for a model), their ratio and host syncs per call."""
    out = ["## Host time per call", ""]
    run = _newest(rows)
    if not run:
        return (out + [f"Not yet measured: `{HOST_COMMAND}`.", ""] + census_lines(rows, provenance_line)
                + instruction_lines(rows, provenance_line) + gpu_host_lines(rows, provenance_line))
    out += ["What the host spends per call, measured without a GPU (the last table: on one): fastbert's launchers "
            "run on CPU tensors with every Triton launch stubbed (the steady path of a GPU launch up to the "
            "driver's launch call, which is not counted), PyTorch's ops and transformers' models run on the same CPU tensors at sizes where "
            "their arithmetic is small (`fastbert/bench/host_suite.py`). Thread CPU time, least mean of repeated "
            "groups of calls (40 groups of 50 calls an op, 50 of 5 a model), the providers of a case taking turns "
            "(the speed of a shared machine drifts from minute to minute; rows of runs before 2026-11-26T23:16 "
            "timed one provider after the other, model rows before 2026-11-27T04:40 groups of 50 calls, and op "
            "rows before 2026-11-27T14:56 5 groups, whose ratios moved by up to a half from run to run). "
            "Denormal floats are flushed to zero while the launches are stubbed: a stubbed kernel leaves its output "
            "unwritten, and PyTorch's ops that then read it (a backward's matmuls) multiplied leftover denormals in "
            "microcode (92 us for a matmul of 2.2 us on normal values, `fastbert/simulated/host_time.py`) in "
            "fastbert's fwd+bwd rows of runs before 2026-11-30T05:00. A stubbed launch calls the C launch of Triton's "
            "CUDA launcher object (a no-op here), as a GPU launch calls the real one: fastbert's kept launches "
            "directly, with what the object would hand it (`kernels/launch.py`); runs before 2026-11-30T23:30 "
            "called a stub function in the object's place. "
            "Ops: `fwd` is an inference call (no_grad, dropout off), `fwd+bwd` a training "
            "forward and its backward, against the same job written with PyTorch's ops. Models: BERT-base's and "
            "ModernBERT-base's graphs (every layer and op, 2 heads of 32, hidden 64), fastbert (backend "
            "\"triton\"; as fastbert-h100, backend \"auto\" running the paths an H100 runs at the GPU suite's "
            "shape of the call, fastbert/paths.json's choices, recorded from that call planned at full width on "
            "meta tensors (host_suite.py's H100_SHAPES); and, as fastbert-eager, backend \"torch\": what "
            "\"auto\" runs on CPU tensors) against "
            "transformers with SDPA, all with default arguments: `fwd` an inference forward "
            "of a padded batch, `fwd+bwd` a pretraining step (loss, backward, AdamW), in float32 without the GPU "
            "suite's bf16 autocast (its casts are left out of every provider's rows). Syncs: what would make the "
            f"host wait for a GPU in one call (`fastbert.host_syncs`). The limit for an op is {OP_LIMIT}x; for a "
            "model, transformers' own time.", ""]
    by_key = {(r["case"], r["direction"], r["provider"]): r for r in run if r.get("status") == "ok"}
    out += ["| case | direction | fastbert us | through the custom op us | PyTorch / transformers us | ratio | within "
            "| syncs (fastbert / other) |", "|---|---|---|---|---|---|---|---|"]
    for (case, direction, provider), row in by_key.items():
        if provider not in FASTBERT_PROVIDERS:
            continue
        other = _comparison(by_key, case, direction)
        if other is None:
            continue
        custom = by_key.get((case, direction, "fastbert-custom-op"))
        custom_us = f"{custom['host_us']:.1f}" if custom else "-"
        ratio = row["host_us"] / other["host_us"]
        label = case if provider == "fastbert" else f"{case} [{provider}]"
        out.append(f"| {label} | {direction} | {row['host_us']:.1f} | {custom_us} | {other['host_us']:.1f} "
                   f"({other['provider']}) | {ratio:.2f} | {_within(row, ratio)} "
                   f"| {row['host_syncs']} / {other['host_syncs']} |")
    return (out + ["", provenance_line(run), ""] + census_lines(rows, provenance_line)
            + instruction_lines(rows, provenance_line) + gpu_host_lines(rows, provenance_line))
