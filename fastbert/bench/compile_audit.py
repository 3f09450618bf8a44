"""`fastbert bench --suite compile`: every kernel compiled for the H100 (sm_90a) and the A100 (sm_80) on a
machine without a GPU, one JSON row per compiled kernel, and the gates CI holds them to.

Each (Triton install, target, dtype) is one worker process (`python -m fastbert.bench.compile_audit`): Triton's
interpreter off, a stand-in driver for the target (stand_in_gpu), and the launcher calls of compile_cases. For
every kernel a launcher compiled, in every config it can pick (for autotuned kernels: every candidate the
autotuner keeps after pruning), the row records the registers, stack and spill bytes, shared memory, warpgroup
MMA (HGMMA) and MMA (HMMA) instructions, the occupancy those resources allow, the Triton and ptxas versions and
which launcher calls use it; a kernel that fails to compile gets a row with its error. Rows carry the provenance
every suite records.

What this proves without a GPU: the kernels compile, their resources (spills, shared memory, occupancy) and
which tensor-core instructions they use. What it cannot: speed, numerics on the hardware, the autotuner's pick.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

# The GPU environment of DESIGN.md runs Triton 3.6; the set-up in the README installs it here, beside the
# Triton this Python uses, so that every audit covers both.
GPU_ENVIRONMENT_TRITON = "3.6.0"
GPU_ENVIRONMENT_TRITON_DIR = os.path.join(os.path.expanduser("~"), ".cache", "fastbert",
                                          f"triton-{GPU_ENVIRONMENT_TRITON}")
TARGETS = ("sm_90a", "sm_80")
GATED_DTYPES = ("float16", "bfloat16")  # the dtypes training and inference run in: no spill, HGMMA
# Kernels built around tl.dot: on sm_90a in 16-bit they must use warpgroup MMA (tests check this list against
# the kernels whose sm_80 build has MMA instructions, so it cannot go stale).
MATMUL_KERNELS = frozenset({"_matmul_fwd_kernel", "_attention_fwd_kernel", "_attention_bwd_kernel",
                            "_mlm_loss_fwd_kernel", "_mlm_loss_bwd_kernel"})
CHOSEN_BY_LAUNCHER = "launcher"  # the host code's fixed choice (or an autotuner's only config)
CHOSEN_BY_AUTOTUNER = "autotuner"  # one of the candidates the autotuner times on the GPU


@dataclass(frozen=True)
class Job:
    triton_dir: str | None  # a `pip install --target` directory; None: the Triton this Python imports
    target: str
    dtype: str

    def command(self, only: str | None) -> list[str]:
        return [sys.executable, "-m", "fastbert.bench.compile_audit", "--target", self.target, "--dtype",
                self.dtype, *(["--only", only] if only else [])]

    def environment(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if self.triton_dir:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self.triton_dir, env.get("PYTHONPATH")) if p)
        return env


def selected_cases(target: str, dtype: str, only: str | None):
    from fastbert.bench.compile_cases import cases

    pattern = re.compile(only) if only else None
    return [c for c in cases(dtypes=(dtype,)) if pattern is None or pattern.search(f"{target} {c.name}")]


# ---------------------------------------------------------------------------------------------------------
# The worker: one Triton, one target, one dtype
# ---------------------------------------------------------------------------------------------------------

def _split_constexprs(constexprs: dict, num_warps, num_stages) -> tuple[dict, dict]:
    """(config: the tile sizes, warps and stages; flags: the kernel's other constexprs)."""
    config = {k: v for k, v in constexprs.items() if k.startswith(("BLOCK", "GROUP"))}
    config.update(num_warps=num_warps, num_stages=num_stages)
    return config, {k: v for k, v in constexprs.items() if k not in config}


def _compiled_row(launch, gpu) -> dict:
    from fastbert.bench import cubin
    from fastbert.simulated.stand_in_gpu import occupancy

    meta = launch.metadata
    row = {"status": "ok", **cubin.resources(launch.cubin)}
    spills = {"spill_store_bytes": 0, "spill_load_bytes": 0}
    if row["stack_bytes"]:  # spilled registers live on the stack: only then is ptxas worth asking
        spills = cubin.ptxas_spills(launch.ptx, meta, gpu.capability)
    row.update(spills, shared_bytes=meta["shared"], **occupancy(gpu, row["registers"], meta["shared"],
                                                                  meta["num_warps"]))
    return row


def _use(case, chosen_by: str) -> dict:
    return {"case": case.name, "launcher": case.launcher, "variant": case.variant, "shape": case.shape,
            "chosen_by": chosen_by}


def worker(target: str, dtype: str, only: str | None, emit) -> None:
    """Compile every selected case's kernels; emit({"done": case}) after each case, then emit({"rows": rows})."""
    import triton
    from triton.runtime.autotuner import Autotuner

    from fastbert.bench import cubin
    from fastbert.simulated.stand_in_gpu import GPUS, Launch, LaunchLog, cpu_seconds, install

    gpu = GPUS[target]
    log = LaunchLog()
    install(gpu, log, cubin.registers)
    from fastbert.kernels import attention, bias_gelu, layer_norm, matmul, mlm_loss, qkv
    autotuners = [obj for module in (attention, bias_gelu, layer_norm, matmul, mlm_loss, qkv)
                  for obj in vars(module).values() if isinstance(obj, Autotuner)]
    common = {"target": target, "gpu": gpu.name, "dtype": dtype, "triton": triton.__version__,
              "ptxas": cubin.ptxas_version(gpu.capability)}
    rows: dict[str, dict] = {}
    for case in selected_cases(target, dtype, only):
        for tuner in autotuners:
            tuner.cache.clear()  # each case tunes afresh, so that it logs every candidate it can pick
        try:
            case.run()
        except Exception as exc:  # logged with the kernel and config being compiled, if any
            log.failed(exc)
        events = log.take()
        candidates = {e.metadata["hash"] for e in events if isinstance(e, Launch) and e.autotune_candidate}
        for event in events:
            if isinstance(event, Launch):
                key = event.metadata["hash"]
                if not event.autotune_candidate and key in candidates:
                    continue  # the autotuner's pick among equal stand-in times: no choice a GPU would make
                if key not in rows:
                    config, flags = _split_constexprs(event.constexprs, event.metadata["num_warps"],
                                                      event.metadata["num_stages"])
                    rows[key] = {"kernel": event.kernel, **common, "config": config, "flags": flags,
                                 **_compiled_row(event, gpu), "compile_cpu_seconds": event.compile_cpu_seconds,
                                 "hash": key, "uses": []}
            else:
                config, flags = _split_constexprs(event.constexprs, event.num_warps, event.num_stages)
                key = json.dumps([event.kernel, config, flags, event.error], default=str)
                rows.setdefault(key, {"kernel": event.kernel, **common, "config": config, "flags": flags,
                                      "status": "error", "error": event.error, "uses": []})
            chosen_by = CHOSEN_BY_AUTOTUNER if event.autotune_candidate else CHOSEN_BY_LAUNCHER
            if _use(case, chosen_by) not in rows[key]["uses"]:
                rows[key]["uses"].append(_use(case, chosen_by))
        emit({"done": case.name})
    # CPU time, the compilers it ran included: what the audit costs, whatever else loads the machine
    cpu = round(cpu_seconds(), 1)
    emit({"rows": [{**row, "worker_cpu_seconds": cpu} for row in rows.values()]})


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m fastbert.bench.compile_audit",
                                description="One compile-audit worker; `fastbert bench --suite compile` runs these.")
    p.add_argument("--target", choices=TARGETS, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--only")
    args = p.parse_args(argv)
    # the rows go to the original stdout; anything else printed (Triton prints failed PTX there) to stderr
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)

    def emit(message: dict) -> None:
        channel.write(json.dumps(message, default=str) + "\n")
        channel.flush()

    worker(args.target, args.dtype, args.only, emit)
    return 0


