"""Write PERF.md and benchmarks/plots/*.png from the JSON rows in benchmarks/results/.

Run from the repository root: `python benchmarks/make_perf.py` (options: --results, --out, --plots).
"""
import sys

from fastbert.bench.report import main

if __name__ == "__main__":
    sys.exit(main())
