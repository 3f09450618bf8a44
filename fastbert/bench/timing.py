"""Medians after warm-up and peak memory, measured the same way for every provider.

GPU: CUDA events through `triton.testing.do_bench` (it also flushes the L2 cache between calls),
median and 20th/80th percentiles. Peak memory: `torch.cuda.max_memory_allocated` after
`reset_peak_memory_stats`, minus what was allocated when the call started.
CPU: `time.perf_counter` around each call (CPU work is synchronous, so the host clock is the
right clock) and the peak of the c10 CPU allocator's running total of live bytes, which it
reports with every allocation and free while `torch.profiler` records memory.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import torch

CUDA_TIMER = "CUDA events: triton.testing.do_bench, median after warm-up"
CPU_TIMER = "time.perf_counter per call, median after warm-up"
CUDA_MEMORY_METER = "torch.cuda.max_memory_allocated after reset_peak_memory_stats"
CPU_MEMORY_METER = "c10 CPU allocator's live-bytes total, reported per allocation to torch.profiler"


def timer_name(device: torch.device) -> str:
    return CUDA_TIMER if device.type == "cuda" else CPU_TIMER


def memory_meter_name(device: torch.device) -> str:
    return CUDA_MEMORY_METER if device.type == "cuda" else CPU_MEMORY_METER


def synchronized(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """fn followed by a device synchronize, so a host clock around it times the GPU work too."""
    def call():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return call


def _clear_grads(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


def time_ms(fn: Callable[[], object], device: torch.device, grad_to_none: Sequence[torch.Tensor] = (),
            warmup_ms: float = 25.0, rep_ms: float = 100.0, min_reps: int = 3) -> dict[str, float]:
    """Median, 20th and 80th percentile of fn's duration in milliseconds.

    The .grad of `grad_to_none` is cleared before every call, so backward passes do not
    accumulate into (and time) a growing gradient.
    """
    if device.type == "cuda":
        import triton.testing

        # do_bench sizes its loops from a first estimate; a floor on rep keeps >= min_reps calls
        # for slow functions (a whole training step), whose estimate would otherwise give one
        estimate_ms = max(_once_ms(fn, device, grad_to_none), 1e-3)
        rep_ms = max(rep_ms, min_reps * estimate_ms)
        warmup_ms = max(warmup_ms, estimate_ms)
        median, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none),
                                                   quantiles=[0.5, 0.2, 0.8])
        return {"median_ms": median, "p20_ms": p20, "p80_ms": p80}
    estimate_ms = max(_once_ms(fn, device, grad_to_none), 1e-3)  # this first call is the first warm-up
    for _ in range(int(warmup_ms / estimate_ms)):
        _clear_grads(grad_to_none)
        fn()
    times = []
    for _ in range(max(min_reps, int(rep_ms / estimate_ms))):
        _clear_grads(grad_to_none)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    quintiles = statistics.quantiles(times, n=5)  # the 20th, 40th, 60th and 80th percentiles
    return {"median_ms": statistics.median(times), "p20_ms": quintiles[0], "p80_ms": quintiles[3]}


def _once_ms(fn, device, grad_to_none) -> float:
    _clear_grads(grad_to_none)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def peak_memory(fn: Callable[[], object], device: torch.device) -> dict[str, int | None]:
    """Peak bytes allocated while fn runs: `peak_mem_bytes` in all (None on CPU, whose allocator
    keeps no process-wide count) and `peak_mem_extra_bytes` above what was live when fn started."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"peak_mem_bytes": peak, "peak_mem_extra_bytes": peak - base}
    return {"peak_mem_bytes": None, "peak_mem_extra_bytes": cpu_peak_extra_bytes(fn)}


@contextlib.contextmanager
def _stderr_to_devnull():
    """Silence file descriptor 2: the profiler's C++ side logs every start and stop there."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def cpu_peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak of CPU bytes live during fn above those live when it started.

    With profile_memory on, c10's CPU allocator reports every allocation and free to the profiler
    together with its running total; replaying those records in time order gives the peak.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _stderr_to_devnull(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            records.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.total_allocated))
        stack.extend(event.children)
    if not records:
        return 0
    records.sort()
    start_total = records[0][2] - records[0][1]
    return max(0, max(total for _, _, total in records) - start_total)
