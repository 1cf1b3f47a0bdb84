#!/usr/bin/env bash
# PD disaggregation, the decode instance with sglang-hisparse: the prefill instance's KV arrives in
# its pinned host pool; each decoding request holds only a B-slot hot buffer per layer on the GPU.
# E.g. DeepSeek-V3.2 on its own 8 x H200 host, TP 8 with DP attention 8.
#   bash scripts/launch/pd_decode.sh [--dry-run] [--plan]
# Variables: MODEL, DEVICE, TP, DP, DP_ATTENTION, BASE_GPU_ID, HOST (127.0.0.1; a public address only deliberately: SGLang serves without authentication), PORT (30001),
# KV_CACHE_DTYPE and DSA_BACKEND (as the prefill instance), MEM_FRACTION_STATIC, CONTEXT_LENGTH,
# TRANSFER_BACKEND (mooncake; mooncake_tcp without RDMA; fake for a smoke test: no KV moves),
# IB_DEVICE, DEVICE_BUFFER_SIZE (B, 4096), HOST_TO_DEVICE_RATIO (10), HISPARSE_EXTRA, EXTRA_ARGS;
# for --plan: GPU_MEM_GIB, HOST_MEM_GIB, PLAN_CONTEXT.
set -euo pipefail
source "$(dirname "$0")/common.sh"
source "$(dirname "$0")/defaults.sh"
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-30001}
TRANSFER_BACKEND=${TRANSFER_BACKEND:-mooncake}
IB_DEVICE=${IB_DEVICE:-}
DEVICE_BUFFER_SIZE=${DEVICE_BUFFER_SIZE:-4096}
HOST_TO_DEVICE_RATIO=${HOST_TO_DEVICE_RATIO:-10}
server_flags
hisparse_flags
flags+=(--disaggregation-mode decode --disaggregation-transfer-backend "$TRANSFER_BACKEND")
[ -n "$IB_DEVICE" ] && flags+=(--disaggregation-ib-device "$IB_DEVICE")
# shellcheck disable=SC2086
plan_or_run "$PYTHON" -m sglang.launch_server "${flags[@]}" $EXTRA_ARGS
