# Host-side launching of the Triton kernels, at the cost of a PyTorch op per call.
#
# Triton's own launch, `kernel[grid](*args, **constexprs)`, does on every call what only changes when the call's
# signature changes: it binds and specialises every argument, computes its cache key, checks the kernel's
# globals, reads its knobs and, for an autotuned kernel, builds the autotuner's key and config arguments (10-30
# us of host time per launch with Triton 3.6-3.9; the first H100 run measured 300-450 us per fused op call in
# all). `launch` keeps, per kernel, the compiled kernel that Triton chose for each call signature, and calls its
# launcher directly. A signature is what Triton's choice depends on: each tensor's dtype and whether its address
# is a multiple of 16 (Triton's pointer specialisation), each int's specialisation (1, a multiple of 16, 32- or
# 64-bit) or, for an autotuner's key argument, its value, every other argument's type, None-ness, and the
# constexpr keywords. The first call of a signature goes through Triton unchanged (compile, autotune, launch), so
# the choice is Triton's own; tests/test_launch.py checks that every later call launches exactly the kernel
# Triton's own path would, for aligned and misaligned views and odd sizes, and `fastbert bench --suite host`
# measures the host time it saves.
#
# The steady path, a call whose exact key was seen, runs in C (kernels/launch.c: the same key, lookup and launcher
# call, without the interpreter between them, and in front of them a cache of the calls last launched, matched by
# their raw words without building the key; `fastbert bench --suite host` measures each op with it, or, with
# FASTBERT_PYTHON_LAUNCH=1 set, without it); every other call takes the Python path below, which also makes the
# entries the C launch keeps. Both hand the launcher each plain tensor as its address (PLAIN_TENSOR_TYPES).
# tests/test_launch.py holds both paths to the same checks. Where the launcher is Triton's CUDA launcher object,
# both call the C launch it calls, directly, with what it would hand that (`_direct_launch`, learnt from its own
# call): its Python (scratch and profiler checks, in Triton 3.9 two closures made per call) then runs once per
# kernel signature, not once per launch; tests/test_host_suite.py checks that the C launch gets the same arguments.
#
# cdiv and next_power_of_2 are plain Python here: Triton's are constexpr functions whose host call costs
# microseconds, and launchers call them several times per launch.
from __future__ import annotations

import copy
import functools
import inspect
import logging
import operator
import os
import pathlib
import shutil
import sysconfig
from typing import Callable, Union

import torch
import triton
from triton.runtime.autotuner import Autotuner

from fastbert.kernels.numerics import INTERPRETER

Grid = Union[tuple, Callable[[dict], tuple]]
LOG = logging.getLogger("fastbert")
_DRIVERS = triton.runtime.driver  # .active: the driver now (a stand-in's while one is installed)
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
# Tensors of these types go to a kept entry's launcher as their addresses (torch.Tensor's data_ptr, which neither
# overrides): Triton's launcher takes an int as it is, where for a tensor it would call data_ptr again and ask the
# CUDA driver about the address (cuPointerGetAttribute) on every launch, to reject a CPU tensor, which fastbert's
# ops rejected before any launch (fastbert.ops.resolve_backend and the ops' checks; a launcher of kernels/ called
# directly, past the ops, must be given CUDA tensors: a signature's first launch still goes through Triton's checks,
# later ones not).
# Another subclass goes as itself: Triton calls its own data_ptr.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_OR, _REDUCE = operator.or_, functools.reduce
# Signatures kept per kernel: packed inputs change the token count (an int argument) from batch to batch; past
# this many the cache starts again rather than grow without bound.
SIGNATURES_PER_KERNEL = 4096


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., N] as [rows, N] (a view where the leading dimensions merge). The ops that take N-D activations
    flatten them inside, so that an eager call records no view nodes for autograd (a reshape of each input
    and a view of each output, each a node run forward and backward)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def row_strides(t: torch.Tensor) -> tuple[int, int] | None:
    """(row stride, column stride) of t [..., N] read as [rows, N] in place, for a 2-D t or a 3-D one whose two
    leading dimensions merge (as the models' [B, S, H] activations do); None otherwise (as_rows then views or
    copies it). A kernel that takes a pointer and these strides needs no [rows, N] view of t: each view is a
    PyTorch op of a few microseconds of host time, and a layer's LayerNorms read four tensors."""
    strides = t.stride()
    if len(strides) == 2:
        return strides
    if len(strides) == 3:
        batch, seqlen, _ = t.shape
        if seqlen == 1:
            return strides[0], strides[2]
        if batch == 1 or strides[0] == seqlen * strides[1]:
            return strides[1], strides[2]
    return None


