#!/bin/bash
# Build .site/site.tar.xz: every Python package SGLang 0.5.17 needs on the H200 test machine for the
# tiny-DSA end to end and the kernel suite that the machine image lacks (or has at a conflicting
# version), trimmed, installed flat for CPython 3.12, xz-compressed (~45 MB; one GPU command may
# carry 64 MiB). Runs on the development machine (PyPI reachable). Adapted from the shared test bed.
# Output: .site/site.tar.xz (git-ignored; pass `carry: [".site"]` to the device call).
PY=${PY:-python3}
W=${W:-/tmp/e2e_wheels}; T=${T:-/tmp/e2e_site}; DEST=${DEST:-$(cd "$(dirname "$0")/../.." && pwd)/.site/site.tar.xz}; mkdir -p "$(dirname "$DEST")"
mkdir -p $W; rm -rf $T
PLAT="--python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
 --platform manylinux1_x86_64 --platform any"
PKGS="sglang==0.5.17 sglang-kernel==0.4.5 sgl-deep-gemm==0.1.5.post1 apache-tvm-ffi==0.1.11
 flashinfer-python==0.6.15.post1 xgrammar==0.2.1 transformers==5.12.1 tokenizers==0.22.2
 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 opentelemetry-api==1.45.2
 orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7
 openai==2.6.1 distro==1.9.0 sniffio==1.3.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
 referencing==0.37.0 rpds-py==2026.9.1 soundfile==0.13.1 cffi==2.1.1 compressed-tensors==0.20.1 loguru==0.7.3
 gguf==0.19.0 dill==0.4.1"
for p in $PKGS; do $PY -m pip download -q --no-deps --only-binary=:all: $PLAT -d $W "$p"; done
cd $W
# trims (files the tiny-DSA path never loads):
zip -q -d sglang_kernel-0.4.5-*.whl 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/infllm_ops*' 'sgl_kernel/sm100/*' || true  # FA3 (1.1 GB), InfLLM, Blackwell ops
zip -q -d sglang-0.5.17-*.whl 'sglang/multimodal_gen/*' 'sglang/srt/server/_core*' 'sglang/srt/grpc/_core*' 'sglang/srt/multimodal/_core*' || true  # diffusion, Rust server/gRPC/mm natives
zip -q -d flashinfer_python-*.whl 'flashinfer/data/cutlass/*' 'flashinfer/data/cccl/*' || true  # JIT headers not needed (norm JIT still builds)
zip -q -d xgrammar-*.whl 'xgrammar/lib/libxgrammar.a' || true  # static lib for C++ linking only
$PY -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: $PLAT --target $T $W/*.whl
rm -rf $T/bin
# IPython stub: sglang/utils.py does `from IPython.display import HTML, display` at import (notebook helpers only)
mkdir -p $T/IPython
echo '# stub: only IPython.display.HTML/display are imported by sglang.utils' > $T/IPython/__init__.py
cat > $T/IPython/display.py <<'PY'
class HTML:
    def __init__(self, data=None, *a, **k): self.data = data
def display(*objs, **kw):
    for o in objs: print(o)
PY
# matplotlib's pyplot asks IPython for the running shell
echo 'def get_ipython(): return None' >> $T/IPython/__init__.py
tar -C $T -cf - . | xz -9 -T0 > "$DEST"
ls -la "$DEST"
