"""The host time of fastbert's kernels without a GPU: every Triton launch stubbed, everything else real.

`stubbed_launches()` makes the stand-in driver of an H100 Triton's active driver in stub mode
(stand_in_gpu.install, kernels="stub"): the first launch of each signature puts a kernel that runs nothing in
Triton's cache, so every later launch takes the steady path a GPU takes (fastbert's argument checks, tile
choices, allocations and launch cache) to the C launch of Triton's CUDA launcher object, which does nothing here
(stand_in_gpu._triton_launcher): what the launch itself costs is left out. It also lets backend="triton" take CPU
tensors (fastbert.ops.set_launches_stubbed): outputs are allocated and never written, so no result is meaningful,
only the time the host spends. What a GPU adds per launch (the
driver's cuLaunchKernel, a few microseconds) is not counted; PyTorch's own ops on CPU tensors are timed with
their (small) CPU arithmetic. That arithmetic also reads the unwritten outputs (a backward's matmuls over the
gradient a stubbed kernel left unwritten), whose leftover bytes may be denormal floats, which a CPU multiplies
in microcode: a 4 x 128 by 128 x 64 matmul took 92 us on them against 2.2 us on normal values (Intel Xeon, one
thread), a cost that varies with what the allocator left and that no GPU run has. So denormals are flushed to
zero while the stubs are in (torch.set_flush_denormal), for every provider alike.

`host_microseconds(fn)`: the CPU time of this thread per call of fn, the least of several repeats: thread
time, not wall time, so other processes on the machine do not count; `interleaved_host_microseconds` times several
functions taking turns, for the ones a ratio compares.
"""
from __future__ import annotations

import contextlib
import time

import torch

from fastbert import ops
from fastbert.simulated.meta_gpu import autotuner_choices
from fastbert.simulated.stand_in_gpu import H100, LaunchLog, install


@contextlib.contextmanager
def stubbed_launches():
    """While entered, Triton launches run nothing, fastbert's kernels take CPU tensors and denormals are flushed
    (module docstring); backend="auto" runs the reference on CPU tensors, as without the stubs, until
    ops.set_stubbed_auto hands it a GPU's choices. On leaving, the driver, the autotuners' choices and fastbert's
    launch cache are as before, "auto" forgets those choices, and denormals are kept again (torch's default)."""
    import triton
    from triton import knobs

    from fastbert.kernels import launch
    from fastbert.kernels.numerics import INTERPRETER

    if INTERPRETER:
        raise RuntimeError("timing the host needs Triton's compiled-kernel path, and fastbert was imported with "
                           "TRITON_INTERPRET=1 (Triton's interpreter runs every kernel in numpy); run it in a "
                           "process without that variable")

    previous_driver, previous_hook = triton.runtime.driver._active, knobs.runtime.jit_cache_hook
    tuned = autotuner_choices()
    install(H100, LaunchLog(), kernels="stub")
    ops.set_launches_stubbed(True)
    flushed = torch.set_flush_denormal(True)  # False where the CPU cannot (no SSE3): nothing to undo
    try:
        yield
    finally:
        if flushed:  # torch cannot tell whether it was on before: back to its default, off
            torch.set_flush_denormal(False)
        ops.set_launches_stubbed(False)
        triton.runtime.driver.set_active(previous_driver)
        knobs.runtime.jit_cache_hook = previous_hook
        launch.clear_cache()  # its stubs are keyed by the stand-in driver, but need not be kept
        for tuner, choices in tuned.items():
            tuner.cache.clear()
            tuner.cache.update(choices)


def host_microseconds(fn, number: int = 50, repeats: int = 5, warmup: int = 5) -> float:
    """Thread CPU microseconds per call of fn: the least mean over `repeats` runs of `number` calls, after
    `warmup` calls (the first call of a signature compiles or stubs, and autotunes)."""
    return interleaved_host_microseconds({None: fn}, number, repeats, warmup)[None]


def interleaved_host_microseconds(fns: dict, number: int = 50, repeats: int = 5, warmup: int = 5) -> dict:
    """{name: thread CPU microseconds per call of fns[name]}, each the least mean over `repeats` runs of `number`
    calls, the functions' runs taking turns: a slow spell of the machine (a neighbour's load, a clock change)
    then falls on every function compared, not on one of them."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.thread_time_ns()
            for _ in range(number):
                fn()
            best[name] = min(best[name], (time.thread_time_ns() - start) / number / 1e3)
    return best


@contextlib.contextmanager
def one_thread():
    """One intra-op torch thread while entered: PyTorch's CPU arithmetic then costs the host one thread's time,
    and no second thread spins."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
