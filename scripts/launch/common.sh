# Sourced by the launch scripts beside this file. Parses the scripts' own options and runs (or
# prints) the command they build. Every deployment value is an environment variable with a
# default in the script that uses it; see `bash <script> --help`.
#   --dry-run   print the exact command instead of running it
#   --plan      (colocated.sh, pd_decode.sh) print the capacity plan of these values and exit
#               (python -m sglang_hisparse.tools.plan; MODEL must then be a local model directory)
set -euo pipefail
DRY_RUN=0
PLAN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --plan) PLAN=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "$(basename "$0"): unknown option $arg (allowed: --dry-run, --plan, --help)" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}

# The DSA sparse-attention backend that serves HiSparse's page table for a KV dtype (bf16 KV:
# flashmla_sparse; fp8_e4m3 KV: flashmla_kv).
dsa_backend_for() {
  case "$1" in
    fp8_e4m3) echo flashmla_kv ;;
    *) echo flashmla_sparse ;;
  esac
}

# DEVICE=cpu: SGLang's CPU engine, with the package's CPU stand-in for sgl_kernel first on PYTHONPATH
# (what a DSA model needs to run without a GPU; sglang_hisparse/cpu/).
cpu_engine_env() {
  [ "$DEVICE" = cpu ] || return 0
  local stand_in
  stand_in=$("$PYTHON" -c "import os, sglang_hisparse.cpu as c; print(os.path.join(os.path.dirname(c.__file__), 'stand_in'))")
  export SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$stand_in${PYTHONPATH:+:$PYTHONPATH}"
}

# The server flags every DSA deployment here shares (model, parallel layout, KV, backends).
server_flags() {
  cpu_engine_env
  flags=(--model-path "$MODEL" --trust-remote-code --host "$HOST" --port "$PORT" --device "$DEVICE"
         --tp-size "$TP" --dp-size "$DP" --kv-cache-dtype "$KV_CACHE_DTYPE" --page-size 64
         --mem-fraction-static "$MEM_FRACTION_STATIC")
  [ "$DP_ATTENTION" = 1 ] && flags+=(--enable-dp-attention)
  [ "$DEVICE" = cuda ] && flags+=(--dsa-prefill-backend "$DSA_BACKEND" --dsa-decode-backend "$DSA_BACKEND")
  [ -n "$CONTEXT_LENGTH" ] && flags+=(--context-length "$CONTEXT_LENGTH")
  [ "$BASE_GPU_ID" != 0 ] && flags+=(--base-gpu-id "$BASE_GPU_ID")
  return 0
}

hisparse_flags() {
  local config="{\"device_buffer_size\": $DEVICE_BUFFER_SIZE, \"host_to_device_ratio\": $HOST_TO_DEVICE_RATIO${HISPARSE_EXTRA:+, $HISPARSE_EXTRA}}"
  flags+=(--disable-radix-cache --enable-hisparse --hisparse-config "$config")
}

plan_or_run() {
  if [ "$PLAN" = 1 ]; then
    local dp_attention=()
    [ "$DP_ATTENTION" = 1 ] && dp_attention=(--dp-attention)
    exec "$PYTHON" -m sglang_hisparse.tools.plan --model-config "$MODEL" --tp "$TP" --dp "$DP" "${dp_attention[@]}" \
      --gpu-mem-gib "$GPU_MEM_GIB" --host-mem-gib "$HOST_MEM_GIB" --context "$PLAN_CONTEXT" \
      --device-buffer-size "$DEVICE_BUFFER_SIZE" --ratio "$HOST_TO_DEVICE_RATIO" --kv-cache-dtype "$KV_CACHE_DTYPE" \
      --mem-fraction-static "$MEM_FRACTION_STATIC"
  fi
  run_or_print "$@"
}

run_or_print() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    exec "$@"
  fi
}
