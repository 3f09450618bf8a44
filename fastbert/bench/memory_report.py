"""PERF.md's section "Memory of a training step on an 80 GB GPU (exact accounting, no GPU needed)", from the rows
of the newest `fastbert bench --suite memory` run (fastbert.bench.memory_cases) and, where a GPU has run
`python benchmarks/memory_gpu_check.py OUTDIR`, the measured peaks beside the plan (suite "memory-gpu-check")."""
from __future__ import annotations

from fastbert.bench.model_cases import SIZES
from fastbert.bench.memory_cases import (FASTBERT, HF_EAGER, HF_SDPA, MEGATRON_SBH, PAPER_SBH, PLANNED_DEVICE_BYTES,
                                         PROVIDERS)
from fastbert.simulated.device_fit import GiB

COMMAND = "fastbert bench --suite memory --out benchmarks/results"
GPU_CHECK_COMMAND = "python benchmarks/memory_gpu_check.py OUTDIR"
TITLE = "Memory of a training step on an 80 GB GPU (exact accounting, no GPU needed)"
GOAL_SEQLEN = 512
GOALS = {"base_sbh": PAPER_SBH, "base_peak": 0.45, "base_batch": 2.5, "large_peak": 0.6}


def newest(rows: list[dict], suite: str) -> list[dict]:
    """The ok rows of the newest run of a suite (a run is the rows sharing one date)."""
    dates = [r["date"] for r in rows if r.get("suite") == suite]
    return [r for r in rows if r.get("suite") == suite and r["date"] == max(dates)] if dates else []


def _gib(value: int) -> str:
    return f"{value / GiB:,.2f}"


def _provenance(rows: list[dict]) -> str:
    r = rows[0]
    commit = (r.get("commit") or "unknown")[:12] + (" (with uncommitted changes)" if r.get("dirty") else "")
    return (f"*Planned on {r.get('host', 'the CPU')} for a {r['device']}; torch {r['torch']}, triton "
            f"{r.get('triton')}, transformers {r.get('transformers')}; commit {commit}; {r['date']}; "
            f"`{r['command']}`; {len(rows)} rows in {r.get('suite_seconds', '?')} s.*")


def _by_key(rows: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["case"], r["provider"]): r for r in rows if r["status"] == "ok"}


def _ratio(a: dict | None, b: dict | None, figure: str) -> float | None:
    return None if not a or not b or not b[figure] else a[figure] / b[figure]


def _ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _step_table(rows: list[dict], by: dict, training: bool) -> list[str]:
    head = ["case", "provider", "batch", "peak GiB"]
    head += ["forward-end GiB", "saved for backward GiB", "per layer"] if training else []
    head += ["largest batch in 80 GB", "peak: fastbert / hf-sdpa", "peak: fastbert / hf-eager"]
    head += ["largest batch: fastbert / hf-sdpa"] if training else []
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append([r["case"], r["provider"], f"{r['status']}: {r.get('error', '')}"] + [""] * (len(head) - 3))
            continue
        sdpa, eager = by.get((r["case"], HF_SDPA)), by.get((r["case"], HF_EAGER))
        own = r["provider"] == FASTBERT
        cells = [r["case"], r["provider"], str(r["batch"]), _gib(r["peak_bytes"])]
        if training:
            cells += [_gib(r["forward_end_bytes"]), _gib(r["saved_for_backward_bytes"]),
                      f"{r['sbh_per_layer']:.2f}·s·b·h"]
        cells += [str(r["largest_batch"]), _ratio_text(_ratio(r, sdpa, "peak_bytes")) if own else "",
                  _ratio_text(_ratio(r, eager, "peak_bytes")) if own else ""]
        if training:
            cells.append(_ratio_text(_ratio(r, sdpa, "largest_batch")) if own else "")
        body.append(cells)
    return _markdown(head, body)


