"""Training throughput accounting: model FLOPs, the device's measured peak, MFU, JSON-lines metrics.

FLOPs follow DESIGN.md: a [M,K]x[K,N] matmul is 2MNK, training is 3x the forward. Per sequence of
s real tokens (padding is not counted, whatever the kernels do with it), the forward is
    per layer: 2 s (4 H^2 + 2 H I)  [QKV, output, FFN]  +  4 s^2 H  [QK^T and PV]
               (ModernBERT: 2 s (4 H^2 + 3 H I) with its GeGLU's 2I-wide up-projection, and on a local layer
               4 p H for the p (query, key) pairs within its window instead of s^2)
    heads:     2 m (H^2 + H V) on the m masked tokens (the MLM head runs only there), 2 (H^2 + 2H)
               [the pooler and the NSP classifier, per sequence; none for the mlm objective]
MFU = achieved model FLOP/s / the device's measured matmul rate in the run's compute dtype.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from fastbert.data.examples import MLM_NSP
from fastbert.files import append_text, write_text

logger = logging.getLogger("fastbert.train")


def attention_pairs(lengths: torch.Tensor, window: int | None) -> torch.Tensor:
    """The (query, key) pairs attention scores over sequences of these lengths: s^2 each, or with a window
    (|i - j| <= w) s (2m + 1) - m (m + 1), m = min(w, s - 1)."""
    lengths = lengths.to(torch.float64)
    if window is None:
        return (lengths ** 2).sum()
    m = torch.clamp(lengths - 1, min=0).clamp(max=window)
    return (lengths * (2 * m + 1) - m * (m + 1)).sum()


def encoder_flops(config, lengths: torch.Tensor, pooler: bool = True) -> float:
    """Forward FLOPs of the encoder (the layers and, unless pooler=False, the pooler) over sequences of these
    real lengths; ModernBERT's GeGLU and local windows counted as they run."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    lengths = lengths.to(torch.float64)
    up = 2 * i if config.model_type == "modernbert" else i  # GeGLU's up-projection computes value and gate
    windows = [config.layer_window(n) if hasattr(config, "layer_window") else None for n in range(layers)]
    encoder = layers * 2 * (4 * h * h + h * (up + i)) * lengths.sum()
    encoder = encoder + sum(4 * h * attention_pairs(lengths, window) for window in windows)
    return float(encoder + pooler * 2 * len(lengths) * h * h)


def training_flops(config, lengths: torch.Tensor, masked_tokens: int, objective: str = MLM_NSP) -> float:
    """FLOPs of one training pass (forward + backward) over sequences of these real lengths: the masked-LM
    model's for the mlm objective (no pooler, no NSP classifier)."""
    h, v = config.hidden_size, config.vocab_size
    nsp = objective == MLM_NSP
    heads = 2 * masked_tokens * (h * h + h * v) + nsp * 4 * len(lengths) * h  # MLM head, NSP classifier
    return 3.0 * (encoder_flops(config, lengths, pooler=nsp) + heads)


def recompute_flops_per_token(config, activation_checkpointing: str, seq_length: int) -> float:
    """Extra forward FLOPs per token that an --activation-checkpointing option costs, over all layers of
    the encoder (what the backward reruns; model FLOPs and MFU leave them out, as recomputation is not
    model work). Per layer and token, with S the sequence length the attention runs over:
        "none"       0
        "attention"  2 (3H) H [QKV] + 4 S H [QK^T and PV] + 2 H H [output projection] = 8 H^2 + 4 S H
        "ffn"        2 H I [the up-projection only: kernels/ffn.py keeps x and reruns x W1^T; the torch
                     backend reruns the whole FFN, 4 H I]
        "full"       the whole layer: 2 (4 H^2 + 2 H I) + 4 S H
    LayerNorms, GELUs and dropout are elementwise and not counted, as in encoder_flops. Raises ValueError
    for an unknown option."""
    h, i, s = config.hidden_size, config.intermediate_size, seq_length
    per_layer = {"none": 0, "attention": 8 * h * h + 4 * s * h, "ffn": 2 * h * i,
                 "full": 2 * (4 * h * h + 2 * h * i) + 4 * s * h}
    if activation_checkpointing not in per_layer:
        raise ValueError(f"activation_checkpointing must be one of {tuple(per_layer)}, "
                         f"got {activation_checkpointing!r}")
    return float(config.num_hidden_layers * per_layer[activation_checkpointing])


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


