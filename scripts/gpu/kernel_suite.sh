#!/usr/bin/env bash
# The resolve kernel's GPU suite, in one command for the H200 test machine.
#
#   cwd: the repository root; python3 imports torch and sglang (PYTHONPATH with the site archive);
#   results: everything under $OUT (default ./.gpu-out):
#     kernel_tests.json  kernel_bench.json  kernel_bench.md  kernel_bench.png
#     suite.log (all output)  sanitizer.log   (scripts/gpu/run.sh packs the logs and the JIT cache)
#
# Steps, under a wall-clock budget (HISPARSE_SUITE_BUDGET_S, default 470 s; a step that would
# not fit is shortened or skipped and the summary says so):
#   1. environment; 2. JIT build of every module (timed: a server's cold start-up build first);
#   3. concurrently: the GPU tests (>= 10000 random cases vs the oracle, graph capture) and
#      compute-sanitizer memcheck + racecheck on a small representative subset;
#   4. the benchmark against upstream SGLang 0.5.17 (alone on the GPU; HISPARSE_BENCH_ARGS: extra
#      flags for scripts/research/bench_resolve.py, e.g. --sized); 5. summary.
# The JIT cache lives in /tmp/jit/tvm-ffi: scripts/gpu/run.sh restores it from .jit/ and packs it.

set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/.gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET_S=${HISPARSE_SUITE_BUDGET_S:-470}
START=$SECONDS
LOG="$OUT/suite.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export HISPARSE_RESULTS_DIR="$OUT"
export TVM_FFI_CACHE_DIR=/tmp/jit/tvm-ffi
mkdir -p "$TVM_FFI_CACHE_DIR"

elapsed() { echo $(( SECONDS - START )); }
# cap WANT RESERVE: WANT seconds, or less so that RESERVE seconds remain in the budget (>= 0)
cap() {
  local want=$1 reserve=$2 left
  left=$(( BUDGET_S - (SECONDS - START) - reserve ))
  (( left < want )) && want=$left
  (( want < 0 )) && want=0
  echo "$want"
}
declare -A STEP_STATUS
note() { echo "[suite $(elapsed)s] $*"; }
# limited SECONDS CMD...: run CMD under a time limit (SIGINT first, so Python writes partial
# results; SIGKILL 15 s later); a limit under 10 s skips the command (exit 124).
limited() {
  local t=$1; shift
  if (( t < 10 )); then note "skipped (no time left): $*"; return 124; fi
  timeout -s INT -k 15 "$t" "$@"
}

note "repository $ROOT, results in $OUT, budget ${BUDGET_S}s"

# ---- 1. environment ----
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || true
ARCH=$($PY -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}.{m}' + ('a' if M >= 9 else ''))") || {
  note "FATAL: python3 cannot see a CUDA GPU"; exit 2; }
export TVM_FFI_CUDA_ARCH_LIST=$ARCH
$PY - <<'EOF' || { note "FATAL: imports failed"; exit 2; }
import importlib.metadata as md, sys, torch
import sglang_hisparse, sglang_hisparse.kernels as k
def version(name):
    try:
        return md.version(name)
    except Exception as e:
        return f"? ({type(e).__name__})"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, sglang {version('sglang')}, "
      f"tvm-ffi {version('apache-tvm-ffi')}")
print(f"sglang_hisparse from {sglang_hisparse.__file__}; kernel sources {k.source_dir()}")
EOF
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
note "arch $ARCH; compute-sanitizer: ${SANITIZER:-not found}; nvcc: $(nvcc --version | tail -1)"

# ---- 2. JIT ----
T=$(cap 200 200)
note "JIT build (limit ${T}s)"
limited "$T" $PY scripts/gpu/jit_warmup.py; STEP_STATUS[jit]=$?

# ---- 3. tests + sanitizers, concurrently ----
T_TESTS=$(cap 250 150)
T_SAN=$(cap 220 150)
note "GPU tests (limit ${T_TESTS}s) with memcheck and racecheck alongside (limit ${T_SAN}s each)"
export HISPARSE_TEST_COMMAND="bash scripts/gpu/kernel_suite.sh (step: python3 -m pytest tests/gpu/test_resolve_kernel.py)"
HISPARSE_TEST_SECONDS=$(( T_TESTS > 90 ? T_TESTS - 60 : 30 )) limited "$T_TESTS" \
  $PY -m pytest -q -s -x -p no:cacheprovider tests/gpu/test_resolve_kernel.py > /tmp/hisparse_tests.log 2>&1 &
PID_TESTS=$!
if [ -n "$SANITIZER" ] && (( T_SAN > 30 )); then
  limited "$T_SAN" "$SANITIZER" --tool memcheck --print-limit 20 \
    $PY scripts/gpu/sanitize_resolve.py --tool memcheck > /tmp/hisparse_memcheck.log 2>&1 &
  PID_MEM=$!
  limited "$T_SAN" "$SANITIZER" --tool racecheck --print-limit 20 \
    $PY scripts/gpu/sanitize_resolve.py --tool racecheck > /tmp/hisparse_racecheck.log 2>&1 &
  PID_RACE=$!
  wait "$PID_MEM"; STEP_STATUS[memcheck]=$?
  wait "$PID_RACE"; STEP_STATUS[racecheck]=$?
else
  note "sanitizers skipped (tool missing or no time)"
  STEP_STATUS[memcheck]=skipped; STEP_STATUS[racecheck]=skipped
fi
wait "$PID_TESTS"; STEP_STATUS[tests]=$?
note "---- GPU tests output ----"
tail -c 2000000 /tmp/hisparse_tests.log
{
  echo "=== TOOL memcheck"; tail -c 7000000 /tmp/hisparse_memcheck.log 2>/dev/null
  echo "=== TOOL racecheck"; tail -c 7000000 /tmp/hisparse_racecheck.log 2>/dev/null
} > "$OUT/sanitizer.log"
note "---- sanitizer summaries ----"
grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|\[(memcheck|racecheck)\]" /tmp/hisparse_memcheck.log /tmp/hisparse_racecheck.log 2>/dev/null | tail -40

# ---- 4. benchmark ----
T=$(cap 200 25)
if (( T > 60 )); then
  note "benchmark (limit ${T}s)"
  export HISPARSE_BENCH_COMMAND="bash scripts/gpu/kernel_suite.sh (step: python3 scripts/research/bench_resolve.py --out \$OUT --budget-s $(( T - 70 )) --stage-clock ${HISPARSE_BENCH_ARGS:-})"
  # shellcheck disable=SC2086  # HISPARSE_BENCH_ARGS: extra bench flags, word-split on purpose (e.g. --sized)
  limited "$T" $PY scripts/research/bench_resolve.py --out "$OUT" --budget-s $(( T - 70 )) --stage-clock ${HISPARSE_BENCH_ARGS:-}; STEP_STATUS[bench]=$?
else
  note "benchmark skipped: no time left"; STEP_STATUS[bench]=skipped
fi

# ---- 5. results ----
$PY scripts/gpu/finalize_results.py "$OUT" "$OUT/sanitizer.log"
ls -la "$OUT"
for s in jit tests memcheck racecheck bench; do
  note "step $s: exit ${STEP_STATUS[$s]:-not run}"
done
note "done"
sleep 1  # let tee flush suite.log
