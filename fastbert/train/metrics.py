"""Training throughput accounting: model FLOPs, the device's measured peak, MFU, JSON-lines metrics.

FLOPs follow DESIGN.md: a [M,K]x[K,N] matmul is 2MNK, training is 3x the forward. Per sequence of
s real tokens (padding is not counted, whatever the kernels do with it), the forward is
    per layer: 2 s (4 H^2 + 2 H I)  [QKV, output, FFN]  +  4 s^2 H  [QK^T and PV]
    heads:     2 m (H^2 + H V) on the m masked tokens (the MLM head runs only there), 2 (H^2 + 2H)
MFU = achieved model FLOP/s / the device's measured matmul rate in the run's compute dtype.
"""
from __future__ import annotations

import json
import os
import time

import torch


def encoder_flops(config, lengths: torch.Tensor) -> float:
    """Forward FLOPs of BertModel (the layers and the pooler) over sequences of these real lengths."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    lengths = lengths.to(torch.float64)
    encoder = layers * (2 * (4 * h * h + 2 * h * i) * lengths.sum() + 4 * h * (lengths ** 2).sum())
    return float(encoder + 2 * len(lengths) * h * h)


def training_flops(config, lengths: torch.Tensor, masked_tokens: int) -> float:
    """FLOPs of one training pass (forward + backward) over sequences of these real lengths."""
    h, v = config.hidden_size, config.vocab_size
    heads = 2 * masked_tokens * (h * h + h * v) + 4 * len(lengths) * h  # MLM head, NSP classifier
    return 3.0 * (encoder_flops(config, lengths) + heads)


def measure_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in dtype on device: the fastest of several timed runs, since a
    peak is the best the device shows (on a shared CPU a median taken under load would understate it
    and push MFU past 100%). Uses its own generator: the run's RNG stream is not touched."""
    n = 8192 if device.type == "cuda" else 1024
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    times = []
    for _ in range(7):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - begin)
    return 2.0 * n ** 3 / min(times[2:])


# The sums over the global batch that a training step returns, in this order.
STATS = ("mlm_loss", "nsp_loss", "mlm_correct", "nsp_correct", "masked_tokens", "sequences", "tokens", "flops")


class Window:
    """The sums (STATS) of the steps since the last metrics line, and the line they make."""

    def __init__(self, device: torch.device, peak_flops: float):
        self.peak_flops = peak_flops  # of all ranks together
        self.totals = torch.zeros(len(STATS), dtype=torch.float64, device=device)
        self.start = time.perf_counter()

    def add(self, stats: torch.Tensor) -> None:
        self.totals += stats

    def record(self, **fields) -> dict:
        """One metrics line: the given fields (step, phase, ...) and the window's averages and rates;
        then the window starts afresh. loss is None when every step of the window was skipped."""
        totals = dict(zip(STATS, self.totals.tolist()))
        elapsed = time.perf_counter() - self.start
        record = dict(fields)
        if totals["masked_tokens"] > 0:
            mlm_loss = totals["mlm_loss"] / totals["masked_tokens"]
            nsp_loss = totals["nsp_loss"] / totals["sequences"]
            record.update(loss=mlm_loss + nsp_loss, mlm_loss=mlm_loss, nsp_loss=nsp_loss,
                          mlm_accuracy=totals["mlm_correct"] / totals["masked_tokens"],
                          nsp_accuracy=totals["nsp_correct"] / totals["sequences"])
        else:
            record["loss"] = None
        record.update(tokens_per_s=totals["tokens"] / elapsed, mfu=totals["flops"] / elapsed / self.peak_flops)
        self.totals.zero_()
        self.start = time.perf_counter()
        return record


class MetricsLog:
    """Appends one JSON object per logged step to <out>/metrics.jsonl (rank 0 only).

    resume_step None starts the file afresh; a step keeps the lines up to it."""

    def __init__(self, path: str, enabled: bool, resume_step: int | None):
        self.path, self.enabled = path, enabled
        if not (enabled and os.path.exists(path)):
            return
        if resume_step is None:
            os.remove(path)
        else:
            # lines a crashed run wrote after its last checkpoint would be repeated by the resumed run
            with open(path, encoding="utf-8") as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resume_step]
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(tmp, path)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