# ---------------------------------------------------------------------------------------------------------
# The suite: workers in parallel, a progress bar, the JSON file
# ---------------------------------------------------------------------------------------------------------

def default_triton_dirs() -> list[str | None]:
    """The Triton this Python imports, and the GPU environment's Triton where the README's set-up put it."""
    import triton

    dirs: list[str | None] = [None]
    if triton.__version__ != GPU_ENVIRONMENT_TRITON:
        if os.path.isdir(GPU_ENVIRONMENT_TRITON_DIR):
            dirs.append(GPU_ENVIRONMENT_TRITON_DIR)
        else:
            import logging
            logging.getLogger("fastbert.bench").warning(
                "Triton %s (the GPU environment's) is not installed in %s, so only Triton %s is audited; "
                "install it with: pip install --no-deps --target %s triton==%s", GPU_ENVIRONMENT_TRITON,
                GPU_ENVIRONMENT_TRITON_DIR, triton.__version__, GPU_ENVIRONMENT_TRITON_DIR, GPU_ENVIRONMENT_TRITON)
    return dirs


def _run_job(job: Job, only: str | None, events: queue.Queue) -> None:
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8") as stderr:
        proc = subprocess.Popen(job.command(only), env=job.environment(), stdout=subprocess.PIPE, stderr=stderr,
                                text=True)
        rows = None
        for line in proc.stdout:
            message = json.loads(line)
            if "done" in message:
                events.put(("done", job, message["done"]))
            else:
                rows = message["rows"]
        proc.wait()
        error = None
        if proc.returncode != 0 or rows is None:
            stderr.seek(0)
            error = f"worker exited with {proc.returncode}: " + " | ".join(stderr.read().strip().splitlines()[-5:])
        events.put(("finished", job, rows or [], error))


