// Micro-benchmark for #17's planning floor (docs/kernel.md, "A variant with memory proportional to
// B"): is probing a persistent per-(layer, request) hash of the slot table in global memory (one
// probe chain per selection), or a dense position -> slot map (one load per selection), cheaper
// than what the planner does now to find its hits (S1: insert the k selections into a
// shared-memory hash; S2: every one of the B slots looks its token up)?
//
// Standalone CUDA (no torch): nvcc -O3 -std=c++17 -arch=sm_90a slot_hash_probe.cu -o probe
//   ./probe [--B 4096] [--k 2048] [--hit 0.87] [--reps 30] [--threads 960] > probe.jsonl
// One CTA per request, as the planner. Every rep flushes L2 first (the bench's convention), then
// launches; thread 0 of CTA 0 stamps clock64() around the timed stage (the stage clock's
// convention), CUDA events time the whole launch. Every variant writes the selection -> slot map
// it found, and the host checks it against the truth of every request before any number is
// printed. Variants:
//   smem_hash : stage the B slot tokens into smem, clear a 4k-entry hash, S1 + S2 as in
//               kernels/resolve.cuh (timed: all of it; `cycles_stage_median` is the token staging alone,
//               in the other variants the hit-mask clear)
//   gprobe    : probe the request's 2B-entry global hash (int32 position, int32 slot) once per
//               selection, setting a B-bit hit mask in smem (timed: all of it)
//   gmap      : the dense map of the eighth session's plan: one int16 load per selection from the
//               request's context-long position -> slot row, the same hit mask (timed: all of it)
// The global tables are freshly built (no tombstones): the probe chains are the shortest a live
// table would have. Output: one JSON object per (variant, batch) on stdout.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, \
                   __LINE__);                                                           \
      std::exit(2);                                                                     \
    }                                                                                   \
  } while (0)

static int ilog2(int x) { int b = 0; while ((1 << b) < x) ++b; return b; }

__host__ __device__ inline int hash_of(int32_t key, int bits) {
  return static_cast<int>((static_cast<uint32_t>(key) * 2654435761u) >> (32 - bits));
}

struct Args {
  const int32_t* topk;   // [batch, k]
  const int32_t* tokens; // [batch, B] position held by each slot
  const int2* table;     // [batch, H] (position, slot), position -1 = empty
  const int16_t* map;    // [batch, context] slot of each position or -1
  int32_t* sel_out;      // [batch, k] slot of each selection or -1
  long long* stamps;     // [3] CTA 0: start, after staging, end
  int B, k, H_bits, hash_bits, context;
};

// Untimed in every variant (S0 stages the top-k row in the planner too).
__device__ void stage_topk(const Args& a, int32_t* topk) {
  for (int j = threadIdx.x; j < a.k; j += blockDim.x) topk[j] = a.topk[size_t(blockIdx.x) * a.k + j];
  __syncthreads();
}

// CTA 0's stamps, then every CTA's selection -> slot row (checked by the host).
__device__ void finish(const Args& a, long long t0, long long t1, long long t2, const int32_t* sel) {
  if (blockIdx.x == 0 && threadIdx.x == 0) { a.stamps[0] = t0; a.stamps[1] = t1; a.stamps[2] = t2; }
  for (int j = threadIdx.x; j < a.k; j += blockDim.x) a.sel_out[size_t(blockIdx.x) * a.k + j] = sel[j];
}

// The current planner's S1 + S2 (smem hash keyed by selected position, B lookups).
__global__ void smem_hash_kernel(Args a) {
  extern __shared__ unsigned char smem[];
  int32_t* topk = reinterpret_cast<int32_t*>(smem);
  int32_t* tok = topk + a.k;
  int32_t* sel = tok + a.B;
  const int H = 1 << a.hash_bits;
  int32_t* hkeys = sel + a.k;
  int16_t* hvals = reinterpret_cast<int16_t*>(hkeys + H);
  const int r = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
  stage_topk(a, topk);
  long long t0 = clock64();
  for (int s = tid; s < a.B; s += nt) tok[s] = a.tokens[size_t(r) * a.B + s];
  __syncthreads();
  long long t1 = clock64();
  for (int h = tid; h < H; h += nt) hkeys[h] = -1;
  for (int j = tid; j < a.k; j += nt) sel[j] = -1;
  __syncthreads();
  for (int j = tid; j < a.k; j += nt) {  // S1
    const int32_t q = topk[j];
    int h = hash_of(q, a.hash_bits);
    while (true) {
      const int32_t prev = atomicCAS(hkeys + h, -1, q);
      if (prev == -1) { hvals[h] = static_cast<int16_t>(j); break; }
      if (prev == q) break;
      h = (h + 1) & (H - 1);
    }
  }
  __syncthreads();
  for (int s = tid; s < a.B; s += nt) {  // S2
    const int32_t t = tok[s];
    if (t < 0) continue;
    int h = hash_of(t, a.hash_bits);
    while (true) {
      const int32_t key = hkeys[h];
      if (key == t) { atomicMax(sel + hvals[h], s); break; }
      if (key == -1) break;
      h = (h + 1) & (H - 1);
    }
  }
  __syncthreads();
  finish(a, t0, t1, clock64(), sel);
}

