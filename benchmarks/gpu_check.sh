#!/usr/bin/env bash
# Everything a GPU session checks, in one call of at most 8 minutes on one H100 or H200 (DESIGN.md's GPU
# environment: torch 2.11, Triton 3.6, transformers 5.17, no package index):
#   benchmarks/gpu_check.sh OUTDIR
# Runs from the checkout as it is: installed with `python -m pip install --no-deps --no-build-isolation -e .`
# or not installed at all (PYTHONPATH is the checkout; fastbert maps fastbert.kernels to kernels/ itself).
# Three stages (four with FASTBERT_CHECK_CHOOSE, below), each under its own limit, all output under OUTDIR:
#   tests   the kernel and model test files on the GPU, pytest in parallel, stopped with SIGINT at its limit so
#           that it still prints every failure with its short traceback (tests.log) and writes tests.xml (JUnit)
#   models  the whole-model benchmarks against transformers (`fastbert bench --suite gpu --only` the model
#           cases), rows in bench-models/
#   ops     `fastbert bench --suite gpu` with a budget, its per-op cases (every case but the models'), rows in
#           bench-ops/
# then prints a summary of at most 40 lines (benchmarks/gpu_check_summary.py; also in summary.txt).
# FASTBERT_CHECK_CHOOSE=1 (benchmarks/gpu_session.sh sets it) runs the ops stage before the models and between them
# a stage "choose" (limit 20 s): OUTDIR/paths.json from the new op rows and the committed ones (choose_paths.py), the
# table the models stage then runs "auto" with (FASTBERT_PATHS), so that one session's model rows measure the paths
# its own op rows chose: the table `python benchmarks/choose_paths.py` commits once the rows are copied in.
# Limits in seconds, from the environment: FASTBERT_CHECK_TESTS_S (240), FASTBERT_CHECK_MODELS_S (110),
# FASTBERT_CHECK_OPS_S (100); the benchmarks' measuring budgets are their limits less 30 s of start-up.
# FASTBERT_CHECK_MODELS: the regex of the models stage's items ('case provider', default every whole-model case),
# for a session that needs a few rows measured rather than the first of all (e.g. one issue's).
# For dry runs and the script's own tests: FASTBERT_CHECK_DEVICE=cpu (no GPU needed), FASTBERT_CHECK_TESTS (the
# test files), FASTBERT_CHECK_WORKERS (pytest -n, 12), FASTBERT_CHECK_BENCH (the command that runs a bench stage).
set -uo pipefail
if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
tests_s=${FASTBERT_CHECK_TESTS_S:-240}
models_s=${FASTBERT_CHECK_MODELS_S:-110}
ops_s=${FASTBERT_CHECK_OPS_S:-100}
test_files=${FASTBERT_CHECK_TESTS:-"tests/test_layer_norm.py tests/test_layer_norm_residual.py tests/test_bias_gelu.py
    tests/test_dropout.py tests/test_qkv.py tests/test_ffn.py tests/test_geglu.py tests/test_attention.py
    tests/test_attention_relative_bias.py tests/test_attention_rotary_window.py tests/test_mlm_loss.py
    tests/test_numerics.py tests/test_model_triton.py tests/test_family_triton.py tests/test_modernbert.py
    tests/test_prefix_keys.py tests/test_bench.py::test_device_time_leaves_the_host_out"}
bench=${FASTBERT_CHECK_BENCH:-"python -m fastbert.bench"}
# the whole-model cases of the GPU suite (fastbert/bench/model_cases.py names them mode/model,...)
model_cases=${FASTBERT_CHECK_MODELS:-'^(train|inference|capacity)/'}

if [ "${FASTBERT_CHECK_DEVICE:-cuda}" = cuda ]; then
    python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU: this script is for a GPU machine")' || exit 2
fi
python -c 'import fastbert.kernels' || exit 2
: > "$out/stages.tsv"

# run_stage NAME LIMIT_S COMMAND...: COMMAND's output in OUTDIR/NAME.log; SIGINT at the limit (KILL 30 s
# later); a line "NAME rc seconds limit" in OUTDIR/stages.tsv
run_stage() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$SECONDS
    echo "== $name (limit ${limit} s): $*" >&2
    timeout -s INT -k 30 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "$name $rc $((SECONDS - start)) $limit" >> "$out/stages.tsv"
}

# shellcheck disable=SC2086  # the lists are word lists
run_stage tests "$tests_s" python -m pytest -n "${FASTBERT_CHECK_WORKERS:-12}" -p no:cacheprovider -q -rfE \
    --tb=short --junitxml "$out/tests.xml" $test_files
run_models() {
    # shellcheck disable=SC2086
    run_stage models "$models_s" $bench --suite gpu --only "$model_cases" \
        --budget $((models_s > 60 ? models_s - 30 : models_s / 2)) --out "$out/bench-models" --no-progress
}
run_ops() {
    # shellcheck disable=SC2086
    run_stage ops "$ops_s" $bench --suite gpu --only "^(?!(train|inference|capacity)/)" \
        --budget $((ops_s > 60 ? ops_s - 30 : ops_s / 2)) --out "$out/bench-ops" --no-progress
}
if [ "${FASTBERT_CHECK_CHOOSE:-0}" = 1 ]; then
    run_ops
    rows_dir=$(mktemp -d)
    cp benchmarks/results/gpu-*.json "$out"/bench-ops/*.json "$rows_dir/" 2>/dev/null
    run_stage choose 20 python benchmarks/choose_paths.py --results "$rows_dir" --out "$out/paths.json"
    rm -rf "$rows_dir"
    if [ -s "$out/paths.json" ]; then
        export FASTBERT_PATHS="$out/paths.json"
    fi
    run_models
else
    run_models
    run_ops
fi
python benchmarks/gpu_check_summary.py "$out" | tee "$out/summary.txt"
# 0 only when every stage ended by itself with 0
awk '$2 != 0 { bad = 1 } END { exit bad }' "$out/stages.tsv"
