"""PERF.md's floors: for every op case of the GPU suite and direction, the least time the job can take on an H100
and how far each measured provider is from it.

A case with a FLOP count (the matmul-type ops: QKV, the FFN up-projection, attention, the MLM head) is bound by
the H100's bf16 matmul rate, its floor FLOPs / MATMUL_FLOP_PER_S; the rest (LayerNorm, bias + GELU) by its copy
bandwidth, the least bytes a fused kernel moves / COPY_BYTES_PER_S. The counts are op_cases' (DESIGN.md's
formulas). A provider's distance is its time (the GPU's alone where the row has it, else its median; timing.comparable_ms)
over the floor: 1.0x is the floor itself.
"""
from __future__ import annotations

from fastbert.bench import op_cases
from fastbert.bench.timing import comparable_ms

# The first H100 run's measured peaks (gpu-runs/2026-11-26-h100/README.md): device copy 2.97-3.0 TB/s, bf16
# matmul 793 TFLOP/s at 8192^3 through torch (the suite's own peak row, at a smaller size, 729).
COPY_BYTES_PER_S = 3.0e12
MATMUL_FLOP_PER_S = 790e12
FLOOR_DEVICE = "NVIDIA H100"  # the floors are this GPU's; runs on others are left out


def floor_ms(case: op_cases.OpCase, direction: str) -> tuple[float, str]:
    """(floor in ms, "compute" or "memory") of one direction of a case."""
    if case.flops is not None:
        return case.flops(direction) / MATMUL_FLOP_PER_S * 1e3, "compute"
    return case.bytes(direction) / COPY_BYTES_PER_S * 1e3, "memory"


def floors_section(gpu_runs: dict[tuple[str, str], list[dict]], provider_order=()) -> list[str]:
    """The section: per H100 run, one row per case and direction of op_cases.gpu_op_cases(), with each provider's
    time and its distance from the floor (or why there is none); providers in provider_order first."""
    lines = ["## Floors (issue 26)", "",
             f"The least time of each op case on an H100: FLOPs over {MATMUL_FLOP_PER_S / 1e12:.0f} TFLOP/s for the "
             f"matmul-type ops (bound: compute), else the least bytes a fused kernel moves over "
             f"{COPY_BYTES_PER_S / 1e12:.1f} TB/s (bound: memory), the H100's measured bf16 matmul rate and copy "
             "bandwidth; each provider's time (the GPU's alone where measured, else the median) follows with its distance "
             "from the floor (1.0x is the floor). "
             "Counts as in the per-op tables (DESIGN.md's formulas; the MLM head's on its labelled rows).", ""]
    h100 = {key: rows for key, rows in gpu_runs.items() if key[1].startswith(FLOOR_DEVICE)}
    if not h100:
        return lines + ["The measured side is **not yet measured**: no H100 has run the GPU suite.", ""]
    for (_, device), rows in h100.items():
        by_key = {(r["case"], r["provider"], r.get("direction")): r for r in rows}
        cases = op_cases.gpu_op_cases()
        measured = {key[1] for key in by_key}
        case_providers = {p for c in cases for p in c.provider_names()}
        providers = [p for p in dict.fromkeys([*provider_order, *sorted(case_providers)])
                     if p in measured and p in case_providers]
        lines += [f"### {device}, {rows[0]['date']}", "",
                  "| case | direction | bound | floor | " + " | ".join(providers) + " |",
                  "|---|---|---|---|" + "---|" * len(providers)]
        for case in cases:
            for direction in op_cases.DIRECTIONS:
                floor, bound = floor_ms(case, direction)
                cells = [_distance(by_key.get((case.name, p, direction)) or by_key.get((case.name, p, None)), floor)
                         if p in case.provider_names() else "" for p in providers]
                lines.append(f"| {case.name.split('/', 1)[0]} {case.name.split('/', 1)[1]} | {direction} | {bound} | "
                             f"{1e3 * floor:,.1f} us | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _distance(row: dict | None, floor: float) -> str:
    """A provider's cell: its time and distance, or its status (skipped by the time budget, failed), or "-"."""
    if row is None:
        return "-"
    if row["status"] != "ok":
        return row["status"] + (" (time budget)" if row["status"] == "skipped" else "")
    ms = comparable_ms(row)[0]
    return f"{1e3 * ms:,.1f} us ({ms / floor:.1f}x)"
