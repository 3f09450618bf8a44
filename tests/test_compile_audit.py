"""The compile audit's own arithmetic and reporting (the audit itself runs in tests/test_compile_gates.py):
the occupancy calculator, the gates' verdicts, the cases it compiles, PERF.md's section, and the command on
one small case."""
import json
from types import SimpleNamespace

import pytest
import triton

from fastbert.bench import compile_cases, compile_report, cubin
from fastbert.bench.compile_audit import GPU_ENVIRONMENT_TRITON, GPU_ENVIRONMENT_TRITON_DIR, gate_failures
from fastbert.simulated.stand_in_gpu import A100, H100, LaunchLog, occupancy


@pytest.mark.parametrize("gpu, registers, shared, warps, blocks, limit", [
    (H100, 255, 0, 8, 1, "registers"),  # 255 -> 256 per thread, 64K per block of 256 threads
    (H100, 128, 0, 4, 4, "registers"),
    (H100, 32, 0, 4, 16, "threads"),  # 2048 threads per SM
    (H100, 16, 0, 1, 32, "blocks"),
    (H100, 64, 100 * 1024, 4, 2, "shared memory"),  # 228 KB per SM, 1 KB reserved per block
    (A100, 64, 100 * 1024, 4, 1, "shared memory"),  # 164 KB per SM
])
def test_occupancy_matches_the_cuda_calculator(gpu, registers, shared, warps, blocks, limit):
    got = occupancy(gpu, registers, shared, warps)
    assert (got["blocks_per_sm"], got["occupancy_limited_by"]) == (blocks, limit)
    assert got["occupancy"] == blocks * warps / 64


def _row(**overrides):
    row = {"kernel": "_matmul_fwd_kernel", "target": "sm_90a", "dtype": "bfloat16", "triton": "3.6.0",
           "status": "ok", "config": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
           "flags": {"ACTIVATION": "gelu"}, "registers": 168, "stack_bytes": 0, "spill_store_bytes": 0,
           "spill_load_bytes": 0, "shared_bytes": 96 * 1024, "wgmma": 4, "mma": 0, "blocks_per_sm": 1,
           "warps_per_sm": 8, "occupancy": 0.125, "occupancy_limited_by": "registers",
           "uses": [{"case": "bias_gelu.linear_bias_gelu[ffn]/x", "launcher": "bias_gelu.linear_bias_gelu",
                     "variant": "ffn,approximate=none", "chosen_by": "autotuner",
                     "shape": {"model": "bert-base", "layout": "padded", "seqlen": 128}}]}
    row.update(overrides)
    return row


@pytest.mark.parametrize("overrides, gate", [
    ({}, None),
    ({"status": "error", "error": "CompilationError: boom"}, "compiles"),
    ({"wgmma": 0, "mma": 32}, "warpgroup MMA"),
    ({"wgmma": 0, "mma": 32, "target": "sm_80"}, None),  # A100 has no warpgroup MMA
    ({"wgmma": 0, "mma": 0, "dtype": "float32"}, None),  # IEEE fp32 dots use no tensor cores
    ({"wgmma": 16, "mma": 0, "dtype": "float32"}, "exact fp32"),  # a TF32 dot where PyTorch promises fp32
    ({"wgmma": 0, "mma": 32, "dtype": "float32", "target": "sm_80"}, "exact fp32"),
    ({"wgmma": 16, "mma": 0, "dtype": "float32+tf32"}, None),  # TF32 allowed
    ({"spill_store_bytes": 8, "spill_load_bytes": 8}, "no spill"),
    ({"spill_store_bytes": 8, "spill_load_bytes": 8, "dtype": "float32", "wgmma": 0}, None),
    ({"shared_bytes": 200 * 1024, "target": "sm_80", "mma": 8, "wgmma": 0}, "shared memory"),  # 163 KB
    ({"shared_bytes": 200 * 1024}, None),  # 227 KB on an H100
])
def test_gates(overrides, gate):
    failures = gate_failures([_row(**overrides)])
    assert [g for g, _ in failures] == ([gate] if gate else [])


