"""`fastbert prepare-data` at corpus scale: CPU time per MB, scaling with workers, and peak memory that
the chunk size bounds whatever the corpus and document sizes (issue 13, item 5).

    python benchmarks/prepare_data.py --workdir /tmp/prepare-bench [--sizes 100M 1G] [--workers 1 2]

Corpora are generated into --workdir from the sentences of Python's standard-library docstrings (real
English prose, drawn with replacement, so token statistics are those of documentation text):
"articles" of 20-60 sentences at each of --sizes, and "books" of 0.5-2 MB each. Every run is a
`fastbert prepare-data` subprocess (--max-seq-length 128 512, the vocabulary given, so that the rows time
the sharding; one row times vocabulary training alone). Measured per run: wall time, the CPU time of
the process and its workers (os.wait4's rusage, which counts waited-for children: robust to other
load on a shared machine, unlike wall time), and the peak resident memory of the process tree, of the
parent and of the largest worker (each process's VmHWM, and /proc sampled every 0.1 s for the sum).
Rows go to benchmarks/results/prepare-data-<device>-<date>.json; `python benchmarks/make_perf.py`
puts them in PERF.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time

import psutil
import torch

from fastbert.bench import provenance
from fastbert.data.corpus import read_documents
from fastbert.data.prepare import parse_bytes

MiB = 1 << 20


def corpus_sentences() -> list[str]:
    return [s for document in read_documents(["stdlib"]) for s in document if len(s) > 20]


def write_corpus(path: str, size: int, sentences_per_document: tuple[int, int], seed: int) -> dict:
    """Documents of random sentences until `size` bytes; returns what was written."""
    if os.path.exists(path + ".json"):
        with open(path + ".json", encoding="utf-8") as f:
            return json.load(f)
    sentences = corpus_sentences()
    rng = random.Random(seed)
    written = documents = 0
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        while written < size:
            text = "\n".join(rng.choices(sentences, k=rng.randint(*sentences_per_document))) + "\n\n"
            f.write(text)
            written += len(text.encode())
            documents += 1
    os.replace(path + ".tmp", path)
    written_corpus = {"path": path, "bytes": written, "documents": documents}
    with open(path + ".json", "w", encoding="utf-8") as f:
        json.dump(written_corpus, f)
    return written_corpus


class TreeMemory:
    """Peak RSS of a process and its descendants, sampled every `interval` seconds in a thread, and
    each process's own peak (VmHWM, exact) as last seen."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.root = psutil.Process(pid)
        self.interval = interval
        self.tree_peak = 0
        self.high_water: dict[int, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        try:
            processes = [self.root] + self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            return
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
                with open(f"/proc/{process.pid}/status", encoding="utf-8") as f:
                    hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
                self.high_water[process.pid] = max(self.high_water.get(process.pid, 0), hwm)
            except (psutil.NoSuchProcess, FileNotFoundError, StopIteration, ProcessLookupError):
                continue
        self.tree_peak = max(self.tree_peak, total)

    def _run(self) -> None:
        while not self.stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        workers = [v for pid, v in self.high_water.items() if pid != self.root.pid]
        return {"peak_rss_tree_bytes": self.tree_peak, "peak_rss_parent_bytes": self.high_water.get(self.root.pid),
                "peak_rss_worker_bytes": max(workers) if workers else None, "processes": len(self.high_water)}


def measure(argv: list[str]) -> dict:
    """Run a command; its wall time, CPU time (its own and its waited-for children's) and memory."""
    started = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    memory = TreeMemory(process.pid)
    stderr_lines: list[str] = []
    reader = threading.Thread(target=lambda: stderr_lines.extend(process.stderr), daemon=True)
    reader.start()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    reader.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{''.join(stderr_lines[-20:])}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, **memory.finish()}


def prepare_argv(corpus: str, out: str, workers: int, chunk_bytes: str, tokenizer: str | None) -> list[str]:
    argv = [sys.executable, "-m", "fastbert.cli", "prepare-data", "--corpus", corpus, "--out", out,
            "--max-seq-length", "128", "512", "--workers", str(workers), "--chunk-bytes", chunk_bytes, "--overwrite"]
    return argv + (["--tokenizer", tokenizer] if tokenizer else [])


