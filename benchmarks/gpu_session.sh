#!/usr/bin/env bash
# A lent GPU's whole session in one call, its outputs packed into one archive (a device session's tool brings
# back a few files a call: the third H100 run lost its test log and rows to that):
#   benchmarks/gpu_session.sh OUTDIR        -> OUTDIR/run.tgz, and nothing else in OUTDIR
# Runs, each step's output in the archive:
#   env.txt          date, commit, git status, nvidia-smi, Python / torch / CUDA / Triton / transformers versions,
#                    whether the C launch (kernels/launch.c) built
#   check/           benchmarks/gpu_check.sh with FASTBERT_CHECK_CHOOSE=1: the kernel and model tests, the op rows,
#                    check/paths.json (the paths "auto" chooses from them and the committed rows), then the model
#                    rows run with that table (FASTBERT_CHECK_MODELS, default issue 25's: BERT-base training at
#                    256 x 128 with and without fastbert.apply and BitFit, inference at 32 x 128 and 1 x 128 with and
#                    without a captured graph, on PyTorch's path (fastbert-eager) and on the kernels alone
#                    (fastbert-triton), against transformers)
#   profile.txt      benchmarks/profile_models.py: torch.profiler tables of the same model cases (fastbert-triton's
#                    timed only, to stay in the stage's limit), with check/paths.json,
#                    and each case's host CPU time per step and its Python functions by own time (cProfile)
#   rows/            every rows file the run wrote, for benchmarks/results/ (then `python benchmarks/choose_paths.py`,
#                    which writes check/paths.json's choices, and `python benchmarks/make_perf.py`); their op and
#                    inference rows carry host_ms, the host's time of a call on this GPU's machine (PERF.md's
#                    "Host time per call on a GPU")
# About 9 minutes with the defaults, inside a device call's 10 (the machine's start-up not included): the stages'
# limits are gpu_check's variables, set here unless the environment sets them (FASTBERT_CHECK_TESTS_S 195,
# FASTBERT_CHECK_MODELS_S 170, FASTBERT_CHECK_OPS_S 70), and FASTBERT_PROFILE_S (100) for the profile (seven cases,
# each step run twice more outside torch.profiler: the tests' limit gave it 20 s).
set -uo pipefail
if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FASTBERT_CHECK_TESTS_S=${FASTBERT_CHECK_TESTS_S:-195} FASTBERT_CHECK_MODELS_S=${FASTBERT_CHECK_MODELS_S:-170}
export FASTBERT_CHECK_OPS_S=${FASTBERT_CHECK_OPS_S:-70} FASTBERT_CHECK_CHOOSE=${FASTBERT_CHECK_CHOOSE:-1}
issue_25_models='^(train/base,batch=256,seqlen=128(,bitfit)? (fastbert|fastbert-apply|hf-sdpa)'
issue_25_models+='|inference/base,batch=(32,seqlen=128,padded|1,seqlen=128)'
issue_25_models+=' (fastbert|fastbert-graph|fastbert-eager|fastbert-triton|hf-sdpa))$'
export FASTBERT_CHECK_MODELS=${FASTBERT_CHECK_MODELS:-$issue_25_models}

{
    date -u
    git rev-parse HEAD
    git status --short
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    python -c 'import sys, torch, triton, transformers; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)'
    python -c 'import sysconfig, os; print("Python.h", os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
    python -c 'from fastbert.kernels import launch; print("C launch:", launch._C_LAUNCH)' 2>&1
} > "$work/env.txt" 2>&1

bash benchmarks/gpu_check.sh "$work/check"
check_rc=$?
if [ -s "$work/check/paths.json" ]; then
    export FASTBERT_PATHS="$work/check/paths.json"
fi
timeout -s INT -k 10 "${FASTBERT_PROFILE_S:-100}" python benchmarks/profile_models.py "$work/profile.txt" --steps 3 \
    > "$work/profile.log" 2>&1
mkdir -p "$work/rows"
find "$work/check" -path '*/bench-*' -name 'gpu-*.json' -exec cp {} "$work/rows/" \;
tar czf "$out/run.tgz" -C "$work" .
echo "gpu_check exit $check_rc; everything in $out/run.tgz"
exit "$check_rc"
