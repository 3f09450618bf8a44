"""Where a training step's host time goes: its forward, its backward and the optimizer's step, fastbert against
transformers, timed apart.

Run from the repository root: `python benchmarks/host_phases.py [--out DIR] [--size base|modernbert-base]
[--repeats N]`. The model rows of `fastbert bench --suite host` (the same models, inputs, stubbed Triton launches,
one intra-op thread and clock: this thread's CPU time, least mean of interleaved groups) time a whole step; this
script times four calls of each provider's model in turns:
- "infer": an inference forward (eval, no_grad), the host suite's "fwd" row;
- "forward": the training forward that builds the autograd graph, up to the loss;
- "forward+backward": that forward, then loss.backward();
- "step": forward, backward, AdamW's step (fused) and zero_grad, the host suite's "fwd+bwd" row.
The backward's share is forward+backward less forward, the optimizer's step less forward+backward: differences of
least means, so each is as noisy as the two it comes from. transformers' rows include its CPU arithmetic (its
ops run on these CPU tensors; fastbert's kernels are stubbed), as in the host suite.
Prints a table and writes the rows (with provenance) to DIR/host-phases-<machine>-<time>.json.
"""
from __future__ import annotations

import sys

import torch

from fastbert.bench import host_suite
from fastbert.bench.runner import cpu_script_parser, save_cpu_rows
from fastbert.command import run_command
from fastbert.simulated.host_time import interleaved_host_microseconds, one_thread, stubbed_launches

PROVIDERS = (host_suite.FASTBERT, host_suite.HF_SDPA)
SIZES = ("base", "modernbert-base")
PHASES = ("infer", "forward", "forward+backward", "step")


def phase_calls(size: str, provider: str) -> dict:
    """phase -> one call of it, on the host suite's model and inputs for this provider."""
    infer = host_suite._model_calls(size, provider)("fwd")
    model, inputs = host_suite.model_and_inputs(size, provider, "train")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def forward():
        model(**inputs).loss

    def forward_backward():
        model(**inputs).loss.backward()
        optimizer.zero_grad(set_to_none=True)

    def step():
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # no call here: interleaved_host_microseconds warms every call up (AdamW's state included) before timing
    return {"infer": infer, "forward": forward, "forward+backward": forward_backward, "step": step}


def measure(size: str, repeats: int) -> list[dict]:
    calls = {(provider, phase): call for provider in PROVIDERS
             for phase, call in phase_calls(size, provider).items()}
    timing = {**host_suite.MODEL_TIMING, "repeats": repeats}
    microseconds = interleaved_host_microseconds(calls, **timing)
    rows = []
    for provider in PROVIDERS:
        us = {phase: microseconds[(provider, phase)] for phase in PHASES}
        derived = {"backward": us["forward+backward"] - us["forward"], "optimizer": us["step"] - us["forward+backward"]}
        for phase, value in (*us.items(), *derived.items()):
            rows.append({"case": f"{size} (host suite widths)", "provider": provider, "phase": phase,
                         "derived": phase in derived, "host_us": value})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'case':36s} {'phase':17s} " + " ".join(f"{p:>10s}" for p in PROVIDERS) + "      ratio"]
    by_key = {(r["case"], r["phase"], r["provider"]): r["host_us"] for r in rows}
    for case, phase in dict.fromkeys((r["case"], r["phase"]) for r in rows):
        values = [by_key[(case, phase, p)] for p in PROVIDERS]
        lines.append(f"{case:36s} {phase:17s} " + " ".join(f"{v:10.0f}" for v in values)
                     + f" {values[0] / values[1]:10.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = cpu_script_parser(__doc__, SIZES)
    parser.add_argument("--repeats", type=int, default=host_suite.MODEL_TIMING["repeats"],
                        help="timed groups per call (default the host suite's)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return run_command("host-phases", lambda: _phase_rows(args))


def _phase_rows(args) -> None:
    rows = []
    with one_thread(), stubbed_launches():
        for size in args.size or SIZES:
            rows += measure(size, args.repeats)
    save_cpu_rows(args.out, "host-phases", host_suite.CPU_CLOCK, rows, table)


if __name__ == "__main__":
    sys.exit(main())