_RUNTIME = triton.knobs.runtime


class _Entry:
    __slots__ = ("compiled", "run", "head", "tail", "grid_meta", "packs", "packed")

    def __init__(self, kernel, compiled, tail: tuple, grid_meta: dict, count: int):
        self.compiled = compiled  # Triton's CompiledKernel
        # its launcher, (grid x, y, z, stream, *head, *arguments, *tail), with as head the function, its packed
        # metadata, no launch metadata and no hooks (a launch with hooks goes through Triton); or, where it is
        # Triton's CUDA launcher object, the C launch it calls, with the head and argument layout it hands that
        # (_direct_launch), the kernel's `count` arguments (positional and tail) in one tuple where `packs`
        run, head = compiled.run, (compiled.function, compiled.packed_metadata, None, None, None)
        self.run, self.head, self.packs = _direct_launch(run, head, count) or (run, head, False)
        self.tail = tail  # the arguments after the positional ones, in the kernel's order: constexprs and config
        self.grid_meta = grid_meta  # what a grid callable reads: the constexprs and the autotuned config
        # what the C launch keeps (launch.c); the kernel too, so that its id, which the C key holds, stays its own
        self.packed = (self.run, self.head, tail, grid_meta, compiled, kernel, self.packs)


class _Probe:
    """One argument of a launcher call while _direct_launch learns where the call hands it on."""
    __slots__ = ()


def _direct_launch(run, head: tuple, count: int) -> tuple | None:
    """(launch, head, packs): the C launch that `run`, Triton's CUDA launcher object (CudaLauncher), calls, the
    arguments it hands that between the stream and the kernel's (the launcher's attributes and `head`), and whether
    it hands the kernel's `count` arguments in one tuple (Triton 3.9) or one by one (3.6), so that a launch calls
    the C launch directly with what run(gx, gy, gz, stream, *head, *arguments) would hand it, without the launcher's
    Python (its scratch and profiler checks: two closures made per call in 3.9). Learnt from the launcher's own
    __call__, run once on stand-ins (_Probe) with its launch recording; only for a launcher whose call maps its
    arguments and does nothing else: no global or profile scratch memory to allocate per launch, no GSan. None
    otherwise, or where the call does not hand every stand-in on, in order, as exactly one of those two layouts:
    then `run` is called."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError:
        return None
    if (type(run) is not CudaLauncher or getattr(run, "global_scratch_size", 1)
            or getattr(run, "profile_scratch_size", 1) or getattr(run, "gsan_enabled", False)):
        return None
    recorded = []
    probe = copy.copy(run)
    probe.launch = lambda *handed: recorded.append(handed)
    grid_and_stream = tuple(_Probe() for _ in range(4))
    arguments = tuple(_Probe() for _ in range(count))
    try:
        CudaLauncher.__call__(probe, *grid_and_stream, *head, *arguments)
    except Exception:  # noqa: BLE001 - a call that is not a plain mapping (another Triton): the launcher serves
        return None
    if len(recorded) != 1:
        return None
    (handed,) = recorded
    if len(handed) < 4 or any(a is not b for a, b in zip(handed, grid_and_stream)):
        return None
    rest = handed[4:]
    packed = bool(rest) and type(rest[-1]) is tuple and len(rest[-1]) == count
    middle, passed = (rest[:-1], rest[-1]) if packed else (rest[:len(rest) - count], rest[len(rest) - count:])
    if (len(passed) != count or any(a is not b for a, b in zip(passed, arguments))
            or any(type(a) is _Probe for a in middle)):
        return None
    return run.launch, tuple(middle), packed


def _getter(positions: list[int]):
    """args -> the tuple of args at these positions (operator.itemgetter returns a bare item for one)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        (only,) = positions
        return lambda args: (args[only],)
    return operator.itemgetter(*positions)


