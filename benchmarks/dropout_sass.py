"""What the kernels that draw dropout masks in a row-major layout (the LayerNorm forward and backward, the dropout
op) spend on Philox, compiled without a GPU for an H100 (sm_90a) by their own launchers at BERT-base's training
shape (256 x 128 tokens, hidden 768, bf16, dropout and a residual) with the installed Triton.

    python benchmarks/dropout_sass.py

Per kernel: registers, SASS instructions, the 32-bit multiplies Philox's rounds compile to (IMAD.WIDE.U32 and
IMAD.HI.U32; nothing else in these kernels multiplies integers that wide) and barriers (BAR.SYNC).
"""
from __future__ import annotations

import logging

import torch

from fastbert.bench import cubin
from fastbert.command import configure_logging
from fastbert.simulated.stand_in_gpu import H100, LaunchLog, install

logger = logging.getLogger("fastbert")
TOKENS, HIDDEN, P = 256 * 128, 768, 0.1
PHILOX_MULTIPLIES = ("IMAD.WIDE.U32", "IMAD.HI.U32")  # with any further modifier (.X: the carry-in form)


def launch_all() -> None:
    """The training forward and the backward from the output of the LayerNorm with residual and dropout, and the
    dropout op, on meta tensors (the stand-in compiles and runs nothing)."""
    from fastbert.kernels import dropout, layer_norm

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    seed, weight, bias = meta(1, dtype=torch.int64), meta(HIDDEN, dtype=torch.float32), meta(HIDDEN, dtype=torch.float32)
    y, _, rstd, side, _ = layer_norm.layer_norm_fwd.function(meta(TOKENS, HIDDEN), weight, bias, meta(TOKENS, HIDDEN),
                                                             seed, 1e-12, P, torch.bfloat16, True)
    layer_norm.layer_norm_bwd.function(meta(TOKENS, HIDDEN), None, None, y, side, weight, bias, seed, None, rstd, P,
                                       torch.bfloat16, True)
    dropout.dropout_fwd.function(meta(TOKENS, HIDDEN), seed, P)


def main() -> int:
    configure_logging()
    log = LaunchLog()
    install(H100, log, registers_of=cubin.registers, kernels="compile")
    launch_all()
    logger.info(f"{'kernel':<24} {'registers':>9} {'instructions':>12} {'Philox multiplies':>17} {'barriers':>8}")
    for event in log.take():
        if not hasattr(event, "cubin"):
            logger.error(f"a compile failed: {event}")
            return 1
        counts = cubin.mnemonics(cubin.sass(event.cubin))
        multiplies = sum(n for m, n in counts.items() if m.startswith(PHILOX_MULTIPLIES))
        barriers = sum(n for m, n in counts.items() if m.startswith("BAR.SYNC"))
        logger.info(f"{event.kernel:<24} {cubin.registers(event.cubin):>9} {sum(counts.values()):>12} "
                    f"{multiplies:>17} {barriers:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
