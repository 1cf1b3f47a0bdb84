#!/usr/bin/env bash
# The resolve kernel on DeepSeek-V4's paged C4 rows (584 B, 37440-byte pages, entries of 4 tokens),
# in one command for the GPU machine (run.sh job `c4`): the random test against the oracle (>= 10000
# cases, tests/gpu/test_resolve_kernel.py::test_kernel_matches_oracle_on_c4_rows), compute-sanitizer
# memcheck and racecheck on the sanitizer script's C4 cases alongside it, then the benchmark against
# SGLang 0.5.17's load_cache_to_device_buffer_dsv4_mla (scripts/research/bench_resolve_c4.py); the C4
# host pool's kernel copies against their torch twin (tests/gpu/test_c4_host_copy.py).
#   results under $OUT: kernel_tests_c4.json, kernel_bench_c4.json, sanitizer_c4.log, c4_suite.log
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/.gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LOG="$OUT/c4_suite.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HISPARSE_RESULTS_DIR="$OUT"
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/jit/tvm-ffi}
START=$SECONDS
note() { echo "[c4 $(( SECONDS - START ))s] $*"; }
ARCH=$($PY -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}.{m}' + ('a' if M >= 9 else ''))") || {
  note "FATAL: no CUDA GPU"; exit 2; }
export TVM_FFI_CUDA_ARCH_LIST=$ARCH
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
note "arch $ARCH; compute-sanitizer ${SANITIZER:-not found}"
$PY scripts/gpu/sanitize_resolve.py --build-only --items 584 || note "sanitizer modules: build failed"
export HISPARSE_TEST_COMMAND="bash scripts/gpu/run.sh c4 (step: python3 -m pytest tests/gpu/test_resolve_kernel.py -k c4_rows)"
HISPARSE_C4_TEST_SECONDS=${HISPARSE_C4_TEST_SECONDS:-240} timeout -s INT -k 15 330 \
  $PY -m pytest -q -s -x -p no:cacheprovider tests/gpu/test_resolve_kernel.py -k c4_rows > /tmp/c4_tests.log 2>&1 &
PID_TESTS=$!
rc=0
if [ -n "$SANITIZER" ]; then
  for tool in memcheck racecheck; do
    timeout -k 15 240 "$SANITIZER" --tool $tool --print-limit 20 $PY scripts/gpu/sanitize_resolve.py --tool $tool \
      --items 584 > /tmp/c4_$tool.log 2>&1 || rc=1
  done
  { for tool in memcheck racecheck; do echo "=== TOOL $tool"; cat /tmp/c4_$tool.log; done; } > "$OUT/sanitizer_c4.log"
  grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|\[(memcheck|racecheck)\]" /tmp/c4_memcheck.log /tmp/c4_racecheck.log
fi
wait "$PID_TESTS" || rc=1
tail -c 20000 /tmp/c4_tests.log
note "host pool copies (SGLang's transfer kernels, value and scale items) against the paged rows; the coordinator's decode steps without host syncs"
$PY -m pytest -q -p no:cacheprovider tests/gpu/test_c4_host_copy.py tests/gpu/test_c4_host_syncs.py 2>&1 | tail -12 || rc=1
note "benchmark"
$PY scripts/research/bench_resolve_c4.py --out "$OUT" --budget-s "${HISPARSE_C4_BENCH_S:-120}" \
  --command "bash scripts/gpu/run.sh c4 (step: python3 scripts/research/bench_resolve_c4.py)" || rc=1
note "done, exit $rc"
exit $rc