class _Layout:
    """Where the tensors and the ints of one tuple of argument types are, and which tensors go to a launcher as
    their addresses (PLAIN_TENSOR_TYPES)."""
    __slots__ = ("tensors", "ints", "plain")

    def __init__(self, types: tuple):
        self.tensors = _getter([i for i, t in enumerate(types) if issubclass(t, torch.Tensor)])
        self.plain = tuple(i for i, t in enumerate(types) if t in PLAIN_TENSOR_TYPES)
        # ints by value, bools and int subclasses (an IntEnum) included: Triton specialises any int by its value
        self.ints = _getter([i for i, t in enumerate(types) if issubclass(t, int)])


class KernelLauncher:
    """Launches one @triton.jit kernel, autotuned or not, through a cache of Triton's choices. Grid callables
    read only the constexpr keywords and the autotuned config from their argument (all of fastbert's do).

    Two levels (and the C launch's own cache of exact keys in front of them, kernels/launch.c): a call's exact
    key (the argument types, every int's value, each tensor's dtype and 16-byte alignment, the constexprs) finds
    its kernel in one dict lookup; a key not seen yet is reduced to Triton's specialisation (ints by 1 / a
    multiple of 16 / width, but the autotuner's key arguments by value), so that a token count that changes from
    batch to batch reuses the kernel Triton chose, without Triton's launch."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.autotuner = kernel if isinstance(kernel, Autotuner) else None
        jit = kernel.fn if self.autotuner is not None else kernel
        self.arg_names: list[str] = list(jit.arg_names)
        self.defaults = {name: p.default for name, p in inspect.signature(jit.fn).parameters.items()
                         if p.default is not inspect.Parameter.empty}
        keys = set(self.autotuner.keys) if self.autotuner is not None else set()
        self.key_positions = frozenset(i for i, name in enumerate(self.arg_names) if name in keys)
        self.layouts: dict[tuple, _Layout] = {}
        self.by_key: dict = {}  # exact key -> _Entry
        self.by_specialisation: dict = {}  # Triton's specialisation -> _Entry

    def specialisation(self, args: tuple, constexprs: dict) -> tuple:
        """What Triton's kernel cache and the autotuner's key depend on."""
        keys, tensor = self.key_positions, torch.Tensor
        spec = [(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, tensor)
                else a if a is None or i in keys
                else (a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63) if isinstance(a, int) and type(a) is not bool
                else type(a)
                for i, a in enumerate(args)]
        spec.extend(constexprs.items())
        return tuple(spec)

    def __call__(self, grid: Grid, args: tuple, constexprs: dict) -> tuple:
        """Launch; returns (the compiled kernel launched, or None where a stand-in skipped it; the entry that
        launched it, packed for the C launch to keep, or None where the launch went through Triton with a hook
        installed or left the kernel to Triton)."""
        driver = _DRIVERS._active or _DRIVERS.active  # the attribute, without the property's call once set
        device = driver.get_current_device()
        types = tuple(map(type, args))
        layout = self.layouts.get(types)
        if layout is None:
            layout = self.layouts[types] = _Layout(types)
        tensors = layout.tensors(args)
        # the exact key, built here rather than in a method (a call per launch), and flat (a tuple's hash is not
        # kept: nested tuples are hashed again on every lookup): per device (a compiled kernel is loaded on one)
        # and driver (a stand-in's stubs never reach a GPU), the argument types (as their layout: one object per
        # types tuple, hashed and compared by identity; the types fix where each part starts), the ints' values,
        # each tensor's dtype, the tensors' 16-byte alignment, the constexprs' names and values. Alignment: one
        # bit, every address's low bits or-ed together, when all are aligned (nearly every launch), else each
        # tensor's, in a tuple (a nested item never equal to the bit)
        misaligned = _REDUCE(_OR, map(_DATA_PTR, tensors), 0) & 15
        key = (device, driver, layout, *layout.ints(args), *map(_DTYPE, tensors),
               tuple(address & 15 == 0 for address in map(_DATA_PTR, tensors)) if misaligned else True,
               *constexprs, *constexprs.values())
        entry = self.by_key.get(key)
        # a launch hook installed (a profiler's) sends the launch through Triton, which builds each launch's
        # metadata and calls the hooks. Triton 3.6-3.9 keep the hooks in (normally empty) chains; a callable set
        # in their place is a hook, None none
        enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
        hooked = getattr(enter, "calls", enter) or getattr(leave, "calls", leave)
        if entry is None or hooked:
            specialisation = (device, driver, self.specialisation(args, constexprs))
            if entry is None:
                entry = self.by_specialisation.get(specialisation)
            if entry is None or hooked:
                return self._first(key, specialisation, grid, args, constexprs, hooked, entry)
            self._keep(self.by_key, key, entry)
        dims = (*(grid(entry.grid_meta) if callable(grid) else grid), 1, 1)  # a grid of 1 to 3 dimensions
        arguments = list(args)
        for i in layout.plain:
            arguments[i] = _DATA_PTR(arguments[i])
        stream = driver.get_current_stream(device)
        if entry.packs:
            entry.run(dims[0], dims[1], dims[2], stream, *entry.head, (*arguments, *entry.tail))
        else:
            entry.run(dims[0], dims[1], dims[2], stream, *entry.head, *arguments, *entry.tail)
        return entry.compiled, entry.packed

    def _first(self, key, specialisation, grid, args, constexprs, hooked, known=None):
        """Triton's own launch; its compiled kernel (None where a stand-in driver skipped it) is kept, in `known`,
        the entry kept for this call already (a hooked launch's), where that holds it. Returns (the compiled kernel,
        the entry made for it unless hooked, or None)."""
        compiled = self.kernel[grid](*args, **constexprs)
        if compiled is None:
            return compiled, None
        meta = dict(constexprs)
        if self.autotuner is not None:
            config = self.autotuner.best_config
            if config.pre_hook is not None:  # a hook runs per launch: leave such kernels to Triton
                return compiled, None
            meta.update(config.kwargs)
        tail = tuple(meta[name] if name in meta else self.defaults[name] for name in self.arg_names[len(args):])
        if known is not None and known.compiled is compiled and known.tail == tail:
            entry = known  # a launch under a profiler's hook: no new entry, no second _direct_launch per launch
        else:
            entry = _Entry(self.kernel, compiled, tail, meta, len(args) + len(tail))
        self._keep(self.by_specialisation, specialisation, entry)
        self._keep(self.by_key, key, entry)
        return compiled, None if hooked else entry.packed

    @staticmethod
    def _keep(cache: dict, key, entry: _Entry) -> None:
        if len(cache) >= SIGNATURES_PER_KERNEL:
            cache.clear()
        cache[key] = entry


class _Placeholders(dict):
    """dtype -> an empty tensor of that dtype on one device, made on first use."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __missing__(self, dtype: torch.dtype) -> torch.Tensor:
        tensor = self[dtype] = torch.empty(0, dtype=dtype, device=self.device)
        return tensor


