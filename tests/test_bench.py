"""The benchmark suite's smoke run (what CI runs of `fastbert bench`), its JSON rows, the
CPU memory meter, the FLOP formulas, the GPU suite's refusal without a GPU, and PERF.md's generator."""
import glob
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

import fastbert
from fastbert import paths
from fastbert.bench import model_cases, op_cases, report, runner
from fastbert.bench.timing import NO_DEVICE_TIME, cpu_peak_extra_bytes, device_time_ms, time_ms
from fastbert.kernels import qkv as qkv_kernel

PROVENANCE = ("device", "device_type", "torch", "triton", "transformers", "python", "commit", "date", "command")
ROW_FIELDS = PROVENANCE + ("suite", "case", "op", "shape", "provider", "direction", "status", "median_ms",
                           "p20_ms", "p80_ms", "timer", "memory_meter")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    path, rows = runner.run_suite("smoke", str(out), progress=False, command=["fastbert", "bench", "--smoke"])
    with open(path, encoding="utf-8") as f:
        return path, json.load(f)


def _finite_positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_smoke_rows_have_provenance_and_sane_figures(smoke):
    _, rows = smoke
    assert rows, "the smoke run wrote no rows"
    bad = [(r["case"], r["provider"], r.get("error")) for r in rows if r["status"] != "ok"]
    assert not bad, f"smoke items failed: {bad}"
    for row in rows:
        missing = [f for f in ROW_FIELDS if f not in row]
        assert not missing, f"{row['case']} [{row['provider']}] lacks {missing}"
        assert row["device_type"] == "cpu" and row["suite"] == "smoke"
        assert row["command"] == "fastbert bench --smoke"
        assert _finite_positive(row["median_ms"]) and row["p20_ms"] <= row["median_ms"] <= row["p80_ms"]
        if row.get("flops"):
            assert _finite_positive(row["tflops"])
            assert row["tflops"] == pytest.approx(row["flops"] / row["median_ms"] / 1e9)
        if row.get("bytes"):
            assert row["gbps"] == pytest.approx(row["bytes"] / row["median_ms"] / 1e6)


def test_smoke_measures_peaks_ops_and_models_side_by_side(smoke):
    _, rows = smoke
    by_case = {}
    for row in rows:
        by_case.setdefault(row["case"], set()).add((row["provider"], row.get("direction")))
    peaks = {r["case"]: r for r in rows if r["op"] == "peak"}
    assert _finite_positive(peaks["peak/copy"]["gbps"]) and _finite_positive(peaks["peak/matmul"]["tflops"])
    ops_seen = {r["op"] for r in rows}
    assert {"layer_norm", "bias_gelu", "ffn_up", "qkv_projection", "attention", "mlm_head", "model"} <= ops_seen
    for case in op_cases.smoke_op_cases():
        expected = {(p, d) for p in (op_cases.EAGER, op_cases.TORCH) for d in op_cases.DIRECTIONS}
        assert expected <= by_case[case.name], case.name
    for row in rows:
        if row["op"] != "peak" and row["op"] != "model":
            assert row["provider"] not in op_cases.GPU_PROVIDERS
            assert isinstance(row["peak_mem_extra_bytes"], int) and row["peak_mem_extra_bytes"] >= 0
    model_rows = [r for r in rows if r["op"] == "model"]
    assert {r["direction"] for r in model_rows} == {"train_step", "inference"}
    mpnet = {(r["provider"], r["direction"]) for r in model_rows if r["shape"]["size"] == "mpnet-tiny"}
    assert mpnet == {("fastbert-eager", "train_step"), ("hf-eager", "train_step")}  # MPNet against transformers'
    modernbert = {(r["provider"], r["direction"]) for r in model_rows if r["shape"]["size"] == "modernbert-tiny"}
    assert modernbert == {("fastbert-eager", "train_step"), ("hf-sdpa", "train_step")}
    for row in model_rows:
        assert _finite_positive(row["tokens_per_s"]) and _finite_positive(row["sequences_per_s"])
        assert 0 < row["tokens"] <= row["batch"] * row["shape"]["seqlen"]
        if row["shape"].get("trainable") == "bitfit":  # its frozen matmuls are skipped: no model FLOPs to count
            assert "flops" not in row and "mfu" not in row
        else:
            assert 0 < row["mfu"]  # CPU rows are read against the CPU's measured fp32 matmul rate
        assert row["peak_mem_extra_bytes"] > 0


