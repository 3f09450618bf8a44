"""benchmarks/host_instructions.py: callgrind's counts read back in order and matched to the host suite's items,
a count that cannot be matched refused, and (slow: valgrind starts PyTorch in minutes) a real count."""
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "host_instructions.py"
_spec = importlib.util.spec_from_file_location("host_instructions", SCRIPT)
host_instructions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_instructions)


def _dump(path, trigger, total):
    path.write_text(f"version: 1\ndesc: Trigger: {trigger}\nevents: Ir\nsummary: {total}\ntotals: {total}\n")


def test_the_counts_are_read_in_the_order_callgrind_wrote_them(tmp_path):
    """Dumps .1 to .11 (numbered, not sorted as text), each a region's; the program's last dump is no region, nor
    is a dump that counted nothing (the marker called outside the regions)."""
    out = tmp_path / "callgrind.out"
    for n in range(1, 12):
        _dump(tmp_path / f"callgrind.out.{n}", f"--dump-after={host_instructions.MARKER}", 100 * n)
    _dump(tmp_path / "callgrind.out.12", f"--dump-after={host_instructions.MARKER}", 0)
    _dump(out, "Program termination", 7)
    assert host_instructions.parse_counts(str(out), 11) == [100 * n for n in range(1, 12)]


def test_a_marker_called_on_a_measured_path_is_refused(tmp_path):
    """One more region than items (a measured call reached the marker itself) cannot be matched to the items."""
    out = tmp_path / "callgrind.out"
    for n in range(1, 4):
        _dump(tmp_path / f"callgrind.out.{n}", f"--dump-after={host_instructions.MARKER}", n)
    with pytest.raises(RuntimeError, match="3 counts for 2 regions.*calls math_fsum"):
        host_instructions.parse_counts(str(out), 2)


def test_only_selects_the_host_suite_items_by_case_provider_and_direction():
    selected = host_instructions.items(r"^linear_cross_entropy/.* (fastbert|torch) fwd$")
    assert [(provider, direction) for _, provider, direction in selected] == [("fastbert", "fwd"), ("torch", "fwd")]
    everything = host_instructions.items(None)
    assert len(everything) == len(set(everything)) > len(selected)
    assert {direction for *_, direction in everything} == {"fwd", "fwd+bwd"}


def test_a_bad_calls_or_an_empty_selection_is_one_message(tmp_path):
    for args, message in ((["--calls", "0"], "--calls must be at least 1, got 0"),
                          (["--only", "no such case"], "--only 'no such case' matches no item")):
        result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *args], capture_output=True,
                                text=True, timeout=120, cwd=ROOT)
        assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow(reason="valgrind starts PyTorch and transformers in about five minutes")
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_a_counted_run_writes_a_row_per_item(tmp_path):
    """The MLM loss's inference call, three ways: fastbert's direct call executes fewer instructions than the same
    call through its torch.library custom op (kernels/fused_op.py's reason for the direct call)."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--calls", "5", "--no-progress",
                             "--only", r"^linear_cross_entropy/.* fwd$"], capture_output=True, text=True,
                            timeout=1200, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = tmp_path.glob("host-instructions-*.json")
    rows = {row["provider"]: row for row in json.loads(path.read_text())}
    assert set(rows) == {"fastbert", "fastbert-custom-op", "torch"}
    assert all(row["suite"] == "host-instructions" and row["calls"] == 5 for row in rows.values())
    assert 0 < rows["fastbert"]["instructions"] < rows["fastbert-custom-op"]["instructions"]
    assert rows["torch"]["instructions"] > 0


def test_perf_md_puts_each_fastbert_count_beside_its_comparison():
    import torch

    from fastbert.bench import host_report, report
    from fastbert.bench.provenance import provenance

    common = {"suite": "host-instructions", **provenance(torch.device("cpu"), ["benchmarks/host_instructions.py"]),
              "timer": "none: instructions"}
    counts = {("op/a", "fastbert"): 150_000, ("op/a", "fastbert-custom-op"): 300_000, ("op/a", "torch"): 100_000,
              ("model/b", "fastbert"): 2_000_000, ("model/b", "fastbert-eager"): 1_000_000,
              ("model/b", "hf-sdpa"): 4_000_000}
    rows = [{**common, "case": case, "provider": provider, "direction": "fwd", "instructions": count}
            for (case, provider), count in counts.items()]
    lines = host_report.instruction_lines(rows, report.provenance_line)
    assert "| op/a | fwd | 150,000 | 300,000 | 100,000 (torch) | 1.50 |" in lines
    assert "| model/b | fwd | 2,000,000 | - | 4,000,000 (hf-sdpa) | 0.50 |" in lines
    assert "| model/b [fastbert-eager] | fwd | 1,000,000 | - | 4,000,000 (hf-sdpa) | 0.25 |" in lines
    assert sum(line.startswith("| op/") or line.startswith("| model/") for line in lines) == 3
    assert "benchmarks/host_instructions.py" in lines[-2]
    assert host_report.instruction_lines([], report.provenance_line)[-2] == (
        "Not yet counted: `python benchmarks/host_instructions.py`.")
