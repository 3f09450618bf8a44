"""PERF.md's section "Compiled for H100 and A100 (static, no GPU needed)", from the rows of the newest
`fastbert bench --suite compile` run: per target, the config each launcher call compiles by default (or the
range over its autotuning candidates), then the worst case of every kernel over all its configs, dtypes and
Triton versions, then the gates."""
from __future__ import annotations

from fastbert.bench.compile_audit import (CHOSEN_BY_AUTOTUNER, CHOSEN_BY_LAUNCHER, GATED_DTYPES, MATMUL_KERNELS,
                                          TARGETS, gate_failures)
from fastbert.bench.compile_cases import DTYPES

COMMAND = "fastbert bench --suite compile --out benchmarks/results"
TITLE = "Compiled for H100 and A100 (static, no GPU needed)"
SHOWN_DTYPE = "bfloat16"  # the launcher tables: the dtype training runs in; the worst-case table covers all
_TARGET_GPU = {"sm_90a": "H100", "sm_80": "A100"}


def _config_text(config: dict) -> str:
    tiles = "x".join(str(v) for k, v in config.items() if k.startswith("BLOCK"))  # GROUP_M orders, not tiles
    return f"{tiles}, {config['num_warps']} warps, {config['num_stages']} stages"


def _span(values, fmt: str = "") -> str:
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def _figures(rows: list[dict]) -> list[str]:
    """regs, spill bytes, shared KB, HGMMA / HMMA, occupancy: one value, or the range over the rows."""
    return [_span([r["registers"] for r in rows]), _span([r["spill_store_bytes"] for r in rows]),
            _span([r["shared_bytes"] / 1024 for r in rows], ".0f"),
            f"{_span([r['wgmma'] for r in rows])} / {_span([r['mma'] for r in rows])}",
            _span([r["occupancy"] for r in rows], ".2f")]


def newest_run(rows: list[dict]) -> list[dict]:
    """The rows of the newest compile run (a run is the rows sharing one date)."""
    dates = [r["date"] for r in rows if r.get("suite") == "compile"]
    return [r for r in rows if r.get("suite") == "compile" and r["date"] == max(dates)] if dates else []


def _launcher_table(rows: list[dict], target: str, triton: str) -> list[str]:
    """One line per (launcher call, kernel, config it picks), or per autotuned kernel with its candidates."""
    shown = [r for r in rows if r["target"] == target and r["dtype"] == SHOWN_DTYPE and r.get("triton") == triton
             and r["status"] == "ok"]
    groups: dict[tuple, list[dict]] = {}
    for row in shown:
        for use in row["uses"]:
            if use["chosen_by"] == CHOSEN_BY_LAUNCHER:
                key = (use["launcher"], use["variant"], row["kernel"], _config_text(row["config"]))
            else:
                key = (use["launcher"], use["variant"], row["kernel"], CHOSEN_BY_AUTOTUNER)
            if row not in groups.setdefault(key, []):
                groups[key].append(row)
    lines = ["| launcher [variant] | kernel | config | registers | spill bytes | shared KB | HGMMA / HMMA | "
             "occupancy |", "|---|---|---|---|---|---|---|---|"]
    for (launcher, variant, kernel, config), group in sorted(groups.items()):
        if config == CHOSEN_BY_AUTOTUNER:
            configs = sorted(group, key=lambda r: tuple(r["config"].values()), reverse=True)  # largest tiles first
            candidates = list(dict.fromkeys(_config_text(r["config"]) for r in configs))
            config = f"autotuned, {len(candidates)} candidates: " + "; ".join(candidates)
        call = launcher if variant == "-" else f"{launcher} [{variant}]"
        lines.append(f"| {call} | {kernel} | {config} | " + " | ".join(_figures(group)) + " |")
    return lines


def _worst_table(rows: list[dict]) -> list[str]:
    """Per kernel and target, the worst over every config, dtype, shape and Triton version compiled."""
    lines = ["| kernel | target | kernels compiled | max registers | max spill bytes, fp16/bf16 | max spill bytes, "
             "fp32 (exact or TF32 dots) | max shared KB | min HGMMA, fp16/bf16 | min occupancy |",
             "|---|---|---|---|---|---|---|---|---|"]
    ok = [r for r in rows if r["status"] == "ok"]
    for kernel in sorted({r["kernel"] for r in ok}):
        for target in TARGETS:
            group = [r for r in ok if r["kernel"] == kernel and r["target"] == target]
            if not group:
                continue
            half = [r for r in group if r["dtype"] in GATED_DTYPES]
            full = [r for r in group if r["dtype"] not in GATED_DTYPES]
            wgmma = str(min(r["wgmma"] for r in half)) if half and kernel in MATMUL_KERNELS else "-"
            lines.append(
                f"| {kernel} | {target} | {len(group)} | {max(r['registers'] for r in group)} | "
                f"{max((r['spill_store_bytes'] for r in half), default='-')} | "
                f"{max((r['spill_store_bytes'] for r in full), default='-')} | "
                f"{max(r['shared_bytes'] for r in group) / 1024:.0f} | {wgmma} | "
                f"{min(r['occupancy'] for r in group):.2f} |")
    return lines


FP32_HEADING = ("What fp32 compiles to (one gate, \"exact fp32\": under PyTorch's default precision no tensor-core "
                "instruction, so no TF32 dot where the op promises fp32; spills are not gated: training and "
                "inference run fp16 or bf16):")


