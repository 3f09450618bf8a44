"""What the kernels that draw dropout masks (the LayerNorm forward and backward, the dropout op, attention's forward
and backward) spend on Philox, compiled without a GPU for an H100 (sm_90a) by their own launchers at BERT-base's
training shapes (256 x 128 tokens, hidden 768, 12 heads of 64, bf16, dropout, LayerNorm with a residual) with the
installed Triton; attention's every autotuning candidate (the stand-in times them all alike).

    python benchmarks/dropout_sass.py

Per compiled kernel: registers, SASS instructions, the 32-bit multiplies Philox's rounds compile to (IMAD.WIDE.U32
and IMAD.HI.U32, with any further modifier; a few address computations compile to them too), barriers
(BAR.SYNC) and those inside each loop.
"""
from __future__ import annotations

import logging

import torch

from fastbert.bench import cubin
from fastbert.command import configure_logging
from fastbert.simulated.stand_in_gpu import H100, LaunchLog, install

logger = logging.getLogger("fastbert")
BATCH, SEQLEN, HIDDEN, HEADS, P = 256, 128, 768, 12, 0.1
TOKENS = BATCH * SEQLEN
PHILOX_MULTIPLIES = ("IMAD.WIDE.U32", "IMAD.HI.U32")  # with any further modifier (.X: the carry-in form)


def launch_all() -> None:
    """The training forward and the backward from the output of the LayerNorm with residual and dropout, the
    dropout op, and attention's forward and backward over a padded batch, on meta tensors (the stand-in compiles
    and runs nothing)."""
    from fastbert.kernels import attention, dropout, layer_norm

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    seed = meta(1, dtype=torch.int64)
    weight, bias = meta(HIDDEN, dtype=torch.float32), meta(HIDDEN, dtype=torch.float32)
    y, stats, _ = layer_norm.layer_norm_fwd.function(meta(TOKENS, HIDDEN), weight, bias, meta(TOKENS, HIDDEN), seed,
                                                     1e-12, P, torch.bfloat16, True)
    layer_norm.layer_norm_bwd.function(meta(TOKENS, HIDDEN), None, None, y, stats, weight, bias, seed, P,
                                       torch.bfloat16, True)
    dropout.dropout_fwd.function(meta(TOKENS, HIDDEN), seed, P)
    q, mask, scale = meta(BATCH, HEADS, SEQLEN, HIDDEN // HEADS), meta(BATCH, SEQLEN, dtype=torch.int64), 0.125
    out, lse = attention.attention_fwd.function(q, q, q, mask, None, SEQLEN, seed, P, scale)
    attention.attention_bwd.function(out, q, q, q, out, lse, mask, None, SEQLEN, seed, P, scale)


def main() -> int:
    configure_logging()
    log = LaunchLog()
    install(H100, log, registers_of=cubin.registers, kernels="compile")
    launch_all()
    logger.info(f"{'kernel':<34} {'tile':<9} {'warps':>5} {'registers':>9} {'instructions':>12} "
                f"{'Philox multiplies':>17} {'barriers':>8}  in loops")
    for event in log.take_compiled():  # a failed compile raises, naming it
        constexprs = dict(event.constexprs)
        tile = "x".join(str(constexprs[k]) for k in ("BLOCK_ROWS", "BLOCK_M", "BLOCK_MAJOR", "BLOCK_MINOR",
                                                      "BLOCK_N", "BLOCK_H") if k in constexprs)
        text = cubin.sass(event.cubin)
        counts = cubin.mnemonics(text)
        multiplies = sum(n for m, n in counts.items() if m.startswith(PHILOX_MULTIPLIES))
        barriers = sum(n for m, n in counts.items() if m.startswith("BAR.SYNC"))
        logger.info(f"{event.kernel:<34} {tile:<9} {event.metadata['num_warps']:>5} {cubin.registers(event.cubin):>9} "
                    f"{sum(counts.values()):>12} {multiplies:>17} {barriers:>8}  {cubin.barriers_in_loops(text)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
