"""benchmarks/profile_models.py on the CPU: the bench's own model cases under torch.profiler, one wall time and
two tables per (case, provider), then the host's part outside the profiler (wall and host CPU time, the Python
functions by own time), and a clear refusal of a malformed case."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "profile_models.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_each_case_gets_its_wall_time_and_both_tables(tmp_path):
    out = tmp_path / "profile.txt"
    result = _run(str(out), "--steps", "2", "--case", "inference/2,16,padded", "fastbert-eager",
                  "--case", "train/2,16", "hf-sdpa")
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    headers = [line for line in text.splitlines() if line.startswith("######## ")]
    assert headers[0].startswith("######## inference tiny batch 2 x 16 padded [fastbert-eager]: ")
    assert headers[1].startswith("######## train tiny batch 2 x 16 [hf-sdpa]: ")
    assert all(" ms per step (median of 2," in h for h in headers) and len(headers) == 2
    assert text.count("#### by device time") == text.count("#### by host time") == 2
    assert "aten::" in text  # the tables list the ops that ran
    fastbert_part, hf_part = text.split(headers[1])
    for part, model_file in ((fastbert_part, "fastbert/modeling.py"),
                             (hf_part, "transformers/models/bert/modeling_bert.py")):
        wall, thread = map(float, re.search(r"#### outside the profiler: ([0-9.]+) ms of wall time per step, "
                                            r"([0-9.]+) ms of it the host's CPU time", part).groups())
        assert 0 < thread <= wall * 1.05  # this thread's CPU time within the step's wall time (rounding aside)
        python_rows = part.split("#### this thread's Python functions by own time (cProfile, per step; ")[1]
        assert f"({model_file}:" in python_rows  # each provider's own model code is where its Python time goes

def test_a_malformed_case_is_refused_by_name(tmp_path):
    result = _run(str(tmp_path / "p.txt"), "--case", "inference/2", "fastbert")
    assert result.returncode == 2
    assert "--case must look like 'inference/32,128,padded' or 'train/256,128', got 'inference/2'" in result.stderr
    assert not (tmp_path / "p.txt").exists()