def _fp32_lines(rows: list[dict]) -> list[str]:
    """What fp32 compiles to in the matmul kernels on sm_90a, with exact (IEEE) and with TF32 dots: tensor
    cores or not, and the spills."""
    lines = []
    for dtype, dots in (("float32", "exact fp32 dots (PyTorch's default)"), ("float32+tf32", "TF32 dots allowed")):
        fp32 = [r for r in rows if r["status"] == "ok" and r["dtype"] == dtype and r["target"] == "sm_90a"
                and r["kernel"] in MATMUL_KERNELS]
        parts = [f"{kernel}: HGMMA {_span([r['wgmma'] for r in group])}, HMMA {_span([r['mma'] for r in group])}, "
                 f"spill bytes {_span([r['spill_store_bytes'] for r in group])}"
                 for kernel in sorted({r["kernel"] for r in fp32})
                 for group in [[r for r in fp32 if r["kernel"] == kernel]]]
        if parts:
            lines += [f"- fp32 with {dots}, on sm_90a over all configs: " + "; ".join(parts) + "."]
    return lines


def compile_section(rows: list[dict], gpu_measured: bool) -> list[str]:
    """The whole section; rows are the newest compile run's (empty: says how to produce them); gpu_measured:
    whether any GPU suite run is among the results."""
    out = [f"## {TITLE}", ""]
    if not gpu_measured:
        out += ["**No GPU has run these kernels yet.** What is known of them on a GPU is what compiling them "
                "for one shows, below.", ""]
    if not rows:
        return out + [f"Not yet run: `{COMMAND}` (no GPU needed; CPU-heavy), then `python benchmarks/make_perf.py`.",
                      ""]
    first = rows[0]
    tritons = sorted({r["triton"] for r in rows if r.get("triton")})
    shapes = [u["shape"] for r in rows for u in r["uses"]]
    models = sorted({s["model"] for s in shapes})
    seqlens = sorted({s["seqlen"] for s in shapes if "seqlen" in s})
    layouts = sorted({s["layout"] for s in shapes if "layout" in s})
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in rows)]
    targets = [t for t in TARGETS if any(r["target"] == t for r in rows)]
    ptxas = sorted({f"{r['ptxas']} ({r['target']}, Triton {r['triton']})" for r in rows if r.get("ptxas")})
    main = first.get("triton") if first.get("triton") in tritons else tritons[-1]
    failures = gate_failures(rows)
    out += [
        f"Every kernel of `kernels/` compiled without a GPU for "
        f"{' and '.join(f'the {_TARGET_GPU[t]} ({t})' for t in targets)}, by the project's own launchers at "
        f"{' and '.join(models)} shapes ({', '.join(layouts)}; S = {', '.join(map(str, seqlens))}) in "
        f"{', '.join(dtypes)}, in every config a launcher can pick (for autotuned kernels every candidate), with "
        f"Triton {' and '.join(tritons)}: a stand-in Triton driver reports the GPU and runs nothing "
        f"(`fastbert/simulated/stand_in_gpu.py`). Registers and stack from `cuobjdump -res-usage`, spill bytes from "
        f"`ptxas -v` (ptxas {', '.join(ptxas)}), warpgroup MMA (HGMMA) and MMA (HMMA) instructions from "
        f"`cuobjdump -sass`, and the occupancy these allow.", "",
        "**Proven here, without a GPU:** every kernel compiles for both GPUs with both Triton versions; how many "
        "registers it takes and whether it spills; its shared memory against the GPU's limit (227 KB on an H100, "
        "163 KB on an A100); whether its matmuls use Hopper's warpgroup MMA; the occupancy its resources allow. "
        "**Still waiting for a GPU:** its speed, its numerics on the hardware (bf16 included: the CPU tests run "
        "Triton's interpreter), and which config each autotuner picks.", "",
        f"*{len(rows)} compiled kernels on {first['device']}; torch {first['torch']}; commit "
        f"{(first.get('commit') or 'unknown')[:12]}{' (with uncommitted changes)' if first.get('dirty') else ''}; "
        f"{first['date']}; `{first['command']}`; {first.get('suite_seconds', '?')} s.*", ""]
    out += ["**Gates** (fp16 and bf16: no spill, HGMMA in every matmul kernel on sm_90a; fp32 at PyTorch's default "
            "precision: no tensor-core instruction; all dtypes: compiles, shared memory within the GPU): "
            + ("all pass." if not failures else f"{len(failures)} failures:"), ""]
    out += [f"- {gate}: {failure}" for gate, failure in failures[:40]] + ([""] if failures else [])
    for target in targets:
        out += [f"### {_TARGET_GPU[target]} ({target}): the config each launcher call compiles ({SHOWN_DTYPE}, "
                f"Triton {main})", "",
                "Ranges span the shapes, and for autotuned kernels the candidates. Occupancy is resident warps over "
                "the SM's 64.", ""] + _launcher_table(rows, target, main) + [""]
    out += ["### Worst case of every kernel over all its configs, dtypes, shapes and Triton versions", ""]
    out += _worst_table(rows) + [""]
    fp32 = _fp32_lines(rows)
    return out + ([FP32_HEADING, ""] + fp32 + [""] if fp32 else [])
