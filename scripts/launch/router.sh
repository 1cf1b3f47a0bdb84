#!/usr/bin/env bash
# PD disaggregation, the router: clients send /generate here; it gives each request a bootstrap
# room and sends it to the prefill and the decode instance at once, and answers with the decode
# instance's output (python -m sglang_hisparse.pd_router).
#   bash scripts/launch/router.sh [--dry-run]
# Variables: PREFILL_URL (http://127.0.0.1:30000), PREFILL_BOOTSTRAP_HOST (the prefill URL's
# host), BOOTSTRAP_PORT (8998, the prefill instance's), DECODE_URL (http://127.0.0.1:30001),
# HOST (0.0.0.0), PORT (8000).
set -euo pipefail
source "$(dirname "$0")/common.sh"
PREFILL_URL=${PREFILL_URL:-http://127.0.0.1:30000}
DECODE_URL=${DECODE_URL:-http://127.0.0.1:30001}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
PREFILL_BOOTSTRAP_HOST=${PREFILL_BOOTSTRAP_HOST:-}
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-8000}
cmd=("$PYTHON" -m sglang_hisparse.pd_router --prefill "$PREFILL_URL" --bootstrap-port "$BOOTSTRAP_PORT"
     --decode "$DECODE_URL" --host "$HOST" --port "$PORT")
[ -n "$PREFILL_BOOTSTRAP_HOST" ] && cmd+=(--bootstrap-host "$PREFILL_BOOTSTRAP_HOST")
run_or_print "${cmd[@]}"