# What a metrics line averages, summed over the global batches of its steps. Those before "tokens" count
# the steps whose loss was finite; tokens and FLOPs were spent by every step. mask_*: the labelled tokens
# shown as [MASK] (copying the input cannot get them right, unlike the 10% shown unchanged).
STATS = ("mlm_loss", "nsp_loss", "mlm_correct", "nsp_correct", "mask_correct", "masked_tokens", "sequences",
         "mask_tokens", "tokens", "flops")
FINITE_STATS = STATS[:STATS.index("tokens")]


@dataclass
class Reading:
    """What Window.read() brought to the host."""
    sums: dict[str, float]  # STATS since the last metrics line
    elapsed: float  # seconds since the last metrics line (a resumed run includes those before its stop)
    skipped: int  # steps whose update was skipped, since the last read
    bad: list[tuple[int, bool]]  # (step, a non-finite loss or gradient) of each step since the last read
    grad_norm: float  # of the last step, before clipping
    logged: bool = False  # its metrics line was written (Window.record): the window starts afresh


class Window:
    """Accounting of the steps since the last metrics line, without waiting for the device: add() only
    queues device operations; read() brings everything to the host in one transfer (once per metrics
    line, and before a checkpoint) and record() makes the metrics line.

    reduce: sums a float64 tensor over the ranks (the host's token and FLOP counts are per rank).
    carried: a checkpoint's window (carry()), so that the first line after a resume averages the
    same steps as the uninterrupted run's. objective: with mlm the lines have no NSP loss or accuracy.
    """

    def __init__(self, device: torch.device, reduce, carried: dict | None = None, objective: str = MLM_NSP):
        self.device, self.reduce, self.objective = device, reduce, objective
        self.sums = torch.zeros(len(FINITE_STATS), dtype=torch.float64, device=device)
        self.skipped = torch.zeros((), dtype=torch.float64, device=device)
        self.bad: list[tuple[int, torch.Tensor]] = []
        self.grad_norm = torch.zeros((), device=device)
        self.rank_tokens = self.rank_flops = 0.0  # this rank's, since the last read
        carried = carried or {}
        if carried:
            self.sums += torch.tensor([carried.get(k, 0.0) for k in FINITE_STATS], dtype=torch.float64, device=device)
        self.tokens, self.flops = carried.get("tokens", 0.0), carried.get("flops", 0.0)  # all ranks'
        self.elapsed_before = carried.get("elapsed", 0.0)
        self.start = time.perf_counter()

    def add(self, step: int, result, masked_global: float, sequences: int, mask_global: float, tokens: int,
            flops: float) -> None:
        """One step's result (step.StepResult); masked_global, sequences and mask_global: the global batch's."""
        finite = result.loss_finite
        counts = torch.stack([finite * float(n) for n in (masked_global, sequences, mask_global)]).double()
        self.sums += torch.where(finite, torch.cat([result.sums, counts]), 0.0)
        self.skipped += result.skipped
        self.bad.append((step, result.bad))
        self.grad_norm = result.grad_norm
        self.rank_tokens += tokens
        self.rank_flops += flops

    def read(self) -> Reading:
        host = self.reduce(torch.tensor([self.rank_tokens, self.rank_flops], dtype=torch.float64, device=self.device))
        device = torch.stack([self.skipped, self.grad_norm.double(), *[bad.double() for _, bad in self.bad]])
        values = torch.cat([self.sums, host, device]).tolist()  # the one wait for the device
        finite, (tokens, flops, skipped, grad_norm, *bad) = values[:len(FINITE_STATS)], values[len(FINITE_STATS):]
        self.tokens, self.flops = self.tokens + tokens, self.flops + flops
        reading = Reading(dict(zip(STATS, finite + [self.tokens, self.flops])),
                          self.elapsed_before + time.perf_counter() - self.start, int(skipped),
                          [(step, bool(b)) for (step, _), b in zip(self.bad, bad)], grad_norm)
        self.rank_tokens = self.rank_flops = 0.0
        self.skipped.zero_()
        self.bad.clear()
        return reading

    @staticmethod
    def carry(reading: Reading) -> dict:
        """The window so far, for a checkpoint (see `carried`): empty once the reading was logged, so that
        the first line after a resume from a checkpoint at a logging step averages only the steps after it."""
        return {} if reading.logged else {**reading.sums, "elapsed": reading.elapsed}

    def record(self, reading: Reading, peak_flops: float, **fields) -> dict:
        """One metrics line: the given fields (step, phase, ...) and the averages and rates of the window;
        then the window starts afresh. loss is None when every step of the window was skipped."""
        totals, record = reading.sums, dict(fields)
        nsp = self.objective == MLM_NSP
        if totals["masked_tokens"] > 0:
            mlm_loss = totals["mlm_loss"] / totals["masked_tokens"]
            nsp_loss = totals["nsp_loss"] / totals["sequences"] if nsp else 0.0
            record.update(loss=mlm_loss + nsp_loss, mlm_loss=mlm_loss,
                          mlm_accuracy=totals["mlm_correct"] / totals["masked_tokens"],
                          mlm_mask_accuracy=totals["mask_correct"] / max(totals["mask_tokens"], 1))
            if nsp:
                record.update(nsp_loss=nsp_loss, nsp_accuracy=totals["nsp_correct"] / totals["sequences"])
        else:
            record["loss"] = None
        record.update(tokens_per_s=totals["tokens"] / reading.elapsed,
                      mfu=totals["flops"] / reading.elapsed / peak_flops,
                      grad_norm=reading.grad_norm if math.isfinite(reading.grad_norm) else None)
        self.sums.zero_()
        self.tokens = self.flops = self.elapsed_before = 0.0
        self.start = time.perf_counter()
        reading.logged = True
        return record


