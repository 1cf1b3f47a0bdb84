#!/usr/bin/env bash
# PD disaggregation, the router: clients send /generate here; it gives each request a bootstrap
# room, sends it to the prefill and the decode instance at once, and answers with the decode
# instance's output.
#   bash scripts/launch/router.sh [--dry-run]
# Variables: ROUTER (sglang: SGLang's own router, `pip install sglang-router==0.3.2`, the production
# load balancer; mini: its Python MiniLB, same package; hisparse: sglang_hisparse.serving.pd_router, standard
# library, for tests), PREFILL_URL (http://127.0.0.1:30000), BOOTSTRAP_PORT (8998, the prefill
# instance's), PREFILL_BOOTSTRAP_HOST (hisparse only; the prefill URL's host), DECODE_URL
# (http://127.0.0.1:30001), HOST (127.0.0.1: the router takes unauthenticated requests; set a public
# address deliberately), PORT (8000), ROUTER_ARGS (more flags for SGLang's router).
set -euo pipefail
source "$(dirname "$0")/common.sh"
ROUTER=${ROUTER:-sglang}
PREFILL_URL=${PREFILL_URL:-http://127.0.0.1:30000}
DECODE_URL=${DECODE_URL:-http://127.0.0.1:30001}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
PREFILL_BOOTSTRAP_HOST=${PREFILL_BOOTSTRAP_HOST:-}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
ROUTER_ARGS=${ROUTER_ARGS:-}
case "$ROUTER" in
  sglang|mini)
    cmd=("$PYTHON" -m sglang_router.launch_router --pd-disaggregation --prefill "$PREFILL_URL" "$BOOTSTRAP_PORT"
         --decode "$DECODE_URL" --host "$HOST" --port "$PORT")
    [ "$ROUTER" = mini ] && cmd+=(--mini-lb)
    # shellcheck disable=SC2206  # ROUTER_ARGS is a list of flags
    cmd+=($ROUTER_ARGS) ;;
  hisparse)
    cmd=("$PYTHON" -m sglang_hisparse.serving.pd_router --prefill "$PREFILL_URL" --bootstrap-port "$BOOTSTRAP_PORT"
         --decode "$DECODE_URL" --host "$HOST" --port "$PORT")
    [ -n "$PREFILL_BOOTSTRAP_HOST" ] && cmd+=(--bootstrap-host "$PREFILL_BOOTSTRAP_HOST") ;;
  *) echo "router.sh: ROUTER=$ROUTER is not one of sglang, mini, hisparse" >&2; exit 2 ;;
esac
run_or_print "${cmd[@]}"
