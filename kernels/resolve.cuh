// sglang-hisparse: the fused RESOLVE kernel and the copy-only plan replay kernel.
//
// One launch resolves one sparse layer for a batch: each request's top-k selected logical
// positions become hot-buffer device rows, misses are copied from pinned host memory, and the
// request's slot table and LRU order are updated. Semantics are exactly those of
// sglang_hisparse/resolver/reference.py (the oracle); docs/kernel.md explains the design.
//
// Grid layout of resolve_kernel (blockDim.x = any multiple of 32 in [32, 1024]):
//   blockIdx.x <  num_reqs            planner CTA of request blockIdx.x (padded rows exit early)
//   blockIdx.x >= num_reqs            copier CTA (only when num_copiers > 0 and not SkipIO)
//
// Planner stages (one CTA per request, all state in shared memory; a configuration too large for it
// keeps its top-k-sized arrays in a per-request global spill slice instead: PlanSpill). A resident request (residency
// tables passed, resident[r] != 0) and then a short one (seq_len <= its buffer size: B, or its entry
// of buffer_sizes) leave after S0's top-k row with their rows looked up directly (resolve_resident /
// the fast path): no IO, no table change.
//   S0  stage the request's rows (top-k, slot tokens, LRU, hot locs) into smem with cp.async
//   S1  insert the selected positions into an open-addressing hash table (position -> j)
//   S2  every slot looks its token up: slot s holding selection j is a hit for j
//       (with the position -> slot map, S1 + S2 are one pass: each selection's map entry names
//       a candidate slot, a hit when that slot holds the position: find_hits_in_map)
//   S3  warp-ballot counts of misses (top-k order) and evictable slots (LRU order)
//   S4  block scan of the per-warp counts (every warp redundantly: no extra barrier)
//   S5  ranks: miss j gets rank m, evictable slot gets rank e; the m-th miss takes the m-th
//       evictable slot; new LRU = [evictables not taken][victims in miss order][hits]; start the
//       host-row gathers of the misses (cp.async)
//   S6  publish: out (top-k order), slot tokens of victims, LRU row, miss list, plan, counters
//   copy: misses are copied host -> device with 16-byte loads, all loads of a thread issued
//         before its stores; either by copier CTAs (after every planner has published) or, with
//         num_copiers == 0, by the planner CTA itself.
//
// Cross-CTA protocol (copier mode only; workspace state words, zero between launches):
//   planner: total_rows += M (atomic, gives the base of its rows in the flat miss list);
//            writes its list; __syncthreads; thread 0: fence + red.release planned += 1
//   copier : thread 0 spins until ld.acquire(planned) >= num_real (planners have lower block
//            indices, so every planner a copier waits for was dispatched before it and never
//            waits itself: the decoupled look-back forward-progress assumption); reads
//            total_rows; exited += 1 (acq_rel); the copier that sees exited == C - 1 is the last
//            reader of the counters and resets planned/total_rows/exited to 0 for the next
//            launch (stream order makes the reset visible to it). No host reset, so the launch is
//            CUDA-graph replayable. A copier that waits longer than spin_timeout_ns traps.

#pragma once

#ifdef HISPARSE_EMULATE
// CPU emulation of the CUDA built-ins used below (tests/emulation/cuda_emulation.h): the device
// code of this file runs unchanged on host threads, for checking it without a GPU.
#include "cuda_emulation.h"
#define HISPARSE_DYNAMIC_SMEM(name) unsigned char* name = emu::dynamic_smem()
#else
#include <sgl_kernel/utils.cuh>
#include <sgl_kernel/utils.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>

#include <cuda_runtime.h>
#define HISPARSE_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>

namespace hisparse {

// ------------------------------------------------------------------------------------------------
// Constants and shared-memory layout
// ------------------------------------------------------------------------------------------------

inline constexpr int kWarpSize = 32;
inline constexpr int kMaxThreads = 1024;
inline constexpr int kCopyUnroll = 4;  // 16-byte chunks a thread has in flight per iteration
// Automatic copier choice: from this many requests on, each planner copies its own misses (no
// copier CTAs). H200 sweep (docs/results/gpu_run8), B=4096, 1152 B, 13% misses, self-copy vs
// 16-132 copier CTAs: batch 4 42 vs 44-46 us, batch 16 113 vs 116-124, batch 64 402 vs 424-460;
// batch 1: 30 vs 25-26 (copiers win).
inline constexpr int kSelfCopyMinReqs = 4;
inline constexpr unsigned kFullMask = 0xffffffffu;

// Workspace state words (uint32), each on its own 128-byte line. Only errors is ever non-zero
// between launches.
inline constexpr int kStatePlanned = 0;
inline constexpr int kStateTotalRows = 32;
inline constexpr int kStateExited = 64;
inline constexpr int kStateErrors = 96;
inline constexpr int kStateClock = 100;  // diagnostic build only: 13 uint64 stamps, words 100-125
inline constexpr int kStateWords = 128;

inline constexpr size_t kMaxSmemBytes = 227 * 1024;  // Hopper opt-in limit per block

// ------------------------------------------------------------------------------------------------
// Row layouts: where a row's bytes are in a KV buffer (the copies and the residency lookup).
// The torch twin is sglang_hisparse/resolver/c4_rows.py.
// ------------------------------------------------------------------------------------------------

// Linear rows (DSA): row g is kItemBytes bytes at g * kItemBytes, copied as kItemBytes / 16 chunks
// of 16 bytes; a position is a token. A buffer's leading dimension indexes rows.
template <int kItemBytes>
struct RowLayout {
  static_assert(kItemBytes % 16 == 0, "linear rows are copied in 16-byte chunks");
  static constexpr uint32_t kChunks = kItemBytes / 16;
  static constexpr int kRatioShift = 0;  // log2(tokens per position)
  static constexpr int64_t kRowsPerUnit = 1;  // rows per index of the buffer's leading dimension
  static constexpr int64_t kUnitBytes = kItemBytes;
  static __device__ __forceinline__ int64_t chunk_offset(int64_t row, uint32_t col) {
    return row * kItemBytes + static_cast<int64_t>(col) * 16;
  }
  static __device__ __forceinline__ constexpr bool is_short_chunk(uint32_t) {
    return false;
  }
};

// DeepSeek-V4's C4 attention KV (584-byte rows: this item size selects the layout), in FlashMLA's
// paged layout as SGLang 0.5.17 allocates it: 64 entries per 37440-byte page; entry e's 576 value
// bytes (fp8 nope + bf16 rope) at page(e) + (e % 64) * 576, its 8 scale bytes at
// page(e) + 36864 + (e % 64) * 8; the page's last 64 bytes are padding (never touched). Copied as
// 36 chunks of 16 bytes and one of 8. A position is a compressed entry of 4 tokens, whose logical
// id is that of the token completing it, divided by 4. A buffer's leading dimension indexes pages.
inline constexpr int kC4ItemBytes = 584;
template <>
struct RowLayout<kC4ItemBytes> {
  static constexpr int kPageEntries = 64;
  static constexpr int64_t kValueBytes = 576;
  static constexpr int64_t kScaleOffset = kPageEntries * kValueBytes;  // 36864
  static constexpr uint32_t kChunks = kValueBytes / 16 + 1;  // 36 value chunks, then the scale chunk
  static constexpr int kRatioShift = 2;
  static constexpr int64_t kRowsPerUnit = kPageEntries;
  static constexpr int64_t kUnitBytes = 37440;
  static __device__ __forceinline__ int64_t chunk_offset(int64_t row, uint32_t col) {
    const int64_t page = (row >> 6) * kUnitBytes;
    const int64_t entry = row & (kPageEntries - 1);
    return col < kChunks - 1 ? page + entry * kValueBytes + static_cast<int64_t>(col) * 16
                             : page + kScaleOffset + entry * 8;
  }
  static __device__ __forceinline__ constexpr bool is_short_chunk(uint32_t col) {
    return col == kChunks - 1;
  }
};

constexpr int next_pow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}
constexpr int ilog2(int x) {
  int l = 0;
  while ((1 << l) < x) ++l;
  return l;
}
constexpr size_t align16(size_t x) {
  return (x + 15) & ~size_t(15);
}
constexpr size_t cmax(size_t a, size_t b) {
  return a > b ? a : b;
}

// Planner shared memory. Mirrored by sglang_hisparse/resolver/cuda.py: planner_smem_bytes().
// kReuse (the reuse-table replacement policy) appends the policy's arrays; without it the layout
// is the LRU kernel's. kSpill (a verify union's N x top_k positions, see PlanSpill) leaves the
// arrays sized by kTopK out (zero bytes here): they live in the request's global spill slice.
template <int kB, int kTopK, bool kReuse, bool kSpill>
struct PlanLayoutOf {
  // Load factor <= 1/4: the probe loops of S1/S2 run as long as the longest probe of the warp's
  // 32 lanes, and shared-memory bank conflicts make every probe cost several cycles of the SM's
  // shared-memory pipe (measured: S1 + S2 were ~14k of a planner's ~29k cycles at load 1/2).
  static constexpr int kHash = next_pow2(4 * kTopK);
  static constexpr int kKGroups = (kTopK + 31) / 32;  // 32-entry groups of the top-k row
  static constexpr int kBGroups = (kB + 31) / 32;     // 32-entry groups of the LRU row
  static constexpr int kHashBits = ilog2(kHash);
  static constexpr size_t kK = kSpill ? 0 : size_t(kTopK);   // top-k-sized arrays held here
  static constexpr size_t kH = kSpill ? 0 : size_t(kHash);   // hash entries held here
  static constexpr size_t kKG = kSpill ? 0 : size_t(kKGroups);
  static constexpr size_t kTopkOff = 0;                                       // int32[kTopK]
  static constexpr size_t kSelOff = align16(kTopkOff + 4 * kK);               // int32[kTopK]
  static constexpr size_t kTokOff = align16(kSelOff + 4 * kK);                // int32[kB]
  static constexpr size_t kHotOff = align16(kTokOff + 4 * size_t(kB));        // int32[kB + 1]
  static constexpr size_t kLruOff = align16(kHotOff + 4 * size_t(kB + 1));    // int16[kB]
  static constexpr size_t kVictOff = align16(kLruOff + 2 * size_t(kB));       // int16[kTopK]
  static constexpr size_t kMissMaskOff = align16(kVictOff + 2 * kK);                         // u32[kKGroups]
  static constexpr size_t kEvictMaskOff = align16(kMissMaskOff + 4 * kKG);                   // u32[kBGroups]
  static constexpr size_t kUnionOff = align16(kEvictMaskOff + 4 * size_t(kBGroups));
  // Union, part 1 (S0-S2): the hash table.
  static constexpr size_t kHashKeysOff = kUnionOff;                         // int32[kHash]
  static constexpr size_t kHashValsOff = align16(kHashKeysOff + 4 * kH);    // int16[kHash]
  static constexpr size_t kHashEnd = align16(kHashValsOff + 2 * kH);
  // Union, part 2 (S5-S6): the new LRU row and the host rows of the misses.
  static constexpr size_t kNewLruOff = kUnionOff;                                   // int16[kB]
  static constexpr size_t kHostRowOff = align16(kNewLruOff + 2 * size_t(kB));       // int64[kTopK]
  static constexpr size_t kPhase2End = align16(kHostRowOff + 8 * kK);
  static constexpr int kWsumRows = kReuse ? 5 : 3;  // per-warp counts (S3; S4b with kReuse)
  static constexpr size_t kMiscOff = cmax(kHashEnd, kPhase2End);  // int32[kWsumRows][32] + int32[8]
  static constexpr size_t kMiscEnd = align16(kMiscOff + 4 * (kWsumRows * kWarpSize + 8));
  // kReuse only (zero bytes otherwise): per-slot history, per-LRU-entry level, level histogram,
  // ballots of the evictables below / at the cut level.
  static constexpr size_t kHistOff = kMiscEnd;                                                // u16[kB]
  static constexpr size_t kLevelOff = align16(kHistOff + (kReuse ? 2 * size_t(kB) : 0));     // u8[kB]
  static constexpr size_t kHistoOff = align16(kLevelOff + (kReuse ? size_t(kB) : 0));        // int32[64]
  static constexpr size_t kLessMaskOff = align16(kHistoOff + (kReuse ? 4 * 64 : 0));         // u32[kBGroups]
  static constexpr size_t kEqMaskOff = align16(kLessMaskOff + (kReuse ? 4 * size_t(kBGroups) : 0));
  static constexpr size_t kBytes = align16(kEqMaskOff + (kReuse ? 4 * size_t(kBGroups) : 0));
};

// Whether a planner spills: its whole layout does not fit one CTA's shared memory. Decided at
// compile time per (B, top_k, policy). LRU at top_k 2048: one row spills above B = 16011, a verify
// union of 2 rows above B = 9108, a union of 3 rows or more at every B.
template <int kB, int kTopK, bool kReuse = false>
inline constexpr bool kPlanSpills = PlanLayoutOf<kB, kTopK, kReuse, false>::kBytes > kMaxSmemBytes;

// The shared memory a planner of this configuration uses (the spilled layout when it spills).
template <int kB, int kTopK, bool kReuse = false>
using PlanLayout = PlanLayoutOf<kB, kTopK, kReuse, kPlanSpills<kB, kTopK, kReuse>>;