def test_cases_cover_every_launcher_in_every_dtype():
    cases = compile_cases.cases()
    launchers = {c.launcher for c in cases}
    assert launchers == {"qkv.qkv_projection_fwd", "qkv.qkv_projection_bwd", "attention.attention_fwd",
                         "attention.attention_infer", "attention.attention_bwd", "layer_norm.layer_norm_fwd",
                         "layer_norm.layer_norm_infer", "layer_norm.layer_norm_bwd",
                         "bias_gelu.linear_bias_gelu", "bias_gelu.bias_gelu_fwd", "bias_gelu.bias_gelu_bwd",
                         "bias_gelu.geglu_fwd", "bias_gelu.geglu_bwd",
                         "mlm_loss.mlm_loss_fwd", "mlm_loss.mlm_loss_inference", "mlm_loss.mlm_loss_bwd",
                         "dropout.dropout_fwd"}
    assert {c.dtype for c in cases} == set(compile_cases.DTYPES)
    assert len({c.name for c in cases}) == len(cases)
    shapes = {(c.shape["model"], c.shape.get("layout"), c.shape.get("seqlen")) for c in cases}
    for model in ("bert-base", "bert-large"):
        for layout in ("padded", "varlen"):
            assert {(model, layout, 128), (model, layout, 512)} <= shapes


def test_packed_batch_has_fewer_rows_than_its_padded_twin():
    model = compile_cases.MODELS[0]
    padded, packed = (compile_cases.Batch(model, layout, 512, None) for layout in ("padded", "varlen"))
    assert padded.rows == compile_cases.TOKEN_SLOTS > packed.rows == sum(packed.lengths)
    assert padded.labelled == packed.labelled == round(0.15 * packed.rows)


def test_perf_section_says_what_is_proven_and_what_waits(tmp_path):
    provenance = {"suite": "compile", "device": "a CPU", "torch": "2.13.0", "commit": "0123456789abcdef",
                  "date": "2026-01-01T00:00:00+00:00", "command": "fastbert bench --suite compile",
                  "ptxas": "12.8.93"}
    default = _row(**provenance, kernel="_layer_norm_fwd_kernel", flags={}, wgmma=0,
                   config={"BLOCK_ROWS": 1, "BLOCK_H": 1024, "num_warps": 4, "num_stages": 3},
                   uses=[{"case": "c", "launcher": "layer_norm.layer_norm_fwd", "variant": "-",
                          "shape": {"model": "bert-large", "layout": "varlen", "seqlen": 512}, "chosen_by": "launcher"}])
    rows = [_row(**provenance), _row(**provenance, config={"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4,
                                                           "num_stages": 4}, registers=92), default,
            _row(**provenance, target="sm_80", spill_store_bytes=24, spill_load_bytes=24)]
    text = "\n".join(compile_report.compile_section(compile_report.newest_run(rows), gpu_measured=False))
    assert compile_report.TITLE in text and "Proven here, without a GPU" in text
    assert "No GPU has run these kernels yet" in text
    assert "No GPU has run" not in "\n".join(compile_report.compile_section(rows, gpu_measured=True))
    assert "bert-base and bert-large shapes (padded, varlen; S = 128, 512) in bfloat16" in text
    assert "Still waiting for a GPU" in text and "autotuner picks" in text
    assert "| layer_norm.layer_norm_fwd | _layer_norm_fwd_kernel | 1x1024, 4 warps, 3 stages | 168 | 0 |" in text
    assert "| bias_gelu.linear_bias_gelu [ffn,approximate=none] | _matmul_fwd_kernel | autotuned, 2 candidates: " \
           "128x128, 8 warps, 3 stages; 64x64, 4 warps, 4 stages | 92-168 | 0 |" in text
    assert "1 failures" in text and "no spill" in text and "24 bytes spilled" in text
    assert "0123456789ab" in text and "fastbert bench --suite compile" in text
    assert "Not yet run" in "\n".join(compile_report.compile_section([], gpu_measured=False))


