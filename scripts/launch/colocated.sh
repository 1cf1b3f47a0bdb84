#!/usr/bin/env bash
# Colocated ("mixed") deployment: prefill and decode in one server with sglang-hisparse, e.g.
# DeepSeek-V3.2 on one 8 x H200 host with TP 8 and DP attention 8.
#   bash scripts/launch/colocated.sh [--dry-run] [--plan]
# Variables (environment, with defaults): MODEL, DEVICE (cuda; cpu for SGLang's CPU engine), TP, DP,
# DP_ATTENTION (1/0), BASE_GPU_ID, HOST (127.0.0.1; a public address only deliberately: SGLang serves without authentication), PORT (30000), KV_CACHE_DTYPE (bfloat16 or
# fp8_e4m3), DSA_BACKEND (follows the dtype), MEM_FRACTION_STATIC (0.85), CONTEXT_LENGTH (the
# model's), DEVICE_BUFFER_SIZE (B, 4096), HOST_TO_DEVICE_RATIO (5), HISPARSE_EXTRA (more
# --hisparse-config keys, e.g. '"stats_log_interval": 100'), EXTRA_ARGS (more server flags);
# for --plan: GPU_MEM_GIB (141), HOST_MEM_GIB (2000), PLAN_CONTEXT (32768).
set -euo pipefail
source "$(dirname "$0")/common.sh"
source "$(dirname "$0")/defaults.sh"
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-30000}
DEVICE_BUFFER_SIZE=${DEVICE_BUFFER_SIZE:-4096}
HOST_TO_DEVICE_RATIO=${HOST_TO_DEVICE_RATIO:-5}
server_flags
hisparse_flags
# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
plan_or_run "$PYTHON" -m sglang.launch_server "${flags[@]}" $EXTRA_ARGS
