"""PERF.md and its plots, generated from the JSON rows under benchmarks/results/.

Only measured rows are shown, each table followed by its provenance (device, versions, commit,
date, exact command). For every suite that has no results yet the page says so and gives the
command that produces them. The newest run of each (suite, device) is used.
"""
from __future__ import annotations

import argparse
import functools
import glob
import json
import logging
import os

from fastbert import paths
from fastbert.bench.compile_report import compile_section, newest_run
from fastbert.bench.floors import floors_section
from fastbert.bench.host_report import host_section
from fastbert.bench.memory_report import memory_section
from fastbert.bench.path_table import chosen_provider, table_section
from fastbert.bench.prepare_report import prepare_data_section
from fastbert.bench.runs import first_rows, newest_per_case, run_labels
from fastbert.bench.timing import comparable_ms
from fastbert.command import configure_logging
from fastbert.files import replaced_file, write_text

GPU_COMMAND = "benchmarks/run_gpu.sh benchmarks/results"
CPU_MEMORY_COMMAND = "fastbert bench --suite cpu-memory --out benchmarks/results"
DATA_COMMAND = "fastbert bench --suite data --out benchmarks/results"
REGENERATE = "python benchmarks/make_perf.py"
DEFAULT_SUITES = ("gpu", "cpu-memory", "data")
logger = logging.getLogger("fastbert.bench")
OP_TITLES = {
    "layer_norm": "Residual + dropout + LayerNorm (issue 3)",
    "bias_gelu": "Bias + GELU (issue 3)",
    "ffn_up": "FFN up-projection with bias + GELU (issue 3)",
    "qkv_projection": "QKV projection (issue 3)",
    "attention": "Attention, padded and varlen (issue 4)",
    "mlm_head": "MLM head + loss (issue 5)",
}
PROVIDER_ORDER = ("fastbert", "fastbert-split", "fastbert-varlen", "fastbert-unpad", "fastbert-graph", "fastbert-apply",
                  "fastbert-triton", "fastbert-eager", "torch",
                  "torch.compile", "hf-sdpa", "hf-eager", "hf-sdpa+compile")
# Published by others, not measured here: shown so our ratios can be read against them.
PUBLISHED = [
    ("FlashAttention-2, forward, S=512, head dim 64, non-causal, H100 80GB SXM5", "282 TFLOP/s",
     "FlashAttention-3 paper (Shah et al., 2024), forward-speed figure, batch x seqlen = 16k, hidden 2048"),
    ("FlashAttention-3, forward, same setting", "333 TFLOP/s", "same figure"),
    ("FlashAttention-2, forward + backward, S=512, head dim 64, H100", "215 TFLOP/s",
     "as quoted in issue 4 (not re-checked against the paper here)"),
]


def load_rows(results_dir: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path, encoding="utf-8") as f:
            rows += json.load(f)
    return rows