@pytest.mark.parametrize("provider", [model_cases.EAGER, model_cases.HF_SDPA])
def test_bitfit_case_trains_the_biases_alone(provider):
    """The BitFit rows' step updates every bias term and nothing else, on fastbert's model and transformers'."""
    (case,) = [c for c in model_cases.smoke_model_cases() if c.trainable == "bitfit"]
    assert case.name.endswith(",bitfit") and case.shape["trainable"] == "bitfit"
    run = model_cases.ProviderRun(case, provider, torch.device("cpu"))
    before = {name: p.detach().clone() for name, p in run.model.named_parameters()}
    step, _ = run.step_for(case.batch, case.padded)
    step()
    changed = {name for name, p in run.model.named_parameters() if not torch.equal(p, before[name])}
    biases = {name for name in before if name.endswith("bias")}
    assert biases and changed == biases
    assert len(run.optimizer.param_groups[0]["params"]) == len(biases)
    with pytest.raises(ValueError, match="trainable must be one of"):
        model_cases.freeze(run.model, "lora")


def test_smoke_mlm_head_memory_favours_masked_only(smoke):
    """HF's head holds the logits of every position; fastbert's holds a chunk of the labelled rows."""
    _, rows = smoke
    peak = {r["provider"]: r["peak_mem_extra_bytes"] for r in rows
            if r["op"] == "mlm_head" and r["direction"] == "fwd+bwd"}
    batch, seqlen, vocab = 4, 64, 1000
    assert peak[op_cases.TORCH] >= batch * seqlen * vocab * 4  # at least the fp32 logits
    assert peak[op_cases.EAGER] < peak[op_cases.TORCH]


