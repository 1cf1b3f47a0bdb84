// CPU emulation of the CUDA built-ins that kernels/resolve.cuh uses, so that its device code runs
// unchanged on host threads (compiled with -DHISPARSE_EMULATE). Test-only.
//
// Model: one std::thread per CUDA thread; __syncthreads is a CTA-wide std::barrier; warp
// collectives (__ballot_sync, __shfl_*) exchange values through a per-warp array between two
// per-warp barriers, so a collective that not all 32 lanes reach deadlocks (the watchdog aborts),
// exactly the divergence bug it would be on a GPU. Shared memory starts filled with 0xA5 garbage.
// CTAs run one after another in blockIdx order (the dispatch order the kernel relies on), or all
// at once (concurrent mode) to exercise the cross-CTA protocol with real concurrency.
// PTX-level helpers (cp.async, ld.nc, scoped atomics) become plain copies and std::atomic_ref.

#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __restrict__
#define __align__(n) alignas(n)

struct int4 {
  int x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline int4 make_int4(int x, int y, int z, int w) {
  return int4{x, y, z, w};
}
struct alignas(8) uint2 {
  unsigned x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return uint4{x, y, z, w};
}
inline uint2 make_uint2(unsigned x, unsigned y) {
  return uint2{x, y};
}

namespace emu {

struct Dim {
  unsigned x = 1, y = 1, z = 1;
};

struct Cta {
  std::unique_ptr<std::barrier<>> bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
  std::vector<std::array<uint64_t, 32>> xchg;
  std::vector<unsigned char> storage;
  unsigned char* smem = nullptr;
};

inline thread_local Dim tl_thread;
inline thread_local Dim tl_block;
inline thread_local Cta* tl_cta = nullptr;
inline Dim g_block;
inline Dim g_grid;

inline unsigned char* dynamic_smem() {
  return tl_cta->smem;
}

inline int lane() {
  return static_cast<int>(tl_thread.x % 32);
}
inline int warp() {
  return static_cast<int>(tl_thread.x / 32);
}

template <typename T>
inline T exchange(T v, int src) {
  static_assert(sizeof(T) <= 8);
  auto& slots = tl_cta->xchg[warp()];
  auto& wb = *tl_cta->warp_bar[warp()];
  uint64_t raw = 0;
  std::memcpy(&raw, &v, sizeof(T));
  slots[lane()] = raw;
  wb.arrive_and_wait();
  T out;
  const uint64_t got = slots[src & 31];
  std::memcpy(&out, &got, sizeof(T));
  wb.arrive_and_wait();
  return out;
}

// Runs `body` as a grid of `grid` CTAs of `block` threads with `smem` bytes of dynamic smem.
template <typename F>
void launch(unsigned grid, unsigned block, size_t smem, F&& body, bool concurrent) {
  if (block % 32 != 0 || block == 0 || block > 1024) {
    std::fprintf(stderr, "emu: bad block size %u\n", block);
    std::abort();
  }
  g_grid = Dim{grid, 1, 1};
  g_block = Dim{block, 1, 1};
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    const auto t0 = std::chrono::steady_clock::now();
    while (!done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(120)) {
        std::fprintf(stderr, "emu: launch of %u x %u threads still running after 120 s (deadlock?)\n", grid, block);
        std::abort();
      }
    }
  });
  auto make_cta = [&]() {
    auto c = std::make_unique<Cta>();
    c->bar = std::make_unique<std::barrier<>>(block);
    for (unsigned w = 0; w < block / 32; ++w) c->warp_bar.push_back(std::make_unique<std::barrier<>>(32));
    c->xchg.resize(block / 32);
    c->storage.assign(smem + 32, 0xA5);
    auto addr = reinterpret_cast<uintptr_t>(c->storage.data());
    c->smem = c->storage.data() + ((16 - addr % 16) % 16);
    return c;
  };
  auto run = [&](unsigned first, unsigned count) {
    std::vector<std::unique_ptr<Cta>> ctas;
    std::vector<std::thread> threads;
    for (unsigned b = first; b < first + count; ++b) ctas.push_back(make_cta());
    for (unsigned b = first; b < first + count; ++b) {
      Cta* c = ctas[b - first].get();
      for (unsigned t = 0; t < block; ++t) {
        threads.emplace_back([&body, c, b, t] {
          tl_cta = c;
          tl_block = Dim{b, 1, 1};
          tl_thread = Dim{t, 1, 1};
          body();
        });
      }
    }
    for (auto& th : threads) th.join();
  };
  if (concurrent) {
    run(0, grid);
  } else {
    for (unsigned b = 0; b < grid; ++b) run(b, 1);
  }
  done.store(true);
  watchdog.join();
}

}  // namespace emu