// Planning with the position -> slot map (ResolveParams::slot_map): S0 stages the slot tokens
// into the hash table's region (unused without the hash table), where find_hits_in_map checks
// the map's candidates, and sets s_tok to "no selection" for every slot. A planner whose hash
// region is smaller than B, or lies in global memory (spilled), checks the candidates against
// the token row in global memory instead.
template <int kB, int kTopK, bool kReuse>
inline constexpr bool kMapStagesTokens =
    !kPlanSpills<kB, kTopK, kReuse> && PlanLayoutOf<kB, kTopK, kReuse, false>::kHash >= kB;

// A spilling planner's arrays sized by kTopK, in request i's slice of the workspace spill buffer
// (global memory, L2-resident in practice; slices of kBytes, 128-byte aligned): the selection map,
// victims, miss ballots, hash table and host rows, with PlanLayoutOf's roles. The top-k row is
// read in place from the input. Mirrored by cuda.py: planner_spill_bytes().
template <int kTopK>
struct PlanSpill {
  static constexpr int kHash = next_pow2(4 * kTopK);
  static constexpr size_t kSelOff = 0;                                                  // int32[kTopK]
  static constexpr size_t kVictOff = align16(kSelOff + 4 * size_t(kTopK));              // int16[kTopK]
  static constexpr size_t kMissMaskOff = align16(kVictOff + 2 * size_t(kTopK));         // u32[kKGroups]
  static constexpr size_t kHashKeysOff = align16(kMissMaskOff + 4 * size_t((kTopK + 31) / 32));  // int32[kHash]
  static constexpr size_t kHashValsOff = align16(kHashKeysOff + 4 * size_t(kHash));     // int16[kHash]
  static constexpr size_t kHostRowOff = align16(kHashValsOff + 2 * size_t(kHash));      // int64[kTopK]
  static constexpr size_t kBytes = (kHostRowOff + 8 * size_t(kTopK) + 127) & ~size_t(127);
};

// The reuse-table policy (kReuse): a slot's history word packs age | count << 8 (age: resolves
// since it was last selected, minus one, saturating at 255; count: selections since it was
// filled, saturating at 127). Levels come from a 54-entry table indexed age bucket * 6 + count
// bucket (sglang_hisparse/resolver/reuse.py); at most kReuseLevels distinct levels.
inline constexpr int kReuseLevels = 64;
inline constexpr uint16_t kVictimMark = 0x8000;  // S5 marks a victim's staged history word

// ------------------------------------------------------------------------------------------------
// Kernel parameters
// ------------------------------------------------------------------------------------------------

struct ResolveParams {
  const int32_t* topk;  // [num_reqs, kTopK], row stride topk_stride
  int64_t topk_stride;
  const void* seq_lens;  // int32 or int64 [num_reqs]
  const void* req_pool_indices;  // int32 or int64 [num_reqs]
  int32_t seq_is_i64;
  int32_t rpi_is_i64;
  const int32_t* hot_locs;  // [table_rows, >= kB + 1]
  int64_t hot_stride;
  int32_t* slot_tokens;  // [table_rows, kB]
  int64_t tok_stride;
  int16_t* lru;  // [table_rows, kB]
  int64_t lru_stride;
  const int64_t* host_locs;  // [table_rows, max_context]
  int64_t host_locs_stride;
  int64_t max_context;
  int64_t table_rows;  // rows valid in all four tables
  const uint8_t* host_kv;  // pinned host, rows of kItemBytes
  int64_t host_rows;
  uint8_t* device_kv;  // device, rows of kItemBytes
  int64_t device_rows;
  int32_t* out;  // [>= num_reqs, kTopK]
  int64_t out_stride;
  const int32_t* num_real_reqs;  // device scalar
  int32_t num_reqs;
  int32_t has_plan;
  int64_t* plan_host;  // [>= num_reqs, >= kTopK]
  int64_t plan_host_stride;
  int32_t* plan_dev;
  int64_t plan_dev_stride;
  int32_t* plan_counts;  // [>= num_reqs]
  int64_t* counters;  // nullable: += (selected, misses)
  // Residency (nullable: resident == nullptr turns it off). A request row r with resident[r] != 0
  // keeps its whole KV on the device: position q is at logical_to_device[req_to_token[r, q]].
  const uint8_t* resident;  // [>= table_rows], uint8 or bool, indexed by r
  const int32_t* req_to_token;  // [>= table_rows, rtt_cols], row stride rtt_stride
  int64_t rtt_stride;
  int64_t rtt_cols;
  const int64_t* logical_to_device;  // [logical_rows]
  int64_t logical_rows;
  // Reuse-table policy (nullable: slot_hist == nullptr is LRU; then the kReuse kernel is not used).
  int16_t* slot_hist;  // [table_rows, kB] history words, row stride hist_stride
  int64_t hist_stride;
  const uint8_t* reuse_levels;  // [54] level of each history cell
  // Position -> slot map (nullable: slot_map == nullptr plans with S1's hash table and S2's lookups).
  // Row r, column q: a slot that may hold position q. A hint, validated against the slot tokens
  // (slot_map[r, q] == s is a hit only if slot_tokens[r, s] == q), so stale or garbage entries
  // are harmless; the invariant its writers keep is the other direction: slot_tokens[r, s] == q
  // >= 0 implies slot_map[r, q] == s. The resolver writes each miss's entry (S6).
  int16_t* slot_map;  // [table_rows, >= max_context], row stride map_stride
  int64_t map_stride;
  // Per-request buffer sizes (nullable: every request uses all kB slots). Request row r uses the
  // slots [0, buffer_sizes[r]) of its tables (0 <= size <= kB; the newest position keeps slot kB):
  // its fast path holds while seq_len <= size, and a slot at or beyond size is neither a hit nor a
  // victim (its token is ignored; it keeps its place among the kept slots of the LRU row).
  const int32_t* buffer_sizes;  // [>= table_rows]
  uint32_t* state;  // workspace state words
  int64_t* flat_host;  // workspace miss list [>= num_reqs * kTopK]
  int32_t* flat_dev;
  uint8_t* spill;  // workspace spill slices [>= num_reqs * PlanSpill<kTopK>::kBytes] (spilling planners)
  uint64_t spin_timeout_ns;
};

struct ReplayParams {
  const int64_t* plan_host;
  int64_t plan_host_stride;
  const int32_t* plan_dev;
  int64_t plan_dev_stride;
  const int32_t* plan_counts;
  int32_t plan_rows;  // rows of the plan (counts.shape[0])
  int32_t plan_width;  // top_k (columns of host_rows / device_rows)
  const int32_t* num_real_reqs;
  const uint8_t* host_kv;
  int64_t host_rows;
  uint8_t* device_kv;
  int64_t device_rows;
  uint32_t* state;
};

// ------------------------------------------------------------------------------------------------
// Device helpers: async copies, vector loads/stores, scoped atomics
// ------------------------------------------------------------------------------------------------

#ifndef HISPARSE_EMULATE  // (the emulation header provides these)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// 16-byte load from pinned host memory (read-only for the kernel's lifetime) and 16-byte store.
// Neither has a "memory" clobber: a thread's loads are all issued before its stores.
__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void st_v4(void* p, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w));
}
// The 8-byte pair of the above (the scale chunk of a DeepSeek-V4 C4 row).
__device__ __forceinline__ uint2 ld_nc_v2(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ void st_v2(void* p, const uint2& v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};\n" ::"l"(p), "r"(v.x), "r"(v.y));
}