def test_cli_writes_one_row_per_compiled_kernel(tmp_path, capsys):
    """`fastbert bench --suite compile` end to end on one small case: a JSON file of rows with provenance,
    the resources of the compiled kernel, and the table on stdout."""
    from fastbert.cli import main

    only = r"sm_80 layer_norm.layer_norm_fwd\[residual=False.*model=bert-base,layout=padded,seqlen=128,.*/bfloat16"
    assert main(["bench", "--suite", "compile", "--only", only, "--triton", GPU_ENVIRONMENT_TRITON_DIR,
                 "--out", str(tmp_path), "--no-progress"]) == 0
    [path] = tmp_path.iterdir()
    rows = json.loads(path.read_text())
    assert {r["triton"] for r in rows} == {triton.__version__, GPU_ENVIRONMENT_TRITON}
    for row in rows:
        assert (row["suite"], row["kernel"], row["target"], row["status"]) == \
            ("compile", "_layer_norm_fwd_kernel", "sm_80", "ok")
        assert row["registers"] > 0 and row["shared_bytes"] >= 0 and row["commit"] and row["ptxas"]
        assert [u["chosen_by"] for u in row["uses"]] == ["launcher"]
    assert "_layer_norm_fwd_kernel" in capsys.readouterr().out


# cuobjdump -sass's layout: a loop from 0x0080 to a branch back at 0x00b0 holding one barrier, a second loop without
# one, a forward branch (not a loop) over a barrier
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0090*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00a0*/                   DADD R6, R6, R4 ;
        /*00b0*/              @!P0 BRA 0x80 ;
        /*00c0*/               @P1 BRA 0x100 ;
        /*00d0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0100*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0110*/               @P0 BRA 0x100 ;
        /*0120*/                   EXIT ;
"""


def test_barriers_are_counted_per_loop():
    """benchmarks/loop_barriers.py's reading of SASS: a loop is a branch back, its barriers those between the
    branch's target and the branch; barriers outside loops and forward branches do not count."""
    assert cubin.barriers_in_loops(SASS) == [1, 0]
    assert cubin.barriers_in_loops(SASS.replace("@!P0 BRA 0x80", "@!P0 BRA 0x90")) == [1, 0]
    assert cubin.barriers_in_loops(SASS.replace("@!P0 BRA 0x80", "@!P0 BRA 0xa0")) == [0, 0]


def test_mnemonics_are_counted_with_their_modifiers():
    """benchmarks/dropout_sass.py's reading of SASS: each instruction's mnemonic with its modifiers, predicated or
    not, once per line."""
    counts = cubin.mnemonics(SASS.replace("IADD3 R0, R0, 0x1, RZ", "IMAD.WIDE.U32 R2, R0, R5, RZ"))
    assert counts == {"MOV": 1, "BAR.SYNC.DEFER_BLOCKING": 3, "LDG.E.128": 1, "DADD": 1, "BRA": 3,
                      "IMAD.WIDE.U32": 1, "EXIT": 1}


def test_take_compiled_keeps_each_kernel_once_and_names_a_failure():
    """The SASS tools' reading of the stand-in's log: each compiled kernel once, in launch order; a failed compile
    stops them with its message."""
    def launch(hash_):
        return SimpleNamespace(cubin=b"", metadata={"hash": hash_})

    log = LaunchLog()
    first, again, other = launch("a"), launch("a"), launch("b")
    log.events += [first, again, other]
    assert log.take_compiled() == [first, other] and log.events == []
    log.events += [first, SimpleNamespace(kernel="_k", error="ptxas: out of registers")]
    with pytest.raises(RuntimeError, match="a compile failed: .*out of registers"):
        log.take_compiled()