def latest_runs(rows: list[dict], suites) -> dict[tuple[str, str], list[dict]]:
    """{(suite, device): the rows that stand (fastbert.bench.runs: each case from its newest run)}."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if row.get("suite") in suites:
            groups.setdefault((row["suite"], row["device"]), []).append(row)
    return {key: newest_per_case(group) for key, group in sorted(groups.items())}


def _run_provenance(r: dict) -> str:
    versions = f"torch {r['torch']}, triton {r.get('triton')}, transformers {r.get('transformers')}"
    if r.get("cuda"):
        versions += f", CUDA {r['cuda']}"
    commit = (r.get("commit") or "unknown")[:12] + (" (with uncommitted changes)" if r.get("dirty") else "")
    load = f"; 1-min load average {r['load_average_1min']:.1f}" if r.get("device_type") == "cpu" and \
        r.get("load_average_1min") is not None else ""
    memory = f"; memory: {r['memory_meter']}" if r.get("memory_meter") else ""
    table = f"; backend \"auto\" chose from {r['paths_table']} (FASTBERT_PATHS)" if r.get("paths_table") else ""
    return (f"{versions}; commit {commit}{table}; {r['date']}{load}; "
            f"`{r['command']}`; timer: {r['timer']}{memory}")


def provenance_line(rows: list[dict]) -> str:
    """Where and how the rows were measured; rows of several runs name each run with its label, (a) the newest,
    which the tables put after each case."""
    labels = run_labels(rows)
    if not labels:
        return f"*Measured on {rows[0]['device']}; {_run_provenance(rows[0])}.*"
    first = first_rows(rows)
    return (f"*Measured on {rows[0]['device']} in {len(labels)} runs, each case in one: "
            + "; ".join(f"({label}) {_run_provenance(first[date])}" for date, label in labels.items()) + ".*")


def _labelled(name: str, row: dict, labels: dict) -> str:
    """A case's name, followed by its run's label where the rows come from several runs."""
    return f"{name} ({labels[row['date']]})" if labels else name


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2 ** 20:,.1f}"


def _cell(row: dict | None, figure: str, chosen: bool = False) -> str:
    """One provider's figures; chosen: the path backend="auto" runs there, marked "(auto)"."""
    if row is None:
        return ""
    if row["status"] != "ok":
        return row["status"] + (" (time budget)" if row["status"] == "skipped" else "") + (" (auto)" if chosen else "")
    rate = ""  # from the GPU's time alone where the row has it (runner.derived): shown beside that time
    if figure == "tflops" and row.get("tflops"):
        rate = f" · {row['tflops']:.1f} TFLOP/s"
    if figure == "gbps" and row.get("gbps"):
        share = f" ({100 * row['gbps_vs_peak']:.0f}%)" if row.get("gbps_vs_peak") else ""
        rate = f" · {row['gbps']:.0f} GB/s{share}"
    timed = (f"{row['median_ms']:.3f} ms (GPU {row['device_ms']:.3f} ms{rate})" if row.get("device_ms") is not None
             else f"{row['median_ms']:.3f} ms{rate}")
    return timed + (" (auto)" if chosen else "")


def _host(row: dict) -> str:
    """", host X": the host's time of the call in ms (timing.device_time_ms), where the row has it."""
    return "" if row.get("host_ms") is None else f", host {row['host_ms']:.1f}"


def _providers(rows: list[dict]) -> list[str]:
    present = {r["provider"] for r in rows}
    return [p for p in PROVIDER_ORDER if p in present] + sorted(present - set(PROVIDER_ORDER))


@functools.lru_cache(maxsize=1)
def committed_table() -> dict:
    """The committed table of paths (fastbert/paths.json), which PERF.md marks, whatever FASTBERT_PATHS names."""
    return paths.load(paths.COMMITTED_TABLE_PATH)


def _ratio(a: dict, b: dict) -> float:
    """Row a's time over row b's, by the times both have (timing.comparable_ms)."""
    a_ms, b_ms = comparable_ms(a, b)
    return a_ms / b_ms


def _speedup(rows_by_provider: dict, provider: str, baseline: str) -> str:
    a, b = rows_by_provider.get(provider), rows_by_provider.get(baseline)
    if not a or not b or a["status"] != "ok" or b["status"] != "ok":
        return ""
    return f"{_ratio(b, a):.2f}x"


