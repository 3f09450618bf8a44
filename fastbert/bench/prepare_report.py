"""PERF.md's section on `fastbert prepare-data` at corpus scale, from the rows of benchmarks/prepare_data.py
(suite "prepare-data"): the measured runs, the rate per core, the scaling with workers, peak memory
per worker against corpus, document and chunk sizes, and the projection to a 16 GB corpus."""
from __future__ import annotations

COMMAND = "python benchmarks/prepare_data.py"
MiB = 1 << 20
PROJECTED_CORPUS_MIB = 16 * 1024  # the paper's corpus: BooksCorpus + English Wikipedia, about 16 GB of text
PROJECTED_CORES = (16, 64)
DEFAULT_VOCAB_SAMPLE_MIB = 1024


def _mib(value) -> str:
    return "-" if value is None else f"{value / MiB:,.0f} MiB"


def _newest(rows: list[dict]) -> list[dict]:
    """The rows of the newest prepare-data run."""
    runs = [r for r in rows if r.get("suite") == "prepare-data"]
    newest = max((r["date"] for r in runs), default=None)
    return [r for r in runs if r["date"] == newest]


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def prepare_data_section(rows: list[dict], provenance_line) -> list[str]:
    run = _newest(rows)
    out = ["## prepare-data at corpus scale (issue 13)", ""]
    if not run:
        return out + [f"Not yet measured: `{COMMAND}`, then `python benchmarks/make_perf.py`.", ""]
    out += [provenance_line(run), "",
            "Corpora generated from sentences of Python's standard-library docstrings drawn with replacement: "
            "\"articles\" of 20-60 sentences, \"books\" of 5,000-20,000 sentences (about 0.5-2 MB each). "
            "`--max-seq-length 128 512`, the vocabulary (30,522) given for the sharding rows. CPU time is that "
            "of the command and its workers (the machine was shared: wall times include waiting for a core, CPU "
            "times do not). Peak memory: each process's own peak resident set (VmHWM); the tree's is the "
            "largest sampled sum of the processes' resident sets (shared library pages are counted once per "
            "process). One worker runs in the command's own process (no worker column).", "",
            "| what | corpus | documents (mean size) | workers | --chunk-bytes | wall | CPU | MiB per CPU-s | "
            "largest worker | parent | whole tree | load (1 min) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in run:
        mean = r["corpus_bytes"] / r["documents"]
        sample = f" ({_mib(r['sample_bytes'])} sample)" if r["op"] == "vocab-training" else ""
        out.append(f"| {r['op']}{sample} | {r['corpus']} ({_mib(r['corpus_bytes'])}) | {r['documents']:,} "
                   f"({mean / 1024:,.1f} KiB) | {r['workers']} | {_mib(r['chunk_bytes'])} | {r['wall_s']:.0f} s | "
                   f"{r['cpu_s']:.0f} s | {r['mib_per_cpu_s']:.2f} | {_mib(r['peak_rss_worker_bytes'])} | "
                   f"{_mib(r['peak_rss_parent_bytes'])} | {_mib(r['peak_rss_tree_bytes'])} | "
                   f"{r['load_average_1min']:.1f} |")
    out.append("")
    sharding = [r for r in run if r["op"] == "sharding"]
    vocab = [r for r in run if r["op"] == "vocab-training"]
    if not sharding:
        return out
    rate = sum(r["corpus_bytes"] for r in sharding) / MiB / sum(r["cpu_s"] for r in sharding)
    out += [f"Sharding rate: **{rate:.2f} MiB of text per CPU-second** over all sharding rows, that is per core "
            "when every core runs a worker.", ""]
    first = min(sharding, key=lambda r: r["workers"])  # the scaling rows: same corpus and chunk, more workers
    same = [r for r in sharding if r["corpus"] == first["corpus"] and r["chunk_bytes"] == first["chunk_bytes"]]
    scaling = sorted(same, key=lambda r: r["workers"])
    out += ["Scaling with workers (" + first["corpus"] + ", the same chunk size): " + "; ".join(
        f"{r['workers']} worker(s) {r['cpu_s'] / (r['corpus_bytes'] / MiB):.2f} CPU-s per MiB, wall time "
        f"{first['wall_s'] / r['wall_s']:.2f}x as fast as {first['workers']}" for r in scaling)
        + ". The work is split by chunk and nothing is shared, so CPU time per MiB does not grow with workers; "
        "wall-clock speed-up here is bounded by the other work on this shared 2-core machine.", ""]
    out.append(f"**Projection** for a {PROJECTED_CORPUS_MIB // 1024} GB corpus (computed, not measured: the rate "
               "above, spread over the cores, assuming it holds per core as the CPU time per MiB above does):")
    out += [f"- {cores} cores: sharding about {_duration(PROJECTED_CORPUS_MIB / rate / cores)}"
            for cores in PROJECTED_CORES]
    if vocab:
        v = vocab[0]
        per_mib = v["cpu_s"] / (v["sample_bytes"] / MiB)
        out.append(f"- plus vocabulary training, on the default {DEFAULT_VOCAB_SAMPLE_MIB} MiB sample whatever the "
                   f"corpus size: {per_mib:.2f} CPU-s per MiB of sample measured on {_mib(v['sample_bytes'])}, so "
                   f"about {_duration(per_mib * DEFAULT_VOCAB_SAMPLE_MIB)} of CPU time (HF tokenizers counts words "
                   "on all cores; its merges are serial)")
    return out + [""]
