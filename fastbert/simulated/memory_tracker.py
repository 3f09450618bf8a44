"""An exact count of the memory a piece of PyTorch code holds: every storage it allocates, while it lives.

`MemoryTracker` is a `TorchDispatchMode`, so it sees every aten op below autograd, on any device (meta tensors
included, which allocate nothing but have sizes): a storage first seen as an op's output is an allocation of
the tracked code, and a weak reference to its Python storage object tells when it dies. Live bytes are the
sum over live storages, each counted once however many views share it. fastbert's kernels are
`torch.library.custom_op`s, which the mode sees as one op (on meta tensors their shape-only fake
registration would run, allocating none of the workspace the kernel's launcher allocates); the tracker runs
their Python implementation instead, with itself re-entered, so the launchers' own allocations (the attention
backward's row statistics, the MLM loss's chunks) are counted as they happen.

What a live storage is, at any point (first match):
- weights: a parameter or buffer of the given modules, as they were when the tracker started;
- inputs: a tensor given as an input (the batch);
- gradients: the .grad of a parameter (seen when autograd accumulates it, and counted from its allocation);
- optimizer: a state tensor of the given optimizer (seen after each step, counted from its allocation);
- weight copies: made from weights alone (every tensor input of the op that made it is a weight or a weight
  copy): autocast's 16-bit casts of the weights, fastbert's concatenated Q, K, V weights; what autograd
  saves of them is the weights' business, not an activation's;
- activations: a storage autograd keeps for the backward (a `saved_tensors_hooks` pack that is still held),
  attributed to the innermost of the given modules whose forward was running when it was first saved;
- transients: everything else live.
Storages live when the tracker starts count in their category and in the totals, but are not allocations of
the tracked code; storages it never sees (other tensors of the process) are not counted at all.

Every allocation, free, save and release is appended to an event log, so the state at any point (a named
mark, the peak) is rebuilt exactly by replaying the log up to it: linear in the number of events.
"""
from __future__ import annotations

import itertools
import sys
import weakref
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from fastbert.ops import interpreter_enabled

CATEGORIES = ("weights", "inputs", "gradients", "optimizer", "weight copies", "activations", "transients")
_FROM_WEIGHTS = ("weights", "weight copies")
_ALLOC, _FREE, _SAVE, _RELEASE = range(4)
_UNTRACKED = -1  # the serial of a storage first seen as an input: made outside the tracked code


@dataclass
class Snapshot:
    """The live storages at one point of the tracked code."""
    total_bytes: int
    categories: dict[str, int]  # CATEGORIES -> bytes
    saved_by_module: dict[str, int]  # module qualified name ("" for the root or no module) -> activation bytes


