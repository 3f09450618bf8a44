"""Host microseconds of the allocations and reshapes fastbert's launchers and layers make, with their sizes as one
tuple or torch.Size against sizes given one by one: why kernels/*.py allocate with `x.new_empty(rows, cols)`,
the MLM loss's scalars with `torch.empty_strided((), ())`, and the attention layer reshapes with
`reshape(*hidden.shape)`. Each pair is timed taking turns on CPU tensors, one thread (PyTorch's argument parser
is the same code for CUDA tensors; the allocator behind it differs).

    python benchmarks/size_arguments.py
"""
from __future__ import annotations

import logging

import torch

from fastbert.command import configure_logging
from fastbert.simulated.host_time import interleaved_host_microseconds, one_thread

logger = logging.getLogger("fastbert")


def pairs() -> dict[str, dict]:
    """{what: {"as one argument": call, "one by one": call}}: the same result each way."""
    x = torch.empty(2, 8, 64)
    heads = torch.empty(2, 2, 8, 32).transpose(1, 2)  # [B, S, heads, d] seen as [B, heads, S, d], as attention's out
    size = x.shape
    f32 = torch.float32
    return {
        "new_empty [rows, cols]": {"as one argument": lambda: x.new_empty((16, 64)),
                                   "one by one": lambda: x.new_empty(16, 64)},
        "new_empty [3, B, heads, S, d]": {"as one argument": lambda: x.new_empty((3, 2, 2, 8, 32)),
                                          "one by one": lambda: x.new_empty(3, 2, 2, 8, 32)},
        "empty [] (a 0-dim loss)": {"as one argument": lambda: torch.empty((), dtype=f32),
                                    "one by one": lambda: torch.empty_strided((), (), dtype=f32)},
        "reshape to a torch.Size": {"as one argument": lambda: heads.reshape(size),
                                    "one by one": lambda: heads.reshape(*size)},
        "view as a torch.Size": {"as one argument": lambda: x.view(size), "one by one": lambda: x.view(*size)},
    }


def main() -> int:
    configure_logging()
    logger.info(f"{'':<32} {'as one argument':>16} {'one by one':>11}  (host us per call, least of 30 x 2000)")
    with one_thread():
        for what, calls in pairs().items():
            us = interleaved_host_microseconds(calls, number=2000, repeats=30)
            logger.info(f"{what:<32} {us['as one argument']:>16.2f} {us['one by one']:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
