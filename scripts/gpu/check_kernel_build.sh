#!/usr/bin/env bash
# Compile kernels/resolve.cuh for sm_90a without a GPU, the way the JIT does (same flags and
# wrappers), and print ptxas' register / stack / spill report per kernel. Needs nvcc and the
# Python environment with SGLang and tvm-ffi (for their headers).
#   usage: scripts/gpu/check_kernel_build.sh [python]     (default: python3)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${1:-python3}
INC=$($PY - <<'EOF'
import importlib.util, pathlib, tvm_ffi.libinfo as l
sg = pathlib.Path(list(importlib.util.find_spec("sglang").submodule_search_locations)[0])
print(l.find_include_path(), l.find_dlpack_include_path(), sg / "kernels" / "jit" / "include")
EOF
)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
{
  echo "#include \"$ROOT/kernels/resolve.cuh\""
  echo "#include <tvm/ffi/function.h>"
  n=0
  for item in 1152 656 584; do  # 584: DeepSeek-V4's paged C4 rows (V4's top_k 512 / 1024)
    configs=("64 64" "64 128" "64 256" "512 512" "512 1024" "512 2048" "2048 2048" "2048 4096" "2048 8192")
    [ "$item" = 584 ] && configs=("512 512" "512 1024" "512 2048" "1024 1024" "1024 2048" "1024 4096")
    for kb in "${configs[@]}"; do
      set -- $kb
      echo "TVM_FFI_DLL_EXPORT_TYPED_FUNC(r$n, (hisparse::resolve_launch<$item, $2, $1, false, false>));"
      echo "TVM_FFI_DLL_EXPORT_TYPED_FUNC(s$n, (hisparse::resolve_launch<$item, $2, $1, true, false>));"
      echo "TVM_FFI_DLL_EXPORT_TYPED_FUNC(u$n, (hisparse::resolve_launch<$item, $2, $1, false, true>));"  # reuse policy
      echo "TVM_FFI_DLL_EXPORT_TYPED_FUNC(v$n, (hisparse::resolve_launch<$item, $2, $1, true, true>));"
      n=$((n + 1))
    done
    echo "TVM_FFI_DLL_EXPORT_TYPED_FUNC(p$item, (hisparse::replay<$item>));"
  done
} > "$TMP/all.cu"
FLAGS=(-DSGL_CUDA_ARCH=900 -std=c++20 -O3 --expt-relaxed-constexpr -lineinfo
       -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Xptxas -v)
for d in $INC; do FLAGS+=(-I"$d"); done
start=$SECONDS
nvcc "${FLAGS[@]}" -c "$TMP/all.cu" -o "$TMP/all.o" 2> "$TMP/ptxas.txt"
echo "compiled $(grep -c 'Compiling entry' "$TMP/ptxas.txt") kernels in $((SECONDS - start))s"
# one line per kernel: name, registers, stack, spills
awk '/Compiling entry function/ { match($0, /_ZN8hisparse[A-Za-z0-9_]+/); name = substr($0, RSTART, RLENGTH) }
     /bytes stack frame/ { stack = $1; spill = $5 + $9 }
     /Used [0-9]+ registers/ { match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15);
                               printf "%-72s regs %3s stack %3s spill %s\n", name, regs, stack, spill }' "$TMP/ptxas.txt"
