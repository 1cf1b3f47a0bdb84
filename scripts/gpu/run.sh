#!/bin/bash
# One GPU-machine command: prepare Python packages, run one job, bring back results and JIT caches.
#
# Runs on the H200 test machine from the repository root, with `carry: [".site"]` holding
#   .site/site.tar.xz          SGLang 0.5.17 and what the image lacks (scripts/gpu/build_site.sh)
#   .site/sglang_hisparse-*.whl our wheel (pip wheel --no-deps -w .site .)
#   .site/pd.tar.xz            optional: mooncake's transfer engine and sglang-router's MiniLB for a real PD
#                              pair (scripts/gpu/build_pd_bundle.sh)
#   .site/v4.tar.xz            optional: TileLang + libz3 for DeepSeek-V4 (scripts/gpu/build_v4_bundle.sh)
#   .site/site-v4.tar.xz       used instead of site.tar.xz when that is not carried: the V4-slim site
#                              (build_v4_bundle.sh --slim-site), so that site + v4 bundle fit one call
#   .jit/*.tar.xz              optional: JIT caches brought back by an earlier call (carry .jit)
# Usage: bash scripts/gpu/run.sh <job> [args...] [+ <job> [args...] ...]   (jobs run in order)
#   job = kernel  -> bash scripts/gpu/kernel_suite.sh
#   job = verify  -> bash scripts/gpu/verify_suite.sh   (the verify-step kernel tests and sanitizers)
#   job = c4      -> bash scripts/gpu/c4_suite.sh   (the kernel on DeepSeek-V4's C4 rows: tests, sanitizers, bench)
#   job = bg <job> [args...] -> that job in the background, alongside the next ones (the call waits
#                    for it before packing the results; its exit status counts like the others')
#   job = e2e     -> python scripts/gpu/e2e.py [args...]
#   job = pytest  -> python -m pytest -q [args...]   (e.g. tests/gpu/test_decode_kernel.py)
#   job = sweep   -> python scripts/gpu/sweep.py [args...]   (the performance sweep, docs/performance.md)
#   job = pd      -> python scripts/gpu/pd.py [args...]   (a PD pair moving real KV: exactness, throughput;
#                    carry .site/pd.tar.xz; docs/pd.md)
#   job = bench   -> python scripts/research/bench_resolve.py --out $OUT [args...]   (the benchmark alone)
#   job = step-host -> python scripts/research/bench_step_host.py --device cuda --out $OUT/step_host_gpu.json [args...]
#                    (our host work per decode step on the GPU machine, by part; no server)
#   job = step-host-tree <dir> [args...] -> <dir>/scripts/research/bench_step_host.py --device cuda [args...]: the
#                    same bench on another checkout's package (carry it, e.g. .snap/base from `git archive`),
#                    for old/new pairs in one call; pass --out $OUT/<name>.json
#   job = demo    -> python -m sglang_hisparse.tools.demo [args...]   (the README's demo; ends "outputs identical")
#   job = policy  -> python scripts/research/bench_policy_replay.py --device cuda --out $OUT/policy_replay.json [args...]
#                    (real traces replayed through the kernel; carry the .traces_gpu/ file, pass --traces)
#   job = probe   -> nvcc scripts/gpu/slot_hash_probe.cu, run it [args...] > $OUT/slot_hash_probe.jsonl
#                    (the planning-floor micro-benchmark, docs/kernel.md; standalone CUDA, no Python)
#   job = v4probe -> python scripts/gpu/v4_probe.py [args...]   (SGLang's DeepSeek-V4 on tiny-dsv4: no
#                    HiSparse vs SGLang's own, token by token, $OUT/v4probe.json; carry .site/v4.tar.xz,
#                    docs/deepseek_v4/gpu-probe.md)
#   job = v4pd    -> python scripts/gpu/v4_pd.py [args...]   (DeepSeek-V4 on a PD decode instance, Mooncake TCP:
#                    ours and SGLang's HiSparse against no HiSparse, token by token, aborts, pools;
#                    $OUT/v4pd.json; needs .site/pd.tar.xz and the V4 site, carried now or extracted by an
#                    earlier call on the same warm machine)
#   job = prefix  -> python scripts/gpu/prefix_bench.py [args...]   (prefix reuse, issue 43: ours with the radix
#                    cache against ours without it, SGLang's HiSparse and no HiSparse with it; multi-turn and
#                    shared-prefix workloads, TTFT, tok/s, exactness, pools; $OUT/prefix.json;
#                    docs/prefix_reuse/README.md)
# Writes under $OUT: the job's files, run.log, logs.tar.xz (other logs, e2e server logs) and jit.tar.xz
# (the JIT caches; per-cache jit-<cache>.tar.xz when one archive would exceed 15.5 MB): at most 8
# files, the device tool's limit (scripts/gpu/pack_outputs.py).
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log() { echo "[run +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run.log"; }
# the site: .site/site.tar.xz, or when that is not carried .site/site-v4.tar.xz (the V4-slim site of
# scripts/gpu/build_v4_bundle.sh --slim-site: no xgrammar bindings, --grammar-backend none only)
SITE_ARCHIVE=.site/site.tar.xz; [ -f "$SITE_ARCHIVE" ] || SITE_ARCHIVE=.site/site-v4.tar.xz
if [ ! -f /tmp/site/.ok ]; then
  python3 -c "import tarfile; tarfile.open('$SITE_ARCHIVE').extractall('/tmp/site')" || { log "cannot extract $SITE_ARCHIVE"; exit 2; }
  log "extracted $SITE_ARCHIVE"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .site/sglang_hisparse-*.whl >/dev/null 2>&1 \
    || { log "cannot install our wheel"; exit 2; }
  touch /tmp/site/.ok
