#!/usr/bin/env bash
# The verify-step kernel checks (issue #18, docs/speculative.md) in one command for the H200:
#   1. JIT build of the sanitizer's modules (spilling planners included);
#   2. concurrently: tests/gpu/test_verify_kernel.py (the verify resolver with the kernel against the
#      loop reference: k = 64 with N = 2, 4, and the servers' k = 2048 with N = 3, 4, where the
#      planner spills its top-k-sized arrays to global memory), and compute-sanitizer memcheck and
#      racecheck over scripts/gpu/sanitize_resolve.py;
#   3. a summary line per step; exit status 1 if any step failed.
# cwd: the repository root (scripts/gpu/run.sh job `verify`); logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/.gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LIMIT_S=${HISPARSE_VERIFY_SUITE_LIMIT_S:-420}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/jit/tvm-ffi}
START=$SECONDS
note() { echo "[verify-suite $(( SECONDS - START ))s] $*"; }
ARCH=$($PY -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}.{m}' + ('a' if M >= 9 else ''))") || {
  note "FATAL: python3 cannot see a CUDA GPU"; exit 2; }
export TVM_FFI_CUDA_ARCH_LIST=$ARCH
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
note "arch $ARCH; compute-sanitizer: ${SANITIZER:-not found}"

timeout -s INT -k 15 "$LIMIT_S" $PY scripts/gpu/sanitize_resolve.py --build-only 2>&1 | tee "$OUT/verify_build.log"
BUILD=${PIPESTATUS[0]}
note "build exit $BUILD"

LEFT=$(( LIMIT_S - (SECONDS - START) ))
export HISPARSE_TEST_COMMAND="bash scripts/gpu/verify_suite.sh (step: python3 -m pytest tests/gpu/test_verify_kernel.py)"
timeout -s INT -k 15 "$LEFT" $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_verify_kernel.py \
  > "$OUT/verify_tests.log" 2>&1 &
PID_TESTS=$!
PIDS_SAN=()
if [ -n "$SANITIZER" ] && [ "$BUILD" = 0 ]; then
  for tool in memcheck racecheck; do
    timeout -s INT -k 15 "$LEFT" "$SANITIZER" --tool "$tool" --print-limit 20 \
      $PY scripts/gpu/sanitize_resolve.py --tool "$tool" > "$OUT/verify_$tool.log" 2>&1 &
    PIDS_SAN+=($!)
  done
fi
wait "$PID_TESTS"; TESTS=$?
for pid in "${PIDS_SAN[@]}"; do wait "$pid"; done  # judged by their logs below
note "tests exit $TESTS: $(grep -E '^\[verify-kernel' "$OUT/verify_tests.log" | tr '\n' ' ')$(tail -1 "$OUT/verify_tests.log")"
rc=$(( BUILD != 0 || TESTS != 0 ))
for tool in memcheck racecheck; do
  log="$OUT/verify_$tool.log"
  [ -f "$log" ] || { note "$tool: not run"; rc=1; continue; }
  note "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1); $(grep -E "^\[$tool\] [0-9]+ cases" "$log")"
  grep -qE "(ERROR|RACECHECK) SUMMARY: 0 (errors|hazards)" "$log" && grep -qE "^\[$tool\] [0-9]+ cases, 0 mismatches" "$log" || rc=1
done
note "exit $rc"
exit $rc
