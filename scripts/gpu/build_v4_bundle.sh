#!/bin/bash
# Build what SGLang 0.5.17's DeepSeek-V4 path needs on the GPU test machine beside the site of
# scripts/gpu/build_site.sh, trimmed so that one device call can carry it (64 MiB per call, the
# working tree included; docs/deepseek_v4/gpu-probe.md has the sizes):
#
#   .site/v4.tar.xz       an overlay that scripts/gpu/run.sh extracts into /tmp/site when present:
#     site/tilelang/...   TileLang 0.1.11 (the version sglang 0.5.17 pins; V4's mHC kernels in
#                         sglang/kernels/ops/layernorm/mhc.py are TileLang-only on CUDA), trimmed:
#                         - 3rdparty/composable_kernel (ROCm only), 3rdparty/tvm/src (C++ sources;
#                           TVM's headers in 3rdparty/tvm/include stay), 3rdparty/cutlass other than
#                           include/ (only cutlass/include is on TileLang's nvcc include path),
#                           ROCm/Metal/WebGPU C++ sources and HIP templates, the RECORD file;
#                         - every header of 3rdparty/cutlass/include that is byte-identical in the
#                           site's deep_gemm/include (CUTLASS 4.2.1 there, 4.1.0 here: all but ~30
#                           files match); run.sh copies them back from /tmp/site/deep_gemm/include
#                           without overwriting (the marker file .fill_from_deep_gemm asks for it),
#                           so TileLang sees exactly its own CUTLASS 4.1.0 headers
#     site/tilelang/lib/libz3.so.4.15
#                         the one file of z3-solver 4.15.4.0 TileLang needs (stripped):
#                         libtvm_compiler.so links it and finds it beside itself (RUNPATH $ORIGIN);
#                         TileLang never imports z3's Python API. Not in site/z3/lib (the wheel's
#                         place): a bare z3/ folder on PYTHONPATH imports as an empty namespace package,
#                         and torch.compile (SGLang's moe_sum_reduce) then fails in
#                         torch/fx/experimental/validator.py: "module 'z3' has no attribute 'ExprRef'"
#                         (seen on the GPU machine, docs/deepseek_v4/gpu-probe.md).
#                         Not carried: torch-c-dlpack-ext (its add-ons stop at torch 2.9; the machine
#                         has 2.11) and cloudpickle, ml-dtypes, psutil, tqdm, numpy (on the machine).
#   .site/site-v4.tar.xz  with --slim-site: .site/site.tar.xz cut for a V4 call, which cannot carry
#                         the full site beside v4.tar.xz; run.sh extracts it when .site/site.tar.xz is
#                         not carried. Cuts: xgrammar's native bindings (51 MB, 9 MB compressed)
#                         replaced by a stub that keeps xgrammar.structural_tag (pure Python; SGLang's
#                         function-call parsers import it at start-up), so only --grammar-backend none
#                         works with it; sglang/test except scripted_runtime (the scheduler imports
#                         it); symbol tables of the unstripped shared libraries (strip --strip-unneeded);
#                         files not read at run time (tvm_ffi's libbacktrace sources, the dist-infos'
#                         RECORD, compressed-tensors' Hadamard tables), for the growing working tree
#                         (gpu-probe.md, "What a call carries").
#
# Needs .site/site.tar.xz (scripts/gpu/build_site.sh) for the CUTLASS de-duplication and the slim site.
# Both archives use xz's x86 filter (BCJ) before LZMA2 (-9e, 256 MiB dictionary): ~10% smaller on
# these shared libraries than plain -9; Python's lzma (run.sh's tarfile) decodes it.
# Runs on the development machine (PyPI reachable). Outputs are git-ignored (.site/).
# Usage: bash scripts/gpu/build_v4_bundle.sh [--slim-site]
set -euo pipefail
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-$ROOT/.site/v4.tar.xz}
SLIM_DEST=${SLIM_DEST:-$ROOT/.site/site-v4.tar.xz}
SITE=${SITE:-$ROOT/.site/site.tar.xz}
SLIM=0
[ "${1:-}" = "--slim-site" ] && SLIM=1
[ -f "$SITE" ] || { echo "no $SITE: run scripts/gpu/build_site.sh first" >&2; exit 2; }
XZ="xz --x86 --lzma2=preset=9e,dict=256MiB -T1"
W=$(mktemp -d); T=$W/tree; S=$W/site; mkdir -p "$T/site" "$S" "$(dirname "$DEST")"
trap 'rm -rf "$W"' EXIT
strip_libs() {  # symbol tables only (.symtab); the dynamic symbols that loading needs stay
  find "$1" -name '*.so*' -type f | while read -r f; do
    if file -b "$f" | grep -q 'ELF.*not stripped'; then strip --strip-unneeded "$f"; fi
  done
}
PLAT="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
$PY -m pip download -q --no-deps --only-binary=:all: $PLAT -d "$W" tilelang==0.1.11 z3-solver==4.15.4.0
tar -C "$S" -xJf "$SITE"
cd "$W"
unzip -q tilelang-0.1.11-*.whl -d "$T/site"
TL=$T/site/tilelang
unzip -q -j z3_solver-4.15.4.0-*.whl 'z3/lib/libz3.so.4.15' -d "$TL/lib"
[ ! -e "$T/site/z3" ] || { echo "a z3/ folder would shadow torch's optional z3 import" >&2; exit 2; }
rm -rf "$TL/3rdparty/composable_kernel" "$TL/3rdparty/tvm/src"
find "$TL/3rdparty/cutlass" -mindepth 1 -maxdepth 1 ! -name include -exec rm -rf {} +
rm -rf "$TL/src/rocm" "$TL/src/metal" "$TL/src/webgpu" "$TL/src/tl_templates/hip"
rm -f "$T"/site/tilelang-*.dist-info/RECORD
find "$T" -name __pycache__ -type d -prune -exec rm -rf {} +
# CUTLASS headers that the site's DeepGEMM already carries byte for byte
CI=$TL/3rdparty/cutlass/include; removed=0
while read -r rel; do
  if [ -f "$S/deep_gemm/include/$rel" ] && cmp -s "$CI/$rel" "$S/deep_gemm/include/$rel"; then
    rm -f "$CI/$rel"; removed=$((removed + 1))
  fi