def _checkpointing_table(rows: list[dict]) -> list[str]:
    body = []
    for r in rows:
        cells = [r["case"].split(",checkpointing=")[0], r["shape"]["checkpointing"]]
        if r["status"] != "ok":
            body.append(cells + [f"not planned: {r.get('error', r['status'])[:160]}", "", "", "", ""])
            continue
        flops = r.get("checkpointing_extra_flops")
        body.append(cells + [_gib(r["peak_bytes"]), _gib(r["saved_for_backward_bytes"]),
                             f"{r['sbh_per_layer']:.2f}·s·b·h", str(r["largest_batch"]), "-" if flops is None else
                             f"{flops:.3g} ({100 * r['checkpointing_extra_flops_fraction']:.1f}%)"])
    return _markdown(["case", "option", "peak GiB", "saved for backward GiB", "per layer", "largest batch in 80 GB",
                      "extra FLOPs per step"], body)


def _markdown(head: list[str], body: list[list[str]]) -> list[str]:
    """A Markdown table's lines."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def _breakdown_table(rows: list[dict]) -> list[str]:
    categories = list(dict.fromkeys(k for r in rows for k in r["peak_breakdown"]))
    return _markdown(["case", "provider", *(f"{c} GiB" for c in categories), "peak GiB"],
                     [[r["case"], r["provider"], *(_gib(r["peak_breakdown"].get(c, 0)) for c in categories),
                       _gib(r["peak_bytes"])] for r in rows])


def _saved_table(rows: list[dict]) -> list[str]:
    """Bytes saved for the backward per module kind, per token of the stated batch."""
    kinds = list(dict.fromkeys(k for r in rows for k in r["saved_by_module_kind"]))
    return _markdown(["module kind", *(f"{r['case']} {r['provider']}" for r in rows)],
                     [[kind, *(f"{r['saved_by_module_kind'].get(kind, 0) / r['tokens']:,.0f}" for r in rows)]
                      for kind in kinds])


def _fsdp2_table(rows: list[dict]) -> list[str]:
    worlds = list(rows[0]["fsdp2_peak_bytes"]) if rows else []
    return _markdown(["case", "provider", "1 GPU", *(f"{w} GPUs" for w in worlds)],
                     [[r["case"], r["provider"], _gib(r["peak_bytes"]),
                       *(_gib(r["fsdp2_peak_bytes"][w]) for w in worlds)] for r in rows])


def goals(by: dict) -> list[str]:
    """Issue 18's goals against the plan: bf16, S = 512, per optimizer; fine-tuning and inference everywhere."""
    lines = ["| goal (issue 18, bf16, S = 512) | planned | met |", "|---|---|---|"]

    def verdict(text: str, value: float | None, limit: float, below: bool, unit: str = "x") -> None:
        if value is None:
            lines.append(f"| {text} | not planned | - |")
            return
        met = value <= limit if below else value >= limit
        lines.append(f"| {text} | {value:.2f}{unit} | {'yes' if met else 'no'} |")

    for optimizer in ("adamw", "lamb"):
        base = f"pretrain/base,S={GOAL_SEQLEN},{optimizer}"
        large = f"pretrain/large,S={GOAL_SEQLEN},{optimizer}"
        own = by.get((base, FASTBERT))
        verdict(f"BERT-base, {optimizer}: encoder activations <= {GOALS['base_sbh']}·s·b·h bytes per layer",
                own and own["sbh_per_layer"], GOALS["base_sbh"], True, "·s·b·h")
        batch = own["batch"] if own else "the stated batch"
        verdict(f"BERT-base, {optimizer}: peak <= {GOALS['base_peak']}x hf-sdpa's at batch {batch}",
                _ratio(own, by.get((base, HF_SDPA)), "peak_bytes"), GOALS["base_peak"], True)
        verdict(f"BERT-base, {optimizer}: largest batch in 80 GB >= {GOALS['base_batch']}x hf-sdpa's",
                _ratio(own, by.get((base, HF_SDPA)), "largest_batch"), GOALS["base_batch"], False)
        verdict(f"BERT-large, {optimizer}: peak <= {GOALS['large_peak']}x hf-sdpa's at the same batch",
                _ratio(by.get((large, FASTBERT)), by.get((large, HF_SDPA)), "peak_bytes"), GOALS["large_peak"], True)
    worst = [(_ratio(r, by.get((case, hf)), "peak_bytes"), f"{case} vs {hf}")
             for (case, provider), r in by.items()
             if provider == FASTBERT and case.startswith(("finetune", "inference")) for hf in (HF_SDPA, HF_EAGER)]
    worst = [w for w in worst if w[0] is not None]
    if worst:
        value, where = max(worst)
        lines.append(f"| fine-tuning and inference: peak never above transformers' (fastbert / transformers <= 1) "
                     f"| largest {value:.2f}x ({where}) | {'yes' if value <= 1 else 'no'} |")
    else:
        lines.append("| fine-tuning and inference: peak never above transformers' | not planned | - |")
    return lines


