"""What attention derives from a key mask, made once per mask rather than once per layer.

Every layer of an encoder takes its forward's one key mask [B, S], forward and backward, and each attention call
turned it into the same few tensors (the Triton kernels' uint8 mask and bounds; the PyTorch path's additive
score bias and query multiplier): 5 to 8 torch ops a layer, each a kernel launch on a GPU. `LastMask` keeps what
was made from the last mask, with a weak reference to it and its version, so an in-place change makes it anew,
and lets it go with the mask (a local layer's bias is [B, 1, S, S]).
Never for an inference-mode tensor (it has no version: a static input buffer refilled in place must not read old
values), while a CUDA graph is captured, whose replays must compute them, nor while PyTorch traces or transforms
the call (torch.compile, fake tensors, dispatch modes, vmap): what it makes there belongs to the trace.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable

import torch

from fastbert.kernels.fused_op import tracing


def may_keep(device: torch.device) -> bool:
    """Whether what a call makes on `device` may be kept for later calls: not while PyTorch traces or transforms
    the call, nor while a CUDA graph is captured (its replays must make it again)."""
    return not tracing() and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


class LastMask:
    """make() for (mask, key), the last result kept (key: what else the result depends on, e.g. a dtype)."""

    def __init__(self):
        self._last = None  # (weak reference to the mask, its version, key, result)

    def get(self, mask: torch.Tensor, key: Hashable, make: Callable[[], Any]):
        last = self._last
        if not may_keep(mask.device) or mask.is_inference():
            return make()
        if last is not None and last[0]() is mask and last[1] == mask._version and last[2] == key:
            return last[3]
        result = make()
        self._last = (weakref.ref(mask, self._forget), mask._version, key, result)
        return result

    def _forget(self, gone: weakref.ref) -> None:
        """The kept mask was freed: so is what was made from it."""
        if self._last is not None and self._last[0] is gone:
            self._last = None