def op_section(op: str, rows: list[dict], labels: dict | None = None) -> list[str]:
    """labels: run_labels of the whole section the table is in (default: of rows)."""
    lines = [f"### {OP_TITLES.get(op, op)}", ""]
    figure = "gbps" if any(r.get("bytes") for r in rows) else "tflops"
    providers = _providers(rows)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    labels = run_labels(rows) if labels is None else labels
    head = "| shape | direction | " + " | ".join(providers) + " | fastbert vs fastbert-eager | fastbert vs torch |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for case in cases:
        case_rows = [r for r in rows if r["case"] == case]
        shape = _labelled(case.split("/", 1)[1], case_rows[0], labels)
        directions = list(dict.fromkeys(r.get("direction") for r in case_rows if r.get("direction")))
        unmeasured = [r for r in case_rows if not r.get("direction")]  # skipped / failed before measuring
        for direction in directions or [None]:
            by_provider = {r["provider"]: r for r in case_rows if r.get("direction") == direction}
            by_provider.update({r["provider"]: r for r in unmeasured})
            chosen = chosen_provider(next(iter(by_provider.values())), committed_table())
            cells = [_cell(by_provider.get(p), figure, p == chosen) for p in providers]
            lines.append(f"| {shape} | {direction or '-'} | " + " | ".join(cells) +
                         f" | {_speedup(by_provider, 'fastbert', 'fastbert-eager')} | "
                         f"{_speedup(by_provider, 'fastbert', 'torch')} |")
    memory = [r for r in rows if r.get("direction") == "fwd+bwd" and r["status"] == "ok"]
    if memory:
        lines += ["", "Peak memory of forward + backward above the inputs (MiB): " + "; ".join(
            f"{r['case'].split('/', 1)[1]} {r['provider']} {_mib(r.get('peak_mem_extra_bytes'))}" for r in memory) + "."]
    notes = {k: v for r in rows for k, v in (r.get("notes") or {}).items()}
    if notes:
        lines += ["", "Providers: " + "; ".join(f"{k}: {v}" for k, v in notes.items()) + "."]
    return lines + [""]


# The backend of fastbert's model-row providers in rows measured before rows named it (commits up to 5b1f443).
MODEL_ROW_BACKEND_BEFORE_FIELD = {"fastbert": "triton", "fastbert-unpad": "triton", "fastbert-graph": "triton",
                                  "fastbert-apply": "triton", "fastbert-eager": "torch"}


def _model_provider(row: dict) -> str:
    """The provider of a model row, with the backend its fastbert model ran (e.g. "fastbert [auto]")."""
    backend = row["backend"] if "backend" in row else MODEL_ROW_BACKEND_BEFORE_FIELD.get(row["provider"])
    return f"{row['provider']} [{backend}]" if backend else row["provider"]