def beyond_the_list(row: dict) -> str | None:
    """A sentence that splits a fastbert row's per-layer figure into issue 18's list (PAPER_SBH) and what
    the list leaves out, from the model's sizes: the last layer's output, kept for the heads (2 bytes per
    token over L layers), the attention's fp32 log-sum-exp (4 bytes per head), each LayerNorm's fp32 1/std
    and side buffer (fastbert.kernels.layer_norm). None when the parts do not add up to the plan (another
    layer, checkpointing) or the LayerNorm works from its input."""
    from fastbert.kernels.layer_norm import SIDE_COLUMNS

    shape = row["shape"]
    preset = SIZES.get(shape.get("size"))  # a user's own config (--model FILE) has no preset
    if (row["provider"] != FASTBERT or shape.get("checkpointing") != "none" or shape.get("mode") != "pretrain"
            or preset is None):
        return None
    config = preset()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    parts = {"the last layer's output, which the heads keep": 2 / layers,
             "the attention's log-sum-exp": 4 * config.num_attention_heads / hidden,
             "the two LayerNorms' 1/std and side buffers": 2 * 4 * (1 + SIDE_COLUMNS) / hidden}
    if abs(PAPER_SBH + sum(parts.values()) - row["sbh_per_layer"]) > 1e-3:
        return None
    listed = ", ".join(f"{name} {value:.4f}" for name, value in parts.items())
    return (f"{shape['size']}: {row['sbh_per_layer']:.4f}·s·b·h per layer = the {PAPER_SBH} of issue 18's list "
            f"(input 2, Q K V 6, attention output 2, FFN pre-activation 8, LayerNorm output 2) + {listed}.")


def gpu_check_lines(check: list[dict]) -> list[str]:
    if not check:
        return [f"**Not yet measured on a GPU**: no GPU has run `{GPU_CHECK_COMMAND}`, which measures "
                "`torch.cuda.max_memory_allocated` over the same steps and writes the rows shown here beside the "
                "plan."]
    lines = ["| case | provider | batch | planned peak GiB | measured max_memory_allocated GiB | measured / planned |",
             "|---|---|---|---|---|---|"]
    for r in check:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | {r['provider']} | {r.get('batch', '-')} | | {r['status']} | |")
            continue
        lines.append(f"| {r['case']} | {r['provider']} | {r['batch']} | {_gib(r['planned_peak_bytes'])} | "
                     f"{_gib(r['peak_mem_bytes'])} | {r['peak_mem_bytes'] / r['planned_peak_bytes']:.3f} |")
    first = check[0]
    return lines + ["", f"*Measured on {first['device']}; torch {first['torch']}, triton {first.get('triton')}, "
                        f"CUDA {first.get('cuda')}; commit {(first.get('commit') or 'unknown')[:12]}; "
                        f"{first['date']}; `{first['command']}`.*"]


