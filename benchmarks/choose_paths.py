"""Write fastbert/paths.json, the table backend="auto" chooses from on a GPU, from the GPU suite's rows in
benchmarks/results/gpu-*.json (the newest run per GPU architecture). Rerun it after copying a new GPU run in,
then `python benchmarks/make_perf.py`.

Run from the repository root: `python benchmarks/choose_paths.py` (options: --results, --out).
"""
import sys

from fastbert.bench.path_table import main

if __name__ == "__main__":
    sys.exit(main())
