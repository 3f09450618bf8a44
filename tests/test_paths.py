"""fastbert.paths: the committed table of measured paths and the choice of backend="auto" on a GPU (shape classes,
the nearest class, dtype and architecture, explicit backends winning), the table's generation from the GPU suite's
rows (fastbert.bench.path_table), the FFN's cuBLAS form through fastbert.ops, and the choice under torch.compile.
No GPU here: meta tensors inside `paths.planned_architecture` stand for a GPU's, as in a memory plan."""
import json
import os
import subprocess
import sys

import pytest
import torch
from tolerance import FORWARD_FACTOR, GRADIENT_FACTOR, assert_within_rule

from fastbert import ops, paths, reference
from fastbert.bench import path_table


def _tensors(op, sizes, dtype, requires_grad):
    """The tensors ops.py hands resolve_backend for op at these sizes (meta: a GPU's stand-ins)."""
    def t(*shape, dtype=dtype):
        return torch.empty(shape, device="meta", dtype=dtype, requires_grad=requires_grad and dtype.is_floating_point)

    if op in ("layer_norm", "bias_gelu"):
        tokens, hidden = sizes
        return (t(tokens, hidden), t(hidden), t(hidden), t(tokens, hidden))[:4 if op == "layer_norm" else 2]
    if op in ("linear_bias_gelu", "feed_forward"):
        tokens, hidden, inner = sizes
        x, w1, b1 = t(tokens, hidden), t(inner, hidden), t(inner)
        return (x, w1, b1) if op == "linear_bias_gelu" else (x, w1, b1, t(hidden, inner), t(hidden))
    if op == "qkv_projection":
        tokens, hidden = sizes
        return t(tokens // 128, 128, hidden), t(3 * hidden, hidden), t(3 * hidden)
    if op == "attention":
        tokens, seqlen, head_dim = sizes
        q, k, v = (t(tokens // seqlen, 2, seqlen, head_dim) for _ in range(3))
        return q, k, v, None, None, None
    tokens, hidden, vocab = sizes  # linear_cross_entropy
    return t(tokens, hidden), t(vocab, hidden), t(vocab), t(tokens, dtype=torch.int64)


def _committed_choices():
    """(op, sizes, dtype, direction, chosen) of every entry of the committed table for sm_90."""
    with open(paths.TABLE_PATH, encoding="utf-8") as f:
        table = json.load(f)
    for op, classes in table["architectures"]["sm_90"]["ops"].items():
        for name, dtypes in classes.items():
            sizes = tuple(int(pair.split("=")[1]) for pair in name.split(","))
            for dtype, directions in dtypes.items():
                for direction, measured in directions.items():
                    yield op, sizes, getattr(torch, dtype), direction, measured["chosen"]


def _resolve(op, sizes, dtype, direction, capability=90, backend="auto"):
    tensors = _tensors(op, sizes, dtype, requires_grad=direction == "fwd+bwd")
    with paths.planned_architecture(capability), torch.set_grad_enabled(direction == "fwd+bwd"):
        return ops.resolve_backend(backend, *tensors, op=op)


@pytest.fixture
def fresh_choices(monkeypatch):
    """An empty choice cache (a test that replaces the table must not read choices of the committed one)."""
    monkeypatch.setattr(paths, "_CHOSEN", {})


def _grown(sizes):
    """The same class: each size a little above its class's least size, below the next half-octave."""
    return tuple(size + size // 8 for size in sizes)


def test_the_committed_table_has_every_op_and_a_choice_each_way():
    choices = list(_committed_choices())
    assert {op for op, *_ in choices} == set(paths.SIZES)
    assert {direction for *_, direction, _ in choices} == set(paths.DIRECTIONS)
    assert {chosen for *_, chosen in choices} <= set(paths.IMPLEMENTATIONS)


@pytest.mark.parametrize("op, sizes, dtype, direction, chosen", list(_committed_choices()),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_a_shape_class_maps_to_its_committed_implementation(op, sizes, dtype, direction, chosen):
    """Inference (no grad) reads the forward's rows, training the forward + backward's; any size within the class
    gets the class's choice. The FFNs read linear_bias_gelu's rows."""
    assert _resolve(op, sizes, dtype, direction) == chosen
    assert _resolve(op, _grown(sizes), dtype, direction) == chosen
    if op == "linear_bias_gelu":
        assert _resolve("feed_forward", sizes, dtype, direction) == chosen


def test_an_op_with_one_candidate_is_not_looked_up(monkeypatch):
    """The LayerNorm and the MLM loss have one candidate: "auto" returns it on every call without reading the
    shapes or the table (paths.choose), and it is what the table chooses for each of their committed classes."""
    assert paths.ONLY_CANDIDATE == {"layer_norm": "triton", "linear_cross_entropy": "triton"}
    looked_up = []
    monkeypatch.setattr(paths, "choose", lambda *args: looked_up.append(args[0]))
    committed = [choice for choice in _committed_choices() if choice[0] in paths.ONLY_CANDIDATE]
    assert {op for op, *_ in committed} == set(paths.ONLY_CANDIDATE)
    for op, sizes, dtype, direction, chosen in committed:
        assert _resolve(op, sizes, dtype, direction) == chosen == paths.ONLY_CANDIDATE[op]
    assert _resolve("qkv_projection", (16384, 768), torch.bfloat16, "fwd") is None  # the patch is what "auto" calls
    assert looked_up == ["qkv_projection"]


def test_the_committed_table_chooses_both_paths():
    """The first H100 run's rows: cuBLAS's QKV projection for training at hidden 768 and the kernel at 1024, the
    Triton bias + GELU for inference and PyTorch's for training, the Triton LayerNorm and MLM loss either way
    (no other candidate); these choices differ by direction and class, so both are read."""
    bf16 = torch.bfloat16
    assert _resolve("qkv_projection", (16384, 768), bf16, "fwd+bwd") == "torch"
    assert _resolve("qkv_projection", (16384, 1024), bf16, "fwd+bwd") == "triton"
    assert _resolve("bias_gelu", (16384, 3072), bf16, "fwd") == "triton"
    assert _resolve("bias_gelu", (16384, 3072), bf16, "fwd+bwd") == "torch"
    for direction in paths.DIRECTIONS:
        assert _resolve("layer_norm", (16384, 768), bf16, direction) == "triton"
        assert _resolve("linear_cross_entropy", (2458, 768, 30522), bf16, direction) == "triton"


def test_auto_chooses_only_what_keeps_the_kernels_saves(tmp_path):
    """An implementation that keeps more for the backward than the kernel (PyTorch's LayerNorm, the FFN's
    reference) is never a choice: a table naming one is refused, and building one from rows leaves it out even
    where it was measured faster."""
    with pytest.raises(ValueError, match="layer_norm .* chooses 'torch', not one of its candidates"):
        _table(tmp_path, {"sm_90": {"layer_norm": {"tokens=16384,hidden=768": {"bfloat16": {"fwd+bwd": "torch"}}}}})
    shape = {"rows": 16384, "hidden": 768, "dropout_p": 0.1}
    table = path_table.build_table([_row("layer_norm", shape, "fastbert", "fwd+bwd", 3.0),
                                    _row("layer_norm", shape, "fastbert-eager", "fwd+bwd", 1.0)])
    measured = table["architectures"]["sm_90"]["ops"]["layer_norm"]["tokens=16384,hidden=768"]["bfloat16"]
    assert measured["fwd+bwd"] == {"chosen": "triton", "ms": {"triton": 3.0}}


def test_explicit_backends_override_the_table(monkeypatch):
    """backend="triton" runs the kernel where the table chooses PyTorch's path, backend="torch" the reference
    where it chooses the kernel; so does FASTBERT_BACKEND for "auto"."""
    qkv, loss = (16384, 768), (2458, 768, 30522)
    assert _resolve("qkv_projection", qkv, torch.bfloat16, "fwd+bwd") == "torch"
    assert _resolve("qkv_projection", qkv, torch.bfloat16, "fwd+bwd", backend="triton") == "triton"
    assert _resolve("linear_cross_entropy", loss, torch.bfloat16, "fwd+bwd", backend="torch") == "torch"
    monkeypatch.setenv("FASTBERT_BACKEND", "triton")
    assert _resolve("qkv_projection", qkv, torch.bfloat16, "fwd+bwd") == "triton"


def _table(tmp_path, architectures):
    """A table file of {arch: {op: {class: {dtype: {direction: chosen}}}}}, loaded as lookups use it."""
    path = tmp_path / "paths.json"
    path.write_text(json.dumps({"architectures": {arch: {"source": {}, "ops": {
        op: {name: {dtype: {d: {"chosen": c, "ms": {}} for d, c in directions.items()}
                    for dtype, directions in dtypes.items()} for name, dtypes in classes.items()}
        for op, classes in entry.items()}} for arch, entry in architectures.items()}}))
    return paths.load(str(path))


def test_an_unknown_architecture_gets_the_nearest_measured_one(tmp_path, monkeypatch, fresh_choices):
    """sm_89 and sm_100 take sm_90's choice, sm_84 sm_80's; sm_85 is as near both and takes the older."""
    row = {"tokens=16384,hidden=768": {"bfloat16": {"fwd+bwd": "torch"}}}
    monkeypatch.setattr(paths, "TABLE", _table(tmp_path, {
        "sm_80": {"qkv_projection": {"tokens=16384,hidden=768": {"bfloat16": {"fwd+bwd": "triton"}}}},
        "sm_90": {"qkv_projection": row}}))
    for capability, chosen in ((89, "torch"), (100, "torch"), (84, "triton"), (85, "triton"), (90, "torch")):
        assert _resolve("qkv_projection", (16384, 768), torch.bfloat16, "fwd+bwd", capability) == chosen, capability


def test_missing_classes_dtypes_and_ops_fall_back(tmp_path, monkeypatch, fresh_choices):
    """An unmeasured class takes the nearest measured one (fewest half-octaves; a tie to the larger); fp16 reads
    bf16's rows; fp32, which no row measured, and an op without rows run the kernel."""
    monkeypatch.setattr(paths, "TABLE", _table(tmp_path, {"sm_90": {"qkv_projection": {
        "tokens=16384,hidden=768": {"bfloat16": {"fwd+bwd": "torch"}},
        "tokens=16384,hidden=3072": {"bfloat16": {"fwd+bwd": "triton"}}}}}))
    bf16 = torch.bfloat16
    assert _resolve("qkv_projection", (16384, 1024), bf16, "fwd+bwd") == "torch"  # 1 half-octave from 768, 3 from 3072
    assert _resolve("qkv_projection", (16384, 2048), bf16, "fwd+bwd") == "triton"  # 1 from 3072, 3 from 768
    assert _resolve("qkv_projection", (16384, 1536), bf16, "fwd+bwd") == "triton"  # 2 from each: the larger
    assert _resolve("qkv_projection", (64, 768), bf16, "fwd+bwd") == "torch"  # tokens far off; hidden decides
    assert _resolve("qkv_projection", (16384, 768), torch.float16, "fwd+bwd") == "torch"
    assert _resolve("bias_gelu", (16384, 768), torch.float32, "fwd+bwd") == "triton"
    assert _resolve("qkv_projection", (16384, 768), bf16, "fwd") == "triton"  # no forward rows
    assert _resolve("bias_gelu", (16384, 3072), bf16, "fwd+bwd") == "triton"


def test_auto_reads_the_autocast_dtype_for_matmul_ops(tmp_path, monkeypatch, fresh_choices):
    """fp32 inputs under bf16 autocast compute in bf16: the matmul-type ops read bf16's rows (bias + GELU, whose
    inputs autocast leaves as they are, keeps its own dtype)."""
    monkeypatch.setattr(paths, "TABLE", _table(tmp_path, {"sm_90": {
        "qkv_projection": {"tokens=16384,hidden=768": {"bfloat16": {"fwd+bwd": "torch"}}},
        "bias_gelu": {"tokens=16384,features=768": {"bfloat16": {"fwd+bwd": "torch"}}}}}))
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type: device_type == "cuda")
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.bfloat16)
    assert _resolve("qkv_projection", (16384, 768), torch.float32, "fwd+bwd") == "torch"
    assert _resolve("bias_gelu", (16384, 768), torch.float32, "fwd+bwd") == "triton"


def test_plain_meta_and_cpu_tensors_keep_the_reference():
    """Outside a plan, meta tensors (shape-only runs) and CPU tensors take the reference under "auto"."""
    x, w, b, r = _tensors("layer_norm", (16384, 768), torch.bfloat16, True)
    assert ops.resolve_backend("auto", x, w, b, r, op="layer_norm") == "torch"
    assert ops.resolve_backend("auto", torch.zeros(2, 3, dtype=torch.bfloat16), op="bias_gelu") == "torch"


def test_recorded_choices_are_what_auto_chose(tmp_path, monkeypatch, fresh_choices):
    """paths.recorded_choices holds each op's choice per direction in the calls made while entered (a choice
    cached before is looked up again; one after the cache overflowed is kept), and refuses an op that got two
    implementations in one direction: no one choice stands for it."""
    monkeypatch.setattr(paths, "TABLE", _table(tmp_path, {"sm_90": {"qkv_projection": {
        "tokens=16384,hidden=768": {"bfloat16": {"fwd+bwd": "torch", "fwd": "cublas_forward"}},
        "tokens=16384,hidden=3072": {"bfloat16": {"fwd+bwd": "triton"}}}}}))
    monkeypatch.setattr(paths, "CACHE_ENTRIES", 2)
    bf16 = torch.bfloat16
    assert _resolve("qkv_projection", (16384, 768), bf16, "fwd") == "cublas_forward"  # cached before
    with paths.recorded_choices() as recorded:
        assert _resolve("qkv_projection", (16384, 768), bf16, "fwd") == "cublas_forward"
        assert _resolve("qkv_projection", (16384, 768), bf16, "fwd+bwd") == "torch"
        assert _resolve("qkv_projection", (4096, 768), bf16, "fwd+bwd") == "torch"  # another class; the cache is full
        assert _resolve("layer_norm", (16384, 768), bf16, "fwd+bwd") == "triton"  # one candidate: never looked up
    assert recorded == {("qkv_projection", "fwd+bwd"): "torch", ("qkv_projection", "fwd"): "cublas_forward"}
    with pytest.raises(ValueError, match="qkv_projection .fwd.bwd. as both 'torch' and 'triton'"):
        with paths.recorded_choices():
            _resolve("qkv_projection", (16384, 768), bf16, "fwd+bwd")
            _resolve("qkv_projection", (16384, 3072), bf16, "fwd+bwd")
    with paths.recorded_choices() as recorded:  # the failed recording left nothing entered
        with pytest.raises(RuntimeError, match="already entered"), paths.recorded_choices():
            pass


def test_stubbed_cpu_tensors_run_the_recorded_choices(monkeypatch):
    """While the launches are stubbed (the host suite), "auto" on CPU tensors runs a GPU's recorded choices: the
    op's in the call's direction, the kernel for an op "auto" has no choice for; a call the choices do not hold is
    an error naming the op. An explicit backend and FASTBERT_BACKEND still win, meta tensors keep their own rule,
    and without choices, or once the stubs go (which forget them), "auto" runs the reference."""
    x, w, b = torch.zeros(4, 8, 8), torch.zeros(24, 8), torch.zeros(24)
    meta = [t.to("meta") for t in (x, w, b)]
    with pytest.raises(RuntimeError, match="needs stubbed launches"):
        ops.set_stubbed_auto({})
    ops.set_launches_stubbed(True)
    try:
        assert ops.resolve_backend("auto", x, w, b, op="qkv_projection") == "torch"
        assert not ops.auto_as_gpu(x)
        ops.set_stubbed_auto({("qkv_projection", "fwd"): "cublas_forward", ("feed_forward", "fwd+bwd"): "torch"})
        assert ops.auto_as_gpu(x) and not ops.auto_as_gpu(meta[0])
        assert ops.resolve_backend("auto", x, w, b, op="qkv_projection") == "cublas_forward"
        with pytest.raises(ValueError, match=r"op qkv_projection \(fwd\+bwd\)"):
            ops.resolve_backend("auto", x.requires_grad_(), w, b, op="qkv_projection")
        with torch.no_grad():
            assert ops.resolve_backend("auto", x, w, b, op="qkv_projection") == "cublas_forward"
        assert ops.resolve_backend("auto", x, op="layer_norm") == ops.resolve_backend("auto", x) == "triton"
        assert ops.resolve_backend("torch", x, w, b, op="qkv_projection") == "torch"
        assert ops.resolve_backend("auto", *meta, op="qkv_projection") == "torch"  # outside a plan, as ever
        with paths.planned_architecture(90):
            assert ops.auto_as_gpu(meta[0])
            assert ops.resolve_backend("auto", *meta, op="qkv_projection") == paths.choose(
                "qkv_projection", meta, torch.float32, 90)
        monkeypatch.setenv("FASTBERT_BACKEND", "torch")
        assert ops.resolve_backend("auto", x, w, b, op="qkv_projection") == "torch"
        monkeypatch.delenv("FASTBERT_BACKEND")
        ops.set_stubbed_auto(None)
        assert ops.resolve_backend("auto", x, w, b, op="qkv_projection") == "torch"
        ops.set_stubbed_auto({("qkv_projection", "fwd+bwd"): "cublas_forward"})
        ops.set_launches_stubbed(True)  # stubbing anew starts without choices
        assert ops.resolve_backend("auto", x, w, b, op="qkv_projection") == "torch" and not ops.auto_as_gpu(x)
    finally:
        ops.set_launches_stubbed(False)
    assert ops.resolve_backend("auto", x, w, b, op="qkv_projection") == "torch"


@pytest.mark.parametrize("size, bucket, least", [(1, 0, 1), (2, 2, 2), (3, 3, 3), (767, 18, 512), (768, 19, 768),
                                                 (1000, 19, 768), (1023, 19, 768), (1024, 20, 1024),
                                                 (30522, 29, 24576), (16384, 28, 16384)])
def test_half_octaves(size, bucket, least):
    assert paths.half_octave(size) == bucket
    assert paths.bucket_floor(size) == least


def test_the_committed_table_is_the_committed_rows():
    """fastbert/paths.json is what `python benchmarks/choose_paths.py` writes from benchmarks/results/: no hand
    edits, and a new run's rows regenerate it."""
    rows, sources = path_table.load_results("benchmarks/results")
    with open(paths.COMMITTED_TABLE_PATH, encoding="utf-8") as f:
        assert path_table.build_table(rows, sources) == json.load(f)


def _row(op, shape, provider, direction, ms, date="2026-01-01T00:00:00+00:00", **fields):
    return {"suite": "gpu", "device": "NVIDIA H100 80GB HBM3", "device_type": "cuda", "date": date, "op": op,
            "case": f"{op}/{shape}", "shape": shape, "dtype": "bfloat16", "provider": provider,
            "direction": direction, "status": "ok", "median_ms": ms, **fields}


def test_build_table_chooses_the_fastest_measured_path_of_the_newest_run():
    """Per class the fastest implementation among fastbert's providers ("torch", PyTorch as a user writes it, is
    no path of fastbert.ops and chooses nothing); the newest run of an architecture wins; an older run's rows and
    other suites are ignored; a run that names its architecture is filed under it."""
    shape = {"rows": 16384, "hidden": 768, "intermediate": 3072}
    rows = [_row("ffn_up", shape, "fastbert", "fwd", 3.0), _row("ffn_up", shape, "fastbert-split", "fwd", 1.0),
            _row("ffn_up", shape, "fastbert-eager", "fwd", 2.0), _row("ffn_up", shape, "torch", "fwd", 0.5),
            _row("ffn_up", shape, "fastbert-split", "fwd", 0.1, date="2025-01-01T00:00:00+00:00"),
            {**_row("ffn_up", shape, "fastbert", "fwd", 0.1), "suite": "smoke"},
            _row("ffn_up", shape, "fastbert", "fwd", 0.1, device="NVIDIA A100-SXM4-80GB", architecture="sm_80")]
    table = path_table.build_table(rows)
    fwd = table["architectures"]["sm_90"]["ops"]["linear_bias_gelu"]["tokens=16384,hidden=768,intermediate=3072"]
    # the reference ("fastbert-eager") keeps the GELU output too: no candidate of the FFNs, which read this class
    assert fwd["bfloat16"]["fwd"] == {"chosen": "cublas_then_bias_gelu",
                                      "ms": {"triton": 3.0, "cublas_then_bias_gelu": 1.0}}
    assert set(table["architectures"]) == {"sm_80", "sm_90"}


def test_build_table_chooses_by_the_gpus_time_alone_where_measured():
    """A row's GPU time alone (device_ms) decides, not its median, which a call's host work can inflate: the
    kernel whose call costs the host more than its GPU time is chosen where the GPU's time says it is faster."""
    shape = {"rows": 16384, "features": 3072}
    medians = [_row("bias_gelu", shape, "fastbert", "fwd+bwd", 0.6), _row("bias_gelu", shape, "fastbert-eager",
                                                                          "fwd+bwd", 0.35)]
    timed_alone = [{**medians[0], "device_ms": 0.2}, {**medians[1], "device_ms": 0.34}]
    choices = []
    for rows in (medians, timed_alone):
        classes = path_table.build_table(rows)["architectures"]["sm_90"]["ops"]["bias_gelu"]
        choices.append(next(iter(classes.values()))["bfloat16"]["fwd+bwd"])
    assert choices == [{"chosen": "torch", "ms": {"triton": 0.6, "torch": 0.35}},
                       {"chosen": "triton", "ms": {"triton": 0.2, "torch": 0.34}}]


def test_a_run_cut_short_leaves_the_whole_comparison_standing():
    """The newest run that timed every candidate of a class decides it: a newer run that timed one of them (its
    budget spent) does not, where an older one timed both; once a newer run times both, it decides."""
    shape = {"rows": 16384, "features": 3072}
    older = [_row("bias_gelu", shape, provider, "fwd+bwd", ms, date="2025-01-01T00:00:00+00:00")
             for provider, ms in (("fastbert", 0.5), ("fastbert-eager", 0.1))]
    cut = [_row("bias_gelu", shape, "fastbert", "fwd+bwd", 0.4),
           {**_row("bias_gelu", shape, "fastbert-eager", "fwd+bwd", 0.0), "status": "skipped"}]
    whole = [_row("bias_gelu", shape, provider, "fwd+bwd", ms, date="2027-01-01T00:00:00+00:00")
             for provider, ms in (("fastbert", 0.3), ("fastbert-eager", 0.35))]
    models_only = {**_row("model", {"batch": 1}, "fastbert", "inference", 1.0), "architecture": "sm_80"}
    chosen = []
    for rows in (older + cut + [models_only], older + cut + whole):
        built = path_table.build_table(rows)
        assert set(built["architectures"]) == {"sm_90"}  # no entry for an architecture whose rows decide nothing
        table = built["architectures"]["sm_90"]
        chosen.append((next(iter(table["ops"]["bias_gelu"].values()))["bfloat16"]["fwd+bwd"],
                       [source["date"] for source in table["sources"]]))
    assert chosen == [({"chosen": "torch", "ms": {"triton": 0.5, "torch": 0.1}}, ["2025-01-01T00:00:00+00:00"]),
                      ({"chosen": "triton", "ms": {"triton": 0.3, "torch": 0.35}}, ["2027-01-01T00:00:00+00:00"])]


def test_fastbert_paths_names_the_table_auto_reads(tmp_path):
    """FASTBERT_PATHS: a table written from one's own GPU rows replaces the committed one, read at import."""
    shape = {"rows": 16384, "features": 3072}
    rows = [_row("bias_gelu", shape, provider, "fwd", ms)
            for provider, ms in (("fastbert", 0.3), ("fastbert-eager", 0.1))]
    table_file = tmp_path / "own.json"
    table_file.write_text(json.dumps(path_table.build_table(rows)))
    code = ("import torch; from fastbert import paths; "
            "print(paths.lookup(paths.TABLE, 90, 'bias_gelu', torch.bfloat16, 'fwd', paths.buckets((16384, 3072))))")
    own = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FASTBERT_PATHS": str(table_file)},
                         capture_output=True, text=True, timeout=300)
    assert own.returncode == 0, own.stderr
    assert own.stdout.strip() == "torch"
    assert paths.lookup(paths.TABLE, 90, "bias_gelu", torch.bfloat16, "fwd", paths.buckets((16384, 3072))) == "triton"
    typo = tmp_path / "typo.json"
    missing = subprocess.run([sys.executable, "-c", "import fastbert.paths"], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "FASTBERT_PATHS": str(typo)})
    assert missing.returncode != 0 and f"FASTBERT_PATHS is '{typo}', which is no file" in missing.stderr


def test_the_split_provider_is_each_ops_cublas_form(tmp_path):
    """"fastbert-split" rows are the FFN's cuBLAS form and, for the QKV projection, "cublas_forward" (PyTorch's
    forward, the kernel's backward), a candidate there; the table's choice maps back to the provider."""
    shape = {"batch": 32, "seqlen": 512, "hidden": 768, "heads": 12}
    rows = [_row("qkv_projection", shape, provider, "fwd+bwd", ms)
            for provider, ms in (("fastbert", 0.82), ("fastbert-split", 0.58), ("fastbert-eager", 0.76))]
    table = path_table.build_table(rows)
    classes = table["architectures"]["sm_90"]["ops"]["qkv_projection"]
    assert classes["tokens=16384,hidden=768"]["bfloat16"]["fwd+bwd"] == {
        "chosen": "cublas_forward", "ms": {"triton": 0.82, "cublas_forward": 0.58, "torch": 0.76}}
    table_file = tmp_path / "paths.json"
    table_file.write_text(json.dumps(table))
    assert path_table.chosen_provider(rows[0], paths.load(str(table_file))) == "fastbert-split"


def test_rows_of_a_device_without_an_architecture_are_refused():
    row = _row("layer_norm", {"rows": 8, "hidden": 8}, "fastbert", "fwd", 1.0, device="Some GPU")
    with pytest.raises(ValueError, match="'Some GPU' name no architecture"):
        path_table.build_table([row])


def test_torch_compile_traces_the_choice(monkeypatch):
    """The choice runs inside compiled code: traced without a graph break, with static shapes (as a first
    compile) and with dynamic ones (a symbolic size is left out of the class rather than specialised on)."""
    def double_where_torch(x, bias):
        return x * 2 if ops.resolve_backend("auto", x, bias, op="bias_gelu") == "torch" else x * 3

    x, bias = (torch.empty(s, device="meta", dtype=torch.bfloat16) for s in ((16384, 3072), (3072,)))
    with paths.planned_architecture(90), torch.no_grad():
        for dynamic in (False, True):
            torch._dynamo.reset()
            compiled = torch.compile(double_where_torch, backend="eager", fullgraph=True, dynamic=dynamic)
            assert compiled(x, bias).shape == x.shape
            assert compiled(x[:1000], bias).shape == (1000, 3072)


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "geglu"])
def test_the_cublas_form_through_ops_matches_the_reference(gated, monkeypatch, device):
    """Where the table chooses "cublas_then_bias_gelu", ops runs the FFN (and linear_bias_gelu) as cuBLAS's GEMM and
    the Triton elementwise kernel: here forced, on the interpreter, bf16, against float64 with the tolerance rule."""
    monkeypatch.setattr(ops, "resolve_backend", lambda backend, *tensors, op=None, **kw: "cublas_then_bias_gelu")

    def epilogue(*args, **kwargs):
        raise AssertionError("the epilogue matmul ran where the cuBLAS form was chosen")

    monkeypatch.setattr(ops.KERNELS["ffn"], "linear_bias_gelu_fwd", epilogue)
    monkeypatch.setattr(ops.KERNELS["bias_gelu"], "_linear_bias_gelu_op", epilogue)
    elementwise = []  # the Triton kernels after cuBLAS's GEMM, as they run
    for module, name in ((ops.KERNELS["ffn"], "geglu_fwd" if gated else "bias_gelu_fwd"),
                         (ops.KERNELS["bias_gelu"], "_bias_gelu_op")):
        def counted(*args, _run=getattr(module, name), _name=name):
            elementwise.append(_name)
            return _run(*args)
        monkeypatch.setattr(module, name, counted)
    generator = torch.Generator().manual_seed(3)
    rows, hidden, inner = 37, 64, 96

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16).to(device)

    inputs = [randn(rows, hidden), randn((2 if gated else 1) * inner, hidden, scale=hidden ** -0.5),
              randn((2 if gated else 1) * inner), randn(hidden, inner, scale=inner ** -0.5), randn(hidden)]
    grad_out = randn(rows, hidden)
    name = "feed_forward_geglu" if gated else "feed_forward"

    def run(fn, tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        out = fn(*leaves)
        out.backward(grad_out.to(out.dtype))
        return [out.detach()] + [t.grad for t in leaves]

    got = run(getattr(ops, name), inputs)
    torch_ = run(getattr(reference, name), inputs)
    exact = run(getattr(reference, name), [t.double() for t in inputs])
    for what, g, t, e in zip(["out", "dx", "dw1", "db1", "dw2", "db2"], got, torch_, exact):
        assert_within_rule(what, g, t, e, FORWARD_FACTOR if what == "out" else GRADIENT_FACTOR)
    # the forward's g and the backward's recomputed g
    assert elementwise == ["geglu_fwd" if gated else "bias_gelu_fwd"] * 2
    if not gated:
        x, w1, b1 = inputs[:3]
        assert_within_rule("linear_bias_gelu", ops.linear_bias_gelu(x, w1, b1), reference.linear_bias_gelu(x, w1, b1),
                           reference.linear_bias_gelu(x.double(), w1.double(), b1.double()))
        assert elementwise[2:] == ["_bias_gelu_op"]
