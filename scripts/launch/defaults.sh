# Sourced by the launch scripts: the values every deployment here shares, each overridable from
# the environment. Defaults: DeepSeek-V3.2 on one 8 x H200 host (141 GiB each), TP 8 with DP
# attention 8, bf16 KV. DEVICE=cpu without MODEL: the shipped tiny model on SGLang's CPU engine.
DEVICE=${DEVICE:-cuda}
if [ "$DEVICE" = cpu ] && [ -z "${MODEL:-}" ]; then
  # No GPU and no model named: the tiny DSA model shipped in the package (random weights, two
  # layers, top_k 64) on SGLang's CPU engine, one rank; requests carry token ids (no tokenizer).
  MODEL=$("$PYTHON" -c "import os, sglang_hisparse.models as m; print(os.path.join(m.__path__[0], 'tiny-dsa-cpu'))")
  TP=${TP:-1} DP=${DP:-1} DP_ATTENTION=${DP_ATTENTION:-0} MEM_FRACTION_STATIC=${MEM_FRACTION_STATIC:-0.5}
  DEVICE_BUFFER_SIZE=${DEVICE_BUFFER_SIZE:-128} HOST_TO_DEVICE_RATIO=${HOST_TO_DEVICE_RATIO:-2}
  EXTRA_ARGS=${EXTRA_ARGS:---load-format dummy --skip-tokenizer-init --max-total-tokens 16384}
fi
MODEL=${MODEL:-deepseek-ai/DeepSeek-V3.2}
TP=${TP:-8}
DP=${DP:-8}
DP_ATTENTION=${DP_ATTENTION:-1}
BASE_GPU_ID=${BASE_GPU_ID:-0}
KV_CACHE_DTYPE=${KV_CACHE_DTYPE:-bfloat16}
DSA_BACKEND=${DSA_BACKEND:-$(dsa_backend_for "$KV_CACHE_DTYPE")}
MEM_FRACTION_STATIC=${MEM_FRACTION_STATIC:-0.85}
CONTEXT_LENGTH=${CONTEXT_LENGTH:-}
EXTRA_ARGS=${EXTRA_ARGS:-}
# for --plan
GPU_MEM_GIB=${GPU_MEM_GIB:-141}
HOST_MEM_GIB=${HOST_MEM_GIB:-2000}
PLAN_CONTEXT=${PLAN_CONTEXT:-32768}