done < <(cd "$CI" && find . -type f | sed 's|^\./||')
find "$CI" -type d -empty -delete
mkdir -p "$CI"
echo "$removed headers identical to deep_gemm/include of $(basename "$S"/sgl_deep_gemm-*.dist-info): run.sh copies them back (cp -rn)" \
  > "$CI/.fill_from_deep_gemm"
echo "CUTLASS de-dup: $removed headers left to deep_gemm/include, $(find "$CI" -type f | wc -l) carried"
strip_libs "$T"
tar -C "$T" -cf - . | $XZ > "$DEST"
ls -la "$DEST"

if [ "$SLIM" = 1 ]; then
  rm -f "$S/xgrammar/libxgrammar_bindings.so"
  cat > "$S/xgrammar/__init__.py" <<'PY'
"""V4-slim stub (scripts/gpu/build_v4_bundle.sh --slim-site): xgrammar without its native bindings.

Only the pure-Python structural-tag models are kept (SGLang's function-call parsers import
``xgrammar.StructuralTag`` and ``xgrammar.structural_tag`` at start-up). Anything else raises
ImportError: run the server with ``--grammar-backend none``."""
from . import structural_tag
from .structural_tag import StructuralTag


def __getattr__(name):
    raise ImportError(f"xgrammar.{name}: not in the V4-slim site (no native bindings); use --grammar-backend none")
PY
  find "$S/sglang/test" -mindepth 1 -maxdepth 1 ! -name scripted_runtime ! -name __init__.py -exec rm -rf {} +
  # not read at run time: tvm_ffi's libbacktrace sources, the installers' RECORD files,
  # compressed-tensors' Hadamard tables (its quantization transforms; the models are dummy bf16)
  rm -f "$S"/*.dist-info/RECORD "$S/compressed_tensors/transform/utils/hadamards.safetensors"
  rm -rf "$S/tvm_ffi/3rdparty/libbacktrace"
  strip_libs "$S"
  tar -C "$S" -cf - . | $XZ > "$SLIM_DEST"
  ls -la "$SLIM_DEST"
fi