// The proposal: one probe chain per selection into the request's global slot-table hash.
struct GlobalHash {
  __device__ int32_t operator()(const Args& a, int32_t q) const {
    const int H = 1 << a.H_bits;
    const int2* table = a.table + size_t(blockIdx.x) * H;
    int h = hash_of(q, a.H_bits);
    while (true) {
      const int2 e = __ldg(table + h);
      if (e.x == q) return e.y;
      if (e.x == -1) return -1;
      h = (h + 1) & (H - 1);
    }
  }
};

// The dense map: one load per selection.
struct DenseMap {
  __device__ int32_t operator()(const Args& a, int32_t q) const {
    return __ldg(a.map + size_t(blockIdx.x) * a.context + q);
  }
};

// Each selection's slot from a persistent table (Lookup), and the B-bit hit mask S3 would read.
template <typename Lookup>
__global__ void lookup_kernel(Args a) {
  extern __shared__ unsigned char smem[];
  int32_t* topk = reinterpret_cast<int32_t*>(smem);
  int32_t* sel = topk + a.k;
  uint32_t* hit = reinterpret_cast<uint32_t*>(sel + a.k);
  stage_topk(a, topk);
  long long t0 = clock64();
  for (int w = threadIdx.x; w < (a.B + 31) / 32; w += blockDim.x) hit[w] = 0;
  __syncthreads();
  long long t1 = clock64();
  for (int j = threadIdx.x; j < a.k; j += blockDim.x) {
    const int32_t slot = Lookup()(a, topk[j]);
    sel[j] = slot;
    if (slot >= 0) atomicOr(hit + (slot >> 5), 1u << (slot & 31));
  }
  __syncthreads();
  finish(a, t0, t1, clock64(), sel);
}

