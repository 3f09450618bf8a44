"""The memory plan against a GPU: every (case, provider) of `fastbert bench --suite memory` whose planned step fits
this GPU's free memory (at the stated batch, or the largest below it that fits) runs the same step on the GPU,
and `torch.cuda.max_memory_allocated` over it is written beside the plan's peak (suite "memory-gpu-check"; PERF.md
shows both). The step is the plan's (fastbert.simulated.memory_plan): the same model, inputs, loss, optimizer,
clipping and update, measured in its steady state (the second step: the optimizer state exists, the gradients
were set to None, Triton's autotuning is done).

    python benchmarks/memory_gpu_check.py OUTDIR [--only REGEX]      (its own call: not one of gpu_check.sh's stages)
"""
from __future__ import annotations

import argparse
import gc
import logging
import re
import sys
from typing import Callable

import torch

from fastbert.bench import memory_cases
from fastbert.bench.model_cases import oom_errors
from fastbert.bench.provenance import provenance
from fastbert.bench.runner import case_fields, result_path, write_rows
from fastbert.bench.timing import memory_meter_name, peak_memory
from fastbert.command import configure_logging
from fastbert.simulated.device_fit import largest_batch
from fastbert.simulated.memory_plan import OptimizerSettings, default_loss, optimizer_step

SUITE = "memory-gpu-check"
logger = logging.getLogger("fastbert.bench")


def batch_that_fits(case: memory_cases.MemoryCase, provider: str, free_bytes: int) -> int:
    """The case's stated batch, or the largest below it whose planned step fits free_bytes with the plan's
    reserve kept; 0 when not even one sequence fits."""
    return largest_batch(lambda b: memory_cases.plan(case, provider, b).peak_bytes, free_bytes, limit=case.batch)[0]


def make_step(case: memory_cases.MemoryCase, provider: str, batch: int,
              device: torch.device) -> tuple[Callable[[], None], torch.nn.Module]:
    """(the plan's step of (case, provider) on real tensors of `device`, the model it trains): a no_grad forward
    for inference; else the loss's forward under bf16 autocast, its backward, and the optimizer pretraining
    builds with the clipping and update of fastbert.train.step."""
    model = memory_cases.build_model(case, provider, device)
    # the whole batch, held by the steps below as the plan holds it; the forward is given given_inputs' part
    inputs = memory_cases.make_inputs(case, batch, device)
    if case.mode == "inference":
        def infer() -> None:
            with torch.no_grad():
                model(**memory_cases.given_inputs(inputs, provider))
        return infer, model
    from fastbert.train.optim import build_optimizer

    settings = OptimizerSettings()
    optimizer = build_optimizer(model, case.optimizer, settings.lr, settings.betas, settings.eps,
                                settings.weight_decay, sharded=False)

    def train() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = default_loss(model, memory_cases.given_inputs(inputs, provider))
        loss.backward()
        optimizer_step(model, optimizer, settings)
    return train, model


def measure(case: memory_cases.MemoryCase, provider: str, batch: int, device: torch.device) -> dict:
    """timing.peak_memory of the step's second run (the first makes the optimizer state and autotunes)."""
    step, _ = make_step(case, provider, batch, device)
    step()
    return peak_memory(step, device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memory_gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory for the JSON rows")
    p.add_argument("--only", metavar="REGEX", help="only the items whose 'case provider' matches")
    args = p.parse_args(argv)
    configure_logging("memory_gpu_check")
    if not torch.cuda.is_available():
        logger.error("no CUDA GPU: this check measures a GPU's memory (the plan itself needs none: "
                     "`fastbert bench --suite memory`)")
        return 2
    device = torch.device("cuda")
    command = ["python", "benchmarks/memory_gpu_check.py", *(sys.argv[1:] if argv is None else argv)]
    common = {**provenance(device, command), "suite": SUITE, "memory_meter": memory_meter_name(device)}
    path = result_path(args.out, SUITE, common)
    rows = []
    for case in memory_cases.memory_cases():
        for provider in case.providers:
            if args.only and not re.search(args.only, f"{case.name} {provider}"):
                continue
            gc.collect()
            torch.cuda.empty_cache()
            base = {**common, **case_fields(case), "dtype": case.precision, "provider": provider}
            batch = batch_that_fits(case, provider, torch.cuda.mem_get_info(device)[0])
            if batch == 0:
                rows.append({**base, "status": "skipped", "error": "the plan of one sequence does not fit this GPU"})
                continue
            base.update(batch=batch, planned_peak_bytes=memory_cases.plan(case, provider, batch).peak_bytes)
            try:
                rows.append({**base, "status": "ok", **measure(case, provider, batch, device)})
            except oom_errors() as exc:
                rows.append({**base, "status": "oom", "error": str(exc).splitlines()[0]})
            logger.info(f"{case.name} [{provider}] batch {batch}: {rows[-1].get('peak_mem_bytes')} bytes measured, "
                        f"{base['planned_peak_bytes']} planned")
            write_rows(path, rows)
    write_rows(path, rows)
    logger.info(f"{len(rows)} rows written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
