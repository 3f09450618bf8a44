"""Registers and barriers per loop of the kernels that stream rows while they sum columns (the bias-GELU and
GeGLU backwards, the QKV projection's gather of gradients that do not come from fastbert's attention),
compiled without a GPU for an H100 (sm_90a) by their own launchers at BERT-base's training shapes
(256 x 128 tokens) with the installed Triton.

    python benchmarks/loop_barriers.py

A barrier inside such a loop (a cross-warp reduction per row tile) makes every warp wait for the slowest once
per iteration; the kernels keep per-element sums instead and reduce them once after the loop.
"""
from __future__ import annotations

import logging

import torch

from fastbert.bench import cubin
from fastbert.command import configure_logging
from fastbert.simulated.stand_in_gpu import H100, LaunchLog, install

logger = logging.getLogger("fastbert")
TOKENS, BATCH, SEQLEN, HIDDEN, HEADS, INTERMEDIATE = 256 * 128, 256, 128, 768, 12, 3072


def launch_all(dtype: torch.dtype) -> None:
    """Every column-summing launch at the training shapes in dtype, on meta tensors (the stand-in compiles and
    runs nothing)."""
    from fastbert.kernels import bias_gelu, qkv

    def meta(*shape):
        return torch.empty(shape, dtype=dtype, device="meta")

    for bias in (None, meta(INTERMEDIATE)):  # the epilogue form's backward (no bias), the unfused one's
        for approximate in ("none", "tanh"):
            bias_gelu.bias_gelu_bwd(meta(TOKENS, INTERMEDIATE), meta(TOKENS, INTERMEDIATE), bias, approximate)
    bias_gelu.geglu_bwd(meta(TOKENS, INTERMEDIATE), meta(TOKENS, 2 * INTERMEDIATE))
    grad = meta(BATCH, HEADS, SEQLEN, HIDDEN // HEADS)
    qkv.qkv_projection_bwd(grad, grad, grad, meta(BATCH, SEQLEN, HIDDEN), meta(3 * HIDDEN, HIDDEN))


def main() -> int:
    configure_logging()
    log = LaunchLog()
    install(H100, log, registers_of=cubin.registers, kernels="compile")
    logger.info(f"{'kernel':<22} {'dtype':<14} {'tile':>8} {'warps':>5} {'registers':>9}  barriers per loop  flags")
    for dtype in (torch.bfloat16, torch.float32):
        launch_all(dtype)
        for event in log.take_compiled():  # a failed compile raises, naming it
            constexprs = dict(event.constexprs)
            tile = f"{constexprs.pop('BLOCK_M')}x{constexprs.pop('BLOCK_N')}"
            logger.info(f"{event.kernel:<22} {str(dtype):<14} {tile:>8} {event.metadata['num_warps']:>5} "
                        f"{cubin.registers(event.cubin):>9}  {str(cubin.barriers_in_loops(cubin.sass(event.cubin))):<17}  "
                        f"{constexprs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
