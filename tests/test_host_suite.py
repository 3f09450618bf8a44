"""`fastbert bench --suite host` (what CI runs of it, --quick) and the stubbed launches it stands on: rows for every
op and model beside their comparison, the models' default forwards and steps without host syncs, and nothing left
behind when the stubs go. The suite times Triton's compiled-kernel path, so it runs in a process of its own without
the interpreter that tests/conftest.py sets."""
import json
import os
import subprocess
import sys

import pytest

from fastbert.bench import host_report, host_suite, report
from fastbert.bench.compile_audit import GPU_ENVIRONMENT_TRITON, GPU_ENVIRONMENT_TRITON_DIR

STUBS_AND_BACK = """
import os, sys, torch, triton
from fastbert import ops
from fastbert.simulated.host_time import host_microseconds, stubbed_launches
x, weight, bias = inputs = torch.randn(4, 32), torch.ones(32), torch.zeros(32)
before = triton.runtime.driver._active
denormal = torch.tensor([1e-40])  # float32's smallest normal is 1.2e-38
from triton.backends.nvidia.driver import CudaLauncher
from fastbert.simulated import stand_in_gpu
handed, launcher_runs = [], []
launcher = stand_in_gpu._STUB_RUN
launcher.launch = lambda *args: handed.append(args)  # the C launch of Triton's launcher object
# a value of its own in each place of the launcher's head, so that a head in another order differs
stand_in_gpu._StubKernel.function, stand_in_gpu._StubKernel.packed_metadata = "function", ("packed", "metadata")
launcher.launch_cooperative_grid, launcher.launch_pdl, launcher.arg_annotations = "cooperative", "pdl", ("annotated",)
def same(triton_own, direct):
    # what Triton's launcher handed its C launch, and fastbert's direct call: a plain tensor as its address
    if type(triton_own) is tuple:
        return type(direct) is tuple and len(direct) == len(triton_own) and all(map(same, triton_own, direct))
    if isinstance(triton_own, torch.Tensor):  # an input's address; the output's differs from call to call
        return type(direct) is int and (direct == triton_own.data_ptr() or all(t is not triton_own for t in inputs))
    if isinstance(triton_own, triton.knobs.HookChain):  # no launch hook installed: fastbert hands None
        return direct is None and not triton_own.calls
    return direct is triton_own or direct == triton_own
with stubbed_launches():
    assert type(stand_in_gpu._STUB_RUN) is CudaLauncher
    # a signature's first launch makes the stub, the second is Triton's own; the third, steady, calls the C launch
    # directly, without the launcher's Python
    for _ in range(2):
        assert ops.layer_norm(x, weight, bias, backend="triton").shape == x.shape
    sys.setprofile(lambda frame, event, arg: launcher_runs.append(1) if event == "call"
                   and frame.f_code is CudaLauncher.__call__.__code__ else None)
    ops.layer_norm(x, weight, bias, backend="triton")
    sys.setprofile(None)
    assert len(handed) == 2 and not launcher_runs and same(*handed), handed
    from fastbert.kernels import launch
    assert (launch._C_LAUNCH is None) == (os.environ.get("FASTBERT_PYTHON_LAUNCH") == "1")
    # a launcher that allocates per launch (scratch memory) or runs GSan is called, its layout not learnt
    import copy
    for field in ("global_scratch_size", "profile_scratch_size", "gsan_enabled"):
        refused = copy.copy(launcher)
        setattr(refused, field, 1)
        assert launch._direct_launch(refused, (None,) * 5, 3) is None, field
    assert launch._direct_launch(copy.copy(launcher), (None,) * 5, 3) is not None
    assert host_microseconds(lambda: ops.layer_norm(x, weight, bias, backend="triton"), number=2, repeats=1) > 0
    assert (denormal * 1).item() == 0  # flushed: unwritten outputs cost PyTorch's ops what real values cost
assert triton.runtime.driver._active is before
assert (denormal * 1).item() == denormal.item() != 0
try:
    ops.layer_norm(x, weight, bias, backend="triton")
except RuntimeError as exc:
    assert "needs CUDA tensors" in str(exc)
else:
    raise AssertionError("the kernels took CPU tensors after the stubs were gone")
print(triton.__version__)
"""


