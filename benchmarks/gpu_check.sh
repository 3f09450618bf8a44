#!/usr/bin/env bash
# Everything a GPU session checks, on one H100 or H200 in the environment DESIGN.md names:
#   benchmarks/gpu_check.sh OUTDIR [tests|bench|memory|all]   (default all)
# tests: every kernel test on the GPU (the full-size `gpu` cases too: the interpreter runs smaller ones) and
#        the whole model on the Triton path, as JUnit XML + log in OUTDIR. A few minutes, mostly Triton autotuning.
# bench: benchmarks/run_gpu.sh OUTDIR (under 10 minutes), then PERF.md regenerated from OUTDIR.
# memory: the memory plan's steps that fit this GPU run on it (benchmarks/memory_gpu_check.py):
#         torch.cuda.max_memory_allocated beside the planned peak, then PERF.md regenerated from OUTDIR.
# On a machine that limits one command to 10 minutes, run `tests` and `bench` as two commands.
set -uo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 OUTDIR [tests|bench|memory|all]" >&2
    exit 2
fi
out=$1
what=${2:-all}
cd "$(dirname "$0")/.."
mkdir -p "$out"
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU: this script is for a GPU machine")' || exit 2
# kernels/ is installed as fastbert.kernels: the checkout needs an install, not a bare PYTHONPATH
python -c 'import fastbert.kernels' 2>/dev/null || pip install --no-deps --no-build-isolation -e . >/dev/null || exit 1
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
    python -m pytest -q -p no:cacheprovider --junitxml "$out/gpu-tests.xml" \
        tests/test_layer_norm.py tests/test_bias_gelu.py tests/test_qkv.py tests/test_attention.py \
        tests/test_mlm_loss.py tests/test_model_triton.py 2>&1 | tee "$out/gpu-tests.log" || status=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    benchmarks/run_gpu.sh "$out" && python benchmarks/make_perf.py --results "$out" || status=1
fi
if [ "$what" = memory ] || [ "$what" = all ]; then
    python benchmarks/memory_gpu_check.py "$out" && python benchmarks/make_perf.py --results "$out" || status=1
fi
exit $status
