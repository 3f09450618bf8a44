"""A stand-in Triton driver that compiles for a GPU without one, and records every launch instead of running it.

Triton asks its active driver for the target (`GPUTarget("cuda", 90, 32)` for an H100), the device's
properties (shared memory per block, SM count) and, at launch, for a loader and a launcher. This driver
answers the first two as the real GPU would, loads nothing, and hands each launch, with its compiled
kernel, to a `LaunchLog`. The project's own host launchers then run unchanged: Triton specialises their
arguments and their autotuners try their configs exactly as on the GPU, and the log says which compiled
kernels they would have launched. Nothing is executed, so no result tensor is meaningful.

Autotuned kernels: the driver's benchmarker compiles every config the autotuner offers it (after the
kernel's own pruning) and reports the same time for all, so every candidate is logged; which one a GPU
would pick waits for a GPU.
"""
from __future__ import annotations

import math
import resource
from dataclasses import dataclass, field

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


@dataclass(frozen=True)
class GPU:
    """What the occupancy and the launch checks need to know about one GPU."""
    name: str
    target: str  # the SASS architecture Triton compiles for
    capability: int  # e.g. 90
    sm_count: int
    max_shared_per_block: int  # bytes a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    shared_per_sm: int  # bytes
    reserved_shared_per_block: int = 1024  # the runtime's own share of every block (sm_80 and later)
    registers_per_sm: int = 65536
    max_registers_per_thread: int = 255
    register_unit: int = 256  # registers are given to a warp in units of this many
    max_threads_per_sm: int = 2048
    max_threads_per_block: int = 1024
    max_blocks_per_sm: int = 32
    warp_size: int = 32

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size

    def warp_registers(self, registers_per_thread: int) -> int:
        """Registers a warp is given: its threads' registers, rounded up to the allocation unit."""
        return math.ceil(registers_per_thread * self.warp_size / self.register_unit) * self.register_unit


# NVIDIA's CUDA C++ Programming Guide, "Compute capabilities" table (8.0 and 9.0); SM counts of the
# A100 SXM4 and H100 SXM5.
H100 = GPU("H100 SXM", "sm_90a", 90, 132, max_shared_per_block=227 * 1024, shared_per_sm=228 * 1024)
A100 = GPU("A100 SXM", "sm_80", 80, 108, max_shared_per_block=163 * 1024, shared_per_sm=164 * 1024)
GPUS = {gpu.target: gpu for gpu in (H100, A100)}


