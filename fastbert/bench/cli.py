"""`fastbert bench`: run a benchmark suite and write its JSON rows (see fastbert.bench.runner)."""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys

from fastbert.command import run_command
from fastbert.files import check_output_parent
from fastbert.files import cache_dir

logger = logging.getLogger("fastbert.bench")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastbert bench",
        description="Measure fastbert's kernels and models against eager PyTorch, torch.compile and transformers. "
                    "The default, the CPU smoke run, compares fastbert's PyTorch reference with torch and "
                    "transformers at tiny shapes; torch.compile and fastbert's Triton kernels run in --suite gpu. "
                    "Writes one JSON file of rows to --out; `python benchmarks/make_perf.py` turns the committed "
                    "rows into PERF.md.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, reference and torch providers "
                      "(a few seconds; what CI runs)")
    mode.add_argument("--suite", choices=("gpu", "cpu-memory", "data", "smoke", "compile", "memory", "host"),
                      help="gpu: the whole suite on one CUDA GPU (H100/H200, under 10 minutes); cpu-memory: the "
                           "MLM head's peak memory and time at full size on the CPU; data: pretraining batches "
                           "built per CPU-second by the input pipeline (about a minute); compile: every kernel "
                           "compiled for H100 (sm_90a) and A100 (sm_80) without a GPU, in every config its launcher "
                           "can pick: registers, spills, shared memory, HGMMA/HMMA, occupancy (CPU-heavy); "
                           "memory: the planned memory of BERT-base and -large training and inference steps on an "
                           "80 GB GPU, fastbert against transformers, on meta tensors (no GPU, a few minutes); "
                           "host: the host's microseconds per fused op call and per BERT-base and ModernBERT-base "
                           "forward and training step, beside PyTorch and transformers, and their host syncs, "
                           "with the Triton launches stubbed (no GPU, a few minutes)")
    # a user's results go to their cache, wherever the command runs: never into a checkout's committed results
    p.add_argument("--out", default=os.path.join(cache_dir(), "bench"),
                   help="directory for the JSON file (default: %(default)s, under FASTBERT_CACHE or XDG_CACHE_HOME "
                        "when set); benchmarks/results holds the repository's committed runs")
    p.add_argument("--only", metavar="REGEX", help="run only the items whose 'case provider' matches "
                   "(compile suite: whose 'target case' matches, e.g. 'sm_90a .*attention.*bfloat16')")
    p.add_argument("--triton", metavar="DIR", action="append",
                   help="compile suite: also audit the Triton installed in DIR (pip install --target DIR "
                        "triton==X); default: this Python's Triton and the GPU environment's Triton 3.6 where "
                        "the README's set-up installs it")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="stop starting new items after this long (gpu default 480); the rest are recorded as skipped")
    p.add_argument("--model", metavar="CONFIG", help="memory suite: plan only a pretraining step of this model "
                   "(a preset tiny/base/large or an HF config.json) and print the plan as a table; needs "
                   "--seq-length and --batch")
    p.add_argument("--seq-length", type=int, metavar="S", help="memory suite with --model: tokens per sequence")
    p.add_argument("--batch", type=int, metavar="B", help="memory suite with --model: sequences per step")
    p.add_argument("--quick", action="store_true", help="host suite: a few calls per row, to check that every "
                   "row runs (what CI runs), not to measure")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quiet", action="store_true", help="no summary table at the end")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    command = ["fastbert", "bench", *(sys.argv[1:] if argv is None else argv)]
    return run_command("bench", lambda: run(args, command))


def run(args: argparse.Namespace, command: list[str]) -> int:
    suite = "smoke" if args.smoke or args.suite is None else args.suite
    check_options(args, suite)
    if suite == "compile":
        return _compile(args, command)
    if suite == "memory":
        return _memory(args, command)
    if args.model is not None or args.seq_length is not None or args.batch is not None:
        raise ValueError("--model, --seq-length and --batch belong to --suite memory")
    from fastbert.bench.host_suite import summary as host_summary
    from fastbert.bench.runner import GPUUnavailable, run_suite, summary

    try:
        path, rows = run_suite(suite, args.out, args.only, args.budget, not args.no_progress, command, args.quick)
    except GPUUnavailable as exc:
        raise ValueError(str(exc)) from None
    if not args.quiet:
        print(host_summary(rows) if suite == "host" else summary(rows))
    failed = [r for r in rows if r["status"] in ("error", "oom")]
    logger.info(f"{len(rows)} rows ({len(failed)} failed) written to {path}")
    return 1 if any(r["status"] == "error" for r in rows) else 0


def check_options(args: argparse.Namespace, suite: str) -> None:
    """Refuse, before anything is measured or written, what would otherwise fail mid-run with a traceback or a
    bare errno (an --only that is not a regular expression, an --out under a file) or be silently taken (a
    --budget that is no time at all, an --only for the data suite, which has no items to select)."""
    if args.only is not None:
        try:
            re.compile(args.only)
        except re.error as exc:  # not a ValueError: it would be a traceback, once per suite module compiling it
            raise ValueError(f"--only {args.only!r}: not a regular expression ({exc})") from None
        if suite == "data":
            raise ValueError(f"--only {args.only!r}: --suite data has no items to select; it runs whole")
    # 0 or less skips every item and NaN compares false (no budget at all); inf is no budget either: leave it out
    if args.budget is not None and not (math.isfinite(args.budget) and args.budget > 0):
        raise ValueError(f"--budget must be a finite number of seconds > 0, got {args.budget}")
    # os.makedirs would say only "[Errno 17] File exists", naming neither --out nor which part is the file
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a file; --out names the directory of the results file")
    check_output_parent(args.out)


def _compile(args, command: list[str]) -> int:
    from fastbert.bench import compile_audit
    from fastbert.bench.runner import check_selection

    jobs = compile_audit.every_job(None if args.triton is None else [None, *args.triton])
    check_selection(args.only, [f"{job.target} {case.name}" for job in jobs
                                for case in compile_audit.selected_cases(job.target, job.dtype, None)], "compile")
    path, rows = compile_audit.run_compile_suite(args.out, jobs, args.only, progress=not args.no_progress,
                                                 command=command)
    if not args.quiet:
        print(compile_audit.summary(rows))
    failures = compile_audit.gate_failures(rows)
    for gate, failure in failures:
        logger.error(f"gate {gate!r} fails: {failure}")
    logger.info(f"{len(rows)} compiled kernels ({len(failures)} gate failures) written to {path}")
    return 1 if failures else 0


def _memory(args, command: list[str]) -> int:
    from fastbert.bench import memory_cases
    from fastbert.bench.runner import check_selection

    user = (args.model, args.seq_length, args.batch)
    if any(v is not None for v in user):
        if any(v is None for v in user):
            raise ValueError("--suite memory --model CONFIG needs --seq-length S and --batch B as well")
        case = memory_cases.user_case(*user)
        print(memory_cases.plan_table(case, memory_cases.row_figures(case, memory_cases.FASTBERT)))
        return 0
    check_selection(args.only, [f"{case.name} {provider}" for case in memory_cases.memory_cases()
                                for provider in case.providers], "memory")
    path, rows = memory_cases.run_memory_suite(args.out, args.only, progress=not args.no_progress, command=command)
    if not args.quiet:
        print(memory_cases.summary(rows))
    failed = [r for r in rows if r["status"] != "ok"]
    logger.info(f"{len(rows)} planned steps ({len(failed)} failed) written to {path}")
    return 1 if failed else 0