def every_job(triton_dirs: list[str | None] | None = None) -> list[Job]:
    """The whole audit: every Triton install (default: default_triton_dirs) x target x dtype, the gated
    16-bit dtypes first (exact fp32, whose attention spills kilobytes, takes ptxas longest)."""
    from fastbert.bench.compile_cases import DTYPES

    return [Job(d, target, dtype) for dtype in reversed(DTYPES)
            for d in (default_triton_dirs() if triton_dirs is None else triton_dirs) for target in TARGETS]


def run_compile_suite(out_dir: str | None, jobs: list[Job], only: str | None = None, progress: bool = True,
                      command: list[str] | None = None, parallel: int | None = None) -> tuple[str | None, list[dict]]:
    """Compile every selected case of every job (Triton install, target, dtype), `parallel` workers at a time
    (default: one per core); write the rows to a JSON file under out_dir (None: write nothing) and return
    (path, rows)."""
    import torch
    from tqdm import tqdm

    from fastbert.bench.provenance import provenance
    from fastbert.bench.runner import result_path, write_rows

    counts = {job: len(selected_cases(job.target, job.dtype, only)) for job in jobs}
    jobs = [job for job in jobs if counts[job]]
    common = {**provenance(torch.device("cpu"), command), "suite": "compile"}
    events: queue.Queue = queue.Queue()
    rows: list[dict] = []
    pending = list(jobs)
    running = 0
    parallel = parallel or os.cpu_count() or 1
    start = time.monotonic()
    bar = tqdm(total=sum(counts.values()), desc="fastbert bench compile", unit="case", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    path = None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = result_path(out_dir, "compile", common)
    while pending or running:
        while pending and running < parallel:
            threading.Thread(target=_run_job, args=(pending.pop(0), only, events), daemon=True).start()
            running += 1
        kind, job, *payload = events.get()
        if kind == "done":
            bar.set_postfix_str(f"{job.target} {payload[0]}"[:80], refresh=False)
            bar.update(1)
            continue
        running -= 1
        job_rows, error = payload
        rows += [{**common, **row} for row in job_rows]
        if error:
            rows.append({**common, "target": job.target, "dtype": job.dtype, "triton_dir": job.triton_dir,
                         "kernel": None, "status": "error", "error": error, "uses": []})
        if path:
            write_rows(path, rows)  # after every job: an interrupted run keeps what it compiled
    bar.close()
    for row in rows:
        row["suite_seconds"] = round(time.monotonic() - start, 1)
    if path:
        write_rows(path, rows)
    return path, rows


# ---------------------------------------------------------------------------------------------------------
# Gates
# ---------------------------------------------------------------------------------------------------------

GATES = ("compiles", "warpgroup MMA", "no spill", "shared memory", "exact fp32")


def gate_failures(rows: list[dict]) -> list[tuple[str, str]]:
    """(gate, what fails it) for each breach: a kernel that does not compile; on sm_90a in fp16 or bf16, a
    matmul kernel without warpgroup MMA; in fp16 or bf16, a config that spills; shared memory over the
    target GPU's limit; in fp32 under PyTorch's default precision ("float32", not "float32+tf32"), a tensor-core
    instruction (a TF32 dot where the op promises fp32)."""
    from fastbert.simulated.stand_in_gpu import GPUS

    failures = []
    for r in rows:
        where = f"{r.get('kernel')} {r.get('config', '')} {r.get('flags', '')} {r['dtype']} {r['target']} " \
                f"triton {r.get('triton', r.get('triton_dir'))}"
        if r["status"] != "ok":
            failures.append(("compiles", f"{where}: {r['error']}"))
            continue
        gated = r["dtype"] in GATED_DTYPES
        if gated and r["target"] == "sm_90a" and r["kernel"] in MATMUL_KERNELS and not r["wgmma"]:
            failures.append(("warpgroup MMA", f"{where}: no HGMMA, {r['mma']} HMMA"))
        if gated and (r["spill_store_bytes"] or r["spill_load_bytes"]):
            failures.append(("no spill", f"{where}: {r['spill_store_bytes']} bytes spilled"))
        if r["dtype"] == "float32" and (r["wgmma"] or r["mma"]):
            failures.append(("exact fp32", f"{where}: {r['wgmma']} HGMMA, {r['mma']} HMMA"))
        if r["shared_bytes"] > GPUS[r["target"]].max_shared_per_block:
            failures.append(("shared memory", f"{where}: {r['shared_bytes']} bytes"))
    return failures


def summary(rows: list[dict]) -> str:
    """The audit for the terminal: each gate's verdict, then one line per kernel with its worst case over every
    target, dtype, Triton and config it compiled in (most registers, spilled bytes and shared memory, the
    lowest occupancy). Every compiled kernel's row is in the JSON file."""
    failing = {}
    for gate, _ in gate_failures(rows):
        failing[gate] = failing.get(gate, 0) + 1
    verdicts = ", ".join(f"{gate}: {f'FAILS ({failing[gate]})' if gate in failing else 'pass'}" for gate in GATES)
    lines = [f"gates over {len(rows)} compiled kernels: {verdicts}",
             f"{'kernel':<32} {'rows':>5} {'errors':>6} {'regs':>4} {'(where: target dtype triton)':<29} "
             f"{'spill B, 16-bit':>15} {'fp32':>6} {'smem KB':>7} {'min occ':>7}"]
    kernels = sorted({str(r.get("kernel")) for r in rows})
    for kernel in kernels:
        mine = [r for r in rows if str(r.get("kernel")) == kernel]
        ok = [r for r in mine if r["status"] == "ok"]
        if not ok:
            lines.append(f"{kernel:<32} {len(mine):>5} {len(mine):>6}  error: {mine[0].get('error', '')[:80]}")
            continue
        most = max(ok, key=lambda r: r["registers"])
        where = f"{most['target']} {most['dtype']} {most['triton']}"
        spilled = [max([r["spill_store_bytes"] for r in ok if (r["dtype"] in GATED_DTYPES) == gated], default=0)
                   for gated in (True, False)]  # the gate holds 16-bit kernels; fp32 spills are reported only
        lines.append(f"{kernel:<32} {len(mine):>5} {len(mine) - len(ok):>6} {most['registers']:>4} {where:<29} "
                     f"{spilled[0]:>15} {spilled[1]:>6} {max(r['shared_bytes'] for r in ok) / 1024:>7.0f} "
                     f"{min(r['occupancy'] for r in ok):>7.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
