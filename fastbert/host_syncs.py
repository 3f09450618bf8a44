"""Counting host syncs without a GPU: `HostSyncCounter`, the one counter that tests and benchmarks use.

On a GPU the host waits for the device (a host sync) when it
- reads a value back: `.item()`, `bool()`, `int()`, `float()` or `operator.index()` of a tensor, `.tolist()`,
  `.numpy()`, `.cpu()`, `.to("cpu")`, and ops that answer with a Python value (`torch.equal`,
  `torch.allclose`, `is_nonzero`); any of these dispatches `_local_scalar_dense` or copies to the CPU;
- runs an op whose output size depends on the data: `nonzero`, `masked_select`, `unique`, boolean-mask
  indexing (`x[mask]`, `x[mask] = v`), `repeat_interleave` without `output_size`;
- copies between host and device without `non_blocking=True`: `torch.tensor(data, device=...)`,
  `torch.as_tensor(data, device=...)`, `.to(device)` (a batch moved to the model's device; `.to("cpu")`).
On CPU nothing waits, so the counter counts these calls by what they are, whatever the device: code run
on CPU tensors under it shows how often the same code would make a GPU's host wait. Two layers see them:
a TorchFunctionMode sees the Python-level calls (`.item()`, `.cpu()`, `bool(t)`, ...), which on CPU
tensors dispatch nothing that looks like a copy, and a TorchDispatchMode sees the ATen ops (`nonzero`,
`_local_scalar_dense` from C++, boolean indexing). A call counted at the Python level is not counted again
for the ops it dispatches.

What is not counted, because it does not sync: `torch._assert_async` (a device-side check), `nonzero_static`,
`.to(device, non_blocking=True)`, and anything done in another thread (both modes are thread-local: a data
loader's host work is not the step's).

    with HostSyncCounter() as counter:
        model(**batch)
    assert counter.syncs == 0, counter.calls
"""
from __future__ import annotations

import collections
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Tensor methods and torch functions that hand a value to the host (a device-to-host copy and a wait)
_READ_BACK = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy",
              torch.Tensor.cpu: "cpu", torch.Tensor.__bool__: "bool", torch.Tensor.__int__: "int",
              torch.Tensor.__float__: "float", torch.Tensor.__index__: "index", torch.Tensor.__complex__: "complex"}
# host data copied to a device when given one: a blocking copy
_HOST_TO_DEVICE = {torch.tensor: "tensor(device=)", torch.as_tensor: "as_tensor(device=)"}
# ATen ops that answer with a host value or a data-dependent size
_SYNCING_OPS = {aten._local_scalar_dense.default: "_local_scalar_dense", aten.nonzero.default: "nonzero",
                aten.masked_select.default: "masked_select", aten._unique2.default: "unique",
                aten.unique_dim.default: "unique", aten.unique_consecutive.default: "unique_consecutive",
                aten.equal.default: "equal", aten.allclose.default: "allclose", aten.is_nonzero.default: "is_nonzero"}
_INDEXING_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
_REPEAT_INTERLEAVE_OPS = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}


def _blocking_move(args, kwargs, caller: str) -> bool:
    """Whether a Tensor.to(...) call would copy between host and device and wait on a GPU: it names a device
    (a string or a torch.device) and not non_blocking=True. On CPU the named device is the CPU too, and
    stands for the GPU (a batch's `.to(device)`) or the host (`.to("cpu")`), both copies on a GPU. Not
    counted: calls from torch's own code (`caller`, the calling module), whose moves are to the tensor's own
    device (clip_grad_norm_ gathers the norms on the first one's) or of host-side state."""
    if caller.startswith("torch.") or kwargs.get("non_blocking", False) or (len(args) > 3 and args[3] is True):
        return False  # args: (self, device, dtype, non_blocking)
    return any(isinstance(value, (str, torch.device)) for value in (*args[1:], kwargs.get("device")))


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, counter: "HostSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _READ_BACK.get(func)
        if name is None and func in _HOST_TO_DEVICE and kwargs.get("device") is not None:
            name = _HOST_TO_DEVICE[func]
        if name is None and func is torch.Tensor.to and _blocking_move(
                args, kwargs, sys._getframe(1).f_globals.get("__name__", "")):
            name = "to(device)"
        if name is None:
            return func(*args, **kwargs)
        self.counter.count(name)
        self.counter.inside += 1  # the ops this call dispatches are this sync, not more
        try:
            return func(*args, **kwargs)
        finally:
            self.counter.inside -= 1


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, counter: "HostSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter.inside:
            name = _SYNCING_OPS.get(func)
            if func in _INDEXING_OPS and any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                name = "boolean-mask indexing"
            elif func in _REPEAT_INTERLEAVE_OPS and kwargs.get("output_size") is None:
                name = "repeat_interleave without output_size"
            if name is not None:
                self.counter.count(name)
        return func(*args, **kwargs)


class HostSyncCounter:
    """A context manager counting host syncs in the thread that enters it (see the module docstring).

    syncs: how many; calls: collections.Counter of them by name ("item", "nonzero", "to(device)", ...),
    for an assertion message that says which. Not reentrant."""

    def __init__(self):
        self.syncs = 0
        self.calls: collections.Counter[str] = collections.Counter()
        self.inside = 0  # depth of counted Python-level calls in progress
        self._modes = (_DispatchLevel(self), _FunctionLevel(self))

    def count(self, name: str) -> None:
        self.syncs += 1
        self.calls[name] += 1

    def __enter__(self) -> "HostSyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