__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_gpu_add(uint32_t* p, uint32_t v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t atom_acq_rel_gpu_add(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void st_relaxed_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
#endif  // HISPARSE_EMULATE

__device__ __forceinline__ void count_error(uint32_t* state) {
  atomicAdd(state + kStateErrors, 1u);
}

// Diagnostic build only (-DHISPARSE_STAGE_CLOCK, scripts/research/bench_resolve.py --stage-clock): thread 0
// of CTA 0 stamps stage boundaries into workspace state words [kStateClock, kStateClock + 26) as
// uint64: 0-8 clock64() at kernel entry and after each planner stage, 9 / 11 globaltimer at the
// planner's start / end, 10 / 12 globaltimer when copier 0 acquired the plan / finished copying.
#ifdef HISPARSE_STAGE_CLOCK
#define HS_STAMP_ANY(k, v) (reinterpret_cast<unsigned long long*>(p.state + kStateClock)[k] = (v))
#define HS_STAMP(k, v)                                    \
  do {                                                    \
    if (blockIdx.x == 0 && threadIdx.x == 0) HS_STAMP_ANY(k, v); \
  } while (0)
#else
#define HS_STAMP_ANY(k, v) ((void)0)
#define HS_STAMP(k, v) ((void)0)
#endif

__device__ __forceinline__ int64_t load_index(const void* p, bool is_i64, int i) {
  return is_i64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Issue asynchronous copies of n elements g[0, n) -> s[0, n) (s is 16-byte aligned), striding the
// CTA's threads. 16-byte copies when g is 16-byte aligned, 4-byte when 4-byte aligned, else plain
// element loads. Complete with cp_async_wait_all() + __syncthreads().
template <typename T>
__device__ __forceinline__ void stage_row(T* s, const T* g, int n, int tid, int nt) {
  if (n <= 0) return;
  const uintptr_t ga = reinterpret_cast<uintptr_t>(g);
  int done = 0;
  if (ga % 16 == 0) {
    constexpr int kPer = 16 / sizeof(T);
    const int nv = n / kPer;
    for (int v = tid; v < nv; v += nt) cp_async16(s + v * kPer, g + v * kPer);
    done = nv * kPer;
  } else if (sizeof(T) <= 4 && ga % 4 == 0) {
    constexpr int kPer = sizeof(T) <= 4 ? 4 / sizeof(T) : 1;
    const int nv = n / kPer;
    for (int v = tid; v < nv; v += nt) cp_async4(s + v * kPer, g + v * kPer);
    done = nv * kPer;
  }
  for (int k = done + tid; k < n; k += nt) s[k] = g[k];
}

// Store n elements s[0, n) -> g[0, n), vectorized like stage_row.
template <typename T>
__device__ __forceinline__ void store_row(T* g, const T* s, int n, int tid, int nt) {
  const uintptr_t ga = reinterpret_cast<uintptr_t>(g);
  int done = 0;
  if (ga % 16 == 0) {
    constexpr int kPer = 16 / sizeof(T);
    const int nv = n / kPer;
    for (int v = tid; v < nv; v += nt) {
      reinterpret_cast<uint4*>(g)[v] = reinterpret_cast<const uint4*>(s)[v];
    }
    done = nv * kPer;
  } else if (sizeof(T) <= 4 && ga % 4 == 0) {
    constexpr int kPer = sizeof(T) <= 4 ? 4 / sizeof(T) : 1;
    const int nv = n / kPer;
    for (int v = tid; v < nv; v += nt) {
      reinterpret_cast<uint32_t*>(g)[v] = reinterpret_cast<const uint32_t*>(s)[v];
    }
    done = nv * kPer;
  }
  for (int k = done + tid; k < n; k += nt) g[k] = s[k];
}

// Inclusive scan across a warp (all 32 lanes participate).
__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
  for (int d = 1; d < kWarpSize; d <<= 1) {
    const int o = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += o;
  }
  return v;
}

// ------------------------------------------------------------------------------------------------
// Copy stage: rows[g] = (host row, device row) for g in [0, total_rows); every row is kItemBytes,
// split into 16-byte chunks. Chunk index idx = start + k * stride; consecutive lanes take
// consecutive chunks (coalesced). Each thread issues kCopyUnroll loads before any store.
// Rows outside [0, host_rows) x [0, device_rows) are skipped and counted as errors.
// ------------------------------------------------------------------------------------------------

struct FlatRows {
  const int64_t* host;
  const int32_t* dev;
  __device__ __forceinline__ void operator()(uint32_t g, int64_t& src, int64_t& dst) const {
    src = __ldcg(host + g);
    dst = static_cast<int64_t>(__ldcg(dev + g));
  }
};

struct PlanRows {
  const int64_t* host;
  int64_t host_stride;
  const int32_t* dev;
  int64_t dev_stride;
  const uint32_t* prefix;  // smem, prefix[0..n] (exclusive scan of the counts)
  int n;
  __device__ __forceinline__ void operator()(uint32_t g, int64_t& src, int64_t& dst) const {
    int lo = 0, hi = n;  // largest i in [0, n) with prefix[i] <= g (then prefix[i + 1] > g)
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (prefix[mid] <= g) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const int64_t m = static_cast<int64_t>(g - prefix[lo]);
    src = host[lo * host_stride + m];
    dst = static_cast<int64_t>(dev[lo * dev_stride + m]);
  }
};

template <int kItemBytes, typename RowFn>
__device__ __forceinline__ void copy_rows(
    const RowFn& rows,
    uint32_t first,
    uint32_t end,
    uint32_t stride,
    const uint8_t* __restrict__ host_kv,
    int64_t host_rows,
    uint8_t* __restrict__ device_kv,
    int64_t device_rows,
    uint32_t* state) {
  using Layout = RowLayout<kItemBytes>;
  constexpr uint32_t kChunks = Layout::kChunks;
  for (uint32_t base = first; base < end; base += stride * kCopyUnroll) {
    int64_t src[kCopyUnroll];
    int64_t dst[kCopyUnroll];
    uint32_t col[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const uint32_t idx = base + static_cast<uint32_t>(u) * stride;
      src[u] = -1;
      dst[u] = 0;
      col[u] = 0;
      if (idx < end) {
        const uint32_t g = idx / kChunks;
        col[u] = idx - g * kChunks;
        rows(g, src[u], dst[u]);
        if (src[u] < 0 || src[u] >= host_rows || dst[u] < 0 || dst[u] >= device_rows) {
          if (col[u] == 0) count_error(state);
          src[u] = -1;
        }
      }
    }
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (src[u] < 0) continue;
      const uint8_t* from = host_kv + Layout::chunk_offset(src[u], col[u]);
      if (Layout::is_short_chunk(col[u])) {
        const uint2 h = ld_nc_v2(from);
        v[u] = make_uint4(h.x, h.y, 0u, 0u);
      } else {
        v[u] = ld_nc_v4(from);
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (src[u] < 0) continue;
      uint8_t* to = device_kv + Layout::chunk_offset(dst[u], col[u]);
      if (Layout::is_short_chunk(col[u])) {
        st_v2(to, make_uint2(v[u].x, v[u].y));
      } else {
        st_v4(to, v[u]);
      }
    }
  }
}

// The chunks [lo, hi) that CTA `cta` of `ctas` copies out of `total`: one contiguous slice per
// CTA, so that the warps of one SM walk the host rows of one or two requests at a time rather
// than of every request (docs/kernel.md, "copy layout"). Consecutive threads take consecutive
// chunks.
__device__ __forceinline__ void cta_slice(uint32_t cta, uint32_t ctas, uint32_t total, uint32_t& lo, uint32_t& hi) {
  const uint32_t per = (total + ctas - 1) / ctas;
  const uint64_t a = static_cast<uint64_t>(cta) * per;
  lo = a < total ? static_cast<uint32_t>(a) : total;
  hi = total - lo < per ? total : lo + per;
}

// ------------------------------------------------------------------------------------------------
// Planner
// ------------------------------------------------------------------------------------------------

template <int kHashBits>
__device__ __forceinline__ int hash_of(int32_t key) {
  return static_cast<int>((static_cast<uint32_t>(key) * 2654435761u) >> (32 - kHashBits));
}

// Ends a planner CTA: every thread's global writes are done (barrier); in copier mode thread 0
// publishes the request (release); in self-copy mode the CTA copies its own misses.
template <int kItemBytes, bool kSkipIO>
__device__ __forceinline__ void finish_planner(const ResolveParams& p, bool copier_mode, uint32_t base, uint32_t misses) {
  __syncthreads();
  if constexpr (kSkipIO) {
    return;
  } else {
    if (copier_mode) {
      // The barrier above orders every thread's writes before thread 0's release (PTX release
      // is cumulative), so the copiers that acquire `planned` see the whole miss list.
      if (threadIdx.x == 0) red_release_gpu_add(p.state + kStatePlanned, 1u);
    } else if (misses > 0) {
      copy_rows<kItemBytes>(
          FlatRows{p.flat_host + base, p.flat_dev + base}, threadIdx.x, misses * RowLayout<kItemBytes>::kChunks, blockDim.x,
          p.host_kv, p.host_rows, p.device_kv, p.device_rows, p.state);
    }
  }
}

// Resident request (whole KV on the device): out[j] = logical_to_device[req_to_token[r, c] >> s] for
// every selected q, -1 for padding (c = q, s = 0; C4 entries of 4 tokens: c = 4q + 3, the token
// completing the entry, s = 2: RowLayout::kRatioShift). Reads only the top-k row (staged in smem by S0; this waits for
// it) and the request's req_to_token entries; copies nothing, leaves slot tokens, LRU, the miss
// list and the counters alone, and records a plan count of 0. A position >= seq_len or beyond
// req_to_token's columns, or a logical id outside logical_to_device, writes -1 and counts an error.
// Called by every thread of the CTA (it contains a barrier).
template <int kItemBytes, int kTopK>
__device__ __forceinline__ void resolve_resident(
    const ResolveParams& p, const int i, const int64_t r, const int64_t L, const int32_t* s_topk, int32_t* out_row) {
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  cp_async_wait_all();
  __syncthreads();
  constexpr int kShift = RowLayout<kItemBytes>::kRatioShift;
  const int32_t* rtt_row = p.req_to_token + r * p.rtt_stride;
  for (int j = tid; j < kTopK; j += nt) {
    const int32_t q = s_topk[j];
    int32_t o = -1;
    if (q >= 0) {
      const int64_t c = (static_cast<int64_t>(q) << kShift) + ((1 << kShift) - 1);  // valid: q < L, c < cols
      const int64_t id = static_cast<int64_t>(q) < L && c < p.rtt_cols ? static_cast<int64_t>(rtt_row[c]) >> kShift : -1;
      if (id >= 0 && id < p.logical_rows) {
        o = static_cast<int32_t>(p.logical_to_device[id]);
      } else {
        count_error(p.state);  // precondition: q < seq_len, a mapped logical id
      }
    }
    out_row[j] = o;
  }
  if (tid == 0 && p.has_plan) p.plan_counts[i] = 0;
}

// Arrays of a planner CTA: PlanLayout's offsets applied to the CTA's dynamic smem. The hash table
// (S1-S2) and the new LRU row + host rows (S5-S6) share PlanLayout's union region. A spilling
// planner (`kSpilled`) has its top-k-sized arrays in its PlanSpill slice and reads the top-k row in
// place; the stages index them alike (generic addresses), only cp.async needs shared memory.
template <int kB, int kTopK, bool kReuse>
struct PlanSmem {
  int32_t* topk;        // [kTopK]   S0: the request's top-k row
  int32_t* sel;         // [kTopK]   S2: the slot holding selection j (-1: none); S5: misses -2 - m
  int32_t* tok;         // [kB]      S0: slot tokens; S2 on: the selection j slot s holds (or -1)
  int32_t* hot;         // [kB + 1]  hot locs: device row of each slot, [kB] the newest position's
  int16_t* lru;         // [kB]      S0: the LRU row
  int16_t* vict;        // [kTopK]   S5: the slot the m-th miss takes
  uint32_t* missmask;   // [kKGroups] S3 ballots, read in S5
  uint32_t* evictmask;  // [kBGroups]
  int32_t* hkeys;       // [kHash]   union, part 1 (S0-S2)
  int16_t* hvals;       // [kHash]
  int16_t* newlru;      // [kB]      union, part 2 (S5-S6)
  int64_t* hostrow;     // [kTopK]
  int32_t* wsum;        // [3|5][32] per-warp counts: S3 misses, evictables, selections; S4b
                        //           (kReuse) evictables below / at the cut level
  int32_t* scalar;      // [8]       [0]: base of the request's rows in the miss list
  uint16_t* hist;       // [kB]      kReuse: S0 history words by slot; S5 marks victims
  uint8_t* level;       // [kB]      kReuse: S3 level of the evictable at LRU index qq
  int32_t* histo;       // [64]      kReuse: S3 evictables per level
  uint32_t* lessmask;   // [kBGroups] kReuse: S4b ballots, read in S5
  uint32_t* eqmask;     // [kBGroups]
  static constexpr bool kSpilled = kPlanSpills<kB, kTopK, kReuse>;  // top-k-sized arrays in global memory

  // `spill`: request i's slice of the workspace spill buffer, `topk_row`: its input top-k row
  // (both read only when the configuration spills).
  __device__ __forceinline__ PlanSmem(unsigned char* smem, unsigned char* spill, const int32_t* topk_row) {
    using Lay = PlanLayout<kB, kTopK, kReuse>;
    topk = reinterpret_cast<int32_t*>(smem + Lay::kTopkOff);
    sel = reinterpret_cast<int32_t*>(smem + Lay::kSelOff);
    tok = reinterpret_cast<int32_t*>(smem + Lay::kTokOff);
    hot = reinterpret_cast<int32_t*>(smem + Lay::kHotOff);
    lru = reinterpret_cast<int16_t*>(smem + Lay::kLruOff);
    vict = reinterpret_cast<int16_t*>(smem + Lay::kVictOff);
    missmask = reinterpret_cast<uint32_t*>(smem + Lay::kMissMaskOff);
    evictmask = reinterpret_cast<uint32_t*>(smem + Lay::kEvictMaskOff);
    hkeys = reinterpret_cast<int32_t*>(smem + Lay::kHashKeysOff);
    hvals = reinterpret_cast<int16_t*>(smem + Lay::kHashValsOff);
    newlru = reinterpret_cast<int16_t*>(smem + Lay::kNewLruOff);
    hostrow = reinterpret_cast<int64_t*>(smem + Lay::kHostRowOff);
    wsum = reinterpret_cast<int32_t*>(smem + Lay::kMiscOff);
    scalar = wsum + Lay::kWsumRows * kWarpSize;
    hist = reinterpret_cast<uint16_t*>(smem + Lay::kHistOff);
    level = reinterpret_cast<uint8_t*>(smem + Lay::kLevelOff);
    histo = reinterpret_cast<int32_t*>(smem + Lay::kHistoOff);
    lessmask = reinterpret_cast<uint32_t*>(smem + Lay::kLessMaskOff);
    eqmask = reinterpret_cast<uint32_t*>(smem + Lay::kEqMaskOff);
    if constexpr (kSpilled) {
      using Sp = PlanSpill<kTopK>;
      topk = const_cast<int32_t*>(topk_row);  // read only
      sel = reinterpret_cast<int32_t*>(spill + Sp::kSelOff);
      vict = reinterpret_cast<int16_t*>(spill + Sp::kVictOff);
      missmask = reinterpret_cast<uint32_t*>(spill + Sp::kMissMaskOff);
      hkeys = reinterpret_cast<int32_t*>(spill + Sp::kHashKeysOff);
      hvals = reinterpret_cast<int16_t*>(spill + Sp::kHashValsOff);
      hostrow = reinterpret_cast<int64_t*>(spill + Sp::kHostRowOff);
    }
  }
};

// The calling thread's place in its CTA.
struct PlanThread {
  int tid;
  int nt;  // threads of the CTA
  int warp;
  int lane;
  int nw;  // warps of the CTA
  unsigned lanes_below;  // mask of the lanes below this one
};

__device__ __forceinline__ PlanThread plan_thread() {
  PlanThread t;
  t.tid = threadIdx.x;
  t.nt = blockDim.x;
  t.warp = t.tid / kWarpSize;
  t.lane = t.tid % kWarpSize;
  t.nw = t.nt / kWarpSize;
  t.lanes_below = (1u << t.lane) - 1u;
  return t;
}

// A long request (seq_len > its buffer size) being planned: its index in the batch and its rows of the tables
// that S0-S6 read or update.
struct PlanRequest {
  int i;
  int32_t* tok_row;
  int16_t* lru_row;
  const int32_t* hot_row;
  const int64_t* host_loc_row;
  int32_t* out_row;
  int16_t* hist_row;  // reuse-table history (nullptr: LRU)
  int16_t* map_row;  // position -> slot map (nullptr: hash-table planning)
  int size;  // slots in use: [0, size) (ResolveParams::buffer_sizes)
};

__device__ __forceinline__ PlanRequest long_request(
    const ResolveParams& p, const int i, const int64_t r, const int32_t* hot_row, int32_t* out_row, const int size) {
  PlanRequest rq;
  rq.i = i;
  rq.size = size;
  rq.tok_row = p.slot_tokens + r * p.tok_stride;
  rq.lru_row = p.lru + r * p.lru_stride;
  rq.hot_row = hot_row;
  rq.host_loc_row = p.host_locs + r * p.host_locs_stride;
  rq.out_row = out_row;
  rq.hist_row = p.slot_hist != nullptr ? p.slot_hist + r * p.hist_stride : nullptr;
  rq.map_row = p.slot_map != nullptr ? p.slot_map + r * p.map_stride : nullptr;
  return rq;
}

// The slots request row r uses (ResolveParams::buffer_sizes; kB without the table). A size outside
// [0, kB] counts one error and is clamped into it. CTA-uniform (every thread reads the same word).
template <int kB>
__device__ __forceinline__ int request_buffer_size(const ResolveParams& p, const int64_t r) {
  if (p.buffer_sizes == nullptr) return kB;
  const int32_t size = p.buffer_sizes[r];
  if (size >= 0 && size <= kB) return size;
  if (threadIdx.x == 0) count_error(p.state);  // precondition: 0 <= buffer_sizes[r] <= B
  return size < 0 ? 0 : kB;
}

// The positions of a long request: the newest (seq_len - 1, the one being decoded: its device row
// is hot locs [B], it is neither hashed nor a miss) and the valid selections 0 <= q < valid_end.
struct Positions {
  int64_t newest;
  int64_t valid_end;

  __device__ __forceinline__ bool is_valid(int32_t q) const {
    return q >= 0 && static_cast<int64_t>(q) < valid_end;
  }
};

__device__ __forceinline__ Positions positions(const ResolveParams& p, const int64_t L) {
  const int64_t newest = L - 1;
  const int64_t valid_end = newest < p.max_context ? newest : p.max_context;
  return Positions{newest, valid_end};
}

// Warp-contiguous element ranges (multiples of 32) of the two ballot scans (S3, S5): top-k
// entries [k_begin, k_end) and LRU entries [b_begin, b_end) of the calling warp.
struct WarpRanges {
  int k_begin, k_end;
  int b_begin, b_end;
};

template <int kB, int kTopK>
__device__ __forceinline__ WarpRanges warp_ranges(const PlanThread& t) {
  WarpRanges w;
  const int k_per_warp = ((kTopK + kWarpSize * t.nw - 1) / (kWarpSize * t.nw)) * kWarpSize;
  w.k_begin = t.warp * k_per_warp;
  w.k_end = min(w.k_begin + k_per_warp, kTopK);
  const int b_per_warp = ((kB + kWarpSize * t.nw - 1) / (kWarpSize * t.nw)) * kWarpSize;
  w.b_begin = t.warp * b_per_warp;
  w.b_end = min(w.b_begin + b_per_warp, kB);
  return w;
}

// S4's result, the same in every thread: the warp's offsets among the misses (top-k order) and
// the evictables (LRU order), the request's totals, and M_eff = min(M, E) misses that get a slot.
struct PlanCounts {
  int miss_off;
  int evict_off;
  int M;
  int E;
  int selected;
  int M_eff;
};

// Invalid request row (r outside the tables): waits for S0's copies, writes -1 for every
// selection, counts one error and records a plan count of 0. CTA-uniform.
template <int kTopK>
__device__ __forceinline__ void reject_request(const ResolveParams& p, const int i, int32_t* out_row) {
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  cp_async_wait_all();
  for (int j = tid; j < kTopK; j += nt) out_row[j] = -1;
  if (tid == 0) {
    count_error(p.state);
    if (p.has_plan) p.plan_counts[i] = 0;
  }
}

// Fast path (seq_len <= the request's buffer size): position q lives at slot q, so out[j] = hot_locs[r, q] from the
// staged hot row; -1 for padding. No IO, no table change, a plan count of 0. A position >= seq_len
// writes -1 and counts an error. Called by every thread of the CTA (it contains a barrier).
template <int kB, int kTopK, bool kReuse>
__device__ __forceinline__ void resolve_short(
    const ResolveParams& p, const int i, const int64_t L, const int32_t* hot_row, const PlanSmem<kB, kTopK, kReuse>& sm,
    int32_t* out_row) {
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  stage_row(sm.hot, hot_row, L > 0 ? static_cast<int>(L) : 0, tid, nt);
  cp_async_wait_all();
  __syncthreads();
  for (int j = tid; j < kTopK; j += nt) {
    const int32_t q = sm.topk[j];
    int32_t o = -1;
    if (q >= 0) {
      if (q < L) {
        o = sm.hot[q];
      } else {
        count_error(p.state);  // precondition: positions < seq_len
      }
    }
    out_row[j] = o;
  }
  if (tid == 0 && p.has_plan) p.plan_counts[i] = 0;
}

// S0 (long path): stage the slot tokens, LRU and hot locs (cp.async); initialise the hash table
// and the selection map while the copies fly. Complete with cp_async_wait_all() + __syncthreads().
// With the position -> slot map: the slot tokens go to the hash region (kMapStagesTokens; else
// they are read in place) and s_tok starts as "no selection" (-1) for every slot.
template <int kB, int kTopK, bool kReuse>
__device__ __forceinline__ void stage_tables(const PlanSmem<kB, kTopK, kReuse>& sm, const PlanThread& t, const PlanRequest& rq) {
  constexpr int kHash = PlanLayout<kB, kTopK>::kHash;
  if (rq.map_row != nullptr) {  // CTA-uniform
    if constexpr (kMapStagesTokens<kB, kTopK, kReuse>) stage_row(sm.hkeys, rq.tok_row, kB, t.tid, t.nt);
    for (int s = t.tid; s < kB; s += t.nt) sm.tok[s] = -1;
  } else {
    stage_row(sm.tok, rq.tok_row, kB, t.tid, t.nt);
    if constexpr (kHash % 4 == 0) {
      for (int h = t.tid; h < kHash / 4; h += t.nt) reinterpret_cast<int4*>(sm.hkeys)[h] = make_int4(-1, -1, -1, -1);
    } else {
      for (int h = t.tid; h < kHash; h += t.nt) sm.hkeys[h] = -1;
    }
  }
  stage_row(sm.lru, rq.lru_row, kB, t.tid, t.nt);
  stage_row(sm.hot, rq.hot_row, kB + 1, t.tid, t.nt);
  if constexpr (kReuse) {
    stage_row(reinterpret_cast<int16_t*>(sm.hist), rq.hist_row, kB, t.tid, t.nt);
    for (int l = t.tid; l < kReuseLevels; l += t.nt) sm.histo[l] = 0;
  }
  for (int j = t.tid; j < kTopK; j += t.nt) sm.sel[j] = -1;  // -1: no slot holds selection j
}

// S1: insert every selected position (not padding, not the newest) into the hash table.
template <int kB, int kTopK, bool kReuse>
__device__ __forceinline__ void insert_selection(
    const ResolveParams& p, const PlanSmem<kB, kTopK, kReuse>& sm, const PlanThread& t, const Positions& pos) {
  using Lay = PlanLayout<kB, kTopK>;
  for (int j = t.tid; j < kTopK; j += t.nt) {
    const int32_t q = sm.topk[j];
    if (q < 0 || q == pos.newest) continue;
    if (!pos.is_valid(q)) {
      count_error(p.state);  // precondition: positions < seq_len (and < max_context)
      continue;
    }
    int h = hash_of<Lay::kHashBits>(q);
    while (true) {
      const int32_t prev = atomicCAS(sm.hkeys + h, -1, q);
      if (prev == -1) {
        sm.hvals[h] = static_cast<int16_t>(j);
        break;
      }
      if (prev == q) {  // precondition: selections are distinct; the first inserter keeps it
        count_error(p.state);
        break;
      }
      h = (h + 1) & (Lay::kHash - 1);
    }
  }
}

// S2: each slot looks up its token; s_tok[s] becomes the selection j it holds (or -1).
// If several slots held the same position (invalid state) the reference keeps the last one:
// atomicMax picks the largest slot index.
template <int kB, int kTopK, bool kReuse>
__device__ __forceinline__ void find_hits(const PlanSmem<kB, kTopK, kReuse>& sm, const PlanThread& t, const int size) {
  using Lay = PlanLayout<kB, kTopK>;
  for (int s = t.tid; s < kB; s += t.nt) {
    const int32_t tk = sm.tok[s];
    int32_t j = -1;
    if (tk >= 0 && s < size) {  // a slot beyond the request's size holds nothing
      int h = hash_of<Lay::kHashBits>(tk);
      while (true) {
        const int32_t k = sm.hkeys[h];
        if (k == tk) {
          j = sm.hvals[h];
          break;
        }
        if (k == -1) break;
        h = (h + 1) & (Lay::kHash - 1);
      }
    }
    sm.tok[s] = j;
    if (j >= 0) atomicMax(sm.sel + j, s);
  }
}

// The position -> slot map's candidates of the calling thread's first kMapPrefetch selections
// (j = tid + m * nt): the top-k entries read in place, then their map entries, all loads issued
// before any is used, while S0's copies fly (so the map's random reads overlap the staging
// instead of following it). s = -1 for padding, the newest position and invalid positions. Reads only.
inline constexpr int kMapPrefetch = 4;
struct MapCandidates {
  int32_t q[kMapPrefetch];  // the selected position (top-k entry j)
  int32_t s[kMapPrefetch];  // its map entry, or -1
};

template <int kTopK>
__device__ __forceinline__ MapCandidates prefetch_map(
    const int32_t* topk_row, const PlanThread& t, const PlanRequest& rq, const Positions& pos) {
  MapCandidates c;
#pragma unroll
  for (int m = 0; m < kMapPrefetch; ++m) {
    const int j = t.tid + m * t.nt;
    c.q[m] = j < kTopK ? topk_row[j] : -1;
  }
#pragma unroll
  for (int m = 0; m < kMapPrefetch; ++m) {
    const int32_t q = c.q[m];
    c.s[m] = (q != pos.newest && pos.is_valid(q)) ? static_cast<int32_t>(rq.map_row[q]) : -1;
  }
  return c;
}

// S1 + S2 with the position -> slot map, in one pass over the selections: selection j's map entry
// names a candidate slot s, a hit when slot s holds j's position (the staged or global token);
// s_tok[s] = j and s_sel[j] = s then, as S2 leaves them. Out-of-range or stale entries are misses.
// A position selected twice (a precondition violation) finds its slot claimed the second time:
// counted as an error and left a miss, as with S1's hash table. Positions held by two slots (an
// invalid state; the map's writers never make one) resolve to the slot the map names, where S2
// would take the larger. `cand`: prefetch_map's candidates of the thread's first selections; the
// rest (small blocks: more than kMapPrefetch selections per thread) read their entries here.
template <int kB, int kTopK, bool kReuse>
__device__ __forceinline__ void find_hits_in_map(
    const ResolveParams& p, const PlanSmem<kB, kTopK, kReuse>& sm, const PlanThread& t, const PlanRequest& rq,
    const Positions& pos, const MapCandidates& cand) {
  const int32_t* tokens = rq.tok_row;
  if constexpr (kMapStagesTokens<kB, kTopK, kReuse>) tokens = sm.hkeys;
  auto claim = [&](const int j, const int32_t q, const int s) {
    if (s < 0 || s >= rq.size || tokens[s] != q) return;  // not held (or beyond the buffer's size): a miss
    if (atomicCAS(sm.tok + s, -1, j) == -1) {
      sm.sel[j] = s;
    } else {
      count_error(p.state);  // precondition: selections are distinct
    }
  };
  auto invalid = [&](const int32_t q) {  // padding and the newest position are skipped, not errors
    if (q < 0 || q == pos.newest) return true;
    if (!pos.is_valid(q)) {
      count_error(p.state);  // precondition: positions < seq_len (and < max_context)
      return true;
    }
    return false;
  };
#pragma unroll
  for (int m = 0; m < kMapPrefetch; ++m) {
    const int j = t.tid + m * t.nt;
    if (j < kTopK && !invalid(cand.q[m])) claim(j, cand.q[m], cand.s[m]);
  }
  for (int j = t.tid + kMapPrefetch * t.nt; j < kTopK; j += t.nt) {
    const int32_t q = sm.topk[j];
    if (!invalid(q)) claim(j, q, rq.map_row[q]);
  }
}

// The eviction level of a slot from its history word (kReuse): age bucket = ceil(log2(age + 1))
// capped at 8 (edges 1, 2, 4, ..., 128), count bucket = floor(log2(count)) for count >= 2, capped
// at 5 (edges 1, 3, 7, 15, 31); the same buckets as sglang_hisparse_analysis/policies.py.
__device__ __forceinline__ int reuse_level(const uint8_t* levels, const uint16_t hist) {
  const int age = (hist & 0xff) + 1;  // resolves since the slot was last selected
  const int count = (hist >> 8) & 0x7f;
  const int age_bucket = min(32 - __clz(age - 1), 8);
  const int count_bucket = count <= 1 ? 0 : min(31 - __clz(count), 5);
  return levels[age_bucket * 6 + count_bucket] & (kReuseLevels - 1);
}

// S3: per-warp counts of misses, valid selections (top-k order) and evictables (LRU); the miss
// and evictable ballots are kept (one word per 32-entry group) for S5.
template <int kB, int kTopK, bool kReuse>
__device__ __forceinline__ void count_misses(
    const ResolveParams& p, const PlanSmem<kB, kTopK, kReuse>& sm, const PlanThread& t, const WarpRanges& w,
    const Positions& pos, const int size) {
  // Kept in place (not evictable): a slot hit this step, a slot beyond the request's size, an
  // invalid slot id.
  auto slot_is_evictable = [&](int s) -> bool {
    if (s < 0 || s >= size) return false;
    const int32_t j = sm.tok[s];
    return !(j >= 0 && sm.sel[j] == s);
  };
  int n_miss = 0, n_sel = 0, n_evict = 0;
  for (int base = w.k_begin; base < w.k_end; base += kWarpSize) {  // warp-uniform trip count
    const int j = base + t.lane;
    const int32_t q = j < w.k_end ? sm.topk[j] : -1;
    const bool v = pos.is_valid(q);
    const bool miss = v && sm.sel[j] < 0;
    n_sel += __popc(__ballot_sync(kFullMask, v));
    const unsigned mm = __ballot_sync(kFullMask, miss);
    n_miss += __popc(mm);
    if (t.lane == 0) sm.missmask[base / kWarpSize] = mm;
  }
  for (int base = w.b_begin; base < w.b_end; base += kWarpSize) {
    const int qq = base + t.lane;
    bool ev = false;
    if (qq < w.b_end) {
      const int s = sm.lru[qq];
      if (s < 0 || s >= kB) count_error(p.state);  // precondition: LRU is a permutation of [0, B)
      ev = slot_is_evictable(s);
      if constexpr (kReuse) {
        if (ev) {
          const int level = reuse_level(p.reuse_levels, sm.hist[s]);
          sm.level[qq] = static_cast<uint8_t>(level);
          atomicAdd(sm.histo + level, 1);
        }
      }
    }
    const unsigned em = __ballot_sync(kFullMask, ev);
    n_evict += __popc(em);
    if (t.lane == 0) sm.evictmask[base / kWarpSize] = em;
  }
  if (t.lane == 0) {
    sm.wsum[t.warp] = n_miss;
    sm.wsum[kWarpSize + t.warp] = n_evict;
    sm.wsum[2 * kWarpSize + t.warp] = n_sel;
  }
}

// S4: scan of the warp counts; every warp computes it (lanes >= nw read 0), so no barrier follows.
template <int kB, int kTopK, bool kReuse>
__device__ __forceinline__ PlanCounts scan_counts(const PlanSmem<kB, kTopK, kReuse>& sm, const PlanThread& t) {
  PlanCounts c;
  const int vm = t.lane < t.nw ? sm.wsum[t.lane] : 0;
  const int ve = t.lane < t.nw ? sm.wsum[kWarpSize + t.lane] : 0;
  const int vs = t.lane < t.nw ? sm.wsum[2 * kWarpSize + t.lane] : 0;
  const int im = warp_inclusive_scan(vm, t.lane);
  const int ie = warp_inclusive_scan(ve, t.lane);
  const int is = warp_inclusive_scan(vs, t.lane);
  c.miss_off = __shfl_sync(kFullMask, im - vm, t.warp);
  c.evict_off = __shfl_sync(kFullMask, ie - ve, t.warp);
  c.M = __shfl_sync(kFullMask, im, kWarpSize - 1);
  c.E = __shfl_sync(kFullMask, ie, kWarpSize - 1);
  c.selected = __shfl_sync(kFullMask, is, kWarpSize - 1);
  c.M_eff = c.M < c.E ? c.M : c.E;  // M <= E holds for valid input (B >= selections)
  return c;
}

// kReuse: the M_eff victims are the evictables of the lowest levels, ties by LRU order. Every
// evictable below `level` is a victim, and the first `need` at `level` in LRU order; S4b's scan
// gives each LRU entry the count of both kinds before it (below_off / at_off: the warp's offsets).
struct ReuseCut {
  int level;  // -1 when there is no victim
  int need;
  int below_off;
  int at_off;
};

// S4b (kReuse; every thread): the cut from S3's level histogram, then per-warp ballots of the
// evictables below / at the cut level into lessmask / eqmask and wsum rows 3 and 4. Complete
// with __syncthreads() and finish_reuse_cut().
template <int kB, int kTopK, bool kReuse>
__device__ __forceinline__ ReuseCut reuse_cut(
    const PlanSmem<kB, kTopK, kReuse>& sm, const PlanThread& t, const WarpRanges& w, const PlanCounts& c) {
  ReuseCut cut{-1, 0, 0, 0};
  int below = 0;
  for (int l = 0; l < kReuseLevels && c.M_eff > 0; ++l) {
    const int n = sm.histo[l];
    if (below + n >= c.M_eff) {
      cut.level = l;
      cut.need = c.M_eff - below;
      break;
    }
    below += n;
  }
  int n_less = 0, n_eq = 0;
  for (int base = w.b_begin; base < w.b_end; base += kWarpSize) {
    const int qq = base + t.lane;
    const bool ev = qq < w.b_end && ((sm.evictmask[base / kWarpSize] >> t.lane) & 1u);
    const int level = ev ? sm.level[qq] : kReuseLevels;
    const unsigned lm = __ballot_sync(kFullMask, level < cut.level);
    const unsigned qm = __ballot_sync(kFullMask, level == cut.level);
    n_less += __popc(lm);
    n_eq += __popc(qm);
    if (t.lane == 0) {
      sm.lessmask[base / kWarpSize] = lm;
      sm.eqmask[base / kWarpSize] = qm;
    }
  }
  if (t.lane == 0) {
    sm.wsum[3 * kWarpSize + t.warp] = n_less;
    sm.wsum[4 * kWarpSize + t.warp] = n_eq;
  }
  return cut;
}

// S4b after its barrier: the warp's offsets among the evictables below / at the cut level.
template <int kB, int kTopK, bool kReuse>
__device__ __forceinline__ void finish_reuse_cut(const PlanSmem<kB, kTopK, kReuse>& sm, const PlanThread& t, ReuseCut& cut) {
  const int vl = t.lane < t.nw ? sm.wsum[3 * kWarpSize + t.lane] : 0;
  const int vq = t.lane < t.nw ? sm.wsum[4 * kWarpSize + t.lane] : 0;
  const int il = warp_inclusive_scan(vl, t.lane);
  const int iq = warp_inclusive_scan(vq, t.lane);
  cut.below_off = __shfl_sync(kFullMask, il - vl, t.warp);
  cut.at_off = __shfl_sync(kFullMask, iq - vq, t.warp);
}

// S4 (thread 0): the base of the request's rows in the flat miss list, into s_scalar[0] (read
// after S5's barrier): its own rows i * top_k in self-copy mode, reserved atomically in copier mode.
template <int kB, int kTopK, bool kReuse>
__device__ __forceinline__ void reserve_miss_rows(
    const ResolveParams& p, const PlanSmem<kB, kTopK, kReuse>& sm, const PlanThread& t, const PlanRequest& rq,
    const PlanCounts& c, const bool copier_mode) {
  if (t.tid == 0) {
    if (c.M > c.E) count_error(p.state);
    uint32_t base = static_cast<uint32_t>(rq.i) * kTopK;  // self-copy mode: the request's own rows
    if (copier_mode && c.M_eff > 0) base = atomicAdd(p.state + kStateTotalRows, static_cast<uint32_t>(c.M_eff));
    sm.scalar[0] = static_cast<int32_t>(base);
  }
}

// S5: ranks. Miss j gets rank m (top-k order); victim v (LRU order) gets rank v; the m-th miss
// takes the m-th victim. LRU: the victims are the first M_eff evictables (v = e). kReuse: those
// the cut selects, v = below + min(at, need) counted before it; a victim's staged history word is
// marked for S6. New LRU = [evictables not taken][victims][hits], each in the old order. Starts
// the host-row gathers of the misses (cp.async); complete with cp_async_wait_all() + __syncthreads().
template <int kB, int kTopK, bool kReuse>
__device__ __forceinline__ void rank_and_gather(
    const ResolveParams& p, const PlanSmem<kB, kTopK, kReuse>& sm, const PlanThread& t, const WarpRanges& w,
    const PlanRequest& rq, const PlanCounts& c, const ReuseCut& cut, const bool need_host_rows) {
  int run = c.miss_off;
  for (int base = w.k_begin; base < w.k_end; base += kWarpSize) {
    const int j = base + t.lane;
    const unsigned mask = sm.missmask[base / kWarpSize];  // S3's ballot of this group
    if ((mask >> t.lane) & 1u) {  // a miss (only this thread rewrites s_sel[j])
      const int m = run + __popc(mask & t.lanes_below);
      sm.sel[j] = -2 - m;  // miss code
      if (need_host_rows && m < c.M_eff) {
        if constexpr (PlanSmem<kB, kTopK, kReuse>::kSpilled) {
          sm.hostrow[m] = rq.host_loc_row[sm.topk[j]];  // global to global: no cp.async
        } else {
          cp_async8(sm.hostrow + m, rq.host_loc_row + sm.topk[j]);
        }
      }
    }
    run += __popc(mask);
  }
  run = c.evict_off;
  int run_below = cut.below_off, run_at = cut.at_off;
  for (int base = w.b_begin; base < w.b_end; base += kWarpSize) {
    const int qq = base + t.lane;
    const unsigned mask = sm.evictmask[base / kWarpSize];
    const bool ev = (mask >> t.lane) & 1u;
    const int s = qq < w.b_end ? sm.lru[qq] : -1;
    const int e = run + __popc(mask & t.lanes_below);  // evictables before qq in LRU order
    bool victim = e < c.M_eff;
    int v = min(e, c.M_eff);  // victims before qq in LRU order
    if constexpr (kReuse) {
      const unsigned lm = sm.lessmask[base / kWarpSize];
      const unsigned qm = sm.eqmask[base / kWarpSize];
      const int at = run_at + __popc(qm & t.lanes_below);
      victim = ((lm >> t.lane) & 1u) || (((qm >> t.lane) & 1u) && at < cut.need);
      v = run_below + __popc(lm & t.lanes_below) + min(at, cut.need);
      run_below += __popc(lm);
      run_at += __popc(qm);
    }
    if (qq < w.b_end) {
      int pos;
      if (ev) {
        pos = victim ? c.E - c.M_eff + v : e - v;
        if (victim) {
          sm.vict[v] = static_cast<int16_t>(s);
          if constexpr (kReuse) sm.hist[s] = kVictimMark | (1u << 8);  // S6: age 0, count 1
        }
      } else {
        pos = c.E + (qq - e);
      }
      sm.newlru[pos] = static_cast<int16_t>(s);
    }
    run += __popc(mask);
  }
}

// S6: publish outputs in top-k order, victims' slot tokens, the miss list and plan, the LRU row
// and the counters. `base`: the request's first row in the flat miss list (S4).
template <int kB, int kTopK, bool kReuse, bool kSkipIO>
__device__ __forceinline__ void publish(
    const ResolveParams& p, const PlanSmem<kB, kTopK, kReuse>& sm, const PlanThread& t, const PlanRequest& rq,
    const Positions& pos, const PlanCounts& c, const bool need_host_rows, const uint32_t base) {
  int64_t* plan_host_row = p.has_plan ? p.plan_host + static_cast<int64_t>(rq.i) * p.plan_host_stride : nullptr;
  int32_t* plan_dev_row = p.has_plan ? p.plan_dev + static_cast<int64_t>(rq.i) * p.plan_dev_stride : nullptr;
  for (int j = t.tid; j < kTopK; j += t.nt) {
    const int32_t q = sm.topk[j];
    const int32_t code = sm.sel[j];
    int32_t o = -1;
    if (q < 0) {
      o = -1;
    } else if (q == pos.newest) {
      o = sm.hot[kB];
    } else if (!pos.is_valid(q)) {
      o = -1;
    } else if (code >= 0) {
      o = sm.hot[code];
    } else {
      const int m = -2 - code;
      if (m < c.M_eff) {
        const int s = sm.vict[m];
        const int32_t dev_row = sm.hot[s];
        o = dev_row;
        rq.tok_row[s] = q;
        if (rq.map_row != nullptr) rq.map_row[q] = static_cast<int16_t>(s);
        if (need_host_rows) {
          const int64_t host_row = sm.hostrow[m];
          if constexpr (!kSkipIO) {
            p.flat_host[base + m] = host_row;
            p.flat_dev[base + m] = dev_row;
          }
          if (p.has_plan) {
            plan_host_row[m] = host_row;
            plan_dev_row[m] = dev_row;
          }
        }
      }
    }
    rq.out_row[j] = o;
  }
  store_row(rq.lru_row, sm.newlru, kB, t.tid, t.nt);
  if constexpr (kReuse) {  // history: victims (marked in S5) age 0 count 1; hits age 0 count + 1
    for (int s = t.tid; s < kB; s += t.nt) {
      const uint16_t h = sm.hist[s];
      uint16_t next;
      if (h & kVictimMark) {
        next = h & ~kVictimMark;
      } else {
        const int j = sm.tok[s];
        const int count = (h >> 8) & 0x7f;
        if (j >= 0 && sm.sel[j] == s) {
          next = static_cast<uint16_t>(min(count + 1, 127) << 8);
        } else {
          next = static_cast<uint16_t>((count << 8) | min((h & 0xff) + 1, 255));
        }
      }
      rq.hist_row[s] = static_cast<int16_t>(next);
    }
  }
  if (t.tid == 0) {
    if (p.has_plan) p.plan_counts[rq.i] = c.M_eff;
    if (p.counters != nullptr) {
      atomicAdd(reinterpret_cast<unsigned long long*>(p.counters), static_cast<unsigned long long>(c.selected));
      atomicAdd(reinterpret_cast<unsigned long long*>(p.counters + 1), static_cast<unsigned long long>(c.M_eff));
    }
  }
}

// The planner of request i: S0's row loads, the CTA-uniform exits (padded row, invalid row,
// resident request, fast path), then the long path's stages S0-S6 separated by the CTA barriers
// every stage relies on (docs/kernel.md, "Why no races"), then finish_planner.
template <int kItemBytes, int kB, int kTopK, bool kSkipIO, bool kReuse>
__device__ __forceinline__ void plan_request(const ResolveParams& p, const int i, unsigned char* smem) {
  const int32_t* topk_row = p.topk + static_cast<int64_t>(i) * p.topk_stride;
  unsigned char* spill = nullptr;
  using Smem = PlanSmem<kB, kTopK, kReuse>;
  if constexpr (Smem::kSpilled) spill = p.spill + static_cast<int64_t>(i) * PlanSpill<kTopK>::kBytes;
  const Smem sm(smem, spill, topk_row);
  const PlanThread t = plan_thread();
  const bool copier_mode = !kSkipIO && (static_cast<int>(gridDim.x) > p.num_reqs);
  int32_t* out_row = p.out + static_cast<int64_t>(i) * p.out_stride;

  // ---- S0: the top-k row and the request's scalars do not depend on the request's tables (nor
  // on num_real_reqs): start them first, so that their DRAM round trip overlaps the load of
  // num_real_reqs. A padded row only reads (rows < num_reqs exist) and then exits. ----
  if constexpr (!Smem::kSpilled) stage_row(sm.topk, topk_row, kTopK, t.tid, t.nt);
  const int64_t r = load_index(p.req_pool_indices, p.rpi_is_i64 != 0, i);
  const int64_t L = load_index(p.seq_lens, p.seq_is_i64 != 0, i);
  if (i >= p.num_real_reqs[0]) {  // CTA-uniform: padded CUDA-graph row, writes nothing
    cp_async_wait_all();
    return;
  }
  HS_STAMP(1, clock64());

  if (r < 0 || r >= p.table_rows) {  // CTA-uniform: not a valid request row
    reject_request<kTopK>(p, i, out_row);
    finish_planner<kItemBytes, kSkipIO>(p, copier_mode, 0, 0);
    return;
  }
  // ---- Resident request: its own device rows; no IO, no table change (before the fast path). ----
  if (p.resident != nullptr && p.resident[r] != 0) {  // CTA-uniform
    resolve_resident<kItemBytes, kTopK>(p, i, r, L, sm.topk, out_row);
    finish_planner<kItemBytes, kSkipIO>(p, copier_mode, 0, 0);
    return;
  }
  const int32_t* hot_row = p.hot_locs + r * p.hot_stride;
  const int size = request_buffer_size<kB>(p, r);  // B without per-request sizes

  // ---- Fast path (L <= size): position q lives at slot q; no IO, no table change. ----
  if (L <= size) {  // CTA-uniform
    resolve_short(p, i, L, hot_row, sm, out_row);
    finish_planner<kItemBytes, kSkipIO>(p, copier_mode, 0, 0);
    return;
  }

  // ---- Long path (L > size). ----
  const PlanRequest rq = long_request(p, i, r, hot_row, out_row, size);
  const Positions pos = positions(p, L);
  stage_tables(sm, t, rq);  // S0 (long path): tables, hash table, selection map
  MapCandidates cand{};
  if (rq.map_row != nullptr) cand = prefetch_map<kTopK>(topk_row, t, rq, pos);  // CTA-uniform; overlaps S0
  cp_async_wait_all();
  __syncthreads();
  HS_STAMP(2, clock64());

  if (rq.map_row != nullptr) {  // CTA-uniform
    find_hits_in_map(p, sm, t, rq, pos, cand);  // S1 + S2
    __syncthreads();
    HS_STAMP(3, clock64());
    HS_STAMP(4, clock64());
  } else {
    insert_selection(p, sm, t, pos);  // S1
    __syncthreads();
    HS_STAMP(3, clock64());

    find_hits(sm, t, size);  // S2
    __syncthreads();
    HS_STAMP(4, clock64());
  }

  const WarpRanges w = warp_ranges<kB, kTopK>(t);
  count_misses(p, sm, t, w, pos, size);  // S3
  __syncthreads();
  HS_STAMP(5, clock64());

  const PlanCounts c = scan_counts(sm, t);  // S4 (no barrier: every warp scans)
  const bool need_host_rows = !kSkipIO || p.has_plan;  // the misses' host rows (miss list, plan)
  reserve_miss_rows(p, sm, t, rq, c, copier_mode);
  ReuseCut cut{};
  if constexpr (kReuse) {
    cut = reuse_cut(sm, t, w, c);  // S4b: the victims' cut level and ballots
    __syncthreads();
    finish_reuse_cut(sm, t, cut);
  }
  rank_and_gather(p, sm, t, w, rq, c, cut, need_host_rows);  // S5
  cp_async_wait_all();
  __syncthreads();
  HS_STAMP(6, clock64());

  const uint32_t base = static_cast<uint32_t>(sm.scalar[0]);
  publish<kB, kTopK, kReuse, kSkipIO>(p, sm, t, rq, pos, c, need_host_rows, base);  // S6
  HS_STAMP(7, clock64());
  finish_planner<kItemBytes, kSkipIO>(p, copier_mode, base, static_cast<uint32_t>(c.M_eff));
  HS_STAMP(8, clock64());
  HS_STAMP(11, global_timer_ns());
}

// ------------------------------------------------------------------------------------------------
// Copier CTA: wait for every real planner, then copy a share of the flat miss list.
// ------------------------------------------------------------------------------------------------

template <int kItemBytes>
__device__ __forceinline__ void copier(const ResolveParams& p, const int c, const int n_real, unsigned char* smem) {
  uint32_t* s_total = reinterpret_cast<uint32_t*>(smem);
  const int num_copiers = static_cast<int>(gridDim.x) - p.num_reqs;
  if (threadIdx.x == 0) {
    uint32_t* st = p.state;
    const uint64_t t0 = global_timer_ns();
    uint32_t spins = 0;
    unsigned backoff = 32;  // ns, doubling to 256: keeps the polling of one L2 line light
    while (ld_acquire_gpu(st + kStatePlanned) < static_cast<uint32_t>(n_real)) {
      __nanosleep(backoff);
      if (backoff < 256) backoff <<= 1;
      if ((++spins & 1023u) == 0 && global_timer_ns() - t0 > p.spin_timeout_ns) {
        printf(
            "hisparse resolve: copier CTA %d waited > %llu ns for %d planners (%u published); trapping\n", c,
            static_cast<unsigned long long>(p.spin_timeout_ns), n_real, ld_relaxed_gpu(st + kStatePlanned));
        __trap();
      }
    }
    // Acquired: every planner's total_rows increment and miss list happen-before this point.
    if (c == 0) HS_STAMP_ANY(10, global_timer_ns());
    const uint32_t total = ld_relaxed_gpu(st + kStateTotalRows);
    *s_total = total;
    // Retire: the copier that makes exited == num_copiers is the last reader of the counters.
    const uint32_t prev = atom_acq_rel_gpu_add(st + kStateExited, 1u);
    if (prev == static_cast<uint32_t>(num_copiers - 1)) {
      st_relaxed_gpu(st + kStatePlanned, 0u);
      st_relaxed_gpu(st + kStateTotalRows, 0u);
      st_relaxed_gpu(st + kStateExited, 0u);
    }
  }
  __syncthreads();
  const uint32_t total = *s_total;
  uint32_t lo, hi;
  cta_slice(static_cast<uint32_t>(c), static_cast<uint32_t>(num_copiers), total * RowLayout<kItemBytes>::kChunks, lo, hi);
  copy_rows<kItemBytes>(
      FlatRows{p.flat_host, p.flat_dev}, lo + threadIdx.x, hi, blockDim.x, p.host_kv, p.host_rows, p.device_kv,
      p.device_rows, p.state);
#ifdef HISPARSE_STAGE_CLOCK
  __syncthreads();
  if (c == 0 && threadIdx.x == 0) HS_STAMP_ANY(12, global_timer_ns());
#endif
}

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

template <int kItemBytes, int kB, int kTopK, bool kSkipIO, bool kReuse = false>
__global__ void __launch_bounds__(kMaxThreads, 1) resolve_kernel(const __grid_constant__ ResolveParams p) {
  static_assert(kB >= 1 && kB <= 32767, "slots are int16");
  static_assert(kTopK >= 1 && kTopK <= kB, "top_k <= B");
  static_assert(PlanLayout<kB, kTopK, kReuse>::kBytes <= kMaxSmemBytes, "B too large for shared memory");
  HISPARSE_DYNAMIC_SMEM(smem);
  HS_STAMP(0, clock64());
  HS_STAMP(9, global_timer_ns());
  const int bid = static_cast<int>(blockIdx.x);
  if (bid < p.num_reqs) {  // padded CUDA-graph rows (bid >= num_real_reqs) exit without writing
#ifdef HISPARSE_STAGE_CLOCK_TWICE
    // Diagnostic: plan twice in one launch; the stamps of the second pass (instruction caches
    // warm, tables in L2) overwrite the first's. Skip-IO only: the first pass's misses are hits.
    if constexpr (kSkipIO) {
      plan_request<kItemBytes, kB, kTopK, kSkipIO, kReuse>(p, bid, smem);
      __syncthreads();
      HS_STAMP(0, clock64());
    }
#endif
    plan_request<kItemBytes, kB, kTopK, kSkipIO, kReuse>(p, bid, smem);
    return;
  }
  if constexpr (!kSkipIO) {
    int n_real = p.num_real_reqs[0];
    n_real = n_real < 0 ? 0 : (n_real > p.num_reqs ? p.num_reqs : n_real);
    copier<kItemBytes>(p, bid - p.num_reqs, n_real, smem);
  }
}

template <int kItemBytes>
__global__ void __launch_bounds__(kMaxThreads, 1) replay_kernel(const __grid_constant__ ReplayParams p) {
  HISPARSE_DYNAMIC_SMEM(smem);
  uint32_t* s_prefix = reinterpret_cast<uint32_t*>(smem);  // [plan_rows + 1]
  int32_t* s_wsum = reinterpret_cast<int32_t*>(s_prefix + p.plan_rows + 1);  // [32]
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int nw = nt / kWarpSize;
  int n = p.num_real_reqs[0];
  n = n < 0 ? 0 : (n > p.plan_rows ? p.plan_rows : n);

  // Exclusive scan of the counts (each clamped to [0, plan_width]) in chunks of nt.
  uint32_t carry = 0;
  for (int chunk = 0; chunk < n; chunk += nt) {
    const int idx = chunk + tid;
    int v = 0;
    if (idx < n) {
      v = p.plan_counts[idx];
      if (v < 0 || v > p.plan_width) {
        count_error(p.state);
        v = v < 0 ? 0 : p.plan_width;
      }
    }
    const int incl = warp_inclusive_scan(v, lane);
    if (lane == kWarpSize - 1) s_wsum[warp] = incl;
    __syncthreads();
    const int ws = lane < nw ? s_wsum[lane] : 0;
    const int wincl = warp_inclusive_scan(ws, lane);
    const int woff = __shfl_sync(kFullMask, wincl - ws, warp);
    const int chunk_total = __shfl_sync(kFullMask, wincl, kWarpSize - 1);
    if (idx < n) s_prefix[idx] = carry + static_cast<uint32_t>(woff + incl - v);
    carry += static_cast<uint32_t>(chunk_total);
    __syncthreads();  // s_wsum is rewritten by the next chunk
  }
  if (tid == 0) s_prefix[n] = carry;
  __syncthreads();
  if (n == 0) return;
  uint32_t lo, hi;
  cta_slice(blockIdx.x, gridDim.x, carry * RowLayout<kItemBytes>::kChunks, lo, hi);
  copy_rows<kItemBytes>(
      PlanRows{p.plan_host, p.plan_host_stride, p.plan_dev, p.plan_dev_stride, s_prefix, n}, lo + threadIdx.x, hi,
      blockDim.x, p.host_kv, p.host_rows, p.device_kv, p.device_rows, p.state);
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

#ifndef HISPARSE_EMULATE

using tvm::ffi::TensorView;

namespace detail {

inline bool is_int(DLDataType t, int bits) {
  return t.code == kDLInt && t.bits == bits && t.lanes == 1;
}

template <typename T>
inline T* ptr(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

inline int current_device() {
  int dev = 0;
  host::RuntimeDeviceCheck(cudaGetDevice(&dev));
  return dev;
}

inline int sm_count(int dev) {
  static std::array<int, 64> cache{};
  if (dev < 0 || dev >= 64) dev = 0;
  if (cache[dev] == 0) {
    int n = 0;
    host::RuntimeDeviceCheck(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cache[dev] = n;
  }
  return cache[dev];
}

// Per kernel instantiation (the template argument is the kernel itself, so each instantiation has
// its own cache): opt into > 48 KB of dynamic smem (once per device) and cache how many CTAs of
// each block size fit on one SM.
template <auto kKernel>
inline int prepare_kernel(int block, size_t smem, int dev) {
  static std::array<bool, 64> attr_set{};
  static std::array<std::array<int, 33>, 64> occ{};
  if (dev < 0 || dev >= 64) dev = 0;
  if (!attr_set[dev]) {
    host::RuntimeDeviceCheck(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    attr_set[dev] = true;
  }
  const int slot = block / kWarpSize;
  if (occ[dev][slot] == 0) {
    int n = 0;
    host::RuntimeDeviceCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, block, smem));
    host::RuntimeCheck(n >= 1, "hisparse: a block of ", block, " threads with ", smem, " B of smem cannot run");
    occ[dev][slot] = n;
  }
  return occ[dev][slot];
}

inline void check_block(int64_t block) {
  host::RuntimeCheck(
      block >= kWarpSize && block <= kMaxThreads && block % kWarpSize == 0,
      "hisparse: block size must be a multiple of 32 in [32, 1024], got ", block);
}

// A KV buffer's leading dimension indexes units of RowLayout::kUnitBytes (a row; a page of C4 rows).
template <int kItemBytes>
inline void check_rows(const TensorView& kv, const char* name) {
  constexpr int64_t unit_bytes = RowLayout<kItemBytes>::kUnitBytes;
  const char* unit = RowLayout<kItemBytes>::kRowsPerUnit > 1 ? " pages" : " rows";
  host::RuntimeCheck(kv.ndim() >= 1, "hisparse: ", name, " must have a row dimension");
  int64_t elems = 1;
  for (int d = 1; d < kv.ndim(); ++d) elems *= kv.size(d);
  const int64_t esize = kv.dtype().bits / 8;
  host::RuntimeCheck(elems * esize == unit_bytes, "hisparse: ", name, unit, " are ", elems * esize,
                     " bytes, the kernel was built for ", unit_bytes);
  host::RuntimeCheck(kv.stride(0) * esize == unit_bytes && kv.stride(kv.ndim() - 1) == 1,
                     "hisparse: ", name, unit, " must be contiguous");
  host::RuntimeCheck(reinterpret_cast<uintptr_t>(ptr<char>(kv)) % 16 == 0, "hisparse: ", name,
                     " must be 16-byte aligned");
}

inline bool is_byte_flag(DLDataType t) {
  return (t.code == kDLUInt || t.code == kDLBool) && t.bits == 8 && t.lanes == 1;
}

inline void check_table(const TensorView& t, int bits, int64_t min_cols, const char* name) {
  host::RuntimeCheck(t.ndim() == 2 && is_int(t.dtype(), bits), "hisparse: ", name, " must be a 2-D int", bits,
                     " tensor");
  host::RuntimeCheck(t.size(1) >= min_cols && (t.size(1) <= 1 || t.stride(1) == 1), "hisparse: ", name,
                     " must have >= ", min_cols, " contiguous columns");
}

// Checks the residency tables and says whether residency is on (all three empty: off). Both
// per-request tables must cover table_rows, since the kernel indexes them by any valid request row.
inline bool check_residency(
    const TensorView& resident, const TensorView& req_to_token, const TensorView& logical_to_device,
    int64_t table_rows) {
  if (resident.numel() == 0 && req_to_token.numel() == 0 && logical_to_device.numel() == 0) return false;
  host::RuntimeCheck(resident.ndim() == 1 && is_byte_flag(resident.dtype()) && resident.size(0) >= table_rows &&
                         (resident.size(0) <= 1 || resident.stride(0) == 1),
                     "hisparse: resident must be a contiguous uint8/bool [>= ", table_rows, "] tensor");
  check_table(req_to_token, 32, 1, "req_to_token");
  host::RuntimeCheck(req_to_token.size(0) >= table_rows, "hisparse: req_to_token must have >= ", table_rows,
                     " rows, has ", req_to_token.size(0));
  host::RuntimeCheck(logical_to_device.ndim() == 1 && is_int(logical_to_device.dtype(), 64) &&
                         logical_to_device.size(0) >= 1 &&
                         (logical_to_device.size(0) <= 1 || logical_to_device.stride(0) == 1),
                     "hisparse: logical_to_device must be a contiguous int64 [>= 1] tensor");
  return true;
}

// Checks the reuse-table policy's tensors and says whether it is on (both empty: LRU): history
// int16 [rows, >= B] with contiguous columns, levels uint8 [>= 54] contiguous (values are masked
// to [0, 64) by the kernel; the Python side checks them once).
inline bool check_reuse(const TensorView& slot_history, const TensorView& reuse_levels, int64_t B) {
  if (slot_history.numel() == 0 && reuse_levels.numel() == 0) return false;
  check_table(slot_history, 16, B, "slot_history");
  host::RuntimeCheck(reuse_levels.ndim() == 1 && reuse_levels.dtype().code == kDLUInt && reuse_levels.dtype().bits == 8 &&
                         reuse_levels.size(0) >= 54 && reuse_levels.stride(0) == 1,
                     "hisparse: reuse_levels must be a contiguous uint8 [54] tensor");
  return true;
}

// Sets p's residency fields (all null / 0 when off; check_residency has accepted the tables).
inline void set_residency(
    ResolveParams& p, bool on, const TensorView& resident, const TensorView& req_to_token,
    const TensorView& logical_to_device) {
  p.resident = on ? ptr<const uint8_t>(resident) : nullptr;
  p.req_to_token = on ? ptr<const int32_t>(req_to_token) : nullptr;
  p.rtt_stride = on ? req_to_token.stride(0) : 0;
  p.rtt_cols = on ? req_to_token.size(1) : 0;
  p.logical_to_device = on ? ptr<const int64_t>(logical_to_device) : nullptr;
  p.logical_rows = on ? logical_to_device.size(0) : 0;
}

}  // namespace detail

// A layer's launch parameters that do not change between calls: checked once by bind_layer (the
// `bind` entry points write it into a CPU byte tensor the caller keeps), completed per call with
// the batch by launch_bound (the `launch` entry points). A server's eager call then passes 5
// tensors instead of 26 and re-checks only the batch.
struct BoundResolve {
  uint64_t key;  // bound_key of the entry point that wrote it (a launch refuses another's)
  ResolveParams p;  // every field except the batch's: topk, seq_lens, req_pool_indices, out, num_reqs
  int64_t miss_capacity;  // entries of the workspace miss list (host and device lists)
  int64_t spill_reqs;  // requests the workspace spill buffer holds (INT64_MAX when the planner does not spill)
  int64_t plan_rows;  // rows of the plan tensors (INT64_MAX without a plan)
  int64_t block;
  int64_t num_copiers;
  int32_t device_type;  // DLPack device of every bound tensor (checked against the batch's)
  int32_t device_id;
};

inline constexpr int64_t kBoundBytes = 512;  // size of the byte tensor Python allocates (>= sizeof)
static_assert(sizeof(BoundResolve) <= kBoundBytes, "BoundResolve outgrew the bound byte tensor");

template <int kItemBytes, int kB, int kTopK, bool kSkipIO, bool kReuse>
constexpr uint64_t bound_key() {
  return (uint64_t{0xB5} << 56) | (uint64_t(kItemBytes) << 40) | (uint64_t(kB) << 20) | (uint64_t(kTopK) << 2) |
         (uint64_t(kSkipIO) << 1) | uint64_t(kReuse);
}

namespace detail {

inline bool same_device(const TensorView& t, int32_t type, int32_t id) {
  return t.device().device_type == type && t.device().device_id == id;
}

// Every check of a layer's unchanging arguments, then the BoundResolve. No CUDA call: the device
// is the tensors' own (all bound tensors must share it) and the occupancy is looked up at launch.
template <int kItemBytes, int kB, int kTopK, bool kSkipIO, bool kReuse>
BoundResolve bind_layer(
    const TensorView& hot_locs, const TensorView& slot_tokens, const TensorView& lru, const TensorView& host_locs,
    const TensorView& host_kv, const TensorView& device_kv, const TensorView& num_real_reqs,
    const TensorView& plan_host, const TensorView& plan_dev, const TensorView& plan_counts,
    const TensorView& counters, const TensorView& resident, const TensorView& req_to_token,
    const TensorView& logical_to_device, const TensorView& slot_history, const TensorView& reuse_levels,
    const TensorView& slot_map, const TensorView& buffer_sizes, const TensorView& ws_state,
    const TensorView& ws_flat_host, const TensorView& ws_flat_dev, const TensorView& ws_spill, int64_t block,
    int64_t num_copiers, int64_t spin_timeout_ns) {
  check_block(block);
  check_table(hot_locs, 32, kB + 1, "hot_locs");
  check_table(slot_tokens, 32, kB, "slot_tokens");
  check_table(lru, 16, kB, "lru");
  check_table(host_locs, 64, 1, "host_locs");
  host::RuntimeCheck(slot_tokens.size(1) == kB && lru.size(1) == kB, "hisparse: slot_tokens / lru must have B columns");
  int64_t rows = hot_locs.size(0);  // rows valid in all four tables
  rows = slot_tokens.size(0) < rows ? slot_tokens.size(0) : rows;
  rows = lru.size(0) < rows ? lru.size(0) : rows;
  rows = host_locs.size(0) < rows ? host_locs.size(0) : rows;
  const bool has_reuse = check_reuse(slot_history, reuse_levels, kB);
  host::RuntimeCheck(has_reuse == kReuse, "hisparse: this entry point is built for the ",
                     kReuse ? "reuse-table policy: slot_history and reuse_levels are required"
                            : "LRU policy: slot_history and reuse_levels must be empty");
  if (has_reuse) rows = slot_history.size(0) < rows ? slot_history.size(0) : rows;
  const bool has_map = slot_map.numel() > 0;  // empty: plan with the hash table
  if (has_map) {
    check_table(slot_map, 16, host_locs.size(1), "slot_map");
    rows = slot_map.size(0) < rows ? slot_map.size(0) : rows;
  }
  const bool has_sizes = buffer_sizes.numel() > 0;  // empty: every request uses B slots
  if (has_sizes) {
    host::RuntimeCheck(buffer_sizes.ndim() == 1 && is_int(buffer_sizes.dtype(), 32) &&
                           (buffer_sizes.size(0) <= 1 || buffer_sizes.stride(0) == 1),
                       "hisparse: buffer_sizes must be a contiguous int32 [rows] tensor");
    rows = buffer_sizes.size(0) < rows ? buffer_sizes.size(0) : rows;
  }
  const bool has_residency = check_residency(resident, req_to_token, logical_to_device, rows);
  host::RuntimeCheck(is_int(num_real_reqs.dtype(), 32) && num_real_reqs.numel() >= 1,
                     "hisparse: num_real_reqs must be an int32 device tensor");
  if constexpr (!kSkipIO) {
    check_rows<kItemBytes>(host_kv, "host_kv");
    check_rows<kItemBytes>(device_kv, "device_kv");
  }
  const bool has_plan = plan_counts.numel() > 0;
  if (has_plan) {
    check_table(plan_host, 64, kTopK, "plan.host_rows");
    check_table(plan_dev, 32, kTopK, "plan.device_rows");
    host::RuntimeCheck(plan_counts.ndim() == 1 && is_int(plan_counts.dtype(), 32) && plan_counts.stride(0) == 1,
                       "hisparse: plan.counts must be a contiguous int32 [rows] tensor");
  }
  const bool has_counters = counters.numel() > 0;
  if (has_counters) {
    host::RuntimeCheck(is_int(counters.dtype(), 64) && counters.numel() >= 2 && counters.stride(0) == 1,
                       "hisparse: counters must be a contiguous int64 [2] tensor");
  }
  host::RuntimeCheck(is_int(ws_state.dtype(), 32) && ws_state.numel() >= kStateWords,
                     "hisparse: workspace state too small");
  host::RuntimeCheck(is_int(ws_flat_host.dtype(), 64) && is_int(ws_flat_dev.dtype(), 32),
                     "hisparse: workspace miss lists must be int64 / int32");
  constexpr bool kSpills = kPlanSpills<kB, kTopK, kReuse>;
  host::RuntimeCheck(ws_spill.ndim() == 1 && ws_spill.dtype().code == kDLUInt && ws_spill.dtype().bits == 8,
                     "hisparse: the workspace spill buffer must be a 1-D uint8 tensor");
  if constexpr (kSpills) {
    host::RuntimeCheck(ws_spill.numel() >= int64_t(PlanSpill<kTopK>::kBytes), "hisparse: B=", kB, ", top_k=", kTopK,
                       " keeps the planner's top-k-sized arrays in global memory: the workspace needs a spill buffer "
                       "of ", PlanSpill<kTopK>::kBytes, " B per request, has ", ws_spill.numel(),
                       " B (make_workspace(spill=True))");
  }
  const int32_t dev_type = hot_locs.device().device_type, dev_id = hot_locs.device().device_id;
  for (const TensorView* t : {&slot_tokens, &lru, &host_locs, &num_real_reqs, &ws_state, &ws_flat_host, &ws_flat_dev,
                              &ws_spill}) {
    host::RuntimeCheck(same_device(*t, dev_type, dev_id), "hisparse: the tables, num_real_reqs and the workspace must be on one device");
  }

  BoundResolve b{};
  b.key = bound_key<kItemBytes, kB, kTopK, kSkipIO, kReuse>();
  ResolveParams& p = b.p;
  p.hot_locs = ptr<const int32_t>(hot_locs);
  p.hot_stride = hot_locs.stride(0);
  p.slot_tokens = ptr<int32_t>(slot_tokens);
  p.tok_stride = slot_tokens.stride(0);
  p.lru = ptr<int16_t>(lru);
  p.lru_stride = lru.stride(0);
  p.host_locs = ptr<const int64_t>(host_locs);
  p.host_locs_stride = host_locs.stride(0);
  p.max_context = host_locs.size(1);
  p.table_rows = rows;
  set_residency(p, has_residency, resident, req_to_token, logical_to_device);
  p.slot_hist = has_reuse ? ptr<int16_t>(slot_history) : nullptr;
  p.hist_stride = has_reuse ? slot_history.stride(0) : 0;
  p.reuse_levels = has_reuse ? ptr<const uint8_t>(reuse_levels) : nullptr;
  host::RuntimeCheck(!has_map || same_device(slot_map, dev_type, dev_id), "hisparse: slot_map must be on the tables' device");
  p.slot_map = has_map ? ptr<int16_t>(slot_map) : nullptr;
  p.map_stride = has_map ? slot_map.stride(0) : 0;
  host::RuntimeCheck(!has_sizes || same_device(buffer_sizes, dev_type, dev_id),
                     "hisparse: buffer_sizes must be on the tables' device");
  p.buffer_sizes = has_sizes ? ptr<const int32_t>(buffer_sizes) : nullptr;
  p.host_kv = ptr<const uint8_t>(host_kv);
  p.host_rows = host_kv.ndim() >= 1 ? host_kv.size(0) * RowLayout<kItemBytes>::kRowsPerUnit : 0;
  p.device_kv = ptr<uint8_t>(device_kv);
  p.device_rows = device_kv.ndim() >= 1 ? device_kv.size(0) * RowLayout<kItemBytes>::kRowsPerUnit : 0;
  p.num_real_reqs = ptr<const int32_t>(num_real_reqs);
  p.has_plan = has_plan ? 1 : 0;
  b.plan_rows = INT64_MAX;
  if (has_plan) {
    p.plan_host = ptr<int64_t>(plan_host);
    p.plan_host_stride = plan_host.stride(0);
    p.plan_dev = ptr<int32_t>(plan_dev);
    p.plan_dev_stride = plan_dev.stride(0);
    p.plan_counts = ptr<int32_t>(plan_counts);
    b.plan_rows = plan_host.size(0);
    b.plan_rows = plan_dev.size(0) < b.plan_rows ? plan_dev.size(0) : b.plan_rows;
    b.plan_rows = plan_counts.size(0) < b.plan_rows ? plan_counts.size(0) : b.plan_rows;
  }
  p.counters = has_counters ? ptr<int64_t>(counters) : nullptr;
  p.state = ptr<uint32_t>(ws_state);
  p.flat_host = ptr<int64_t>(ws_flat_host);
  p.flat_dev = ptr<int32_t>(ws_flat_dev);
  p.spill = kSpills ? ptr<uint8_t>(ws_spill) : nullptr;
  b.spill_reqs = kSpills ? ws_spill.numel() / int64_t(PlanSpill<kTopK>::kBytes) : INT64_MAX;
  p.spin_timeout_ns = static_cast<uint64_t>(spin_timeout_ns > 0 ? spin_timeout_ns : 10'000'000'000LL);
  b.miss_capacity = ws_flat_host.numel() < ws_flat_dev.numel() ? ws_flat_host.numel() : ws_flat_dev.numel();
  b.block = block;
  b.num_copiers = num_copiers;
  b.device_type = dev_type;
  b.device_id = dev_id;
  return b;
}

inline void check_index_vector(const TensorView& t, int64_t num_reqs, const char* name) {
  host::RuntimeCheck(t.ndim() == 1 && (is_int(t.dtype(), 32) || is_int(t.dtype(), 64)) && t.size(0) >= num_reqs &&
                         (t.size(0) <= 1 || t.stride(0) == 1),
                     "hisparse: ", name, " must be a contiguous int32/int64 [>= num_reqs] tensor");
}

// Checks one call's batch against a bound layer and launches (asynchronous, current stream of the
// tables' device). Every check precedes the first CUDA call.
template <int kItemBytes, int kB, int kTopK, bool kSkipIO, bool kReuse>
void launch_bound(const BoundResolve& b, const TensorView& topk, const TensorView& seq_lens,
                  const TensorView& req_pool_indices, const TensorView& out) {
  host::RuntimeCheck(b.key == bound_key<kItemBytes, kB, kTopK, kSkipIO, kReuse>(),
                     "hisparse: the bound parameters were written by another entry point or module");
  host::RuntimeCheck(topk.ndim() == 2 && is_int(topk.dtype(), 32) && topk.size(1) == kTopK,
                     "hisparse: top_k_positions must be int32 [num_reqs, ", kTopK, "]");
  host::RuntimeCheck(kTopK == 1 || topk.stride(1) == 1, "hisparse: top_k_positions rows must be contiguous");
  const int64_t num_reqs = topk.size(0);
  if (num_reqs == 0) return;
  host::RuntimeCheck(num_reqs < (1 << 30), "hisparse: too many requests");
  check_index_vector(seq_lens, num_reqs, "seq_lens");
  check_index_vector(req_pool_indices, num_reqs, "req_pool_indices");
  check_table(out, 32, kTopK, "out");
  host::RuntimeCheck(out.size(0) >= num_reqs && out.size(1) == kTopK, "hisparse: out must be int32 [>= num_reqs, top_k]");
  for (const TensorView* t : {&topk, &seq_lens, &req_pool_indices, &out}) {
    host::RuntimeCheck(same_device(*t, b.device_type, b.device_id),
                       "hisparse: top_k_positions, seq_lens, req_pool_indices and out must be on the tables' device");
  }
  host::RuntimeCheck(num_reqs * kTopK <= b.miss_capacity, "hisparse: a batch of ", num_reqs,
                     " rows exceeds the workspace (miss list of ", b.miss_capacity, " entries)");
  host::RuntimeCheck(num_reqs <= b.plan_rows, "hisparse: plan tensors must cover num_reqs rows");
  host::RuntimeCheck(num_reqs <= b.spill_reqs, "hisparse: a batch of ", num_reqs, " rows exceeds the workspace (spill "
                     "buffer of ", b.spill_reqs, " requests)");
  host::RuntimeCheck(num_reqs * kTopK * int64_t(RowLayout<kItemBytes>::kChunks) < (int64_t(1) << 31),
                     "hisparse: num_reqs * top_k too large for 32-bit chunk indices");
  host::RuntimeCheck(b.device_type == kDLCUDA, "hisparse: the tables must be on a CUDA device");

  constexpr size_t smem = PlanLayout<kB, kTopK, kReuse>::kBytes;
  constexpr auto kernel = resolve_kernel<kItemBytes, kB, kTopK, kSkipIO, kReuse>;
  const int per_sm = prepare_kernel<kernel>(static_cast<int>(b.block), smem, b.device_id);

  int64_t copiers = 0;
  if constexpr (!kSkipIO) {
    if (b.num_copiers >= 0) {
      copiers = b.num_copiers;
    } else if (num_reqs >= kSelfCopyMinReqs) {
      copiers = 0;  // planners copy their own misses (measured faster from batch 4 up: docs/kernel.md)
    } else {
      // Small batch: enough copier threads for the worst case (every selection a miss), but no
      // more than fit beside the planners in one wave (a second wave would delay even a launch
      // with no misses).
      const int64_t fill = int64_t(per_sm) * sm_count(b.device_id);
      const int64_t need = host::div_ceil(num_reqs * kTopK * int64_t(RowLayout<kItemBytes>::kChunks), b.block * kCopyUnroll);
      const int64_t room = fill - num_reqs > fill / 2 ? fill - num_reqs : fill / 2;
      copiers = need < room ? need : room;
      if (copiers < 1) copiers = 1;
    }
  }

  ResolveParams p = b.p;
  p.topk = ptr<const int32_t>(topk);
  p.topk_stride = topk.stride(0);
  p.seq_lens = ptr<const void>(seq_lens);
  p.req_pool_indices = ptr<const void>(req_pool_indices);
  p.seq_is_i64 = is_int(seq_lens.dtype(), 64) ? 1 : 0;
  p.rpi_is_i64 = is_int(req_pool_indices.dtype(), 64) ? 1 : 0;
  p.out = ptr<int32_t>(out);
  p.out_stride = out.stride(0);
  p.num_reqs = static_cast<int32_t>(num_reqs);
  const auto stream = host::LaunchKernel::resolve_device(topk.device());
  host::LaunchKernel(dim3(static_cast<unsigned>(num_reqs + copiers)), dim3(static_cast<unsigned>(b.block)), stream,
                     smem)(kernel, p);
}

inline BoundResolve* bound_storage(const TensorView& bound) {
  host::RuntimeCheck(bound.ndim() == 1 && bound.dtype().code == kDLUInt && bound.dtype().bits == 8 &&
                         bound.numel() >= kBoundBytes && bound.device().device_type == kDLCPU,
                     "hisparse: bound parameters must be a CPU uint8 [>= ", kBoundBytes, "] tensor");
  return reinterpret_cast<BoundResolve*>(ptr<unsigned char>(bound));
}

}  // namespace detail

// Sets the smem attribute and returns CTAs per SM of the resolve kernel at this block size
// (called by warmup_build before any CUDA-graph capture). kReuse: the reuse-table policy's
// kernels (a module holds one policy, so that a server builds only the one it uses).
template <int kItemBytes, int kB, int kTopK, bool kReuse>
int64_t resolve_prepare(int64_t block) {
  detail::check_block(block);
  const int dev = detail::current_device();
  constexpr size_t smem = PlanLayout<kB, kTopK, kReuse>::kBytes;
  const int a =
      detail::prepare_kernel<resolve_kernel<kItemBytes, kB, kTopK, false, kReuse>>(static_cast<int>(block), smem, dev);
  detail::prepare_kernel<resolve_kernel<kItemBytes, kB, kTopK, true, kReuse>>(static_cast<int>(block), smem, dev);
  return a;
}

// Bind one layer: its unchanging arguments, checked once and written into `bound` (a CPU uint8
// [>= kBoundBytes] tensor the caller keeps and passes to resolve_launch). The bound tensors must
// outlive every launch with it, at the same addresses. Plan / counters / residency are absent when
// their tensors are empty (residency: resident uint8/bool [>= table rows], req_to_token int32
// [>= table rows, max_context] with contiguous columns, logical_to_device int64 [logical ids]).
// num_copiers < 0: automatic (fill the GPU, capped by the worst-case miss volume); 0: each planner
// copies its own misses; > 0: that many copier CTAs. kReuse: the entry point of the reuse-table
// policy, which needs slot_history and reuse_levels (the LRU one refuses them). slot_map: int16
// [>= table rows, >= max_context] with contiguous columns, the position -> slot map (empty: off).
// buffer_sizes: int32 [>= table rows], each request's slots in use (empty: B for every request).
template <int kItemBytes, int kB, int kTopK, bool kSkipIO, bool kReuse>
void resolve_bind(
    TensorView bound,
    TensorView hot_locs,
    TensorView slot_tokens,
    TensorView lru,
    TensorView host_locs,
    TensorView host_kv,
    TensorView device_kv,
    TensorView num_real_reqs,
    TensorView plan_host,
    TensorView plan_dev,
    TensorView plan_counts,
    TensorView counters,
    TensorView resident,
    TensorView req_to_token,
    TensorView logical_to_device,
    TensorView slot_history,
    TensorView reuse_levels,
    TensorView slot_map,
    TensorView buffer_sizes,
    TensorView ws_state,
    TensorView ws_flat_host,
    TensorView ws_flat_dev,
    TensorView ws_spill,
    int64_t block,
    int64_t num_copiers,
    int64_t spin_timeout_ns) {
  BoundResolve* dst = detail::bound_storage(bound);
  const BoundResolve b = detail::bind_layer<kItemBytes, kB, kTopK, kSkipIO, kReuse>(
      hot_locs, slot_tokens, lru, host_locs, host_kv, device_kv, num_real_reqs, plan_host, plan_dev, plan_counts,
      counters, resident, req_to_token, logical_to_device, slot_history, reuse_levels, slot_map, buffer_sizes,
      ws_state, ws_flat_host, ws_flat_dev, ws_spill, block, num_copiers, spin_timeout_ns);
  std::memcpy(static_cast<void*>(dst), &b, sizeof(b));
}

// One call of a bound layer: checks the batch's four tensors and launches.
template <int kItemBytes, int kB, int kTopK, bool kSkipIO, bool kReuse>
void resolve_launch(TensorView bound, TensorView topk, TensorView seq_lens, TensorView req_pool_indices, TensorView out) {
  BoundResolve b;
  std::memcpy(&b, detail::bound_storage(bound), sizeof(b));
  detail::launch_bound<kItemBytes, kB, kTopK, kSkipIO, kReuse>(b, topk, seq_lens, req_pool_indices, out);
}

// Copy-only replay of a miss plan on another layer's buffers (few CTAs; see replay_kernel).
template <int kItemBytes>
void replay(
    TensorView plan_host,
    TensorView plan_dev,
    TensorView plan_counts,
    TensorView num_real_reqs,
    TensorView host_kv,
    TensorView device_kv,
    TensorView ws_state,
    int64_t block,
    int64_t num_ctas) {
  using namespace detail;
  check_block(block);
  host::RuntimeCheck(num_ctas >= 1 && num_ctas <= 65535, "hisparse: replay CTAs must be in [1, 65535]");
  host::RuntimeCheck(plan_counts.ndim() == 1 && is_int(plan_counts.dtype(), 32) &&
                         (plan_counts.size(0) <= 1 || plan_counts.stride(0) == 1),
                     "hisparse: plan.counts must be a contiguous int32 [rows] tensor");
  const int64_t plan_rows = plan_counts.size(0);
  if (plan_rows == 0) return;
  check_table(plan_host, 64, 1, "plan.host_rows");
  check_table(plan_dev, 32, 1, "plan.device_rows");
  host::RuntimeCheck(plan_host.size(0) >= plan_rows && plan_dev.size(0) >= plan_rows &&
                         plan_host.size(1) == plan_dev.size(1),
                     "hisparse: plan tensors disagree in shape");
  host::RuntimeCheck(is_int(num_real_reqs.dtype(), 32) && num_real_reqs.numel() >= 1,
                     "hisparse: num_real_reqs must be an int32 device tensor");
  check_rows<kItemBytes>(host_kv, "host_kv");
  check_rows<kItemBytes>(device_kv, "device_kv");
  host::RuntimeCheck(is_int(ws_state.dtype(), 32) && ws_state.numel() >= kStateWords,
                     "hisparse: workspace state too small");
  host::RuntimeCheck(plan_rows * plan_host.size(1) * int64_t(RowLayout<kItemBytes>::kChunks) < (int64_t(1) << 31),
                     "hisparse: plan too large for 32-bit chunk indices");
  const size_t smem = align16(4 * size_t(plan_rows + 1)) + 4 * kWarpSize;
  host::RuntimeCheck(smem <= kMaxSmemBytes, "hisparse: plan has too many rows for one CTA's prefix table");
  auto kernel = replay_kernel<kItemBytes>;
  if (smem > 48 * 1024) {
    host::RuntimeDeviceCheck(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }

  ReplayParams p{};
  p.plan_host = ptr<const int64_t>(plan_host);
  p.plan_host_stride = plan_host.stride(0);
  p.plan_dev = ptr<const int32_t>(plan_dev);
  p.plan_dev_stride = plan_dev.stride(0);
  p.plan_counts = ptr<const int32_t>(plan_counts);
  p.plan_rows = static_cast<int32_t>(plan_rows);
  p.plan_width = static_cast<int32_t>(plan_host.size(1));
  p.num_real_reqs = ptr<const int32_t>(num_real_reqs);
  p.host_kv = ptr<const uint8_t>(host_kv);
  p.host_rows = host_kv.size(0) * RowLayout<kItemBytes>::kRowsPerUnit;
  p.device_kv = ptr<uint8_t>(device_kv);
  p.device_rows = device_kv.size(0) * RowLayout<kItemBytes>::kRowsPerUnit;
  p.state = ptr<uint32_t>(ws_state);
  const auto stream = host::LaunchKernel::resolve_device(plan_counts.device());
  host::LaunchKernel(dim3(static_cast<unsigned>(num_ctas)), dim3(static_cast<unsigned>(block)), stream, smem)(kernel, p);
}

#endif  // HISPARSE_EMULATE

}  // namespace hisparse