_PLACEHOLDERS: dict = {}


def placeholders(device: torch.device) -> dict:
    """dtype -> an empty tensor on `device` for a pointer argument a launch does not read, kept (one per dtype
    and device; never an op's output, which must be a tensor of its own). Its dtype is the real argument's:
    Triton specialises, and an autotuner keys, on every tensor argument's dtype. Where that does not matter,
    None is cheaper (LayerNorm, the MLM loss): Triton makes it a constant and the launch reads no tensor."""
    found = _PLACEHOLDERS.get(device)
    if found is None:
        found = _PLACEHOLDERS[device] = _Placeholders(device)
    return found


_LAUNCHERS: dict = {}


def _launch_python(kernel, grid: Grid, args: tuple, constexprs: dict) -> tuple:
    """KernelLauncher's launch of one call: (the compiled kernel, the packed entry or None)."""
    launcher = _LAUNCHERS.get(id(kernel))  # by id: a JITFunction hashes in Python
    if launcher is None:
        launcher = _LAUNCHERS[id(kernel)] = KernelLauncher(kernel)
    return launcher(grid, args, constexprs)


def launch(kernel, grid: Grid, *args, **constexprs):
    """kernel[grid](*args, **constexprs), with the host work of repeated signatures cached (see the header).
    Tensor and scalar arguments positionally, constexprs (num_warps and num_stages included) by keyword.
    Under Triton's interpreter (no driver, nothing compiled) Triton's own launch. Where the C launch builds
    (`_c_launch`), this name is bound to it instead: the same key, in a cache of its own in front of this one,
    whose entries this path makes; the same kernel launched."""
    if INTERPRETER:
        return kernel[grid](*args, **constexprs)
    return _launch_python(kernel, grid, args, constexprs)[0]