def _compiled_path(code: str, *args: str, cwd=None, python_launch=False,
                   triton_dir=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTBERT_PYTHON_LAUNCH")}
    if python_launch:  # kernels/launch.py's Python path in place of its C launch
        env["FASTBERT_PYTHON_LAUNCH"] = "1"
    if triton_dir is not None:  # another Triton, installed apart (the README's set-up)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (triton_dir, env.get("PYTHONPATH"))))
    return subprocess.run([sys.executable, *args] if not code else [sys.executable, "-c", code], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_every_case_has_a_comparison():
    cases = host_suite.host_cases()
    ops_measured = {case.op for case in cases}
    assert {"layer_norm", "bias_gelu", "linear_bias_gelu", "feed_forward", "qkv_projection", "attention",
            "attention_varlen", "linear_cross_entropy", "dropout", "model"} == ops_measured
    for case in cases:
        assert set(case.providers) in ({host_suite.FASTBERT, host_suite.CUSTOM_OP, host_suite.TORCH},
                                       {host_suite.FASTBERT, host_suite.H100_AUTO, host_suite.TORCH_PATH,
                                        host_suite.HF_SDPA}), case.name


def test_the_quick_suite_writes_rows_perf_reads(tmp_path):
    done = _compiled_path("", "-m", "fastbert.bench", "--suite", "host", "--quick", "--out", str(tmp_path),
                          "--no-progress", "--only", "^(layer_norm|dropout|model/base)")
    assert done.returncode == 0, done.stderr
    (path,) = tmp_path.glob("host-*.json")
    rows = json.loads(path.read_text())
    assert {(r["op"], r["provider"], r["direction"]) for r in rows} == {
        (op, provider, direction) for op, providers in (("layer_norm", ("fastbert", "fastbert-custom-op", "torch")),
                                                        ("dropout", ("fastbert", "fastbert-custom-op", "torch")),
                                                        ("model", ("fastbert", "fastbert-h100", "fastbert-eager",
                                                                   "hf-sdpa")))
        for provider in providers for direction in host_suite.DIRECTIONS}
    assert all(r["status"] == "ok" and r["host_us"] > 0 and r["suite"] == "host" for r in rows)
    # issue 25: fastbert's default forward and training step make the host wait zero times
    assert [r["host_syncs"] for r in rows if r["op"] == "model" and r["provider"] != "hf-sdpa"] == [0] * 6
    assert "model/base" in done.stdout and "ratio" in done.stdout
    section = "\n".join(host_report.host_section(rows, report.provenance_line))
    assert section.count("| model/base") == 6 and "fastbert bench --suite host" in section


def test_perf_md_sets_the_gpu_hosts_time_of_each_fastbert_call_beside_its_comparison():
    """PERF.md's table of the host's time on a real GPU (the GPU suite's host_ms): the newest GPU's rows, each case
    from its newest run (labelled by run), fastbert's providers beside PyTorch's op or transformers' model, judged by
    issue 25's limits (1.5x for an op, 1x for a model); another GPU's rows and other providers are left out."""
    import torch

    from fastbert.bench.provenance import provenance

    common = {**provenance(torch.device("cpu"), ["fastbert", "bench", "--suite", "gpu"]), "suite": "gpu",
              "device": "NVIDIA H200", "status": "ok", "timer": "CUDA events"}
    figures = [("2026-12-02", "layer_norm/rows=8", "layer_norm", "fwd", "fastbert", 0.012, 0.05),
               ("2026-12-02", "layer_norm/rows=8", "layer_norm", "fwd", "torch", 0.010, 0.04),
               ("2026-12-02", "inference/base", "model", "inference", "fastbert", 4.1, 1.8),
               ("2026-12-02", "inference/base", "model", "inference", "fastbert-triton", 2.6, 2.0),
               ("2026-12-02", "inference/base", "model", "inference", "hf-eager", 6.0, 2.5),
               ("2026-12-02", "inference/base", "model", "inference", "hf-sdpa", 5.5, 2.2),
               ("2026-12-01", "bias_gelu/rows=8", "bias_gelu", "fwd", "fastbert", 0.020, 0.03),
               ("2026-12-01", "bias_gelu/rows=8", "bias_gelu", "fwd", "torch", 0.010, 0.03),
               ("2026-12-01", "layer_norm/rows=8", "layer_norm", "fwd", "fastbert", 0.5, 0.05),
               ("2026-12-01", "layer_norm/rows=8", "layer_norm", "fwd", "torch", 0.010, 0.04)]
    rows = [{**common, "date": date, "case": case, "op": op, "direction": direction, "provider": provider,
             "host_ms": host, "device_ms": device_ms, "median_ms": device_ms + host}
            for date, case, op, direction, provider, host, device_ms in figures]
    older_gpu = [{**row, "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-27", "case": "dropout/rows=8"}
                 for row in rows[:2]]
    untimed = {**rows[1], "host_ms": None, "case": "dropout/rows=8"}  # a row of a run before host_ms
    lines = host_report.gpu_host_lines([*rows, *older_gpu, untimed], report.provenance_line)
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| case")]
    assert table == ["| layer_norm/rows=8 (a) | fwd | fastbert | 12.0 | 10.0 (torch) | 1.20 | yes | 50.0 |",
                     "| inference/base (a) | inference | fastbert | 4,100.0 | 5,500.0 (hf-sdpa) | 0.75 | yes "
                     "| 1,800.0 |",
                     "| inference/base (a) | inference | fastbert-triton | 2,600.0 | 5,500.0 (hf-sdpa) | 0.47 | yes "
                     "| 2,000.0 |",
                     "| bias_gelu/rows=8 (b) | fwd | fastbert | 20.0 | 10.0 (torch) | 2.00 | **no** | 30.0 |"]
    assert "NVIDIA H200 in 2 runs" in lines[-2]
    assert host_report.gpu_host_lines([untimed], report.provenance_line)[-2].startswith("Not yet measured")


@pytest.mark.parametrize("python_launch,triton_dir", [(False, None), (True, None), (False, GPU_ENVIRONMENT_TRITON_DIR)],
                         ids=["C launch", "Python launch", "Triton of the GPU runs"])
def test_stubbed_launches_leave_nothing_behind(python_launch, triton_dir):
    """Inside, backend="triton" takes CPU tensors and launches nothing, a steady launch calls the C launch of
    Triton's launcher object with what that object would hand it (kernels/launch.py's _direct_launch; through the
    C launch cache, through its Python path, and with the Triton the GPU runs have, whose launcher hands the
    kernel's arguments one by one), and denormals are flushed to zero; after, Triton's driver is what it was,
    denormals are kept and the kernels refuse CPU tensors again."""
    if triton_dir is not None and not os.path.isdir(triton_dir):
        pytest.fail(f"Triton {GPU_ENVIRONMENT_TRITON} is not installed in {triton_dir}: run the README's set-up "
                    f"(pip install --no-deps --target {triton_dir} triton=={GPU_ENVIRONMENT_TRITON})")
    done = _compiled_path(STUBS_AND_BACK, python_launch=python_launch, triton_dir=triton_dir)
    assert done.returncode == 0, done.stderr
    if triton_dir is not None:
        assert done.stdout.split()[-1] == GPU_ENVIRONMENT_TRITON


def test_the_interpreter_is_refused():
    """Under TRITON_INTERPRET=1 (this process) every kernel would run in numpy: the host cannot be timed."""
    from fastbert.kernels.numerics import INTERPRETER
    from fastbert.simulated.host_time import stubbed_launches

    if not INTERPRETER:
        pytest.skip("this process runs Triton's compiled kernels (a GPU): no interpreter to refuse")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"), stubbed_launches():
        pass


def test_compared_functions_take_turns():
    """The functions a ratio compares are timed in alternating runs (after each one's warm-up), so a slow spell
    of the machine falls on all of them; each gets its own least mean."""
    from fastbert.simulated.host_time import interleaved_host_microseconds

    calls = []
    figures = interleaved_host_microseconds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                            number=2, repeats=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert set(figures) == {"a", "b"} and all(0 <= us < float("inf") for us in figures.values())


def test_the_host_census_counts_exactly(tmp_path):
    # benchmarks/host_census.py: two runs give the same counts (what makes them worth comparing across commits),
    # launches only on the Triton path, Python autograd nodes only in fastbert's, no host sync in fastbert's calls
    counts = []
    for run in ("first", "second"):
        done = _compiled_path("", "benchmarks/host_census.py", "--size", "base", "--out", str(tmp_path / run),
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert done.returncode == 0, done.stderr
        (path,) = (tmp_path / run).glob("host-census-*.json")
        rows = json.loads(path.read_text())
        counts.append({(r["provider"], r["direction"]): {k: r.get(k) for k in (
            "python_calls", "c_calls", "launches", "backward_launches", "autograd_nodes", "python_nodes",
            "view_nodes", "host_syncs")} for r in rows})
    assert counts[0] == counts[1]
    by = counts[0]
    providers = ("fastbert", "fastbert-h100", "fastbert-eager", "hf-sdpa")
    assert set(by) == {(p, d) for p in providers for d in ("fwd", "fwd+bwd")}
    step = {provider: by[(provider, "fwd+bwd")] for provider in providers}
    assert step["fastbert"]["launches"] > step["fastbert"]["backward_launches"] > 0
    assert step["fastbert-eager"]["launches"] == step["hf-sdpa"]["launches"] == 0
    assert step["fastbert"]["python_nodes"] > 0 and step["hf-sdpa"]["python_nodes"] == 0
    assert all(by[(p, d)]["host_syncs"] == 0 for p in ("fastbert", "fastbert-h100") for d in ("fwd", "fwd+bwd"))
    assert step["fastbert-h100"]["launches"] > step["fastbert-h100"]["backward_launches"] > 0
    assert 0 < step["fastbert"]["autograd_nodes"] < step["hf-sdpa"]["autograd_nodes"]
    # PERF.md's table of the run: a line per provider and direction, under the run's provenance
    table = host_report.census_lines(rows, report.provenance_line)
    assert sum(line.startswith("| base (host suite widths) |") for line in table) == 8
    assert "benchmarks/host_census.py --size base" in table[-2] and "counted" in table[-2]
    # an output that cannot be written: one message naming it, exit code 2, no traceback
    (tmp_path / "a file").write_text("")
    done = _compiled_path("", "benchmarks/host_census.py", "--size", "base", "--out", str(tmp_path / "a file" / "x"),
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 2 and "a file" in done.stderr and "Traceback" not in done.stderr, done.stderr


H100_PATHS = """
import collections, json, sys, torch
import fastbert
from fastbert import ops
from fastbert.bench import host_suite
from fastbert.simulated.host_time import stubbed_launches
resolved, gates, real_resolve = collections.Counter(), collections.Counter(), ops.resolve_backend
real_gate = fastbert.modeling.one_node_sublayers
nodes, real_node = [], fastbert.sublayer._APPLY  # the attention sublayers run as one node
fastbert.sublayer._APPLY = lambda *args: nodes.append(1) or real_node(*args)
def spy(backend, *tensors, op=None, **kw):
    path = real_resolve(backend, *tensors, op=op, **kw)
    resolved[str(op), path] += 1
    return path
def gate(config, hidden):
    answer = real_gate(config, hidden)
    gates[answer] += 1
    return answer
ops.resolve_backend = spy
for module in list(sys.modules.values()):
    if getattr(module, "one_node_sublayers", None) is real_gate:
        module.one_node_sublayers = gate
seen = {}
for size, mode in host_suite.H100_SHAPES:
    resolved.clear()
    gates.clear()
    host_suite.h100_choices.__wrapped__(size, mode)  # the planned H100 call, at full width, on meta tensors
    planned = [sorted(resolved.items()), sorted(gates.items())]
    with stubbed_launches():
        call = host_suite._model_calls(size, host_suite.H100_AUTO)("fwd" if mode == "inference" else "fwd+bwd")
        call()
        resolved.clear()
        gates.clear()
        nodes.clear()
        call()
    layers = host_suite.model_config(size).num_hidden_layers
    seen[f"{size} {mode}"] = [planned, [sorted(resolved.items()), sorted(gates.items())], [len(nodes), layers]]
json.dump(seen, sys.stdout)
"""


def test_the_h100_rows_run_what_an_h100_runs():
    """A fastbert-h100 call resolves every op as the GPU suite's call that it stands for does on an H100 (planned on
    meta tensors, full width, bf16), the same implementations the same number of times, and its training step runs
    the sublayers as one autograd node each, as CUDA tensors do: its host time is that path's. (On the CPU tensors
    "auto" would run the reference throughout, op by op.) Each shape it stands for is one the GPU suite runs."""
    from fastbert.bench import model_cases

    gpu_cases = {(c.size, c.mode, c.batch, c.seqlen, c.padded) for c in model_cases.gpu_model_cases()}
    assert all((*call, *shape) in gpu_cases for call, shape in host_suite.H100_SHAPES.items())
    done = _compiled_path(H100_PATHS)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert set(seen) == {"base inference", "base train", "modernbert-base inference", "modernbert-base train"}
    for call, (planned, stubbed, (attention_nodes, layers)) in seen.items():
        assert planned == stubbed, call
        paths, gates = stubbed
        assert any(path != "torch" for (_, path), _ in paths), call  # the kernels run, not the CPU's reference
        assert gates == ([] if call.endswith("inference") else [[True, gates[0][1]]]), call
        # every layer's attention sublayer one node in training, the QKV projection's PyTorch path included
        assert attention_nodes == (0 if call.endswith("inference") else layers), call


def test_host_phases_split_a_step(tmp_path):
    # benchmarks/host_phases.py: each phase of each provider timed, the backward and the optimizer as the
    # differences of the phases that contain them; a bad --repeats is one message naming it before anything runs
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = _compiled_path("", "benchmarks/host_phases.py", "--size", "base", "--repeats", "1", "--out", str(tmp_path),
                          cwd=root)
    assert done.returncode == 0, done.stderr
    (path,) = tmp_path.glob("host-phases-*.json")
    rows = json.loads(path.read_text())
    us = {(r["provider"], r["phase"]): r["host_us"] for r in rows}
    phases = ("infer", "forward", "forward+backward", "step", "backward", "optimizer")
    assert set(us) == {(p, phase) for p in ("fastbert", "hf-sdpa") for phase in phases}
    for provider in ("fastbert", "hf-sdpa"):
        assert all(0 < us[(provider, phase)] < float("inf") for phase in phases[:4])
        assert us[(provider, "backward")] == us[(provider, "forward+backward")] - us[(provider, "forward")]
        assert us[(provider, "optimizer")] == us[(provider, "step")] - us[(provider, "forward+backward")]
    assert {r["derived"] for r in rows if r["phase"] in phases[4:]} == {True}
    assert all(r["commit"] and r["timer"] == host_suite.CPU_CLOCK for r in rows)
    done = _compiled_path("", "benchmarks/host_phases.py", "--repeats", "0", "--out", str(tmp_path / "none"), cwd=root)
    assert done.returncode == 2 and "--repeats must be at least 1, got 0" in done.stderr
    assert not (tmp_path / "none").exists()


def test_size_argument_forms_make_the_same_tensors():
    # benchmarks/size_arguments.py times each allocation and reshape with its sizes as one argument and one by
    # one, the second being what kernels/*.py and the layers use: both must make the same tensor
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "size_arguments.py")
    spec = importlib.util.spec_from_file_location("size_arguments", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for what, calls in module.pairs().items():
        one, many = calls["as one argument"](), calls["one by one"]()
        assert (one.shape, one.stride(), one.dtype) == (many.shape, many.stride(), many.dtype), what
