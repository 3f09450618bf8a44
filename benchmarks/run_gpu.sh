#!/usr/bin/env bash
# The whole GPU benchmark suite in one command, inside 10 minutes on one H100 or H200:
#   benchmarks/run_gpu.sh OUTDIR        (e.g. benchmarks/results)
# Writes one JSON file of rows to OUTDIR (peaks, BERT-base training and inference against transformers first,
# then every op x provider x direction, the other models and capacity); items the 480 s measuring budget leaves are recorded as skipped. Then regenerate
# PERF.md with `python benchmarks/make_perf.py --results OUTDIR`; once the rows are copied into
# benchmarks/results, `python benchmarks/choose_paths.py` rewrites the paths backend="auto" takes (fastbert/paths.json),
# then make_perf again. Extra arguments go to `fastbert bench`
# (e.g. --only attention, --budget 300).
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 OUTDIR [fastbert bench options]" >&2
    exit 2
fi
out=$1
shift
cd "$(dirname "$0")/.."
exec python -m fastbert.bench --suite gpu --out "$out" "$@"
