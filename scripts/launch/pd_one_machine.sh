#!/usr/bin/env bash
# PD disaggregation on one machine: a prefill instance, a decode instance with sglang-hisparse and
# the router, the KV moving between them for real (mooncake's transfer engine over TCP on
# 127.0.0.1: no RDMA, no metadata server). On one GPU both instances share it; on a machine with
# more, give each its own (PREFILL_BASE_GPU_ID / DECODE_BASE_GPU_ID, TP). DEVICE=cpu runs SGLang's
# CPU engine with the package's CPU stand-ins (e.g. the shipped tiny model, below).
#   bash scripts/launch/pd_one_machine.sh [--dry-run]
# Needs: `pip install mooncake-transfer-engine-cuda13==0.3.14` (GPU; CPU: mooncake-transfer-engine-non-cuda
# ==0.3.13.post1) and, for ROUTER=sglang (the default) or mini, `pip install sglang-router==0.3.2`.
# Variables: MODEL, DEVICE (cuda), TP (1), PREFILL_BASE_GPU_ID (0), DECODE_BASE_GPU_ID (0),
# PREFILL_MEM_FRACTION / DECODE_MEM_FRACTION (0.4 each: two servers on one GPU), PREFILL_PORT (30000),
# DECODE_PORT (30001), BOOTSTRAP_PORT (8998), PORT (8000, the router's; clients use this one),
# ROUTER (sglang, mini or hisparse: router.sh), DEVICE_BUFFER_SIZE (B, 4096), HOST_TO_DEVICE_RATIO (10),
# HISPARSE_EXTRA, KV_CACHE_DTYPE, CONTEXT_LENGTH, EXTRA_ARGS (flags for both instances).
# Everything listens on 127.0.0.1. Ctrl-C (or any of the three exiting) stops all three.
# The tiny model on a CPU-only machine:
#   DEVICE=cpu MODEL=sglang_hisparse/models/tiny-dsa-cpu DEVICE_BUFFER_SIZE=128 HOST_TO_DEVICE_RATIO=2 \
#     EXTRA_ARGS="--load-format dummy --max-total-tokens 16384 --skip-tokenizer-init" bash scripts/launch/pd_one_machine.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/common.sh"
export MODEL=${MODEL:-deepseek-ai/DeepSeek-V3.2} DEVICE=${DEVICE:-cuda} TP=${TP:-1} DP=1 DP_ATTENTION=0 HOST=127.0.0.1
export TRANSFER_BACKEND=mooncake_tcp BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998} PYTHON
export SGLANG_HOST_IP=127.0.0.1 MC_TCP_ENABLE_CONNECTION_POOL=true  # mooncake: loopback TCP, no route probing
PREFILL_PORT=${PREFILL_PORT:-30000}
DECODE_PORT=${DECODE_PORT:-30001}
ROUTER_PORT=${PORT:-8000}
prefill_env=(PORT="$PREFILL_PORT" BASE_GPU_ID="${PREFILL_BASE_GPU_ID:-0}" MEM_FRACTION_STATIC="${PREFILL_MEM_FRACTION:-0.4}")
decode_env=(PORT="$DECODE_PORT" BASE_GPU_ID="${DECODE_BASE_GPU_ID:-0}" MEM_FRACTION_STATIC="${DECODE_MEM_FRACTION:-0.4}")
router_env=(PORT="$ROUTER_PORT" PREFILL_URL="http://127.0.0.1:$PREFILL_PORT" DECODE_URL="http://127.0.0.1:$DECODE_PORT")
if [ "$DRY_RUN" = 1 ]; then
  env "${prefill_env[@]}" bash "$HERE/pd_prefill.sh" --dry-run
  env "${decode_env[@]}" bash "$HERE/pd_decode.sh" --dry-run
  env "${router_env[@]}" bash "$HERE/router.sh" --dry-run
  exit 0
fi
pids=()
stop_all() { trap - EXIT INT TERM; kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop_all EXIT INT TERM
env "${prefill_env[@]}" bash "$HERE/pd_prefill.sh" & pids+=($!)
env "${decode_env[@]}" bash "$HERE/pd_decode.sh" & pids+=($!)
wait_healthy() {  # wait_healthy PORT NAME [PATH]: until GET PATH (/health) answers 200, or a child exits
  echo "[pd_one_machine] waiting for the $2 on 127.0.0.1:$1"
  until "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" \
      "http://127.0.0.1:$1${3:-/health}" 2>/dev/null; do
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "[pd_one_machine] an instance exited" >&2; exit 1; }; done
    sleep 2
  done
}
wait_healthy "$PREFILL_PORT" "prefill instance"
wait_healthy "$DECODE_PORT" "decode instance"
env "${router_env[@]}" bash "$HERE/router.sh" & pids+=($!)
# the router registers its workers in the background: /health answers at once, /readiness (sglang-router)
# only once both are registered; until then a request gets 503
[ "${ROUTER:-sglang}" = sglang ] && wait_healthy "$ROUTER_PORT" "router's workers" /readiness
echo "[pd_one_machine] prefill :$PREFILL_PORT, decode :$DECODE_PORT (HiSparse), router :$ROUTER_PORT (send requests here)"
wait -n "${pids[@]}"
echo "[pd_one_machine] a process exited; stopping the others" >&2
exit 1