VOCAB_ONLY = """
import sys
from fastbert.data.corpus import plan_chunks
from fastbert.data.prepare import VocabularySample, DEFAULT_CHUNK_BYTES
from fastbert.data.tokenizer import save_tokenizer, train_wordpiece
plan = plan_chunks([sys.argv[1]], DEFAULT_CHUNK_BYTES)
save_tokenizer(train_wordpiece(VocabularySample(plan, int(sys.argv[3]), "strict"), 30522), sys.argv[2])
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/fastbert-prepare-bench", help="corpora and outputs (about 3x --sizes)")
    p.add_argument("--sizes", nargs="+", default=["100M", "1G"], help="sizes of the article corpora")
    p.add_argument("--books", default="100M", help="size of the corpus of book-sized documents")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts for the scaling rows")
    p.add_argument("--chunk-bytes", nargs="+", default=["8M", "32M"],
                   help="chunk sizes for the memory rows (on the smallest corpus)")
    p.add_argument("--vocab-sample", default="100M", help="text the vocabulary-training row trains on")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON rows")
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    command = ["python", "benchmarks/prepare_data.py", *(sys.argv[1:] if argv is None else argv)]
    base = {**provenance.provenance(torch.device("cpu"), command), "suite": "prepare-data",
            "timer": "wall: time.perf_counter; CPU: os.wait4 rusage of the command (its workers included)",
            "memory_meter": "each process's VmHWM; the tree's RSS sampled every 0.1 s"}

    corpora = {}
    for size in args.sizes:
        corpora[f"articles-{size}"] = write_corpus(os.path.join(args.workdir, f"articles-{size}.txt"),
                                                   parse_bytes(size), (20, 60), seed=1)
    corpora[f"books-{args.books}"] = write_corpus(os.path.join(args.workdir, f"books-{args.books}.txt"),
                                                  parse_bytes(args.books), (5000, 20000), seed=2)
    smallest = f"articles-{args.sizes[0]}"
    tokenizer = os.path.join(args.workdir, "tokenizer")
    rows = []

    def record(kind: str, corpus: str, workers: int, chunk: str, result: dict) -> None:
        mb = corpora[corpus]["bytes"] / MiB
        row = {**base, **result, "status": "ok", "op": kind, "corpus": corpus, "corpus_bytes": corpora[corpus]["bytes"],
               "documents": corpora[corpus]["documents"], "workers": workers, "chunk_bytes": parse_bytes(chunk),
               "load_average_1min": os.getloadavg()[0], "mib_per_cpu_s": mb / result["cpu_s"],
               "mib_per_s": mb / result["wall_s"]}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("op", "corpus", "workers", "chunk_bytes", "wall_s", "cpu_s",
                                              "peak_rss_worker_bytes", "peak_rss_tree_bytes")}), flush=True)

    sample = parse_bytes(args.vocab_sample)
    result = measure([sys.executable, "-c", VOCAB_ONLY, corpora[smallest]["path"], tokenizer, str(sample)])
    record("vocab-training", smallest, 1, "32M", {**result, "sample_bytes": min(sample, corpora[smallest]["bytes"])})
    tokenizer_file = os.path.join(tokenizer, "tokenizer.json")
    runs = [(smallest, w, "32M") for w in args.workers]
    runs += [(smallest, max(args.workers), c) for c in args.chunk_bytes if c != "32M"]
    runs += [(name, max(args.workers), "32M") for name in corpora if name != smallest]
    for corpus, workers, chunk in runs:
        out = os.path.join(args.workdir, f"out-{corpus}-{workers}-{chunk}")
        shutil.rmtree(out, ignore_errors=True)  # prepare-data leaves a finished same-option dataset alone
        result = measure(prepare_argv(corpora[corpus]["path"], out, workers, chunk, tokenizer_file))
        record("sharding", corpus, workers, chunk, result)
    os.makedirs(args.out, exist_ok=True)
    stamp = base["date"].replace(":", "").replace("-", "").replace("+0000", "Z")
    device = re.sub(r"[^A-Za-z0-9]+", "-", base["device"]).strip("-")
    path = os.path.join(args.out, f"prepare-data-{device}-{stamp}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    print(f"{len(rows)} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