def test_cpu_memory_meter_counts_a_known_allocation():
    n = 1 << 20

    def allocate():
        a = torch.ones(n)  # 4 MiB live ...
        b = torch.ones(n)  # ... and 4 MiB more at the peak
        del a, b
        torch.ones(n // 2)

    assert cpu_peak_extra_bytes(allocate) == pytest.approx(8 * n, rel=0.01)


def test_time_ms_orders_quantiles():
    t = time_ms(lambda: torch.ones(1000).sum(), torch.device("cpu"), warmup_ms=0, rep_ms=0, min_reps=5)
    assert 0 < t["p20_ms"] <= t["median_ms"] <= t["p80_ms"]


def test_op_rows_are_compared_by_the_gpus_time_alone_where_measured():
    """An op row with the GPU's time alone (device_ms) shows it beside the median, and its GB/s and floor distance
    read it: a call whose host work outlasts its kernels reads as slower than it runs. A speed-up reads it where
    both rows have it, else both medians (never one against the other)."""
    from fastbert.bench.floors import _distance
    shape = {"rows": 16384, "hidden": 768, "dropout_p": 0.1}
    rows = [runner.derived({**_h100_row("layer_norm", shape, provider, "fwd", median), "bytes": 75e6,
                            **({"device_ms": alone} if alone else {})}, {})
            for provider, median, alone in (("fastbert", 0.254, 0.05), ("torch", 0.093, 0.1),
                                            (op_cases.EAGER, 0.094, None))]
    assert [round(r["gbps"]) for r in rows] == [1500, 750, 798]  # bytes over device_ms, else over median_ms
    line = next(line for line in report.op_section("layer_norm", rows) if "| fwd |" in line)
    assert "| 0.254 ms (GPU 0.050 ms · 1500 GB/s) (auto) | 0.094 ms · 798 GB/s | " \
           "0.093 ms (GPU 0.100 ms · 750 GB/s) |" in line
    assert line.endswith("| 0.37x | 2.00x |")  # medians 0.094 over 0.254 (eager has no GPU time); 0.1 over 0.05
    assert _distance(rows[0], 0.025) == "50.0 us (2.0x)"
    # a model's inference row shows the GPU's time of a forward beside its wall time, which its figures keep, and the
    # host's where the row has it
    inference = {**_h100_row("model", {"batch": 32}, "fastbert", "inference", 5.9), "case": "inference/base",
                 "batch": 32, "tokens_per_s": 1e5, "sequences_per_s": 32 / 5.9e-3, "device_ms": 1.8, "backend": "auto"}
    line = next(line for line in report.model_section([inference]) if line.startswith("| inference/base"))
    assert line.endswith("| 5.9 (GPU 1.8) |")
    line = next(line for line in report.model_section([{**inference, "host_ms": 4.1}])
                if line.startswith("| inference/base"))
    assert line.endswith("| 5.9 (GPU 1.8, host 4.1) |")
    header, row = runner.summary([{**inference, "host_ms": 4.1, "direction": "inference"}]).splitlines()
    assert header.split()[6:9] == ["GPU", "ms", "host"] and row.split()[-5:-3] == ["1.800", "4.100"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times a GPU (benchmarks/gpu_check.sh runs it)")
def test_device_time_leaves_the_host_out():
    """device_time_ms times the GPU's work alone: a call of 2 ms of host work and a kernel of a few microseconds
    reads as the kernel; a GPU-bound copy reads no longer than do_bench's time of it and no shorter than its bytes
    allow; a call that syncs has no GPU time alone. Its host_ms times the host's alone: the 2 ms, and a copy's
    launch, not the copy."""
    device = torch.device("cuda")
    x = torch.ones(1 << 20, device=device)

    def slow_host():
        time.sleep(0.002)
        x.mul_(1.0)

    # bounds loose enough for the other test processes that gpu_check's tests stage runs on the same GPU
    assert time_ms(slow_host, device, warmup_ms=0, rep_ms=20, min_reps=5)["median_ms"] > 1.5
    slow = device_time_ms(slow_host, device, calls=5)
    assert slow["device_ms"] < 1.0 and slow["host_ms"] > 1.5  # and the host's time alone is the host's 2 ms
    big = torch.ones(1 << 26, device=device)  # 256 MiB, copied in about 0.2 ms
    out = torch.empty_like(big)
    wall = time_ms(lambda: out.copy_(big), device)["median_ms"]
    copy = device_time_ms(lambda: out.copy_(big), device)
    alone = copy["device_ms"]
    assert 2 * big.numel() * 4 / 6e12 * 1e3 < alone <= 2 * wall  # no GPU here copies 6 TB/s
    assert copy["host_ms"] < alone / 2  # launching the copy does not wait for it
    assert device_time_ms(lambda: x.sum().item(), device, calls=3) == NO_DEVICE_TIME


def test_flop_formulas():
    lengths = torch.tensor([3, 5])
    config = fastbert.BertConfig.tiny()
    hidden, inter, vocab, layers = 128, 512, 1024, 2
    encoder = layers * (8 * (8 * hidden ** 2 + 4 * hidden * inter) + 4 * hidden * (9 + 25))
    assert model_cases.model_flops(config, lengths, 0, "inference") == encoder + 2 * 2 * hidden ** 2
    train = 3 * (encoder + 2 * 2 * hidden ** 2 + 4 * (2 * hidden ** 2 + 2 * hidden * vocab) + 2 * 4 * hidden)
    assert model_cases.model_flops(config, lengths, 4, "train") == train
    case = op_cases.attention_case(2, 8, 2, 16, torch.float32, padded=False)
    assert case.flops("fwd") == 4 * 2 * 16 * (2 * 8 * 8) and case.flops("bwd") == 2.5 * case.flops("fwd")
    qkv = op_cases.qkv_case(2, 8, 32, 2, torch.float32)
    assert qkv.flops("fwd+bwd") == 3 * 2 * (2 * 8) * 32 * 96


def test_qkv_case_hands_its_backward_the_attention_layout():
    """The QKV projection's case gives its backward dq, dk and dv as a model's attention backward does, the
    column blocks of one buffer, which the kernel's backward reads in place: with a random tensor of each's
    own, its rows timed the gather (and PyTorch's autograd a copy) that the model does not run."""
    case = op_cases.qkv_case(2, 8, 32, 2, torch.float32)
    outputs = case.provider(op_cases.EAGER)(**case.make_inputs(torch.device("cpu")))
    grads = case.grad_outputs(outputs)
    assert [g.shape for g in grads] == [o.shape for o in outputs]
    assert qkv_kernel._one_matrix(*grads, 2 * 8, 32) is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_suite_refuses_without_gpu(tmp_path, capsys):
    from fastbert.cli import main
    assert main(["bench", "--suite", "gpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "CUDA GPU" in err and "--smoke" in err
    assert not list(tmp_path.iterdir())


def test_bench_writes_to_the_users_cache_and_says_smoke_times_are_noise(tmp_path, monkeypatch, capsys):
    from fastbert.cli import main
    monkeypatch.setenv("FASTBERT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "checkout").mkdir()
    monkeypatch.chdir(tmp_path / "checkout")  # as from a clone's root: nothing is written where it runs
    assert main(["bench", "--smoke", "--only", "^layer_norm/.* torch$", "--no-progress"]) == 0
    assert os.listdir(tmp_path / "checkout") == []
    written = os.listdir(tmp_path / "cache" / "bench")
    assert len(written) == 1 and written[0].startswith("smoke-") and written[0].endswith(".json")
    assert capsys.readouterr().out.splitlines()[0] == runner.SMOKE_CAVEAT


def test_compile_summary_is_the_gates_verdict_and_each_kernels_worst_case():
    from fastbert.bench import compile_audit
    with open(glob.glob(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "compile-*.json"))[0],
              encoding="utf-8") as f:
        rows = json.load(f)
    kernels = {r["kernel"] for r in rows}
    lines = compile_audit.summary(rows).splitlines()
    assert lines[0] == f"gates over {len(rows)} compiled kernels: compiles: pass, warpgroup MMA: pass, no spill: " \
                       "pass, shared memory: pass, exact fp32: pass"
    assert len(lines) == 2 + len(kernels)  # the verdict, the header, one line per kernel
    spilling = next(r for r in rows if r["dtype"] == "bfloat16" and r["kernel"] == "_layer_norm_fwd_kernel")
    spilling["spill_store_bytes"] = 12345
    lines = compile_audit.summary(rows).splitlines()
    assert "no spill: FAILS (1)" in lines[0]
    assert " 12345 " in next(line for line in lines if line.startswith("_layer_norm_fwd_kernel "))


def test_report_says_what_is_not_measured(smoke, tmp_path):
    path, rows = smoke
    text = report.render(rows, plots_dir=None)
    assert "not yet measured" in text.lower() and "benchmarks/run_gpu.sh" in text
    # smoke rows are not results: no measured table, no peak, no target verdict comes from them
    assert "fastbert vs fastbert-eager" not in text and "ms/step" not in text
    assert "No peaks measured yet." in text and "| yes |" not in text and "| no |" not in text


def test_report_tables_carry_provenance(smoke):
    _, rows = smoke
    text = report.render(rows, plots_dir=None, suites=("smoke",))
    assert "layer_norm" in text and "fastbert-eager" in text and "hf-sdpa" in text
    assert rows[0]["commit"][:10] in text and rows[0]["device"] in text and "fastbert bench --smoke" in text


def test_ffn_form_section_names_the_faster_form_only_when_measured():
    from fastbert.bench.report import ffn_form_lines
    assert "not yet measured" in "\n".join(ffn_form_lines({}))
    rows = [{"op": "ffn_up", "direction": "fwd+bwd", "status": "ok", "shape": {"rows": 16384, "hidden": 768},
             "provider": provider, "median_ms": ms} for provider, ms in (("fastbert", 1.25), ("fastbert-split", 1.0))]
    table = ffn_form_lines({("gpu", "H100"): rows})
    assert table[-1].endswith("| 1.250 | 1.000 | fastbert-split |")
    assert not any("not yet measured" in line for line in table)


def test_data_suite_rows_and_their_verdict(tmp_path, monkeypatch):
    """The data suite's loader row on a small dataset (CPU time per batch, sequences per CPU-second),
    and PERF.md's verdict on issue 13's targets, taken from the slowest row of each length."""
    from fastbert.bench import data_suite
    monkeypatch.setattr(data_suite, "EXAMPLES", 400)
    monkeypatch.setattr(data_suite, "SHARDS", 8)
    dataset = data_suite.write_dataset(str(tmp_path), 128)
    assert len(dataset) == 400 and len(dataset.metadata["shards"]) == 8
    row = data_suite.loader_row(dataset, batch=16, whole_word=True, threads=1)
    assert row["p20_ms"] <= row["median_ms"] <= row["p80_ms"] and row["median_ms"] > 0
    assert row["sequences_per_cpu_s"] == pytest.approx(16 / row["median_ms"] * 1e3)
    slow = {**row, "shape": {**row["shape"], "batch": 32}, "sequences_per_cpu_s": 24_000.0, "median_ms": 32 / 24.0}
    fast = {**row, "sequences_per_cpu_s": 90_000.0}
    text = "\n".join(report.data_lines([fast, slow]))
    assert "| S=128: >= 25,000 | 24,000 | no |" in text and "| S=512: >= 6,300 | not yet measured | - |" in text
    assert "| S=128: >= 25,000 | 90,000 | yes |" in "\n".join(report.data_lines([fast]))


def test_modernbert_flops_count_the_geglu_and_the_windows():
    """ModernBERT's encoder FLOPs: the matmuls as FlopCounterMode counts them on the reference path (windows
    wider than the sequence, attention on matmuls through output_attentions), and a window's (query, key)
    pairs as a brute-force count."""
    from torch.utils.flop_counter import FlopCounterMode

    from fastbert.modernbert import ModernBertModel
    from fastbert.train.metrics import attention_pairs, encoder_flops
    from fastbert.family_config import ModernBertConfig

    config = ModernBertConfig.tiny(hidden_size=32, intermediate_size=48, local_attention=64, backend="torch")
    model = ModernBertModel(config).eval()
    ids = torch.randint(3, 1024, (2, 9), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids, output_attentions=True)
    assert counter.get_total_flops() == encoder_flops(config, torch.tensor([9, 9]), pooler=False)
    for length in (1, 5, 20):
        for window in (0, 2, 30):
            pairs = sum(abs(i - j) <= window for i in range(length) for j in range(length))
            assert attention_pairs(torch.tensor([length]), window) == pairs
    narrow = ModernBertConfig.tiny(local_attention=4)  # two local layers of window 2 out of three
    lengths = torch.tensor([9])
    assert (encoder_flops(ModernBertConfig.tiny(local_attention=64), lengths, pooler=False)
            - encoder_flops(narrow, lengths, pooler=False)) == 2 * 4 * 128 * (81 - attention_pairs(lengths, 2))


def test_gpu_suite_measures_the_whole_model_comparisons_first():
    """What users compare first comes first, so a short budget still yields it: BERT-base training and inference,
    fastbert against transformers' SDPA, then against SDPA + torch.compile, then every op's rows."""
    items = runner.work_items("gpu")
    first_op = next(i for i, item in enumerate(items) if isinstance(item.case, op_cases.OpCase))
    headline = [item for item in items[:first_op] if isinstance(item.case, model_cases.ModelCase)]
    assert len(headline) == first_op  # nothing but models before the first op
    providers = {(item.case.name, item.provider) for item in headline}
    for case in model_cases.gpu_model_cases():
        if case.size == "base" and case.mode in ("train", "inference") and case.trainable == "all":
            for provider in {model_cases.FASTBERT, model_cases.HF_SDPA, model_cases.HF_COMPILE} & set(case.providers):
                assert (case.name, provider) in providers, (case.name, provider)
    assert "train/base,batch=256,seqlen=128,bitfit" in {item.case.name for item in items[first_op:]}  # after them
    assert ("train/base,batch=256,seqlen=128", model_cases.HF_COMPILE) in providers
    compiled = [i for i, item in enumerate(headline) if item.provider == model_cases.HF_COMPILE]
    assert min(compiled) == len(headline) - len(compiled)  # the compiles (a minute each) after the rest
    assert {item.case.size for item in headline} == {"base"}
    assert model_cases.HF_EAGER not in {item.provider for item in headline}


def _h100_row(op, shape, provider, direction, ms, dtype="bfloat16"):
    case = f"{op}/" + ",".join(f"{k}={v}" for k, v in shape.items())
    return {"suite": "gpu", "device": "NVIDIA H100 80GB HBM3", "device_type": "cuda", "date": "2026-01-01",
            "op": op, "case": case, "shape": shape, "dtype": dtype, "provider": provider, "direction": direction,
            "status": "ok", "median_ms": ms}


def test_summary_and_op_tables_mark_the_path_auto_runs():
    """The committed table chooses cuBLAS's QKV projection at 32 x 512 x 768 on sm_90 for training and the Triton
    MLM loss: the terminal summary stars those providers' rows and PERF.md's per-op tables mark them "(auto)"."""
    shape = {"batch": 32, "seqlen": 512, "hidden": 768, "heads": 12}
    rows = [_h100_row("qkv_projection", shape, p, "fwd+bwd", ms) for p, ms in
            (("fastbert", 0.9), (op_cases.EAGER, 0.58), (op_cases.TORCH, 0.6))]
    starred = [line.split()[1] for line in runner.summary(rows).splitlines()[1:] if line.split()[2] == "*"]
    assert starred == [op_cases.EAGER]
    table = "\n".join(report.op_section("qkv_projection", rows))
    assert "0.580 ms (auto)" in table and table.count("(auto)") == 1
    mlm = {"batch": 32, "seqlen": 512, "hidden": 768, "vocab": 30522, "labelled": 0.15}
    rows = [_h100_row("mlm_head", mlm, p, "fwd", 1.0) for p in ("fastbert", op_cases.EAGER)]
    fastbert_cell = "\n".join(report.op_section("mlm_head", rows)).split("| fwd |")[1].split("|")[0]
    assert fastbert_cell.strip() == "1.000 ms (auto)"


def test_rows_name_a_table_other_than_the_committed_one(smoke, tmp_path):
    """A run whose "auto" chose from a table FASTBERT_PATHS named (a GPU session's own) says so in its rows and in
    PERF.md's provenance line; the committed table's rows name none."""
    _, rows = smoke
    assert {row["paths_table"] for row in rows} == {None}
    table = tmp_path / "paths.json"
    table.write_text(open(paths.COMMITTED_TABLE_PATH, encoding="utf-8").read())
    code = ("import torch; from fastbert.bench.provenance import provenance; "
            "print(provenance(torch.device('cpu'))['paths_table'])")
    own = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FASTBERT_PATHS": str(table)},
                         capture_output=True, text=True, timeout=300)
    assert own.stdout.strip().startswith(f"{table} (sha256 "), own.stderr
    line = report.provenance_line([{**rows[0], "paths_table": own.stdout.strip()}])
    assert f'backend "auto" chose from {own.stdout.strip()} (FASTBERT_PATHS)' in line
    assert "FASTBERT_PATHS" not in report.provenance_line(rows)


def test_op_cases_call_without_a_host_sync():
    """The op cases' PyTorch-path providers, forward and backward, never make the host wait for the device
    (fastbert.host_syncs' counter, on CPU), so that the GPU suite times their GPU work alone; the Triton ones
    share their code outside the kernels (whose interpreter here reads tensors on the host)."""
    from fastbert.host_syncs import HostSyncCounter
    for case in op_cases.smoke_op_cases():
        for provider in (op_cases.EAGER, op_cases.TORCH):
            make_run, _ = runner.op_runs(case, provider, torch.device("cpu"))
            run = make_run("fwd+bwd")
            with HostSyncCounter() as counter:
                run()
            assert counter.syncs == 0, (case.name, provider, counter.calls)


def test_a_short_budget_measures_bert_bases_classes_first():
    """The GPU suite's op items run in case order and a budget cuts the last: the cases of every class BERT-base's
    paths are chosen from (its widths, its MLM head, attention without padding at 128 and 512) come first."""
    ops = [item.case for item in runner.work_items("gpu") if isinstance(item.case, op_cases.OpCase)]
    names = list(dict.fromkeys(case.name for case in ops))
    bert_base = [name for name in names
                 if re.search(r"hidden=768|features=3072|seqlen=(128|512),heads=32,head_dim=64,padding=0.0,d", name)]
    assert len(bert_base) == 7 and names[:7] == bert_base


def test_floors_are_the_cases_counts_over_the_h100s_peaks():
    """LayerNorm at 16384 x 768 in bf16 moves 3 x 25,165,824 bytes forward: 25.2 us at 3.0 TB/s; the QKV
    projection at 32 x 512 x 768 is 2 x 16384 x 768 x 2304 FLOPs forward: 73.4 us at 790 TFLOP/s. Each provider's
    time is read against its case's floor; without an H100 run the measured side is not yet measured."""
    from fastbert.bench import floors

    cases = {c.name: c for c in op_cases.gpu_op_cases()}
    layer_norm = cases["layer_norm/rows=16384,hidden=768,dropout_p=0.1"]
    qkv = cases["qkv_projection/batch=32,seqlen=512,hidden=768,heads=12"]
    assert floors.floor_ms(layer_norm, "fwd") == (pytest.approx(3 * 16384 * 768 * 2 / 3.0e12 * 1e3), "memory")
    assert floors.floor_ms(qkv, "fwd+bwd") == (pytest.approx(3 * 2 * 16384 * 768 * 2304 / 790e12 * 1e3), "compute")
    assert all(floors.floor_ms(c, d)[0] > 0 for c in cases.values() for d in op_cases.DIRECTIONS)
    assert "not yet measured" in "\n".join(floors.floors_section({}))
    floor = floors.floor_ms(layer_norm, "fwd")[0]
    row = _h100_row("layer_norm", layer_norm.shape, "fastbert", "fwd", 2 * floor)
    text = "\n".join(floors.floors_section({("gpu", row["device"]): [row]}))
    assert f"| layer_norm rows=16384,hidden=768,dropout_p=0.1 | fwd | memory | {1e3 * floor:,.1f} us | " \
           f"{2e3 * floor:,.1f} us (2.0x) |" in text
    assert sum(line.startswith("| ") for line in text.splitlines()) == 1 + len(cases) * len(op_cases.DIRECTIONS)


def test_perf_md_has_the_path_table_and_the_floors_beside_its_sections():
    rows = report.load_rows(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results"))
    text = report.render(rows, plots_dir=None)
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    for heading in ("## Status", "## Peak references", "## Targets", "## The FFN up-projection's form",
                    "## The faster path per op (issue 26)", "## Floors (issue 26)"):
        assert heading in headings, heading
    assert "Read with care" in text and "| layer_norm | tokens=16384,hidden=768 | bfloat16 |" in text


THIRD_H100_RUN = "gpu-NVIDIA-H100-80GB-HBM3-20261127T143638Z.json"


def test_perf_md_judges_issue_25s_targets_by_the_model_rows():
    """Each of issue 25's whole-model targets reads a (case, provider) the GPU suite runs, and PERF.md's Targets table
    judges it from the rows: the third H100 run's default forward at 32 x 128 (5.9 ms) misses 2.8 ms, its graphs and
    training step meet theirs, and the applied model's step (65.3 ms) is within fastbert's (65.2, p80 65.6)."""
    suite = {(case.name, provider) for case in model_cases.gpu_model_cases() for provider in case.providers}
    assert all((case, provider) in suite for case, provider, _, _ in report.MODEL_TARGETS)
    with open(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", THIRD_H100_RUN)) as f:
        rows = json.load(f)
    lines = [line for line in report.targets({("gpu", rows[0]["device"]): rows}) if line.startswith("| BERT-base ")]
    assert [line.rstrip(" |").rsplit("| ", 1)[1] for line in lines] == ["no", "yes", "yes", "yes", "yes"]
    assert "| 5.9 ms on NVIDIA H100 80GB HBM3 |" in lines[0] and "| 0.726 ms on" in lines[2]


def test_issue_25s_targets_judge_each_gpu_by_its_own_rows():
    """A second GPU's rows get their own verdicts, the applied model's against that GPU's fastbert row: slower than
    its 80th percentile is slower."""
    def row(device, case, provider, median, p80=None):
        return {"op": "model", "status": "ok", "device": device, "case": case, "provider": provider,
                "median_ms": median, "p20_ms": median, "p80_ms": median if p80 is None else p80}
    train = "train/base,batch=256,seqlen=128"
    rows = [row("A", train, "fastbert", 60.0, 60.5), row("A", train, "fastbert-apply", 60.4),
            row("B", train, "fastbert", 75.0, 75.2), row("B", train, "fastbert-apply", 75.3)]
    checks = report.model_targets(rows)
    judged = {(text.split(": ")[0], measured.rsplit(" on ", 1)[1]): met for text, (measured, met) in
              (c for c in checks if c[1] is not None)}
    step, applied = ("BERT-base bf16 pretraining step 256 x 128, default arguments",
                     "BERT-base bf16 pretraining step 256 x 128 after fastbert.apply")
    assert judged == {(step, "A"): True, (step, "B"): False, (applied, "A"): True, (applied, "B"): False}
    assert sum(verdict is None for _, verdict in checks) == 3  # the inference targets: not measured


@pytest.mark.parametrize("provider", [model_cases.FASTBERT, model_cases.APPLY, model_cases.HF_SDPA])
def test_model_providers_run_the_defaults_and_share_the_mlm_budget(provider):
    """fastbert's class and the applied transformers model run fastbert's default backend and read the MLM head on
    the same static budget of positions (the batch's most labelled); transformers' own model has no fastbert config."""
    case = model_cases.ModelCase("train", "tiny", 3, 16, True, (provider,))
    run = model_cases.ProviderRun(case, provider, torch.device("cpu"))
    config = fastbert.in_place.fastbert_config(run.model)
    _, data = run.step_for(case.batch, case.padded)
    assert data["backend"] == model_cases.provider_backend(provider, case.config)  # what an unmeasured row names
    if provider == model_cases.HF_SDPA:
        assert config is None and data["backend"] is None
        return
    assert data["backend"] == config.backend == fastbert.BertConfig().backend
    assert 0 < data["most_labelled"] == config.max_predictions_per_seq
    if provider == model_cases.APPLY:  # the head's fused loss reads the base's config: the budget reaches it
        assert vars(run.model)[fastbert.in_place.ACCELERATED_HEAD].config is config


def test_model_rows_name_their_backend_measured_or_not(tmp_path):
    """A model row the time budget skipped names the backend its provider would have run, as a measured row does:
    the report labels it by that, not by the backend of rows measured before rows named one."""
    _, rows = runner.run_suite("smoke", str(tmp_path), budget_s=0.0, progress=False)
    skipped = [r for r in rows if r.get("op") == "model"]
    assert skipped and all(r["status"] == "skipped" for r in skipped)
    assert all(r["backend"] == {"fastbert-eager": "torch"}.get(r["provider"]) for r in skipped), skipped
    # fastbert's own provider (a GPU suite's) runs "auto": labelled so, not by the rows before the field ("triton")
    row = {"provider": model_cases.FASTBERT, "backend": model_cases.provider_backend(model_cases.FASTBERT,
                                                                                   fastbert.BertConfig.tiny())}
    assert report._model_provider(row) == "fastbert [auto]"


def test_each_case_stands_from_its_newest_measuring_run():
    """A short run that measured a few cases replaces those cases alone, whole: no table mixes two runs' rows of
    one case, an older run's measured case outlives a newer run's skipped row, and the tables name each row's run."""
    from fastbert.bench.runs import newest_per_case

    def row(date, case, provider, status="ok", ms=1.0):
        return {"date": date, "case": case, "provider": provider, "status": status, "median_ms": ms}

    old, new = "2026-01-01T00:00:00+00:00", "2026-02-01T00:00:00+00:00"
    rows = [row(old, "op/a", "fastbert", ms=2.0), row(old, "op/a", "torch"), row(old, "op/b", "fastbert"),
            row(old, "op/c", "fastbert", "skipped"), row(new, "op/a", "fastbert"), row(new, "op/b", "fastbert", "skipped"),
            row(new, "op/d", "fastbert", "error")]
    kept = newest_per_case(rows)
    assert sorted((r["case"], r["provider"], r["date"]) for r in kept) == [
        ("op/a", "fastbert", new), ("op/b", "fastbert", old), ("op/c", "fastbert", old), ("op/d", "fastbert", new)]
    provenance = dict(device="GPU", device_type="cuda", torch="2", triton="3", transformers="5", commit="abc",
                      command="fastbert bench", timer="events")
    table = "\n".join(report.op_section("op", [{**provenance, **r, "op": "op", "direction": "fwd"} for r in kept]))
    assert "| a (a) | fwd |" in table and "| b (b) | fwd |" in table  # (a) the newest run
    line = report.provenance_line([{**provenance, **r} for r in kept])
    assert "in 2 runs" in line and f"(a) torch 2, triton 3, transformers 5; commit abc; {new}" in line


@pytest.mark.parametrize("case", [op_cases.layer_norm_case(8, 768, torch.float32),
                                  op_cases.mlm_head_case(1, 8, 768, 64, torch.float32)], ids=lambda c: c.op)
def test_layer_norm_weights_of_the_op_cases_are_a_models(case):
    """The LayerNorm weights the op cases time with are near one, as a model's: none below the Triton kernel's
    MIN_WEIGHT, whose backward is exact for at most SIDE_COLUMNS such columns (standard normal weights put 139
    of 768 there, and the backward the GPU suite timed returned NaN)."""
    from fastbert.kernels.layer_norm import MIN_WEIGHT

    inputs = case.make_inputs(torch.device("cpu"))
    weight = inputs["weight" if case.op == "layer_norm" else "ln_weight"]
    assert weight.abs().min() >= MIN_WEIGHT


def test_bench_only_that_is_no_regex_or_selects_nothing_is_a_message_before_any_work(tmp_path, capsys):
    """--only is compiled up front (re.error is not a ValueError: it was a traceback), and one that selects no
    item is refused rather than a run of the two peak rows alone that exits 0."""
    from fastbert.cli import main
    for only, message in (("[", "--only '[': not a regular expression (unterminated character set at position 0)"),
                          ("zzzznomatch", "--only 'zzzznomatch' matches no item of the smoke suite")):
        assert main(["bench", "--only", only, "--out", str(tmp_path / "out"), "--quiet", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"fastbert bench: error: {message}" in err and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("budget", ["-5", "0", "nan", "inf"])
def test_bench_budget_must_be_a_finite_positive_time(tmp_path, capsys, budget):
    """0 or less skipped every item and exited 0; NaN (every comparison false) and inf meant no budget at all."""
    from fastbert.cli import main
    assert main(["bench", "--budget", budget, "--out", str(tmp_path / "out"), "--quiet", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--budget must be a finite number of seconds > 0, got {float(budget)}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_bench_out_that_is_or_is_under_a_file_names_out_and_the_file(tmp_path, capsys):
    """Not os.makedirs's bare "[Errno 17] File exists", and the file is left as it was."""
    from fastbert.cli import main
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me\n")
    for out, message in ((notes, f"--out {notes} is a file"),
                         (notes / "sub", f"--out {notes / 'sub'}: {notes} is a file")):
        assert main(["bench", "--only", "^layer_norm/.* torch$", "--out", str(out), "--quiet", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"fastbert bench: error: {message}" in err and "Errno" not in err and "Traceback" not in err, err
    assert notes.read_text() == "keep me\n"