fi
# optional: .site/pd.tar.xz (scripts/gpu/build_pd_bundle.sh), the transfer engine and router of a real PD pair;
# of its system libraries only those the machine lacks go on LD_LIBRARY_PATH (found with ldd, to a fixpoint)
if [ -f .site/pd.tar.xz ] && [ ! -f /tmp/site/.pd_ok ]; then
  mkdir -p /tmp/pd_bundle /tmp/pd_libs
  python3 -c "import tarfile; tarfile.open('.site/pd.tar.xz').extractall('/tmp/pd_bundle')" || { log "cannot extract .site/pd.tar.xz"; exit 2; }
  cp -a /tmp/pd_bundle/site/. /tmp/site/
  cudart=$(python3 -c "import glob, site; print(next(iter(glob.glob(site.getsitepackages()[0] + '/nvidia/**/libcudart.so.13', recursive=True)), ''))")
  [ -n "$cudart" ] && ln -sf "$cudart" /tmp/pd_libs/  # torch's CUDA runtime, which engine.so links
  for _ in 1 2 3 4 5; do
    missing=$(LD_LIBRARY_PATH=/tmp/pd_libs ldd /tmp/site/mooncake/engine.so /tmp/pd_libs/*.so* 2>/dev/null | awk '/not found/ {print $1}' | sort -u)
    [ -z "$missing" ] && break
    for lib in $missing; do [ -e "/tmp/pd_bundle/syslibs/$lib" ] && cp -aL "/tmp/pd_bundle/syslibs/$lib" /tmp/pd_libs/; done
  done
  log "PD bundle: system libraries carried in: $(ls /tmp/pd_libs | tr '\n' ' ')${missing:+; still missing: $missing}"
  touch /tmp/site/.pd_ok
fi
# optional: .site/v4.tar.xz (scripts/gpu/build_v4_bundle.sh), TileLang and libz3 for DeepSeek-V4's mHC
# kernels; the CUTLASS headers it shares with DeepGEMM come back from /tmp/site/deep_gemm/include
if [ -f .site/v4.tar.xz ] && [ ! -f /tmp/site/.v4_ok ]; then
  python3 -c "import tarfile; tarfile.open('.site/v4.tar.xz').extractall('/tmp/v4_bundle')" || { log "cannot extract .site/v4.tar.xz"; exit 2; }
  cp -a /tmp/v4_bundle/site/. /tmp/site/ && rm -rf /tmp/v4_bundle
  cutlass=/tmp/site/tilelang/3rdparty/cutlass/include
  if [ -f $cutlass/.fill_from_deep_gemm ]; then
    python3 -c "
import os, shutil, sys
src, dst = '/tmp/site/deep_gemm/include', sys.argv[1]
for top in ('cute', 'cutlass'):  # copy what is missing, overwrite nothing (TileLang's own differing headers stay)
    for d, _, files in os.walk(os.path.join(src, top)):
        for f in files:
            out = os.path.join(dst, os.path.relpath(os.path.join(d, f), src))
            if not os.path.exists(out):
                os.makedirs(os.path.dirname(out), exist_ok=True)
                shutil.copy2(os.path.join(d, f), out)
" $cutlass || { log "cannot fill TileLang's CUTLASS headers"; exit 2; }
  fi
  log "V4 bundle: $(ls -d /tmp/site/tilelang-*.dist-info 2>/dev/null | xargs -n1 basename), $(find $cutlass -type f | wc -l) CUTLASS headers"
  touch /tmp/site/.v4_ok
fi
if [ -d /tmp/pd_libs ]; then
  export LD_LIBRARY_PATH=/tmp/pd_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  PYTHONPATH=/tmp/site python3 -c "import torch; from mooncake.engine import TransferEngine" 2>&1 | tail -1 | sed 's/^/[pd bundle] /' \
    | tee -a "$OUT/run.log"
fi
for cache in .jit/*.tar.xz; do
  if [ -f "$cache" ]; then
    mkdir -p /tmp/jit && python3 -c "import tarfile; tarfile.open('$cache').extractall('/tmp/jit')" && log "restored JIT cache $cache"
  fi
done
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export TVM_FFI_CACHE_DIR=/tmp/jit/tvm-ffi DG_JIT_CACHE_DIR=/tmp/jit/deep_gemm SGLANG_DG_CACHE_DIR=/tmp/jit/deep_gemm
export TRITON_CACHE_DIR=/tmp/jit/triton FLASHINFER_WORKSPACE_BASE=/tmp/jit/flashinfer SGLANG_CACHE_DIR=/tmp/jit/sglang
export TILELANG_CACHE_DIR=/tmp/jit/tilelang  # TileLang's kernel cache (V4's mHC), packed with the others
export SGLANG_HISPARSE_DUMMY_INIT=normal OUT
rm -rf /tmp/e2e_logs  # a warm machine keeps the last call's server logs; bring back only this call's
log "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1); python $(python3 -V 2>&1)"
python3 -c "import torch, sglang, sglang_hisparse; print('versions', torch.__version__, sglang.__version__, sglang_hisparse.__file__)" 2>&1 | tail -1 | tee -a "$OUT/run.log"
run_probe() {  # the probe job: build, run (JSON lines to $OUT/slot_hash_probe.jsonl), echo its lines
  nvcc -O3 -std=c++17 -arch=sm_90a scripts/gpu/slot_hash_probe.cu -o /tmp/slot_hash_probe || return $?
  /tmp/slot_hash_probe "$@" > "$OUT/slot_hash_probe.jsonl"
  local probe_rc=$?
  cat "$OUT/slot_hash_probe.jsonl"
  return "$probe_rc"
}
run_job() {
  local job=$1; shift
  log "job $job $*"
  case "$job" in
    kernel) bash scripts/gpu/kernel_suite.sh "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    verify) bash scripts/gpu/verify_suite.sh "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    c4) bash scripts/gpu/c4_suite.sh "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    e2e) python3 scripts/gpu/e2e.py "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    pytest) python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    bench) HISPARSE_BENCH_COMMAND="bash scripts/gpu/run.sh bench $*" python3 scripts/research/bench_resolve.py --out "$OUT" "$@" 2>&1 \
             | tee -a "$OUT/run.log" ;;
    sweep) python3 scripts/gpu/sweep.py "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    pd) python3 scripts/gpu/pd.py "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    step-host) python3 scripts/research/bench_step_host.py --device cuda --out "$OUT/step_host_gpu.json" "$@" 2>&1 \
                 | tee -a "$OUT/run.log" ;;
    step-host-tree) local tree=$1; shift  # another checkout's bench and package (e.g. the code before a change)
                    python3 "$tree/scripts/research/bench_step_host.py" --device cuda "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    policy) python3 scripts/research/bench_policy_replay.py --device cuda --out "$OUT/policy_replay.json" "$@" 2>&1 \
              | tee -a "$OUT/run.log" ;;
    demo) python3 -m sglang_hisparse.tools.demo --log-dir /tmp/e2e_logs/demo "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    probe) run_probe "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    v4probe) python3 scripts/gpu/v4_probe.py "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    v4pd) python3 scripts/gpu/v4_pd.py "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    prefix) python3 scripts/gpu/prefix_bench.py "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    *) log "unknown job $job"; return 2 ;;
  esac
  local job_rc=${PIPESTATUS[0]}
  log "job $job exit $job_rc"
  return "$job_rc"
}
rc=0
args=()
bg_pids=()
for word in "$@" +; do
  if [ "$word" = "+" ]; then
    if [ ${#args[@]} -gt 1 ] && [ "${args[0]}" = bg ]; then
      run_job "${args[@]:1}" &
      bg_pids+=($!)
      log "job ${args[1]} started in the background"
    elif [ ${#args[@]} -gt 0 ]; then
      run_job "${args[@]}" || rc=$?
    fi
    args=()
  else
    args+=("$word")
  fi
done
for pid in "${bg_pids[@]}"; do wait "$pid" || rc=$?; done
# at most 8 files come back: logs into logs.tar.xz, JIT caches into jit.tar.xz
# HISPARSE_PACK_JIT=0: leave the JIT caches out (packing them takes minutes of device time; worth it
# only when a later call will carry them)
JIT_DIR=/tmp/jit; [ "${HISPARSE_PACK_JIT:-1}" = 0 ] && JIT_DIR=/nonexistent && log "JIT caches not packed (HISPARSE_PACK_JIT=0)"
python3 scripts/gpu/pack_outputs.py "$OUT" --jit-dir "$JIT_DIR" --e2e-logs /tmp/e2e_logs || true
log "all jobs done, exit $rc"
exit $rc