def memory_section(rows: list[dict]) -> list[str]:
    run = newest(rows, "memory")
    out = [f"## {TITLE}", ""]
    if not run:
        return out + [f"Not yet planned: `{COMMAND}`, then `python benchmarks/make_perf.py`.", ""]
    by = _by_key(run)
    first = run[0]
    out += [_provenance(run), "",
            "**A plan from the code, not a measurement on a GPU.** Each step (forward, backward, optimizer step) "
            "runs on meta tensors: fastbert's Triton launchers and autograd Functions go through the stand-in "
            "driver (nothing is launched), transformers' BERT runs its own code (SDPA routed to the flash "
            "kernel, as an H100 runs it), and a dispatch-level tracker of live storages "
            "(`fastbert.simulated.memory_plan.plan_step`) counts every byte allocated and freed: the peak, what is "
            "live at the end of the forward and what autograd keeps for the backward. Same inputs for every "
            "provider: full-length sequences, two segments, 15% of the tokens labelled, an NSP label each; bf16 "
            "autocast with fp32 weights (as `fastbert pretrain` runs on a GPU), inference in bf16 weights. "
            f"The largest batch is searched exactly (the batch fits, the next does not) in "
            f"{PLANNED_DEVICE_BYTES / GiB:g} GiB keeping {first['reserve']} (for the CUDA context, the driver's "
            "share, workspaces and the caching allocator's fragmentation: `RESERVE` in "
            "fastbert/simulated/device_fit.py). `benchmarks/gpu_check.sh` measures `torch.cuda.max_memory_allocated` "
            "over the same steps on a GPU; its rows appear below beside the plan.", "",
            f"Per layer: bytes the encoder's layers keep for the backward, per token per layer, over h, to read "
            f"against Megatron's {MEGATRON_SBH}·s·b·h for a 16-bit layer with flash attention (Korthikanti et al., "
            f"2022) and issue 18's {PAPER_SBH}·s·b·h for an exact backward without recomputing a matmul.", ""]
    out += ["### Goals", ""] + goals(by) + [""]
    goal_rows = [by.get((f"pretrain/{size},S={GOAL_SEQLEN},adamw", FASTBERT)) for size in ("base", "large")]
    split = [text for row in goal_rows if row and (text := beyond_the_list(row))]
    if split:
        out += ["What a fastbert layer keeps beyond issue 18's list (bytes per token and hidden unit, from the "
                "sizes; the sum is the planned figure):", ""] + [f"- {text}" for text in split] + [""]
    pretrain = [r for r in run if r["shape"]["mode"] == "pretrain" and r["shape"]["checkpointing"] == "none"]
    out += ["### Pretraining step (BertForPreTraining, MLM + NSP)", ""] + _step_table(pretrain, by, True) + [""]
    others = [r for r in run if r["shape"]["mode"] != "pretrain"]
    if others:
        out += ["### Fine-tuning (BertForSequenceClassification, AdamW) and inference (BertModel forward, bf16)", ""]
        out += _step_table(others, by, False) + [""]
    options = [r for r in run if r["provider"] == FASTBERT and r["shape"]["mode"] == "pretrain"
               and r["shape"]["optimizer"] == "adamw"]
    if any(r["shape"]["checkpointing"] != "none" for r in options):
        out += ["### fastbert's `--activation-checkpointing` options (AdamW)", "",
                "Extra FLOPs: what the backward recomputes, per step at the stated batch, and its share of the "
                "step's FLOPs.", ""] + _checkpointing_table(options) + [""]
    else:
        out += ["fastbert's `--activation-checkpointing` options are not in this run (the model has no such "
                "switch at its commit).", ""]
    goal_rows = [r for r in run if r["status"] == "ok" and r["shape"]["mode"] == "pretrain"
                 and r["shape"]["checkpointing"] == "none" and r["shape"]["seqlen"] == GOAL_SEQLEN
                 and r["shape"]["optimizer"] == "adamw"]
    goal_rows.sort(key=lambda r: (r["case"], PROVIDERS.index(r["provider"])))
    if goal_rows:
        out += [f"### At the peak: what is live (S = {GOAL_SEQLEN}, AdamW, at the stated batch)", ""]
        out += _breakdown_table(goal_rows) + [""]
        out += ["### Saved for the backward per module kind (bytes per token)", ""] + _saved_table(goal_rows) + [""]
    trained = [r for r in run if r["status"] == "ok" and r["shape"]["mode"] != "inference"
               and r["shape"]["checkpointing"] == "none" and r["shape"]["optimizer"] == "adamw"]
    out += ["### Under torchrun with FSDP2 (`--distributed fsdp`), per rank, GiB (computed from the plan)", "",
            "Weights, gradients and optimizer state at the peak divided by the world size; activations and "
            "transients not; plus the unsharded bf16 weights FSDP2 holds at once (the root's embeddings and heads, "
            "two encoder layers: the one computing and the one prefetched).", ""] + _fsdp2_table(trained) + [""]
    out += ["### The plan against a GPU", ""] + gpu_check_lines(newest(rows, "memory-gpu-check")) + [""]
    return out