class _Saved:
    """What autograd holds for a saved tensor while the tracker's pack hook is active: the tensor itself
    (nothing is copied or moved), and a finalizer that tells the tracker when autograd lets it go."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class MemoryTracker(TorchDispatchMode):
    """Tracks live storages while entered; see the module docstring for the categories.

    modules: the models whose parameters and buffers are the weights (their submodules' forwards name the
    activations); optimizer: the optimizer whose state is "optimizer"; inputs: tensors counted as "inputs".

        with MemoryTracker([model], optimizer, inputs=batch.values()) as tracker:
            loss = model(**batch).loss
            tracker.mark("forward end")
            loss.backward()
        tracker.peak_bytes, tracker.snapshot("forward end"), tracker.peak_snapshot()

    Raises RuntimeError when a fastbert custom op has no Python implementation to run, or when one would run
    Triton's interpreter on meta tensors (the interpreted kernels read their data).
    """

    def __init__(self, modules=(), optimizer: torch.optim.Optimizer | None = None, inputs=()):
        super().__init__()
        self._modules = list(modules)
        self._optimizer = optimizer
        self._inputs = list(inputs)
        self._serial = WeakIdKeyDictionary()  # storage -> serial (or _UNTRACKED)
        self._refs: dict[int, weakref.ref] = {}
        self._nbytes: list[int] = []  # by serial
        self._role: dict[int, str] = {}  # serial -> weights, inputs, gradients, optimizer or weight copies
        self._module_of: dict[int, str] = {}  # serial -> module active when first saved
        self._events: list[tuple[int, int]] = []
        self._marks: dict[str, int] = {}  # name -> number of events before it
        self._module_names: dict[int, str] = {}  # id(module) -> qualified name
        self._handles: list = []
        self._saved_hooks = None
        self._entered = False
        self._tracking = False  # between the set-up of __enter__ and __exit__
        self.current_bytes = 0
        self.start_bytes = 0
        self.peak_bytes = 0
        self._peak_events = 0

    # --- entering and leaving -------------------------------------------------------------------------

    def __enter__(self):
        if self._entered:
            raise RuntimeError("a MemoryTracker counts one run: make a new one for another")
        self._entered = True
        for module in self._modules:
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                self._adopt(tensor, "weights")
            for param in module.parameters():
                if param.grad is not None:
                    self._adopt(param.grad, "gradients")
                self._handles.append(param.register_post_accumulate_grad_hook(self._gradient_accumulated))
            self._module_names.update((id(sub), name) for name, sub in module.named_modules())
        if self._optimizer is not None:
            self._optimizer_stepped(self._optimizer)
            self._handles.append(self._optimizer.register_step_post_hook(self._optimizer_stepped))
        for tensor in self._inputs:
            self._adopt(tensor, "inputs")
        self.start_bytes = self.peak_bytes = self.current_bytes
        self._peak_events = len(self._events)
        self._tracking = True
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            self._saved_hooks.__exit__(exc_type, exc, tb)
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._tracking = False

    def _adopt(self, tensor: torch.Tensor, role: str) -> None:
        """A storage live before the tracker started, counted in `role`."""
        serial = self._allocated(tensor.untyped_storage())
        if serial is not None and serial not in self._role:
            self._role[serial] = role

    # --- the dispatch mode ----------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from_weights = None  # whether every tensor input is a weight or a weight copy (None: no tensor input)
        for tensor in pytree.tree_leaves((args, kwargs)):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                serial = self._serial.get(storage)
                if serial is None:
                    self._serial[storage] = _UNTRACKED
                from_weights = (from_weights is not False) and self._role.get(serial) in _FROM_WEIGHTS
        if func.namespace == "fastbert":
            out = self._run_implementation(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                serial = self._allocated(tensor.untyped_storage())
                if from_weights and serial is not None:
                    self._role.setdefault(serial, "weight copies")
        return out

    def _run_implementation(self, func, args, kwargs):
        """A fastbert custom op's Python body, run with the tracker re-entered so that what it allocates
        inside (workspaces, chunks) is tracked op by op."""
        from torch._library.custom_ops import OPDEFS

        name = func._schema.name
        if name not in OPDEFS:
            raise RuntimeError(f"{name} is not a torch.library.custom_op: its allocations cannot be tracked")
        on_meta = any(t.is_meta for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        if on_meta and interpreter_enabled():
            raise RuntimeError(
                f"{name} on meta tensors runs the compiled kernels' launchers, but TRITON_INTERPRET=1 made the "
                "kernels interpreted ones, which read their tensors' data: track it in a process without it")
        TorchDispatchMode.__enter__(self)  # the mode alone: the tracker's own set-up was done once
        try:
            return OPDEFS[name]._init_fn(*args, **kwargs)
        finally:
            TorchDispatchMode.__exit__(self, None, None, None)

    def _allocated(self, storage) -> int | None:
        """Count a storage the first time it is seen; its serial, None if it was made outside."""
        serial = self._serial.get(storage)
        if serial is not None:
            return None if serial == _UNTRACKED else serial
        serial = len(self._nbytes)
        self._serial[storage] = serial
        self._nbytes.append(storage.nbytes())
        self._refs[serial] = weakref.ref(storage, lambda _, serial=serial: self._freed(serial))
        self._events.append((_ALLOC, serial))
        self.current_bytes += self._nbytes[serial]
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._peak_events = len(self._events)
        return serial

    def _freed(self, serial: int) -> None:
        del self._refs[serial]
        if self._tracking:
            self._events.append((_FREE, serial))
            self.current_bytes -= self._nbytes[serial]

    # --- autograd's saved tensors, gradients, optimizer state ------------------------------------------

    def _pack(self, tensor: torch.Tensor):
        saved = _Saved(tensor)
        serial = self._serial.get(tensor.untyped_storage())
        if serial is not None and serial != _UNTRACKED:
            if serial not in self._module_of:
                self._module_of[serial] = self._running_module()
            self._events.append((_SAVE, serial))
            weakref.finalize(saved, self._released, serial)
        return saved

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _released(self, serial: int) -> None:
        if self._tracking:
            self._events.append((_RELEASE, serial))

    def _gradient_accumulated(self, param: torch.Tensor) -> None:
        serial = self._serial.get(param.grad.untyped_storage())
        if serial is not None and serial != _UNTRACKED:
            self._role.setdefault(serial, "gradients")

    def _optimizer_stepped(self, optimizer, *_) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._adopt(value, "optimizer")

    def _running_module(self) -> str:
        """The qualified name of the innermost module whose forward is on the Python stack ("" for none).
        Read from the stack rather than from forward hooks: a hooked module may take another path (fastbert
        calls a hooked nn.Linear instead of fusing it), and the plan must see the model's own."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_name == "forward":
                name = self._module_names.get(id(frame.f_locals.get("self")))
                if name is not None:
                    return name
            frame = frame.f_back
        return ""

    # --- results --------------------------------------------------------------------------------------

    def mark(self, name: str) -> None:
        """Name this point of the tracked code, for `snapshot(name)`; raises ValueError on a used name."""
        if name in self._marks:
            raise ValueError(f"mark {name!r} was already set")
        self._marks[name] = len(self._events)

    def snapshot(self, mark: str) -> Snapshot:
        """The live storages at a mark; raises KeyError naming the marks there are."""
        if mark not in self._marks:
            raise KeyError(f"no mark {mark!r}; marks: {sorted(self._marks)}")
        return self._replay(self._marks[mark])

    def peak_snapshot(self) -> Snapshot:
        """The live storages at the (first) peak of live bytes."""
        return self._replay(self._peak_events)

    def phase_at_peak(self, phases: list[str]) -> str:
        """Which of `phases` (marks, in order, each closing its phase) the peak fell in: the first mark set
        after it (the last phase if none is)."""
        for phase in phases:
            if phase in self._marks and self._peak_events <= self._marks[phase]:
                return phase
        return phases[-1]

    def _replay(self, events: int) -> Snapshot:
        live, saved = set(), Counter()
        for kind, serial in self._events[:events]:
            if kind == _ALLOC:
                live.add(serial)
            elif kind == _FREE:
                live.discard(serial)
            elif kind == _SAVE:
                saved[serial] += 1
            else:
                saved[serial] -= 1
        categories = dict.fromkeys(CATEGORIES, 0)
        by_module: Counter = Counter()
        for serial in live:
            role = self._role.get(serial)
            if role is None and saved[serial] > 0:
                role = "activations"
                by_module[self._module_of[serial]] += self._nbytes[serial]
            categories[role or "transients"] += self._nbytes[serial]
        return Snapshot(sum(categories.values()), categories, dict(by_module))