def model_section(rows: list[dict], labels: dict | None = None) -> list[str]:
    """labels: run_labels of the whole section the tables are in (default: of rows)."""
    lines, labels = [], run_labels(rows) if labels is None else labels
    for mode, title in (("train_step", "Training step (MLM + NSP, AdamW, bf16 autocast)"),
                        ("inference", "Inference (BertModel, bf16, no grad)")):
        mode_rows = [r for r in rows if r.get("direction") == mode or
                     (not r.get("direction") and r["case"].startswith(mode.split("_")[0]))]
        if not mode_rows:
            continue
        lines += [f"### {title}", "", "| case | provider | batch | tokens/s | sequences/s | MFU | peak GiB | ms/step |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in mode_rows:
            case = _labelled(r["case"], r, labels)
            if r["status"] != "ok":
                lines.append(f"| {case} | {_model_provider(r)} | {r['status']} | | | | | |")
                continue
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
            peak = "-" if r.get("peak_mem_bytes") is None else f"{r['peak_mem_bytes'] / 2 ** 30:.2f}"
            lines.append(f"| {case} | {_model_provider(r)} | {r['batch']} | {r['tokens_per_s']:,.0f} | "
                         f"{r['sequences_per_s']:,.1f} | {mfu} | {peak} | {r['median_ms']:.1f}"
                         + (f" (GPU {r['device_ms']:.1f}{_host(r)})" if r.get("device_ms") is not None else "")
                         + " |")
        lines.append("")
    capacity = [r for r in rows if r["case"].startswith("capacity/")]
    if capacity:
        lines += ["### Largest training batch that fits", "", "| case | provider | largest batch | first batch that failed |",
                  "|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['provider']} | {r.get('batch', r['status'])} | {r.get('first_failed_batch', '-')} |"
                  for r in capacity]
        lines.append("")
    return lines


def peaks_table(runs: dict) -> list[str]:
    lines = ["| device | suite | copy bandwidth | matmul rate | date |", "|---|---|---|---|---|"]
    for (suite, device), rows in runs.items():
        peak = {r["case"]: r for r in rows if r["op"] == "peak"}
        if "peak/copy" in peak and "peak/matmul" in peak:
            mm = peak["peak/matmul"]
            lines.append(f"| {device} | {suite} | {peak['peak/copy']['gbps']:,.0f} GB/s | "
                         f"{mm['tflops']:,.2f} TFLOP/s ({mm['dtype']}, {mm['shape']['m']}^3) | {rows[0]['date']} |")
    return lines


def mlm_memory_lines(rows: list[dict]) -> list[str]:
    mlm = {r["provider"]: r for r in rows if r["op"] == "mlm_head" and r.get("direction") == "fwd+bwd"
           and r["status"] == "ok"}
    if "torch" not in mlm:
        return []
    hf = mlm["torch"]
    lines = ["| provider | peak memory above inputs (MiB) | HF's / this | forward + backward |", "|---|---|---|---|"]
    for provider in _providers(list(mlm.values())):
        r = mlm[provider]
        ratio = hf["peak_mem_extra_bytes"] / r["peak_mem_extra_bytes"] if r["peak_mem_extra_bytes"] else float("nan")
        lines.append(f"| {provider} | {_mib(r['peak_mem_extra_bytes'])} | {ratio:.1f}x | {r['median_ms']:,.0f} ms |")
    notes = hf.get("notes") or {}
    if notes:
        lines += ["", "; ".join(f"{k}: {v}" for k, v in notes.items()) + "."]
    if hf["device_type"] == "cpu":
        lines += ["", "On the CPU the memory figures are the allocator's exact count and do not depend on other work; "
                      "the times do (see the load average above) and are indicative only. fastbert's Triton path "
                      "runs on a GPU only: its figures here are not yet measured."]
    return lines


def data_lines(rows: list[dict]) -> list[str]:
    """The input pipeline's sequences per CPU-second against issue 13's target, and the permutation's cost."""
    from fastbert.bench.data_suite import TARGETS
    loader = [r for r in rows if r["op"] == "loader" and r["status"] == "ok"]
    lines = ["### Pretraining batches built per CPU-second (issue 13)", "",
             "| length | batch | masking | loader thread | sequences per CPU-second | CPU ms per batch |",
             "|---|---|---|---|---|---|"]
    for r in loader:
        shape = r["shape"]
        lines.append(f"| {shape['seqlen']} | {shape['batch']} | {'whole-word' if shape['whole_word'] else 'token'} | "
                     f"{r['provider']} | {r['sequences_per_cpu_s']:,.0f} | {r['median_ms']:.2f} |")
    lines += ["", "| target: sequences per CPU-second (4x one H100's training rate) | slowest row measured | met |",
              "|---|---|---|"]
    for seqlen, target in TARGETS.items():
        measured = [r["sequences_per_cpu_s"] for r in loader if r["shape"]["seqlen"] == seqlen]
        lines.append(f"| S={seqlen}: >= {target:,} | " + (f"{min(measured):,.0f} | {'yes' if min(measured) >= target else 'no'} |"
                                                         if measured else "not yet measured | - |"))
    permutation = [r for r in rows if r["op"] == "permutation" and r["status"] == "ok"]
    if permutation:
        lines += ["", "Epoch permutation (keyed Feistel network, cycle-walked): CPU time to map one batch of stream "
                      "positions to examples, whatever the dataset size (no per-epoch table):", "",
                  "| examples in the dataset | batch | CPU ms |", "|---|---|---|"]
        lines += [f"| {r['shape']['examples']:,} | {r['shape']['batch']} | {r['median_ms']:.3f} |" for r in permutation]
    return lines + [""]


def plots(runs: dict, plots_dir: str) -> list[str]:
    """PNG plots of the measured rows; returns their paths relative to the repository root."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plots_dir, exist_ok=True)
    written = []
    for (suite, device), rows in runs.items():
        slug = f"{suite}-" + "".join(c if c.isalnum() else "-" for c in device).strip("-")
        mlm = [r for r in rows if r["op"] == "mlm_head" and r.get("direction") == "fwd+bwd" and r["status"] == "ok"]
        if mlm:
            fig, ax = plt.subplots(figsize=(6, 3))
            ax.barh([r["provider"] for r in mlm], [r["peak_mem_extra_bytes"] / 2 ** 20 for r in mlm])
            ax.set_xlabel("peak memory above inputs, MiB (forward + backward)")
            ax.set_title(f"MLM head + loss, {mlm[0]['case'].split('/', 1)[1]}\n{device}", fontsize=8)
            written.append(_save(fig, plots_dir, f"{slug}-mlm-memory.png"))
        ops = [r for r in rows if r.get("direction") == "fwd+bwd" and r["status"] == "ok" and r["op"] != "mlm_head"]
        eager = {r["case"]: r for r in ops if r["provider"] == "fastbert-eager"}
        speed = [(r["case"], r["provider"], _ratio(eager[r["case"]], r)) for r in ops
                 if r["case"] in eager and r["provider"] != "fastbert-eager"]
        if speed:
            cases = list(dict.fromkeys(c for c, _, _ in speed))
            providers = _providers([{"provider": p} for _, p, _ in speed])
            fig, ax = plt.subplots(figsize=(8, 0.35 * len(cases) * len(providers) + 1))
            width = 0.8 / len(providers)
            for i, provider in enumerate(providers):
                values = {c: s for c, p, s in speed if p == provider}
                ax.barh([j + i * width for j in range(len(cases))], [values.get(c, 0) for c in cases], width,
                        label=provider)
            ax.set_yticks([j + 0.4 - width / 2 for j in range(len(cases))], cases, fontsize=6)
            ax.axvline(1.0, color="black", lw=0.8)
            ax.set_xlabel("forward + backward speed-up over fastbert-eager")
            ax.legend(fontsize=7)
            written.append(_save(fig, plots_dir, f"{slug}-ops-speedup.png"))
        train = [r for r in rows if r.get("direction") == "train_step" and r["status"] == "ok"]
        if train:
            labels = [f"{r['case'].split('/', 1)[1]} {r['provider']}" for r in train]
            fig, ax = plt.subplots(figsize=(8, 0.25 * len(train) + 1))
            ax.barh(labels, [r["tokens_per_s"] for r in train])
            ax.tick_params(axis="y", labelsize=6)
            ax.set_xlabel("training tokens/s (non-padding tokens)")
            written.append(_save(fig, plots_dir, f"{slug}-train-tokens.png"))
    return written


def _save(fig, plots_dir: str, name: str) -> str:
    path = os.path.join(plots_dir, name)
    fig.tight_layout()
    with replaced_file(path) as partial:  # a full disk or a crash leaves the previous plot
        fig.savefig(partial, dpi=120, format="png")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


# Issue 25's targets for whole BERT-base calls on a GPU (bf16): (model case, as gpu_model_cases names it; provider;
# the limit in ms, or for None: no slower than the same case's fastbert row; what the row is)
MODEL_TARGETS = (
    ("inference/base,batch=32,seqlen=128,padded", "fastbert", 2.8, "inference 32 x 128 padded, default forward"),
    ("inference/base,batch=32,seqlen=128,padded", "fastbert-graph", 2.8, "inference 32 x 128 padded, captured graph"),
    ("inference/base,batch=1,seqlen=128", "fastbert-graph", 1.5, "inference 1 x 128, captured graph"),
    ("train/base,batch=256,seqlen=128", "fastbert", 70.0, "pretraining step 256 x 128, default arguments"),
    ("train/base,batch=256,seqlen=128", "fastbert-apply", None, "pretraining step 256 x 128 after fastbert.apply"),
)


def model_targets(rows: list[dict], with_device: bool = True) -> list[tuple[str, tuple[str, bool] | None]]:
    """Issue 25's MODEL_TARGETS against these rows' medians (a call's wall time): (text, None where no row measured
    it, else (what was measured, on which device unless not with_device; whether the target is met)), one entry per
    target and GPU that measured it (each GPU's rows judged by themselves). The applied model runs fastbert's kernels:
    "no slower" is its median at most fastbert's 80th percentile, as two medians of the same work differ by noise."""
    timed = {(r["device"], r["case"], r["provider"]): r for r in rows
             if r.get("op") == "model" and r.get("status", "ok") == "ok" and r.get("median_ms") is not None}
    devices = sorted({device for device, _, _ in timed})
    checks = []
    for case, provider, limit, what in MODEL_TARGETS:
        text = f"BERT-base bf16 {what}: " + ("median <= fastbert's p80" if limit is None else f"<= {limit:g} ms")
        judged = False
        for device in devices:
            row, own = timed.get((device, case, provider)), timed.get((device, case, "fastbert"))
            if row is None or (limit is None and own is None):
                continue
            where = f" on {device}" if with_device else ""
            if limit is None:
                verdict = (f"{row['median_ms']:.1f} ms, fastbert {own['median_ms']:.1f} ms (p20-p80 "
                           f"{own['p20_ms']:.1f}-{own['p80_ms']:.1f}){where}", row["median_ms"] <= own["p80_ms"])
            else:
                verdict = f"{row['median_ms']:.3g} ms{where}", row["median_ms"] <= limit
            checks.append((text, verdict))
            judged = True
        if not judged:
            checks.append((text, None))
    return checks


def targets(runs: dict) -> list[str]:
    """Issue targets with what was measured against them, or 'not yet measured'."""
    gpu = [r for (suite, _), rows in runs.items() if suite == "gpu" for r in rows if r["status"] == "ok"]

    def find(op, provider, direction, **shape):
        for r in gpu:
            if r["op"] == op and r["provider"] == provider and r.get("direction") == direction and \
                    all(r["shape"].get(k) == v for k, v in shape.items()):
                return r
        return None

    def ratio(op, direction, **shape):
        a, b = find(op, "fastbert", direction, **shape), find(op, "fastbert-eager", direction, **shape)
        return None if not a or not b else _ratio(b, a)

    checks = []
    for hidden in (768, 1024):
        ln = find("layer_norm", "fastbert", "fwd+bwd", hidden=hidden)
        checks.append((f"LayerNorm fwd+bwd, H={hidden}: >= 80% of copy bandwidth",
                       None if ln is None or not ln.get("gbps_vs_peak") else (f"{100 * ln['gbps_vs_peak']:.0f}%",
                                                                             ln["gbps_vs_peak"] >= 0.8)))
        for op, target in (("layer_norm", 1.5), ("bias_gelu", 1.3), ("ffn_up", 1.3), ("qkv_projection", 1.1)):
            r = ratio(op, "fwd+bwd", hidden=hidden) if op != "bias_gelu" else ratio(op, "fwd+bwd", features=4 * hidden)
            checks.append((f"{op} fwd+bwd, H={hidden}: >= {target}x fastbert-eager",
                           None if r is None else (f"{r:.2f}x", r >= target)))
    for direction, target in (("fwd", 300), ("fwd+bwd", 200)):
        r = find("attention", "fastbert", direction, seqlen=512, padding=0.0, dropout_p=0.0)
        checks.append((f"attention {direction}, S=512, no padding: >= {target} TFLOP/s (H100 target)",
                       None if r is None else (f"{r['tflops']:.0f} TFLOP/s on {r['device']}", r["tflops"] >= target)))
    for seqlen in (128, 512, 2048):
        padded = [r for r in gpu if r["op"] == "attention" and r.get("direction") == "fwd+bwd" and
                  r["shape"]["seqlen"] == seqlen and r["shape"]["padding"] > 0 and r["shape"]["dropout_p"] == 0.0]
        by = {r["provider"]: r for r in padded}
        verdict = None
        if "fastbert" in by and "fastbert-varlen" in by:
            pad = by["fastbert"]["shape"]["padding"]
            speedup = _ratio(by["fastbert"], by["fastbert-varlen"])
            verdict = (f"{speedup:.2f}x (padding {100 * pad:.0f}%)", speedup >= 1 / (1 - pad))
        checks.append((f"attention varlen vs padded fwd+bwd, S={seqlen}: speed-up >= 1 / (1 - padding fraction)",
                       verdict))
    mlm = {r["provider"]: r for r in gpu if r["op"] == "mlm_head" and r.get("direction") == "fwd+bwd"}
    both = "fastbert" in mlm and "torch" in mlm
    checks.append(("MLM head + loss peak memory: >= 6x lower than HF's head",
                   None if not both else (f"{mlm['torch']['peak_mem_extra_bytes'] / mlm['fastbert']['peak_mem_extra_bytes']:.1f}x",
                                          mlm["torch"]["peak_mem_extra_bytes"] >= 6 * mlm["fastbert"]["peak_mem_extra_bytes"])))
    checks.append(("MLM head + loss fwd+bwd: >= 1.5x faster than HF's head",
                   None if not both else (f"{_ratio(mlm['torch'], mlm['fastbert']):.2f}x",
                                          _ratio(mlm["torch"], mlm["fastbert"]) >= 1.5)))
    checks += model_targets(gpu)
    lines = ["| target (GPU, from issues 3-5 and 25) | measured | met |", "|---|---|---|"]
    for text, verdict in checks:
        lines.append(f"| {text} | not yet measured | - |" if verdict is None else
                     f"| {text} | {verdict[0]} | {'yes' if verdict[1] else 'no'} |")
    return lines


def ffn_form_lines(gpu_runs: dict) -> list[str]:
    """Which of the two fused FFN forms the model runs, and what the GPU measured of both."""
    from fastbert.bench.op_cases import FFN_FORM
    lines = [f"The model's FFN up-projection runs the form set by `LINEAR_BIAS_GELU_FORM` in kernels/bias_gelu.py, "
             f"now {FFN_FORM!r}: \"epilogue\" is a Triton matmul with bias + GELU in its epilogue, "
             "\"cublas_then_bias_gelu\" a cuBLAS matmul followed by the bias + GELU kernel (provider "
             "fastbert-split). The faster on the GPU should be the model's path."]
    rows = [r for run in gpu_runs.values() for r in run
            if r["op"] == "ffn_up" and r.get("direction") == "fwd+bwd" and r.get("status", "ok") == "ok"]
    timed = {}
    for row in rows:
        timed.setdefault(tuple(sorted(row["shape"].items())), {})[row["provider"]] = row
    measured = [(shape, comparable_ms(t["fastbert"], t["fastbert-split"])) for shape, t in timed.items()
                if "fastbert" in t and "fastbert-split" in t]
    if not measured:
        return lines + ["", "Which is faster is **not yet measured**: no GPU has run the suite."]
    lines += ["", "| shape | fastbert (model's form), ms | fastbert-split, ms | faster |", "|---|---|---|---|"]
    for shape, (fused, split) in measured:
        faster = "fastbert" if fused <= split else "fastbert-split"
        lines.append(f"| {dict(shape)} | {fused:.3f} | {split:.3f} | {faster} |")
    return lines


def render(rows: list[dict], plots_dir: str | None = None, suites=DEFAULT_SUITES, plot_prefix: str = "") -> str:
    runs = latest_runs(rows, suites)
    gpu_runs = {k: v for k, v in runs.items() if k[0] == "gpu"}
    out = ["# fastbert performance", "",
           f"Generated by `{REGENERATE}` from the JSON rows in `benchmarks/results/`; do not edit by hand. "
           "Every figure below was measured, and each table names the run it comes from. Times are medians "
           "after warm-up (CUDA events via `triton.testing.do_bench` on a GPU). An op row or a model's inference row of a "
           "GPU run also gives, where measured, the GPU's time alone (\"GPU ...\": the host's time left out, see "
           "fastbert/bench/timing.py's `device_time_ms`); an op's speed-ups, TFLOP/s, GB/s, floor distance and the "
           "path table read that time where both rows compared have it, else the medians; a model's figures are its "
           "wall time's. FLOPs: a matmul is 2MNK and its "
           "backward twice that; attention forward is 4 x heads x head_dim x sum(L_i^2) (flash-attention's count "
           "over the real lengths), backward 2.5x forward; a BERT training step is 3x its forward FLOPs, with the "
           "MLM head counted on the labelled tokens only for every provider. GB/s uses the least bytes a fused "
           "kernel must move, the same figure for every provider, read against the measured copy bandwidth. "
           "MFU is model FLOP/s over the measured matmul rate of the same run.", ""]
    out += ["## Status", ""]
    if runs:
        out += ["Runs shown (a suite with several: each case from the newest run that measured it):", ""]
        out += [f"- {suite} on {device}: {date}, `{first['command']}`" for (suite, device), rows in runs.items()
                for date, first in first_rows(rows).items()] + [""]
    if not gpu_runs:
        out += ["**GPU figures: not yet measured.** No GPU has run the suite yet, so every per-op time, "
                "TFLOP/s and GB/s figure, every whole-model tokens/s, MFU and peak-memory figure, and the GPU's "
                "peak references are not yet measured and are not shown. To produce them, on one H100 or H200 "
                f"(the GPU environment of DESIGN.md): `{GPU_COMMAND}` (under 10 minutes), then `{REGENERATE}`.", ""]
    if not any(k[0] == "cpu-memory" for k in runs):
        out += [f"The CPU memory measurement of the MLM head is not yet measured: `{CPU_MEMORY_COMMAND}`.", ""]
    if not any(k[0] == "data" for k in runs):
        out += [f"The input pipeline's rate (issue 13) is not yet measured: `{DATA_COMMAND}`.", ""]
    out += host_section(rows, provenance_line)
    out += compile_section(newest_run(rows), gpu_measured=bool(gpu_runs))
    out += memory_section(rows)
    out += ["## Peak references", ""]
    peak_lines = peaks_table(runs)
    out += (peak_lines if len(peak_lines) > 2 else ["No peaks measured yet."]) + [""]
    out += ["Published figures (not ours, for reading attention ratios):", "",
            "| figure | value | source |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in PUBLISHED] + [""]
    out += ["## Targets", ""] + targets(runs) + [""]
    out += ["## The FFN up-projection's form", ""] + ffn_form_lines(gpu_runs) + [""]
    out += table_section()
    out += floors_section(gpu_runs, PROVIDER_ORDER)
    out += prepare_data_section(rows, provenance_line)
    images = plots(runs, plots_dir) if plots_dir else []
    for (suite, device), rows in runs.items():
        out += [f"## {suite} suite on {device}", "", provenance_line(rows), ""]
        if suite == "data":
            out += data_lines(rows)
            continue
        measured = [r for r in rows if r["op"] != "peak"]
        if suite == "cpu-memory" or (suite != "gpu" and any(r["op"] == "mlm_head" for r in measured)):
            mlm = mlm_memory_lines(measured)
            if mlm:
                out += ["### MLM head + loss: peak memory and time (forward + backward)", ""] + mlm + [""]
        if suite == "cpu-memory":
            continue
        labels = run_labels(rows)
        for op in dict.fromkeys(r["op"] for r in measured if r["op"] != "model"):
            out += op_section(op, [r for r in measured if r["op"] == op], labels)
        out += model_section([r for r in measured if r["op"] == "model"], labels)
    if images:
        out += ["## Plots", ""] + [f"![{os.path.basename(p)}]({plot_prefix}{p})" for p in images] + [""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make_perf", description="Write PERF.md and its plots from the JSON results.")
    p.add_argument("--results", default="benchmarks/results", help="directory of JSON result files")
    p.add_argument("--out", default="PERF.md", help="the Markdown file to write")
    p.add_argument("--plots", default="benchmarks/plots", help="directory for the PNG plots")
    args = p.parse_args(argv)
    rows = load_rows(args.results)
    # image links are relative to the Markdown file's directory
    prefix = os.path.relpath(os.getcwd(), os.path.dirname(os.path.abspath(args.out))) + "/"
    text = render(rows, args.plots, plot_prefix="" if prefix == "./" else prefix)
    write_text(args.out, text + "\n")
    configure_logging("make_perf")
    logger.info(f"wrote {args.out} from {len(rows)} rows")
    return 0