def _c_launch():
    """kernels/launch.c's module, built by Triton's own helper (Triton's cache keeps the build, keyed by the
    source and the platform, so a machine builds it once), or None: under the interpreter, with
    FASTBERT_PYTHON_LAUNCH=1 (the Python path, for a comparison), or where it cannot be built (no C compiler or
    no Python headers: logged, and the Python path serves)."""
    if INTERPRETER or os.environ.get("FASTBERT_PYTHON_LAUNCH") == "1":
        return None
    missing = _build_tools_missing()
    if missing:
        LOG.info("the C launch (kernels/launch.c) is not built: %s; launches take the Python path", missing)
        return None
    try:
        from triton.runtime.build import compile_module_from_src

        source = pathlib.Path(__file__).with_name("launch.c").read_text()
        module = compile_module_from_src(source, "fastbert_launch")
    except Exception as exc:  # noqa: BLE001 - the Python path serves whatever went wrong
        LOG.warning("the C launch (kernels/launch.c) did not build (%s: %s); launches take the Python path",
                    type(exc).__name__, exc)
        return None
    module.init(_DRIVERS, _RUNTIME, torch.Tensor, PLAIN_TENSOR_TYPES, _launch_python)
    return module


def _build_tools_missing() -> str:
    """What building the C launch needs and this machine lacks ("" for nothing): a C compiler where Triton's
    helper looks ($CC, gcc, clang) and Python's headers (checked first: a compile without them would print its
    errors at every import)."""
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        return "no C compiler ($CC, gcc or clang)"
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme  # Debian's, as Triton's helper reads it
    if not os.path.exists(os.path.join(sysconfig.get_paths(scheme=scheme)["include"], "Python.h")):
        return "no Python headers (Python.h)"
    return ""


_C_LAUNCH = _c_launch()
if _C_LAUNCH is not None:
    launch = _C_LAUNCH.launch  # noqa: F811 - the same launch, its cached path in C


def clear_cache() -> None:
    """Forget every kept kernel (fastbert.simulated.host_time, after stubbing the launches)."""
    _LAUNCHERS.clear()
    if _C_LAUNCH is not None:
        _C_LAUNCH.clear()
