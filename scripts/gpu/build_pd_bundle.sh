#!/bin/bash
# Build .site/pd.tar.xz: what a PD pair with a real KV transfer needs on the H200 test machine beside
# .site/site.tar.xz (scripts/gpu/build_site.sh), trimmed to a few MB so both fit one device call:
#   site/mooncake/...                     mooncake-transfer-engine-cuda13 0.3.14: the transfer engine
#                                         (engine.so and the libraries it links), nothing else
#   site/mooncake_transfer_engine_cuda13.libs/...
#   site/sglang_router/...                sglang-router 0.3.2 without its Rust extension: the Python
#                                         MiniLB (`python -m sglang_router.launch_router --mini-lb`)
#   syslibs/*.so*                         Debian 12's libibverbs, libmlx5, libnl, libnuma, libcurl and
#                                         what they link: engine.so needs them; scripts/gpu/run.sh puts
#                                         only those the machine lacks on LD_LIBRARY_PATH
# Runs on the development machine (PyPI and Debian reachable). Output: .site/pd.tar.xz (git-ignored).
set -euo pipefail
PY=${PY:-python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-$ROOT/.site/pd.tar.xz}
W=$(mktemp -d); T=$W/tree; mkdir -p "$T/site" "$T/syslibs" "$W/debs"
PLAT="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
 --platform manylinux2014_x86_64"
$PY -m pip download -q --no-deps --only-binary=:all: $PLAT -d "$W" mooncake-transfer-engine-cuda13==0.3.14 sglang-router==0.3.2
cd "$W"
unzip -q mooncake_transfer_engine_cuda13-*.whl 'mooncake/__init__.py' 'mooncake/engine.so' 'mooncake/libasio.so' \
  'mooncake/libetcd_wrapper.so' 'mooncake_transfer_engine_cuda13.libs/libyaml-cpp-*' \
  'mooncake_transfer_engine_cuda13.libs/libjsoncpp-*' 'mooncake_transfer_engine_cuda13.libs/libglog-*' \
  'mooncake_transfer_engine_cuda13.libs/libgflags-*' -d "$T/site"
unzip -q sglang_router-*.whl 'sglang_router/*.py' -d "$T/site"
# system libraries engine.so links that the wheel does not bundle (and what they link in turn)
cd "$W/debs"
apt-get download -q libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 libnghttp2-14 \
  libpsl5 librtmp1 libssh2-1 libldap-2.5-0 libsasl2-2 libbrotli1 libidn2-0 libgssapi-krb5-2 libkrb5-3 libk5crypto3 \
  libkrb5support0 libkeyutils1 libgnutls30 libhogweed6 libnettle8 libp11-kit0 libtasn1-6 libunistring2 libgmp10 \
  libffi8 >/dev/null
for deb in *.deb; do dpkg -x "$deb" "$W/x"; done
find "$W/x" -name '*.so*' \( -type f -o -type l \) -path '*lib*' ! -path '*/libibverbs/*' -exec cp -a {} "$T/syslibs/" \;
cp -a "$W"/x/usr/lib/x86_64-linux-gnu/libibverbs/libmlx5-rdmav*.so "$T/syslibs/" 2>/dev/null || true
tar -C "$T" -cf - . | xz -9 -T0 > "$DEST"
ls -la "$DEST"
rm -rf "$W"
