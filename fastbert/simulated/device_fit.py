"""Fitting a planned step onto a device: the reserve a plan keeps, the largest batch whose step fits, the per-rank
peak under FSDP2, and `fastbert pretrain --micro-batch-size auto`'s choice of the micro-batch
(`choose_micro_batch`, which plans fastbert's pretraining step with simulated.memory_plan.plan_step).
`fastbert bench --suite memory` (bench.memory_cases) reads its plans against an H100 with the same pieces.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from fastbert.config import BertConfig
from fastbert.simulated.memory_plan import StepMemory, plan_step
from fastbert.simulated.pretraining import pretraining_batch, pretraining_model, training_head

GiB = 1 << 30
SECANT_STEPS = 4  # refits of the line before the search falls back to galloping and bisecting
STATE_CATEGORIES = ("weights", "gradients", "optimizer")  # plan_step's breakdown keys that FSDP2 shards


@dataclass(frozen=True)
class Reserve:
    """Memory a step may not plan on: a fixed part for what torch's allocator does not count (the share of HBM
    the driver keeps, the CUDA context with its loaded kernels, cuBLAS/cuDNN workspaces, NCCL buffers under
    torchrun) and a fraction of the planned peak for the caching allocator's rounding and fragmentation
    (blocks rounded to 512 B, segments of 2 MiB and 20 MiB whose free tails other sizes cannot always use)."""
    fixed_bytes: int
    fraction: float

    def needed(self, peak_bytes: int) -> int:
        """The device memory a step whose plan peaks at peak_bytes needs."""
        return self.fixed_bytes + math.ceil(peak_bytes * (1 + self.fraction))

    def text(self) -> str:
        return f"{self.fixed_bytes / GiB:g} GiB + {100 * self.fraction:g}% of the planned peak"


# 3 GiB: about 0.9 GiB of an 80 GiB H100 is not visible to CUDA, a context with fastbert's and cuBLAS's kernels
# loaded takes about 0.5-1 GiB, cuBLAS workspaces and NCCL buffers the rest. 10%: the caching allocator's
# reserved-over-allocated ratio at the peak of a training step is typically 1.02-1.10 without
# expandable_segments; the upper end is kept so that a batch the plan accepts does not run out of memory.
RESERVE = Reserve(fixed_bytes=3 * GiB, fraction=0.10)


def fits(peak_bytes: int, device_bytes: int, reserve: Reserve = RESERVE) -> bool:
    return reserve.needed(peak_bytes) <= device_bytes


def largest_batch(peak_of, device_bytes: int, reserve: Reserve = RESERVE, known: dict | None = None,
                  limit: int = 1 << 20) -> tuple[int, int]:
    """(the largest batch whose planned peak fits device_bytes with the reserve, the plans it took).

    peak_of(batch) -> peak bytes. Past small batches (whose peak is the optimizer step's: weights, gradients and
    state) a step's peak is affine in the batch, so a line through two planned batches near the budget crosses
    it at the answer: the search plans a second batch (half the one known), then the line's crossing, refitted
    (secant steps) until the batch fits and the next does not; where the line is off it gallops and bisects, so
    the answer is exact either way. known: {batch: peak bytes} already planned. The search goes no further than
    `limit`, returned when it fits; (0, plans) when not even batch 1 fits."""
    peaks = dict(known or {})
    budget = (device_bytes - reserve.fixed_bytes) / (1 + reserve.fraction)  # the largest peak that fits

    def ok(b: int) -> bool:
        if b not in peaks:
            peaks[b] = peak_of(b)
        return fits(peaks[b], device_bytes, reserve)

    def plans() -> int:
        return len(peaks) - len(known or {})

    def bracket() -> tuple[int, int | None]:
        fitting = [b for b in peaks if ok(b)]
        return max(fitting, default=0), min((b for b in peaks if not ok(b)), default=None)

    def crossing() -> int:
        """The line's crossing with the budget, through the planned batch nearest it and one far enough from
        it that rounding does not tilt the line."""
        near = sorted(peaks, key=lambda b: abs(peaks[b] - budget))
        a = near[0]
        b = next((b for b in near[1:] if abs(b - a) >= max(2, a // 8)), near[1])
        slope = (peaks[b] - peaks[a]) / (b - a)
        return limit if slope <= 0 else round(a + (budget - peaks[a]) / slope)

    if not any(ok(b) for b in list(peaks)) and not ok(1):
        return 0, plans()
    if len(peaks) < 2:
        only = next(iter(peaks))
        ok(only // 2 if only > 1 else 2)
    low, high = bracket()
    for _ in range(SECANT_STEPS):
        if high is not None and high - low <= 1:
            return low, plans()
        guess = min(max(crossing(), low + 1), limit if high is None else high - 1)
        if guess in peaks:
            break
        ok(guess)
        low, high = bracket()
    step = 1
    while high is None:  # gallop upwards from the largest batch that fits
        following = min(limit, low + step)
        if following == low:
            return low, plans()
        if ok(following):
            low, step = following, 2 * step
        else:
            high = following
    while high - low > 1:
        middle = (low + high) // 2
        if ok(middle):
            low = middle
        else:
            high = middle
    return low, plans()

# an encoder layer's module names in HF's layouts: ...encoder.layer.N... (BERT), ...transformer.layer.N...
# (DistilBERT), ...layers.N... (ModernBERT)
LAYER = re.compile(r"\.(?:encoder\.layer|transformer\.layer|layers)\.(\d+)(?:\.|$)")


def layer_index(name: str) -> str | None:
    """The encoder layer a module or parameter name belongs to, or None."""
    match = LAYER.search(f".{name}")
    return None if match is None else match.group(1)


def gathered_parameters(model: torch.nn.Module) -> int:
    """Parameters FSDP2 holds unsharded at once under `--distributed fsdp` (one shard group per encoder layer
    plus the root): the root's (embeddings and heads, gathered through the root's forward) and two layers'
    (the one computing and the one prefetched)."""
    layers: dict[str, int] = {}
    root = 0
    for name, p in model.named_parameters():
        index = layer_index(name)
        if index is not None:
            layers[index] = layers.get(index, 0) + p.numel()
        else:
            root += p.numel()
    return root + 2 * max(layers.values(), default=0)


def fsdp2_per_rank(memory: StepMemory, gathered_params: int, world_size: int) -> int:
    """A rank's peak under FSDP2 with bf16 all-gathers: the peak's weights, gradients and optimizer state
    divided by the world size, the rest (activations, transients) unchanged, plus the gathered parameters in
    bf16 (gathered_parameters)."""
    state = sum(memory.peak_breakdown.get(k, 0) for k in STATE_CATEGORIES)
    return memory.peak_bytes - state + math.ceil(state / world_size) + 2 * gathered_params


@dataclass
class MicroBatchChoice:
    """`fastbert pretrain --micro-batch-size auto` for one phase: the micro-batch, the largest batch that fits
    and the plan of a step at the micro-batch (peak and what is saved for the backward, bytes)."""
    micro_batch_size: int
    largest_batch: int
    peak_bytes: int
    saved_for_backward_bytes: int
    plans: int


def choose_micro_batch(config: BertConfig, seqlen: int, rank_batch: int, optimizer: str, precision: str,
                       free_bytes: int, fsdp_world_size: int = 1) -> MicroBatchChoice:
    """The largest divisor of rank_batch (this rank's sequences per step) whose planned step fits free_bytes with
    RESERVE kept: fastbert's pretraining step (simulated.pretraining: BertForPreTraining for BERT, the masked LM
    for the rest) at sequence length seqlen, with the model's config (its activation_checkpointing included), the
    optimizer, precision "bf16" or "fp32", per rank under FSDP2 when fsdp_world_size > 1. Raises ValueError when
    not even a micro-batch of one sequence fits."""
    head = training_head(config)
    gathered = gathered_parameters(pretraining_model(config, seqlen, head)) if fsdp_world_size > 1 else 0
    plans: dict[int, StepMemory] = {}

    def step(batch: int) -> StepMemory:
        if batch not in plans:
            plans[batch] = plan_step(pretraining_model(config, seqlen, head),
                                     pretraining_batch(config, batch, seqlen, head), mode="train",
                                     optimizer=optimizer, precision=precision)
        return plans[batch]

    def peak_of(batch: int) -> int:
        memory = step(batch)
        return memory.peak_bytes if fsdp_world_size == 1 else fsdp2_per_rank(memory, gathered, fsdp_world_size)

    largest, count = largest_batch(peak_of, free_bytes, limit=rank_batch)
    if largest == 0:
        raise ValueError(f"--micro-batch-size auto: a micro-batch of 1 sequence of length {seqlen} needs "
                         f"{RESERVE.needed(peak_of(1)) / GiB:.2f} GiB by the plan ({RESERVE.text()} kept), and the "
                         f"GPU has {free_bytes / GiB:.2f} GiB free")
    size = max(d for d in range(1, largest + 1) if rank_batch % d == 0)
    return MicroBatchChoice(size, largest, peak_of(size), step(size).saved_for_backward_bytes, count)