int main(int argc, char** argv) {
  int B = 4096, k = 2048, reps = 30, threads = 960;
  double hit_frac = 0.87;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string o = argv[i];
    if (o == "--B") B = std::atoi(argv[i + 1]);
    else if (o == "--k") k = std::atoi(argv[i + 1]);
    else if (o == "--reps") reps = std::atoi(argv[i + 1]);
    else if (o == "--threads") threads = std::atoi(argv[i + 1]);
    else if (o == "--hit") hit_frac = std::atof(argv[i + 1]);
    else { std::fprintf(stderr, "unknown option %s (allowed: --B --k --reps --threads --hit)\n", o.c_str()); return 2; }
  }
  if (k > B || B > 32767 || threads % 32 != 0 || threads < 32 || threads > 1024) {
    std::fprintf(stderr, "need k <= B <= 32767 and --threads a multiple of 32 in [32, 1024]\n");
    return 2;
  }
  const int context = 8 * B, H_bits = ilog2(2 * B), H = 1 << H_bits, hash_bits = ilog2(4 * k);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const int max_batch = 64;
  std::mt19937 rng(1234);
  std::vector<int32_t> topk(size_t(max_batch) * k), tokens(size_t(max_batch) * B), truth(size_t(max_batch) * k);
  std::vector<int2> table(size_t(max_batch) * H, make_int2(-1, -1));
  std::vector<int16_t> dense(size_t(max_batch) * context, int16_t(-1));
  const int hits = static_cast<int>(hit_frac * k + 0.5);
  for (int r = 0; r < max_batch; ++r) {
    std::vector<int32_t> perm(context);
    for (int p = 0; p < context; ++p) perm[p] = p;
    std::shuffle(perm.begin(), perm.end(), rng);
    // slots 0..B-1 hold perm[0..B-1]; selections: `hits` resident positions, the rest not resident
    std::vector<int32_t> slot_of_pos(context, -1);
    for (int s = 0; s < B; ++s) {
      tokens[size_t(r) * B + s] = perm[s];
      slot_of_pos[perm[s]] = s;
      dense[size_t(r) * context + perm[s]] = int16_t(s);
    }
    std::vector<int32_t> chosen(perm.begin(), perm.begin() + hits);
    chosen.insert(chosen.end(), perm.begin() + B, perm.begin() + B + (k - hits));
    std::shuffle(chosen.begin(), chosen.end(), rng);
    for (int j = 0; j < k; ++j) {
      topk[size_t(r) * k + j] = chosen[j];
      truth[size_t(r) * k + j] = slot_of_pos[chosen[j]];
    }
    for (int s = 0; s < B; ++s) {
      int h = hash_of(perm[s], H_bits);
      while (table[size_t(r) * H + h].x != -1) h = (h + 1) & (H - 1);
      table[size_t(r) * H + h] = make_int2(perm[s], s);
    }
  }
  int32_t *d_topk, *d_tokens, *d_sel;
  int2* d_table;
  int16_t* d_map;
  long long* d_stamps;
  unsigned char* d_flush;
  const size_t flush_bytes = 256ull << 20;
  CHECK(cudaMalloc(&d_topk, topk.size() * 4));
  CHECK(cudaMalloc(&d_tokens, tokens.size() * 4));
  CHECK(cudaMalloc(&d_sel, truth.size() * 4));
  CHECK(cudaMalloc(&d_table, table.size() * sizeof(int2)));
  CHECK(cudaMalloc(&d_map, dense.size() * sizeof(int16_t)));
  CHECK(cudaMalloc(&d_stamps, 3 * sizeof(long long)));
  CHECK(cudaMalloc(&d_flush, flush_bytes));
  CHECK(cudaMemcpy(d_topk, topk.data(), topk.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_tokens, tokens.data(), tokens.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_table, table.data(), table.size() * sizeof(int2), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_map, dense.data(), dense.size() * sizeof(int16_t), cudaMemcpyHostToDevice));
  Args a{d_topk, d_tokens, d_table, d_map, d_sel, d_stamps, B, k, H_bits, hash_bits, context};
  const size_t smem_hash = size_t(k) * 4 + size_t(B) * 4 + size_t(k) * 4 + (size_t(1) << hash_bits) * 6;
  const size_t smem_probe = size_t(k) * 4 * 2 + size_t((B + 31) / 32) * 4;
  CHECK(cudaFuncSetAttribute(smem_hash_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_hash)));
  CHECK(cudaFuncSetAttribute(lookup_kernel<GlobalHash>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_probe)));
  CHECK(cudaFuncSetAttribute(lookup_kernel<DenseMap>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_probe)));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::fprintf(stderr, "[probe] %s, %d SMs, clock %d kHz; B %d, k %d, hit %.2f, global table %d entries (%zu KB per "
               "request), smem hash %d entries\n", prop.name, prop.multiProcessorCount, clock_khz, B, k, hit_frac, H,
               size_t(H) * sizeof(int2) / 1024, 1 << hash_bits);
  const char* names[3] = {"smem_hash", "gprobe", "gmap"};
  for (int batch : {1, 16, 64}) {
    for (int v = 0; v < 3; ++v) {
      std::vector<double> cycles, cycles_stage, us;
      for (int rep = 0; rep < reps + 2; ++rep) {  // the first two are warm-up
        CHECK(cudaMemset(d_sel, 0x7f, truth.size() * 4));  // poisoned
        CHECK(cudaMemsetAsync(d_flush, rep & 0xff, flush_bytes));
        CHECK(cudaEventRecord(e0));
        if (v == 0) smem_hash_kernel<<<batch, threads, smem_hash>>>(a);
        else if (v == 1) lookup_kernel<GlobalHash><<<batch, threads, smem_probe>>>(a);
        else lookup_kernel<DenseMap><<<batch, threads, smem_probe>>>(a);
        CHECK(cudaEventRecord(e1));
        CHECK(cudaGetLastError());
        CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        long long st[3];
        CHECK(cudaMemcpy(st, d_stamps, sizeof(st), cudaMemcpyDeviceToHost));
        std::vector<int32_t> got(size_t(batch) * k);
        CHECK(cudaMemcpy(got.data(), d_sel, got.size() * 4, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < got.size(); ++i) {
          if (got[i] != truth[i]) {
            std::fprintf(stderr, "[probe] %s batch %d: selection %zu of request %zu got %d, expected %d\n", names[v],
                         batch, i % k, i / k, got[i], truth[i]);
            return 1;
          }
        }
        if (rep < 2) continue;
        cycles.push_back(double(st[2] - st[0]));
        cycles_stage.push_back(double(st[1] - st[0]));
        us.push_back(ms * 1000.0);
      }
      auto median = [](std::vector<double> x) { std::sort(x.begin(), x.end()); return x[x.size() / 2]; };
      std::printf("{\"variant\": \"%s\", \"B\": %d, \"k\": %d, \"hit\": %.3f, \"batch\": %d, \"threads\": %d, "
                  "\"reps\": %d, \"cycles_median\": %.0f, \"cycles_stage_median\": %.0f, \"event_us_median\": %.2f, "
                  "\"checked\": true, \"gpu\": \"%s\"}\n",
                  names[v], B, k, hit_frac, batch, threads, reps, median(cycles), median(cycles_stage), median(us),
                  prop.name);
      std::fflush(stdout);
    }
  }
  return 0;
}