class MetricsLog:
    """Appends one JSON object per logged step to <out>/metrics.jsonl (rank 0 only).

    resume_step None starts the file afresh; a step keeps the lines up to it. A last line cut short
    (a crash while it was written) is dropped with a warning; a bad line before it is a ValueError
    naming the file and the line."""

    def __init__(self, path: str, enabled: bool, resume_step: int | None):
        self.path, self.enabled = path, enabled
        if not (enabled and os.path.exists(path)):
            return
        if resume_step is None:
            os.remove(path)
            return
        # lines a crashed run wrote after its last checkpoint would be repeated by the resumed run
        write_text(path, "".join(line for line, record in self._records() if record["step"] <= resume_step))

    def _records(self) -> list[tuple[str, dict]]:
        with open(self.path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        records = []
        for number, line in enumerate(lines, start=1):
            record = _parse_record(line)
            if record is None:
                if number < len(lines):
                    raise ValueError(f"{self.path}, line {number}: not a metrics record: {line.strip()[:80]!r}")
                logger.warning(f"{self.path}: dropped its last line, cut short (a crash while it was written): "
                               f"{line.strip()[:80]!r}")
                break
            records.append((line if line.endswith("\n") else line + "\n", record))
        return records

    def write(self, record: dict) -> None:
        if self.enabled:
            append_text(self.path, json.dumps(record) + "\n", kept="its earlier lines are unchanged; the same "
                        "command resumes from the last checkpoint")


def _parse_record(line: str) -> dict | None:
    """A metrics line's record, or None when the line is not one."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None
