"""DESIGN.md's compile gates, on CI's share of `fastbert bench --suite compile` (no GPU needed).

The project's launchers compile every kernel, in every config they can pick (every autotuning candidate),
for the H100 (sm_90a) and the A100 (sm_80), in fp16 and bf16, with this Python's Triton and with the GPU
environment's (3.6, installed beside it by the README's set-up). CI's share is BERT-base at S = 128, padded
and packed, and a small fine-tuning MLM batch (every kernel and every flag the model runs with), ModernBERT-base's
bias-less kernels (the GeGLU epilogue, the pre-LN LayerNorm: compile_cases.MODERNBERT) and its attention with
rotary positions and a window (S = 512 and 8192, padded and packed: compile_cases.MODERNBERT_POSITIONS), and
MPNet's attention with its relative-position bias at S = 512 (BERT-base's heads: compile_cases.RELATIVE_BIAS_BATCHES), in
four workers: each Triton builds both targets, each target in both 16-bit dtypes, each Triton in both (all eight
pairs would cost twice the CPU time; fp16 and bf16 builds of one kernel have spilled alike but once).
The whole cross product (BERT-large, S = 512, the eight pairs, fp32 as well) is the suite itself, whose
committed rows test_compile_audit.py holds to the same gates.
"""
import json
import os
from pathlib import Path

import filelock
import pytest

from fastbert.bench import compile_audit, compile_report
from fastbert.bench.compile_cases import DTYPES, LAYOUTS, SEQLENS
from fastbert.bench.report import load_rows
from fastbert.bench.compile_audit import GPU_ENVIRONMENT_TRITON_DIR, MATMUL_KERNELS, TARGETS, Job

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
CI_CASES = (r"model=bert-base,(layout=\w+,)?seqlen=128,|model=bert-base,rows=40/"
            r"|attention_(fwd|bwd)\[relative_bias,[^]]*\]/model=bert-base,layout=\w+,seqlen=512,"
            r"|model=modernbert-base,")
CI_JOBS = [Job(None, "sm_90a", "bfloat16"), Job(None, "sm_80", "float16"),
           Job(GPU_ENVIRONMENT_TRITON_DIR, "sm_90a", "float16"), Job(GPU_ENVIRONMENT_TRITON_DIR, "sm_80", "bfloat16")]
KERNELS = {"_matmul_fwd_kernel", "_bias_gelu_fwd_kernel", "_bias_gelu_bwd_kernel", "_qkv_bwd_kernel",
           "_attention_fwd_kernel", "_attention_bwd_preprocess_kernel", "_attention_bwd_kernel",
           "_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel", "_mlm_loss_fwd_kernel", "_mlm_loss_merge_kernel",
           "_mlm_loss_bwd_kernel", "_dropout_kernel"}
# the fixture `audit` builds every kernel for two GPU targets with two Tritons: CPU-minutes with an empty Triton cache
COMPILES = pytest.mark.slow(reason="the compile gates: every kernel built for sm_90a and sm_80 with both Tritons")


@pytest.fixture(scope="session")
def audit(tmp_path_factory):
    """The rows of CI's share, compiled once per test session: the first pytest-xdist worker to ask
    compiles (its own workers use every core), the others read its rows."""
    if not os.path.isdir(GPU_ENVIRONMENT_TRITON_DIR):
        pytest.fail(f"Triton {compile_audit.GPU_ENVIRONMENT_TRITON} is not installed in {GPU_ENVIRONMENT_TRITON_DIR}: "
                    f"run the README's set-up (pip install --no-deps --target {GPU_ENVIRONMENT_TRITON_DIR} "
                    f"triton=={compile_audit.GPU_ENVIRONMENT_TRITON})")
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's directory, above each worker's own
    path = shared / "compile-gates.json"
    with filelock.FileLock(str(path) + ".lock"):
        if not path.is_file():
            _, rows = compile_audit.run_compile_suite(None, CI_JOBS, only=CI_CASES, progress=False)
            path.write_text(json.dumps(rows))
        return json.loads(path.read_text())


def _failures(rows, gate):
    return [failure for name, failure in compile_audit.gate_failures(rows) if name == gate]


@COMPILES
def test_every_kernel_compiles_for_both_gpus_with_both_tritons(audit):
    assert not _failures(audit, "compiles")
    tritons = {r["triton"] for r in audit}
    assert len(tritons) == 2, f"compiled with Triton {tritons} only; the gates need this one and 3.6"
    built = {(r["triton"], r["target"], r["dtype"]) for r in audit}
    assert len(built) == len(CI_JOBS) and {target for _, target, _ in built} == set(TARGETS)
    for triton, target, dtype in built:
        compiled = {r["kernel"] for r in audit if (r["triton"], r["target"], r["dtype"]) == (triton, target, dtype)}
        assert compiled == KERNELS, f"Triton {triton}, {target}, {dtype}: missing {KERNELS - compiled}"


@COMPILES
def test_matmul_kernels_use_warpgroup_mma_on_sm90a(audit):
    assert not _failures(audit, "warpgroup MMA")


@COMPILES
def test_no_config_a_launcher_can_pick_spills(audit):
    assert not _failures(audit, "no spill")


@COMPILES
def test_shared_memory_fits_the_gpu(audit):
    assert not _failures(audit, "shared memory")


@COMPILES
def test_autotuned_kernels_compile_every_candidate(audit):
    """The gates see every config an autotuner can pick, not only the one it would pick here."""
    candidates = [r for r in audit if r["kernel"] == "_attention_fwd_kernel" and r["target"] == "sm_90a"
                  and any(u["chosen_by"] == compile_audit.CHOSEN_BY_AUTOTUNER for u in r["uses"])]
    configs = {json.dumps(r["config"], sort_keys=True) for r in candidates}
    assert len(configs) > 1


@COMPILES
def test_matmul_kernel_list_is_every_kernel_with_tensor_core_instructions(audit):
    """MATMUL_KERNELS (the warpgroup-MMA gate's list) are the kernels whose sm_80 build has MMA instructions."""
    with_mma = {r["kernel"] for r in audit if r["target"] == "sm_80" and r["mma"]}
    assert with_mma == MATMUL_KERNELS


def test_committed_audit_is_whole_and_passes_the_gates():
    """The newest `fastbert bench --suite compile` run under benchmarks/results (the one PERF.md shows): every
    kernel for both targets in every dtype with both Tritons, and every gate passed."""
    rows = compile_report.newest_run(load_rows(str(RESULTS)))
    assert rows, f"no compile run under {RESULTS}"
    assert not compile_audit.gate_failures(rows)
    tritons = {r["triton"] for r in rows}
    assert compile_audit.GPU_ENVIRONMENT_TRITON in tritons and len(tritons) == 2
    for triton in tritons:
        for target in TARGETS:
            for dtype in DTYPES:
                compiled = {r["kernel"] for r in rows if (r["triton"], r["target"], r["dtype"]) == (triton, target, dtype)}
                assert compiled == KERNELS, f"Triton {triton}, {target}, {dtype}: missing {KERNELS - compiled}"
    shapes = {(u["shape"]["model"], u["shape"].get("layout"), u["shape"].get("seqlen")) for r in rows for u in r["uses"]}
    assert {(model, layout, seqlen) for model in ("bert-base", "bert-large") for layout in LAYOUTS
            for seqlen in SEQLENS} <= shapes