#define threadIdx (::emu::tl_thread)
#define blockIdx (::emu::tl_block)
#define blockDim (::emu::g_block)
#define gridDim (::emu::g_grid)

inline void __syncthreads() {
  emu::tl_cta->bar->arrive_and_wait();
}

inline unsigned __ballot_sync(unsigned mask, bool pred) {
  (void)mask;
  auto& slots = emu::tl_cta->xchg[emu::warp()];
  auto& wb = *emu::tl_cta->warp_bar[emu::warp()];
  slots[emu::lane()] = pred ? 1 : 0;
  wb.arrive_and_wait();
  unsigned out = 0;
  for (int l = 0; l < 32; ++l) out |= (slots[l] ? 1u : 0u) << l;
  wb.arrive_and_wait();
  return out;
}

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src) {
  (void)mask;
  return emu::exchange(v, src);
}

template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
  (void)mask;
  const int src = emu::lane() - static_cast<int>(delta);
  const T got = emu::exchange(v, src < 0 ? emu::lane() : src);
  return src < 0 ? v : got;
}

inline int __popc(unsigned x) {
  return __builtin_popcount(x);
}
inline int __clz(int x) {
  return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x));
}

inline int atomicCAS(int* a, int compare, int val) {
  std::atomic_ref<int> r(*a);
  int expected = compare;
  r.compare_exchange_strong(expected, val);
  return expected;  // the old value either way
}
inline int atomicMax(int* a, int v) {
  std::atomic_ref<int> r(*a);
  int old = r.load();
  while (old < v && !r.compare_exchange_weak(old, v)) {
  }
  return old;
}
inline int atomicAdd(int* a, int v) {
  return std::atomic_ref<int>(*a).fetch_add(v);
}
inline unsigned atomicAdd(unsigned* a, unsigned v) {
  return std::atomic_ref<unsigned>(*a).fetch_add(v);
}
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*a).fetch_add(v);
}

template <typename T>
inline T __ldcg(const T* p) {
  return std::atomic_ref<T>(*const_cast<T*>(p)).load(std::memory_order_relaxed);
}

inline void __nanosleep(unsigned) {
  std::this_thread::yield();
}

[[noreturn]] inline void __trap() {
  std::fprintf(stderr, "emu: __trap()\n");
  std::abort();
}

template <typename T>
inline T min(T a, T b) {
  return a < b ? a : b;
}

// ---- the PTX helpers of resolve.cuh ----

inline void cp_async16(void* s, const void* g) {
  std::memcpy(s, g, 16);
}
inline void cp_async8(void* s, const void* g) {
  std::memcpy(s, g, 8);
}
inline void cp_async4(void* s, const void* g) {
  std::memcpy(s, g, 4);
}
inline void cp_async_wait_all() {}
inline uint4 ld_nc_v4(const void* p) {
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline void st_v4(void* p, const uint4& v) {
  std::memcpy(p, &v, 16);
}
inline uint2 ld_nc_v2(const void* p) {
  uint2 v;
  std::memcpy(&v, p, 8);
  return v;
}
inline void st_v2(void* p, const uint2& v) {
  std::memcpy(p, &v, 8);
}
inline uint32_t ld_acquire_gpu(const uint32_t* p) {
  return std::atomic_ref<uint32_t>(*const_cast<uint32_t*>(p)).load(std::memory_order_acquire);
}
inline uint32_t ld_relaxed_gpu(const uint32_t* p) {
  return std::atomic_ref<uint32_t>(*const_cast<uint32_t*>(p)).load(std::memory_order_relaxed);
}
inline void red_release_gpu_add(uint32_t* p, uint32_t v) {
  std::atomic_ref<uint32_t>(*p).fetch_add(v, std::memory_order_release);
}
inline uint32_t atom_acq_rel_gpu_add(uint32_t* p, uint32_t v) {
  return std::atomic_ref<uint32_t>(*p).fetch_add(v, std::memory_order_acq_rel);
}
inline void st_relaxed_gpu(uint32_t* p, uint32_t v) {
  std::atomic_ref<uint32_t>(*p).store(v, std::memory_order_relaxed);
}
inline uint64_t global_timer_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
