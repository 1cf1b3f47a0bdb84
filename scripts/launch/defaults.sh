# Sourced by the launch scripts: the values every deployment here shares, each overridable from
# the environment. Defaults: DeepSeek-V3.2 on one 8 x H200 host (141 GiB each), TP 8 with DP
# attention 8, bf16 KV.
MODEL=${MODEL:-deepseek-ai/DeepSeek-V3.2}
DEVICE=${DEVICE:-cuda}
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
