"""Medians after warm-up and peak memory, measured the same way for every provider.

GPU: CUDA events through `triton.testing.do_bench` (it also flushes the L2 cache between calls),
median and 20th/80th percentiles. Peak memory: `torch.cuda.max_memory_allocated` after
`reset_peak_memory_stats`, minus what was allocated when the call started.
GPU op rows add the GPU's time alone (`device_time_ms`): do_bench's events also time any host work of a call
that outlasts the L2 flush before it, so a call whose host costs more than its kernels reads as the host's time.
The same calls give the host's time alone (`host_ms`): while the GPU sleeps no call waits for it, so the host clock
around one times what the host spends launching it, the figure the stand-in driver's host suite predicts.
CPU: `time.perf_counter` around each call (CPU work is synchronous, so the host clock is the
right clock) and the peak of the c10 CPU allocator's running total of live bytes, which it
reports with every allocation and free while `torch.profiler` records memory.
"""
from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import time
import warnings
from typing import Callable, Sequence

import torch

logger = logging.getLogger("fastbert.bench")

CUDA_TIMER = "CUDA events: triton.testing.do_bench, median after warm-up"
DEVICE_TIMER = ("the GPU's time alone: CUDA events around each call, all enqueued while the GPU sleeps "
                "(torch.cuda._sleep), each after an L2 flush; median of the calls. The host's time alone (host_ms): "
                "time.perf_counter around each of those calls, which never wait for the sleeping GPU; median")
NO_DEVICE_TIME = {"device_ms": None, "device_p20_ms": None, "device_p80_ms": None,
                  "host_ms": None}  # where none was measured
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


def device_time_ms(fn: Callable[[], object], device: torch.device, grad_to_none: Sequence[torch.Tensor] = (),
                   calls: int = 20) -> dict[str, float | None]:
    """Median, 20th and 80th percentile of the GPU's time for one call of fn on a CUDA device, the host's time
    left out (DEVICE_TIMER): a sleep kernel holds the GPU while the host enqueues every call, so no kernel waits
    for the host that launches it. And host_ms, the median of the host's time of those calls, the GPU's left
    out: none of them waits for the sleeping GPU. Each call follows an L2 flush, as in do_bench. That the GPU still
    slept when the host had enqueued the last call is checked, not assumed (a sleep twice as long is tried once
    more). A call that syncs with the host (CUDA's sync debug mode warns) has no such times: the figures are None
    then, as where the check fails, and a warning says why."""
    import triton

    if _syncs(fn, grad_to_none):
        logger.warning("the GPU's time alone was not measured: a call syncs with the host")
        return dict(NO_DEVICE_TIME)
    driver = triton.runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    host_ms = max(_once_ms(fn, device, grad_to_none), 1e-3)  # the host's time of a call is at most this
    cycles_per_ms = _sleep_cycles_per_ms(device)
    for longer in (1, 2):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
        slept = torch.cuda.Event()
        torch.cuda.synchronize(device)
        torch.cuda._sleep(int(longer * (2 * calls * host_ms + 1.0) * cycles_per_ms))
        slept.record()
        host_times = []
        for start, end in zip(starts, ends):
            _clear_grads(grad_to_none)
            driver.clear_cache(cache)
            start.record()
            began = time.perf_counter()
            fn()
            host_times.append((time.perf_counter() - began) * 1e3)
            end.record()
        host_got_ahead = not slept.query()  # the GPU is still in the sleep
        torch.cuda.synchronize(device)
        if host_got_ahead:
            times = [start.elapsed_time(end) for start, end in zip(starts, ends)]
            quintiles = statistics.quantiles(times, n=5)
            return {"device_ms": statistics.median(times), "device_p20_ms": quintiles[0],
                    "device_p80_ms": quintiles[3], "host_ms": statistics.median(host_times)}
    logger.warning("the GPU's time alone was not measured: the host enqueued %d calls more slowly than the GPU "
                   "slept, twice", calls)
    return dict(NO_DEVICE_TIME)


def device_time_fields(fn: Callable[[], object], device: torch.device, grad_to_none: Sequence[torch.Tensor] = (),
                       calls: int = 20) -> dict:
    """A GPU row's fields for device_time_ms (its figures and DEVICE_TIMER); the None figures where the timer fails,
    logged: a row keeps its median either way."""
    try:
        figures = device_time_ms(fn, device, grad_to_none, calls)
    except Exception:  # a timer's failure must not lose the row's other figures
        logger.exception("the GPU's time alone was not measured")
        figures = dict(NO_DEVICE_TIME)
    return {"device_timer": DEVICE_TIMER, **figures}


def _syncs(fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor]) -> bool:
    """Whether a call of fn syncs with the host, by CUDA's sync debug mode (its warnings, recorded)."""
    _clear_grads(grad_to_none)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return any("synchroniz" in str(w.message).lower() for w in caught)


_SLEEP_CYCLES_PER_MS: dict[int, float] = {}  # CUDA device index -> torch.cuda._sleep's cycles per millisecond


def _sleep_cycles_per_ms(device: torch.device) -> float:
    """What torch.cuda._sleep's argument counts (the GPU's clock cycles) per millisecond, measured once a device."""
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _SLEEP_CYCLES_PER_MS:
        torch.cuda._sleep(1000)  # loads the sleep kernel (CUDA loads modules lazily) outside the timed sleep
        cycles = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize(device)
        _SLEEP_CYCLES_PER_MS[index] = cycles / start.elapsed_time(end)
    return _SLEEP_CYCLES_PER_MS[index]


def comparable_ms(*rows: dict) -> list[float]:
    """The times rows are compared by, in their order: each one's GPU time alone where every row has it (the GPU
    suite's op rows), else their medians, so that no comparison sets one against the other (a call that syncs with
    the host has no GPU time alone). One row: the time its TFLOP/s and GB/s are computed from."""
    if all(row.get("device_ms") is not None for row in rows):
        return [row["device_ms"] for row in rows]
    return [row["median_ms"] for row in rows]


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
