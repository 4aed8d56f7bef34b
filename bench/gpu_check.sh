#!/usr/bin/env bash
# The one command for a lent GPU machine: torch and GPU info, the GPU tests
# (pytest -m cuda tests/test_cuda.py), the self-check tests, and the GPU benchmark,
# each under a timeout so that the whole stays under 9 minutes.  Everything goes to
# bench/results/ (and to $OUT too, where the machine hands that folder back).
#
# Nothing is installed: the repository root is the package gradfx, so a temporary
# folder with a link named gradfx to the root goes first on PYTHONPATH.
#
# Usage: bash bench/gpu_check.sh [--dry-run]
#   --dry-run: the benchmark's CPU dry run (tiniest models); the GPU tests skip.
# PYTHON=... picks the interpreter (default: python, else python3).
set -u

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
RESULTS="$ROOT/bench/results"
mkdir -p "$RESULTS"
TOTAL=${GPU_CHECK_SECONDS:-530}  # the whole script's budget, in seconds
START=$(date +%s)
left() { echo $((TOTAL - ($(date +%s) - START))); }

SHIM=$(mktemp -d)
ln -s "$ROOT" "$SHIM/gradfx"
trap 'rm -rf "$SHIM"' EXIT
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic cuBLAS for the bitwise tests
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

declare -A RC
step() {  # step NAME SECONDS LOGFILE COMMAND...: run it under a timeout, its output to the log and here
    local name=$1 secs=$2 log=$3
    shift 3
    echo "=== $name (timeout ${secs} s, $(left) s of the script's budget left)"
    local t0=$(date +%s)
    timeout --kill-after=10 "$secs" "$@" 2>&1 | tee "$RESULTS/$log"
    RC[$name]=${PIPESTATUS[0]}
    echo "=== $name: exit ${RC[$name]} after $(( $(date +%s) - t0 )) s" | tee -a "$RESULTS/$log"
}

cat > "$SHIM/info.py" <<'PY'
import sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print("gpu", props.name, f"sm_{props.major}{props.minor}", round(props.total_memory / 2**30, 1), "GiB")
for name in ("triton", "transformers", "timm"):
    try:
        print(name, __import__(name).__version__)
    except Exception as err:
        print(name, "not importable:", type(err).__name__)
import gradfx
print("gradfx", gradfx.__version__, "from", gradfx.__file__)
PY
step info 60 gpu_info.txt bash -c 'date; uname -a; if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "no nvidia-smi"; fi
    "$0" "$1"' \
    "$PYTHON" "$SHIM/info.py"

cap() { local l=$(left); [ "$l" -lt "$1" ] && echo $(( l > 5 ? l : 5 )) || echo "$1"; }
step pytest_cuda "$(cap 180)" pytest_cuda.txt \
    "$PYTHON" -m pytest -q -rfEs -m cuda tests/test_cuda.py -p no:cacheprovider
step pytest_self_check "$(cap 60)" pytest_self_check.txt \
    "$PYTHON" -m pytest -q -rfE tests/test_self_check.py -p no:cacheprovider

# The benchmark gets what is left, less its grace (a worker past the budget is stopped
# 20 s after it) and 25 s for its start and its table.
BUDGET=$(( $(left) - 45 ))
if [ "$DRY" = 1 ] && [ "$BUDGET" -gt 170 ]; then BUDGET=170; fi
if [ "$BUDGET" -lt 30 ]; then
    echo "=== bench_gpu: skipped, ${BUDGET} s left" | tee "$RESULTS/bench_gpu.log"
    RC[bench_gpu]=skipped
else
    BENCH_ARGS=(--budget "$BUDGET" --out "$RESULTS")
    [ "$DRY" = 1 ] && BENCH_ARGS+=(--dry-run)
    step bench_gpu $(( BUDGET + 40 )) bench_gpu.log "$PYTHON" bench/bench_gpu.py "${BENCH_ARGS[@]}"
fi

{
    echo "=== gpu_check summary ($(( $(date +%s) - START )) s$( [ "$DRY" = 1 ] && echo ', dry run'))"
    for name in info pytest_cuda pytest_self_check bench_gpu; do echo "  $name: exit ${RC[$name]:-not run}"; done
} | tee "$RESULTS/summary.txt"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then cp -r "$RESULTS/." "$OUT/"; fi
for name in pytest_cuda pytest_self_check bench_gpu; do
    [ "${RC[$name]:-0}" = 0 ] || [ "${RC[$name]}" = skipped ] || exit 1
done
exit 0
