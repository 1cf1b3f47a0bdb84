// sglang-hisparse: the decode step's id kernels (one launch each, a few microseconds of host time).
//
// decode_ids: each request's new token id for a one-token decode step. A request whose previous
//   id last_loc[b] ends its page (its new position starts one) gets the first id of the next free
//   page, in batch order: the r-th such request takes free_pages[r]; every other request gets
//   last_loc[b] + 1. Exactly sglang_hisparse/memory/paging.py's PageAllocator.decode (its torch twin and
//   oracle); one CTA, a block-wide exclusive scan of the page-start flags per chunk of the batch.
//   A page start whose rank is past free_pages gets -1 (the host passes exactly as many pages as
//   it counted page starts, so that never happens in a server; the tests check it).
// map_pages: a resident step's new pages: logical_to_device[logical_pages[i] * page] =
//   row_pages[i] * page and page_resident[logical_pages[i]] = 1 for every i (decode/pressure.py's
//   ResidentDecode.resident_step; torch twin: paging.map_new_pages_torch).

#pragma once

#include <sgl_kernel/utils.cuh>
#include <sgl_kernel/utils.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>

#include <cuda_runtime.h>

#include <cstdint>

namespace hisparse_decode {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

template <typename LocT>
__global__ void __launch_bounds__(kThreads, 1) decode_ids_kernel(const LocT* __restrict__ last_loc, int64_t bs,
                                                                 const int64_t* __restrict__ free_pages,
                                                                 int64_t n_free, int64_t page,
                                                                 int64_t* __restrict__ out) {
  __shared__ int32_t warp_sums[kWarps];
  __shared__ int32_t chunk_total;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t base_rank = 0;  // page starts before this chunk (same value in every thread)
  for (int64_t start = 0; start < bs; start += kThreads) {
    const int64_t b = start + tid;
    int64_t next = 0;
    bool starts = false;
    if (b < bs) {
      next = static_cast<int64_t>(last_loc[b]) + 1;
      starts = next % page == 0;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, starts);
    const int in_warp = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the warp sums by the first warp
      const int v = warp_sums[lane];
      int inclusive = v;
      for (int d = 1; d < 32; d <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += up;
      }
      warp_sums[lane] = inclusive - v;
      if (lane == 31) chunk_total = inclusive;
    }
    __syncthreads();
    if (b < bs) {
      if (starts) {
        const int64_t rank = base_rank + warp_sums[warp] + in_warp;
        out[b] = rank < n_free ? free_pages[rank] * page : -1;
      } else {
        out[b] = next;
      }
    }
    base_rank += chunk_total;
    __syncthreads();  // warp_sums and chunk_total are rewritten by the next chunk
  }
}

__global__ void map_pages_kernel(const int64_t* __restrict__ logical_pages, const int64_t* __restrict__ row_pages,
                                 int64_t n, int64_t page, int64_t* __restrict__ logical_to_device,
                                 uint8_t* __restrict__ page_resident) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t lp = logical_pages[i];
  logical_to_device[lp * page] = row_pages[i] * page;
  page_resident[lp] = 1;
}

using tvm::ffi::TensorView;

inline bool is_int(DLDataType t, int bits) { return t.code == kDLInt && t.bits == bits && t.lanes == 1; }

template <typename T>
inline T* ptr(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

inline void check_vector(const TensorView& t, const char* name, bool int32_ok) {
  host::RuntimeCheck(t.ndim() == 1 && (is_int(t.dtype(), 64) || (int32_ok && is_int(t.dtype(), 32))) &&
                         (t.size(0) <= 1 || t.stride(0) == 1),
                     "hisparse decode: ", name, " must be a contiguous 1-D int", int32_ok ? "32/int" : "", "64 tensor");
  host::RuntimeCheck(t.device().device_type == kDLCUDA, "hisparse decode: ", name, " must be on a CUDA device");
}

// out (int64 [bs]) = the step's new ids; free_pages: the free list's first pages (int64, a view).
inline void decode_ids(TensorView last_loc, TensorView free_pages, TensorView out, int64_t page) {
  check_vector(last_loc, "last_loc", true);
  check_vector(free_pages, "free_pages", false);
  check_vector(out, "out", false);
  host::RuntimeCheck(out.size(0) == last_loc.size(0), "hisparse decode: out must have one id per request");
  host::RuntimeCheck(page >= 1, "hisparse decode: page size must be >= 1");
  const int64_t bs = last_loc.size(0);
  if (bs == 0) return;
  const auto stream = host::LaunchKernel::resolve_device(out.device());
  if (is_int(last_loc.dtype(), 32)) {
    host::LaunchKernel(dim3(1), dim3(kThreads), stream)(decode_ids_kernel<int32_t>, ptr<int32_t>(last_loc), bs,
                                                         ptr<int64_t>(free_pages), free_pages.size(0), page,
                                                         ptr<int64_t>(out));
  } else {
    host::LaunchKernel(dim3(1), dim3(kThreads), stream)(decode_ids_kernel<int64_t>, ptr<int64_t>(last_loc), bs,
                                                         ptr<int64_t>(free_pages), free_pages.size(0), page,
                                                         ptr<int64_t>(out));
  }
}

inline void map_pages(TensorView logical_pages, TensorView row_pages, TensorView logical_to_device,
                      TensorView page_resident, int64_t page) {
  check_vector(logical_pages, "logical_pages", false);
  check_vector(row_pages, "row_pages", false);
  check_vector(logical_to_device, "logical_to_device", false);
  host::RuntimeCheck(page_resident.ndim() == 1 && page_resident.dtype().bits == 8 &&
                         (page_resident.size(0) <= 1 || page_resident.stride(0) == 1),
                     "hisparse decode: page_resident must be a contiguous 1-D uint8 tensor");
  host::RuntimeCheck(row_pages.size(0) == logical_pages.size(0), "hisparse decode: one row page per logical page");
  const int64_t n = logical_pages.size(0);
  if (n == 0) return;
  const auto stream = host::LaunchKernel::resolve_device(logical_to_device.device());
  const unsigned threads = 128;
  host::LaunchKernel(dim3(static_cast<unsigned>((n + threads - 1) / threads)), dim3(threads), stream)(
      map_pages_kernel, ptr<int64_t>(logical_pages), ptr<int64_t>(row_pages), n, page,
      ptr<int64_t>(logical_to_device), ptr<uint8_t>(page_resident));
}

}  // namespace hisparse_decode
