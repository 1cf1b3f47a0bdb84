#!/usr/bin/env bash
# PD disaggregation, the prefill instance (no HiSparse: it writes each request's KV straight into
# the decode instance's pinned host pool through the transfer backend), e.g. DeepSeek-V3.2 on its
# own 8 x H200 host.
#   bash scripts/launch/pd_prefill.sh [--dry-run]
# Variables: MODEL, DEVICE, TP, DP, DP_ATTENTION, BASE_GPU_ID, HOST (127.0.0.1; a public address only deliberately: SGLang serves without authentication), PORT (30000),
# KV_CACHE_DTYPE and DSA_BACKEND (must match the decode instance), MEM_FRACTION_STATIC,
# CONTEXT_LENGTH, TRANSFER_BACKEND (mooncake; mooncake_tcp without RDMA), IB_DEVICE (RDMA device,
# optional), BOOTSTRAP_PORT (8998), EXTRA_ARGS.
set -euo pipefail
source "$(dirname "$0")/common.sh"
source "$(dirname "$0")/defaults.sh"
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-30000}
TRANSFER_BACKEND=${TRANSFER_BACKEND:-mooncake}
IB_DEVICE=${IB_DEVICE:-}
BOOTSTRAP_PORT=${BOOTSTRAP_PORT:-8998}
server_flags
flags+=(--disaggregation-mode prefill --disaggregation-transfer-backend "$TRANSFER_BACKEND"
        --disaggregation-bootstrap-port "$BOOTSTRAP_PORT")
[ -n "$IB_DEVICE" ] && flags+=(--disaggregation-ib-device "$IB_DEVICE")
# shellcheck disable=SC2086
run_or_print "$PYTHON" -m sglang.launch_server "${flags[@]}" $EXTRA_ARGS