def occupancy(gpu: GPU, registers: int, shared_bytes: int, num_warps: int) -> dict:
    """Resident blocks and warps per SM that a kernel's registers, shared memory and warps allow, as the
    CUDA occupancy calculator computes them, and which resource limits it."""
    warp_registers = gpu.warp_registers(registers)
    limits = {
        "blocks": gpu.max_blocks_per_sm,
        "threads": gpu.max_threads_per_sm // (num_warps * gpu.warp_size),
        "registers": (gpu.registers_per_sm // warp_registers) // num_warps if warp_registers else gpu.max_blocks_per_sm,
    }
    if shared_bytes:
        per_block = math.ceil((shared_bytes + gpu.reserved_shared_per_block) / 128) * 128
        limits["shared memory"] = gpu.shared_per_sm // per_block
    blocks = min(limits.values())
    warps = blocks * num_warps
    return {"blocks_per_sm": blocks, "warps_per_sm": warps, "occupancy": warps / gpu.max_warps_per_sm,
            "occupancy_limited_by": min(limits, key=limits.get)}


@dataclass
class Launch:
    """One launch the host code asked for: which compiled kernel, in which config, for what."""
    kernel: str  # the @triton.jit function's name
    constexprs: dict  # every tl.constexpr argument by name: the config's block sizes and the flags
    metadata: dict  # Triton's metadata of the compiled kernel: hash, num_warps, num_stages, shared, ...
    cubin: bytes
    ptx: str
    autotune_candidate: bool  # launched by the autotuner's benchmark, not chosen by the host code
    compile_cpu_seconds: float | None  # CPU time of its compile, ptxas included (small when Triton's disk cache
    # had it); None: compiled earlier in this process


@dataclass
class Failure:
    """A compile that raised: the kernel and config it was for, when Triton had said so."""
    kernel: str | None
    constexprs: dict
    num_warps: int | None
    num_stages: int | None
    error: str
    autotune_candidate: bool


@dataclass
class LaunchLog:
    events: list = field(default_factory=list)
    compiling: dict | None = None  # what Triton announced it compiles, until the launch that follows
    benchmarking: bool = False  # inside the autotuner's benchmark of one config

    def take(self) -> list:
        events, self.events = self.events, []
        return events

    def take_compiled(self) -> list:
        """`take`'s launches, each compiled kernel once (an autotuner launches its chosen config again); raises
        RuntimeError naming the first compile that failed."""
        launches, seen = [], set()
        for event in self.take():
            if not hasattr(event, "cubin"):
                raise RuntimeError(f"a compile failed: {event}")
            if event.metadata["hash"] not in seen:
                seen.add(event.metadata["hash"])
                launches.append(event)
        return launches

    def failed(self, exc: BaseException) -> None:
        about = self.compiling or {}
        self.events.append(Failure(about.get("kernel"), about.get("constexprs", {}), about.get("num_warps"),
                                   about.get("num_stages"), f"{type(exc).__name__}: {_first_line(exc)}",
                                   self.benchmarking))
        self.compiling = None


def cpu_seconds() -> float:
    """CPU time of this process and of the programs it ran and waited for (ptxas, cuobjdump)."""
    return sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for field in ("ru_utime", "ru_stime"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _constexprs(fn, constants: dict) -> dict:
    """{name: value} of a kernel's constexpr arguments from Triton's {(index,): value} map."""
    names = fn.arg_names
    out = {}
    for path, value in constants.items():
        index = path[0] if isinstance(path, tuple) else names.index(path)
        if index in fn.constexprs:
            out[names[index]] = value.value if hasattr(value, "value") else value
    return out


class _Binary:
    """What load_binary hands back in place of a loaded CUDA function: the cubin, kept for the log."""

    def __init__(self, name: str, cubin: bytes):
        self.name = name
        self.cubin = cubin


class _Launcher:
    """Logs each launch of one compiled kernel, with its binary and its PTX, and runs nothing."""

    def __init__(self, src, metadata, log: LaunchLog):
        self.src = src
        self.metadata = metadata._asdict()
        self.log = log

    def __call__(self, grid_x, grid_y, grid_z, stream, function, *args):
        name = function.name
        # the PTX lies beside the cubin in Triton's cache, where every compile leaves its stages
        files = triton.runtime.cache.get_cache_manager(self.metadata["hash"]).get_group(f"{name}.json")
        with open(files[f"{name}.ptx"], encoding="utf-8") as f:
            ptx = f.read()
        about = self.log.compiling
        cpu = None if about is None else round(cpu_seconds() - about["cpu_seconds"], 2)
        self.log.events.append(Launch(name, _constexprs(self.src.fn, self.src.constants), self.metadata,
                                      function.cubin, ptx, self.log.benchmarking, cpu))
        self.log.compiling = None


class _Utils:
    def __init__(self, gpu: GPU, registers_of):
        self.gpu = gpu
        self.registers_of = registers_of

    def get_device_properties(self, device):
        gpu = self.gpu
        return {"max_shared_mem": gpu.max_shared_per_block, "multiprocessor_count": gpu.sm_count,
                "max_num_regs": gpu.registers_per_sm, "warpSize": gpu.warp_size,
                "sm_clock_rate": 0, "mem_clock_rate": 0, "mem_bus_width": 0}

    def load_binary(self, name, cubin, shared, device):
        """(module, function, registers per thread, spilled registers, max threads per block), as the CUDA
        driver reports them; max threads shrink when the registers of a full block would not fit the SM."""
        gpu = self.gpu
        registers = self.registers_of(cubin)
        max_threads = min(gpu.max_threads_per_block,
                          gpu.registers_per_sm // max(1, gpu.warp_registers(registers)) * gpu.warp_size)
        return object(), _Binary(name, cubin), registers, 0, max_threads

    def unload_module(self, module):
        pass


class StandInDriver(DriverBase):
    """Triton's driver for `gpu`, with no GPU: compiles, checks resources, and logs launches to `log`.

    registers_of(cubin) -> registers per thread (cuobjdump's count), which load_binary reports as CUDA
    would, so that Triton's own check of threads per block sees what it sees on the GPU.
    """

    def __init__(self, gpu: GPU, log: LaunchLog, registers_of):
        super().__init__()
        self.gpu = gpu
        self.log = log
        self.utils = _Utils(gpu, registers_of)

    def launcher_cls(self, src, metadata):
        """What Triton builds once per compiled kernel and calls for each launch."""
        return _Launcher(src, metadata, self.log)

    @staticmethod
    def is_active():
        return False

    def get_current_target(self):
        return GPUTarget("cuda", self.gpu.capability, self.gpu.warp_size)

    def get_current_device(self):
        # Triton caches compiled kernels per device index; one index per GPU model keeps targets apart
        return self.gpu.capability

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=None):
        return divmod(self.gpu.capability, 10)

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp
        return ty_to_cpp(ty)

    def get_benchmarker(self):
        log = self.log

        def compile_candidate(kernel_call, quantiles=None, **kwargs):
            """Compile (and log) one autotuning candidate; every candidate gets the same time."""
            log.benchmarking = True
            try:
                kernel_call()
                times = [1.0, 1.0, 1.0]
            except Exception as exc:  # a candidate that does not compile is logged, and never chosen
                log.failed(exc)
                times = [math.inf] * 3
            finally:
                log.benchmarking = False
            return times if quantiles else times[0]

        return compile_candidate


def _run_nothing(*args):
    pass


_NO_LAUNCH = "".format  # a C function that takes any arguments and does nothing with them: the C launch's place


def _triton_launcher():
    """Triton's own CUDA launcher object (the NVIDIA backend's CudaLauncher) of a kernel without scratch memory,
    without tensor descriptors or GSan, whose C launch is a no-op taking any arguments: a stub launch then does
    what a GPU launch does up to that C launch (through the object's Python, its scratch and profiler checks, or
    directly, as fastbert's kept launches call it: kernels/launch.py's _direct_launch), which a stub function in
    the object's place would not. The attributes are those Triton's __init__ sets, in 3.6 and 3.9 (a superset).
    None where the backend has no CudaLauncher."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError:
        return None
    launcher = object.__new__(CudaLauncher)
    launcher.__dict__.update(num_ctas=1, launch=_NO_LAUNCH, global_scratch_size=0, global_scratch_align=1,
                             profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False,
                             launch_pdl=False, gsan_enabled=False, arg_annotations=(), kernel_signature=b"")
    return launcher


# what a stub launch calls: Triton's launcher of a GPU (one object: none of its state is a kernel's), else a function
# that does nothing
_STUB_RUN = _triton_launcher() or _run_nothing


class _StubKernel:
    """What Triton's kernel cache holds for a launch in stub mode: a compiled kernel whose launcher runs Triton's
    host code of a launch and launches nothing."""
    function = None
    packed_metadata = None
    run = _STUB_RUN

    def launch_metadata(self, grid, stream, *args):
        return None


KERNEL_MODES = ("compile", "skip", "stub")


def install(gpu: GPU, log: LaunchLog, registers_of=None, kernels: str = "compile") -> StandInDriver:
    """Make a stand-in for `gpu` Triton's active driver. kernels (KERNEL_MODES) says what a launch does:

    "compile": every compile is announced to `log`, then made for `gpu`, and the launch logged (the compile audit).
    "skip" (a memory plan, which needs the host code and not the kernels): Triton binds and specialises every
    launch's arguments as usual, then skips the compile and the launch (`JITFunction.run` returns None), so no
    cubin is made, registers_of is never called and nothing reaches `log`; the autotuners' benchmark calls are
    skipped the same way and every candidate gets the same time.
    "stub" (the host suite, which times the host code): as "skip" on a signature's first launch, which puts a
    kernel that runs nothing in Triton's cache, so every later launch takes Triton's (and fastbert's) steady
    path to the C launch of Triton's own launcher object, as on a GPU, where that launch does nothing
    (_triton_launcher).
    """
    from triton import knobs

    if kernels not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {kernels!r}")
    driver = StandInDriver(gpu, log, registers_of)
    triton.runtime.driver.set_active(driver)

    def announce(fn, compile, **_):
        jit = fn.jit_function
        log.compiling = {"kernel": jit.__name__, "constexprs": _constexprs(jit, compile["constants"]),
                         "num_warps": compile["num_warps"], "num_stages": compile["num_stages"],
                         "cpu_seconds": cpu_seconds()}
        return False  # go on and compile

    def skip(**_):
        return True  # a true answer makes Triton skip the compile and the launch

    def stub(key, fn, compile, **_):
        fn.jit_function.device_caches[compile["device"]][0][key] = _StubKernel()
        return True

    knobs.runtime.jit_cache_hook = {"compile": announce, "skip": skip, "stub": stub}[kernels]
    return driver
