"""The "data" suite: how many pretraining sequences per CPU-second the input pipeline builds.

Issue 13's target: one H100 trains BERT-base on about 6,200 sequences/s at length 128 and 1,575 at
512, and the host must build batches at 4x that per CPU core: 25,000 and 6,300 sequences per
CPU-second. Measured as training runs it: PretrainingLoader's steps (Feistel epoch permutation,
reading from memory-mapped shards, padding, 80/10/10 masking, whole-word or not) produced in the
prefetch thread and taken by the main thread. The clock is the process's CPU time (every thread
of it), so other work on the machine does not count, and the loader thread is measured at one
torch thread and at torch's default (one per core), which would show any oversubscription.

The data: synthetic examples written as `fastbert prepare-data` writes them, BERT's vocabulary size
(30,522, a fifth of it "##" pieces), 90% of the examples at full length and 10% shorter (as the
paper's short_seq_prob), spread over many small shards so that a batch reads from many of them as it
does from a corpus of hundreds of shards.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np
import torch

from fastbert.data.examples import Example
from fastbert.data.loader import PretrainingLoader, permute, prefetch
from fastbert.data.masking import MaskingCollator
from fastbert.data.shards import ShardedDataset, shard_name, write_index, write_shard
from fastbert.data.tokenizer import SPECIAL_TOKENS

VOCAB_SIZE = 30522
SEQ_LENGTHS = (128, 512)
BATCH_SIZES = (32, 256)  # per rank: a global batch of 256 on 8 GPUs, and on 1
EXAMPLES, SHARDS = 20_000, 200
# sequences per CPU-second the loader must build (issue 13): 4x one H100's training rate
TARGETS = {128: 25_000, 512: 6_300}
REPEATS, REPEAT_CPU_S = 5, 0.25  # timed groups of batches, each at least this much CPU time
PERMUTATION_SIZES = (10 ** 6, 10 ** 9)
CPU_CLOCK = "time.process_time (CPU time of every thread of the process), median over timed groups"


def vocabulary() -> list[str]:
    return list(SPECIAL_TOKENS) + [f"##p{i}" if i % 5 == 0 else f"w{i}" for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS))]


def write_dataset(directory: str, seq_length: int, seed: int = 0) -> ShardedDataset:
    """EXAMPLES synthetic examples of at most seq_length tokens in SHARDS shards."""
    rng = np.random.default_rng(seed)
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    entries = []
    for shard in range(SHARDS):
        examples = []
        for _ in range(EXAMPLES // SHARDS):
            length = seq_length if rng.random() >= 0.1 else int(rng.integers(8, seq_length))
            a_length = int(rng.integers(2, length - 2))
            tokens = rng.integers(len(SPECIAL_TOKENS), VOCAB_SIZE, length)
            tokens[0], tokens[a_length - 1], tokens[-1] = ids["[CLS]"], ids["[SEP]"], ids["[SEP]"]
            examples.append(Example(tokens.tolist(), a_length, int(rng.integers(0, 2))))
        entries.append(write_shard(directory, shard_name(shard), examples, VOCAB_SIZE))
    write_index(directory, {"max_seq_length": seq_length, "vocab_size": VOCAB_SIZE, "shards": entries,
                            "special_ids": {"pad": ids["[PAD]"], "unk": ids["[UNK]"], "cls": ids["[CLS]"],
                                            "sep": ids["[SEP]"], "mask": ids["[MASK]"]}})
    with open(os.path.join(directory, "vocab.txt"), "w", encoding="utf-8") as f:
        f.writelines(token + "\n" for token in vocabulary())
    return ShardedDataset(directory)


def cpu_ms_per_item(next_item, repeats: int = REPEATS, group_cpu_s: float = REPEAT_CPU_S) -> list[float]:
    """CPU milliseconds per call of next_item, one figure per timed group (after one warm-up call)."""
    next_item()
    figures = []
    for _ in range(repeats):
        start, calls = time.process_time(), 0
        while time.process_time() - start < group_cpu_s:
            next_item()
            calls += 1
        figures.append((time.process_time() - start) * 1e3 / calls)
    return figures


def loader_row(dataset: ShardedDataset, batch: int, whole_word: bool, threads: int) -> dict:
    collator = MaskingCollator(dataset.vocabulary(), whole_word=whole_word)
    loader = PretrainingLoader(dataset, collator, batch, batch, seed=1)
    batches = prefetch(loader.steps(0), depth=2, threads=threads)
    try:
        figures = cpu_ms_per_item(lambda: next(batches))
    finally:
        batches.close()
    median = statistics.median(figures)
    return {"op": "loader", "case": f"loader/S={dataset.max_seq_length},B={batch},"
                                    f"{'whole-word' if whole_word else 'token'} masking",
            "shape": {"seqlen": dataset.max_seq_length, "batch": batch, "whole_word": whole_word},
            "provider": f"torch threads {threads}" + (" (torch's default)" if threads == torch.get_num_threads() else ""),
            "torch_threads": threads, "status": "ok",
            "median_ms": median, "p20_ms": float(np.percentile(figures, 20)), "p80_ms": float(np.percentile(figures, 80)),
            "sequences_per_cpu_s": batch / median * 1e3}


def permutation_row(size: int, batch: int = 256) -> dict:
    """CPU time to map one batch of stream positions to examples, for a dataset of `size` examples."""
    positions = np.arange(size // 2, size // 2 + batch)
    figures = cpu_ms_per_item(lambda: permute(positions, size, key=1), group_cpu_s=0.05)
    median = statistics.median(figures)
    return {"op": "permutation", "case": f"permutation/N={size:.0e},B={batch}", "shape": {"examples": size, "batch": batch},
            "provider": "feistel", "status": "ok", "median_ms": median, "p20_ms": float(np.percentile(figures, 20)),
            "p80_ms": float(np.percentile(figures, 80))}


def measure(progress: bool = True) -> list[dict]:
    """Every row of the suite (figures only; the caller adds provenance)."""
    from tqdm import tqdm

    default_threads = torch.get_num_threads()
    plan = [(s, b, w, t) for s in SEQ_LENGTHS for b in BATCH_SIZES for w in (False, True)
            for t in dict.fromkeys((1, default_threads))]
    bar = tqdm(total=len(plan) + len(PERMUTATION_SIZES), desc="fastbert bench data", unit="item",
               disable=not progress, dynamic_ncols=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fastbert-bench-data-") as root:
        datasets = {}
        for seq_length, batch, whole_word, threads in plan:
            if seq_length not in datasets:
                bar.set_postfix_str(f"writing {EXAMPLES} examples of length {seq_length}", refresh=True)
                directory = os.path.join(root, f"seq{seq_length}")
                os.makedirs(directory)
                datasets[seq_length] = write_dataset(directory, seq_length)
            row = loader_row(datasets[seq_length], batch, whole_word, threads)
            rows.append(row)
            bar.set_postfix_str(f"{row['case']} [{row['provider']}]: {row['sequences_per_cpu_s']:,.0f} seq/CPU-s",
                                refresh=False)
            bar.update(1)
    for size in PERMUTATION_SIZES:
        rows.append(permutation_row(size))
        bar.update(1)
    bar.close()
    return rows
