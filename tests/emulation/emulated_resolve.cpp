// Torch CPU extension that runs the device code of kernels/resolve.cuh on host threads
// (cuda_emulation.h). Parameter plumbing mirrors the CUDA host wrappers of resolve.cuh; the grid
// (planners + copiers) is the same. Test-only: see tests/test_kernel_emulation.py.

#include <torch/extension.h>

#define HISPARSE_EMULATE 1
#include "resolve.cuh"

// Two small configurations planned as a verify union too large for shared memory would be: their
// top-k-sized arrays in the global spill slices (PlanSpill), so that the spilled planner is checked
// here at sizes the emulator runs quickly. Declared before any instantiation of the kernel.
namespace hisparse {
template <>
inline constexpr bool kPlanSpills<40, 16, false> = true;
template <>
inline constexpr bool kPlanSpills<40, 16, true> = true;
template <>
inline constexpr bool kPlanSpills<96, 48, false> = true;
template <>
inline constexpr bool kPlanSpills<96, 48, true> = true;
}  // namespace hisparse

#include <map>
#include <tuple>

namespace {

using hisparse::PlanLayout;
using hisparse::ReplayParams;
using hisparse::ResolveParams;

template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

struct Args {
  torch::Tensor topk, seq_lens, rpi, hot, tok, lru, host_locs, host_kv, device_kv, out, num_real;
  torch::Tensor plan_host, plan_dev, plan_counts, counters, state, flat_host, flat_dev, spill;
  torch::Tensor resident, req_to_token, logical_to_device;  // all empty: residency off
  torch::Tensor slot_history, reuse_levels;  // both empty: LRU
  torch::Tensor slot_map;  // empty: hash-table planning
  torch::Tensor buffer_sizes;  // empty: B slots for every request
  int64_t block, copiers;
  bool concurrent;
};

template <int kItemBytes, int kB, int kTopK, bool kSkipIO>
void run_resolve(const Args& a) {
  const int64_t num_reqs = a.topk.size(0);
  if (num_reqs == 0) return;
  ResolveParams p{};
  p.topk = ptr<const int32_t>(a.topk);
  p.topk_stride = a.topk.stride(0);
  p.seq_lens = a.seq_lens.data_ptr();
  p.req_pool_indices = a.rpi.data_ptr();
  p.seq_is_i64 = a.seq_lens.scalar_type() == torch::kInt64;
  p.rpi_is_i64 = a.rpi.scalar_type() == torch::kInt64;
  p.hot_locs = ptr<const int32_t>(a.hot);
  p.hot_stride = a.hot.stride(0);
  p.slot_tokens = ptr<int32_t>(a.tok);
  p.tok_stride = a.tok.stride(0);
  p.lru = ptr<int16_t>(a.lru);
  p.lru_stride = a.lru.stride(0);
  p.host_locs = ptr<const int64_t>(a.host_locs);
  p.host_locs_stride = a.host_locs.stride(0);
  p.max_context = a.host_locs.size(1);
  p.table_rows = std::min({a.hot.size(0), a.tok.size(0), a.lru.size(0), a.host_locs.size(0)});
  p.host_kv = reinterpret_cast<const uint8_t*>(a.host_kv.data_ptr());
  p.host_rows = a.host_kv.size(0) * hisparse::RowLayout<kItemBytes>::kRowsPerUnit;
  p.device_kv = reinterpret_cast<uint8_t*>(a.device_kv.data_ptr());
  p.device_rows = a.device_kv.size(0) * hisparse::RowLayout<kItemBytes>::kRowsPerUnit;
  p.out = ptr<int32_t>(a.out);
  p.out_stride = a.out.stride(0);
  p.num_real_reqs = ptr<const int32_t>(a.num_real);
  p.num_reqs = static_cast<int32_t>(num_reqs);
  p.has_plan = a.plan_counts.numel() > 0;
  if (p.has_plan) {
    p.plan_host = ptr<int64_t>(a.plan_host);
    p.plan_host_stride = a.plan_host.stride(0);
    p.plan_dev = ptr<int32_t>(a.plan_dev);
    p.plan_dev_stride = a.plan_dev.stride(0);
    p.plan_counts = ptr<int32_t>(a.plan_counts);
  }
  p.counters = a.counters.numel() > 0 ? ptr<int64_t>(a.counters) : nullptr;
  if (a.resident.numel() > 0) {  // the host wrapper's check_residency, in short
    TORCH_CHECK(a.resident.dim() == 1 && a.resident.element_size() == 1 && a.resident.size(0) >= p.table_rows &&
                    a.resident.is_contiguous(),
                "resident must be a contiguous uint8/bool [>= table rows] tensor");
    TORCH_CHECK(a.req_to_token.dim() == 2 && a.req_to_token.scalar_type() == torch::kInt32 &&
                    a.req_to_token.size(0) >= p.table_rows && a.req_to_token.stride(1) == 1,
                "req_to_token must be int32 [>= table rows, cols] with contiguous columns");
    TORCH_CHECK(a.logical_to_device.dim() == 1 && a.logical_to_device.scalar_type() == torch::kInt64 &&
                    a.logical_to_device.is_contiguous(),
                "logical_to_device must be a contiguous int64 tensor");
    p.resident = reinterpret_cast<const uint8_t*>(a.resident.data_ptr());
    p.req_to_token = ptr<const int32_t>(a.req_to_token);
    p.rtt_stride = a.req_to_token.stride(0);
    p.rtt_cols = a.req_to_token.size(1);
    p.logical_to_device = ptr<const int64_t>(a.logical_to_device);
    p.logical_rows = a.logical_to_device.size(0);
  }
  const bool reuse = a.slot_history.numel() > 0;
  if (reuse) {  // the host wrapper's check_reuse, in short
    TORCH_CHECK(a.slot_history.dim() == 2 && a.slot_history.scalar_type() == torch::kInt16 &&
                    a.slot_history.size(1) >= kB && a.slot_history.stride(1) == 1,
                "slot_history must be int16 [rows, >= B] with contiguous columns");
    TORCH_CHECK(a.reuse_levels.dim() == 1 && a.reuse_levels.scalar_type() == torch::kUInt8 &&
                    a.reuse_levels.size(0) >= 54 && a.reuse_levels.is_contiguous(),
                "reuse_levels must be a contiguous uint8 [54] tensor");
    p.table_rows = std::min(p.table_rows, a.slot_history.size(0));
    p.slot_hist = ptr<int16_t>(a.slot_history);
    p.hist_stride = a.slot_history.stride(0);
    p.reuse_levels = ptr<const uint8_t>(a.reuse_levels);
  }
  if (a.slot_map.numel() > 0) {  // the host wrapper's check of the position -> slot map, in short
    TORCH_CHECK(a.slot_map.dim() == 2 && a.slot_map.scalar_type() == torch::kInt16 &&
                    a.slot_map.size(1) >= p.max_context && a.slot_map.stride(1) == 1,
                "slot_map must be int16 [rows, >= max_context] with contiguous columns");
    p.table_rows = std::min(p.table_rows, a.slot_map.size(0));
    p.slot_map = ptr<int16_t>(a.slot_map);
    p.map_stride = a.slot_map.stride(0);
  }
  if (a.buffer_sizes.numel() > 0) {  // the host wrapper's check of the per-request buffer sizes, in short
    TORCH_CHECK(a.buffer_sizes.dim() == 1 && a.buffer_sizes.scalar_type() == torch::kInt32 &&
                    a.buffer_sizes.is_contiguous(),
                "buffer_sizes must be a contiguous int32 [rows] tensor");
    p.table_rows = std::min(p.table_rows, a.buffer_sizes.size(0));
    p.buffer_sizes = ptr<const int32_t>(a.buffer_sizes);
  }
  p.state = reinterpret_cast<uint32_t*>(a.state.data_ptr());
  p.flat_host = ptr<int64_t>(a.flat_host);
  p.flat_dev = ptr<int32_t>(a.flat_dev);
  if (hisparse::kPlanSpills<kB, kTopK, false> || hisparse::kPlanSpills<kB, kTopK, true>) {  // the host wrapper's check
    TORCH_CHECK(a.spill.numel() >= num_reqs * int64_t(hisparse::PlanSpill<kTopK>::kBytes),
                "the spill buffer must hold num_reqs slices of ", hisparse::PlanSpill<kTopK>::kBytes, " B");
    p.spill = reinterpret_cast<uint8_t*>(a.spill.data_ptr());
  }
  p.spin_timeout_ns = 60'000'000'000ull;
  const int64_t copiers = kSkipIO ? 0 : (a.copiers >= 0 ? a.copiers : 3);
  if (reuse) {
    emu::launch(
        static_cast<unsigned>(num_reqs + copiers), static_cast<unsigned>(a.block), PlanLayout<kB, kTopK, true>::kBytes,
        [&p] { hisparse::resolve_kernel<kItemBytes, kB, kTopK, kSkipIO, true>(p); }, a.concurrent);
  } else {
    emu::launch(
        static_cast<unsigned>(num_reqs + copiers), static_cast<unsigned>(a.block), PlanLayout<kB, kTopK>::kBytes,
        [&p] { hisparse::resolve_kernel<kItemBytes, kB, kTopK, kSkipIO>(p); }, a.concurrent);
  }
}

template <int kItemBytes>
void run_replay(torch::Tensor plan_host, torch::Tensor plan_dev, torch::Tensor plan_counts, torch::Tensor num_real,
                torch::Tensor host_kv, torch::Tensor device_kv, torch::Tensor state, int64_t block, int64_t ctas,
                bool concurrent) {
  ReplayParams p{};
  p.plan_host = ptr<const int64_t>(plan_host);
  p.plan_host_stride = plan_host.stride(0);
  p.plan_dev = ptr<const int32_t>(plan_dev);
  p.plan_dev_stride = plan_dev.stride(0);
  p.plan_counts = ptr<const int32_t>(plan_counts);
  p.plan_rows = static_cast<int32_t>(plan_counts.size(0));
  p.plan_width = static_cast<int32_t>(plan_host.size(1));
  p.num_real_reqs = ptr<const int32_t>(num_real);
  p.host_kv = reinterpret_cast<const uint8_t*>(host_kv.data_ptr());
  p.host_rows = host_kv.size(0) * hisparse::RowLayout<kItemBytes>::kRowsPerUnit;
  p.device_kv = reinterpret_cast<uint8_t*>(device_kv.data_ptr());
  p.device_rows = device_kv.size(0) * hisparse::RowLayout<kItemBytes>::kRowsPerUnit;
  p.state = reinterpret_cast<uint32_t*>(state.data_ptr());
  const size_t smem = hisparse::align16(4 * size_t(p.plan_rows + 1)) + 4 * 32;
  emu::launch(static_cast<unsigned>(ctas), static_cast<unsigned>(block), smem,
              [&p] { hisparse::replay_kernel<kItemBytes>(p); }, concurrent);
}

using ResolveFn = void (*)(const Args&);
using Key = std::tuple<int, int, int, bool>;

#define HISPARSE_EMU_CONFIG(I, B, K)                              \
  {Key{I, B, K, false}, &run_resolve<I, B, K, false>}, {Key{I, B, K, true}, &run_resolve<I, B, K, true>}

const std::map<Key, ResolveFn>& table() {
  static const std::map<Key, ResolveFn> t = {
      HISPARSE_EMU_CONFIG(1152, 13, 5),  HISPARSE_EMU_CONFIG(656, 13, 5),   HISPARSE_EMU_CONFIG(1152, 8, 8),
      HISPARSE_EMU_CONFIG(656, 8, 8),    HISPARSE_EMU_CONFIG(1152, 32, 8),  HISPARSE_EMU_CONFIG(656, 32, 8),
      HISPARSE_EMU_CONFIG(1152, 32, 32), HISPARSE_EMU_CONFIG(656, 32, 32),  HISPARSE_EMU_CONFIG(1152, 64, 32),
      HISPARSE_EMU_CONFIG(656, 64, 32),  HISPARSE_EMU_CONFIG(1152, 64, 64), HISPARSE_EMU_CONFIG(656, 64, 64),
      HISPARSE_EMU_CONFIG(1152, 256, 64), HISPARSE_EMU_CONFIG(656, 256, 64),
      HISPARSE_EMU_CONFIG(656, 64, 8),  // hash region < B: the map's candidates checked in global memory
      HISPARSE_EMU_CONFIG(1152, 40, 16),  HISPARSE_EMU_CONFIG(656, 96, 48),  // spilled (see kPlanSpills above)
      // DeepSeek-V4's paged C4 rows (RowLayout<584>): entries of 4 tokens in 37440-byte pages
      HISPARSE_EMU_CONFIG(584, 13, 5),   HISPARSE_EMU_CONFIG(584, 64, 32),  HISPARSE_EMU_CONFIG(584, 256, 64),
  };
  return t;
}

std::vector<std::tuple<int64_t, int64_t, int64_t>> configs() {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
  for (const auto& [k, fn] : table()) {
    if (!std::get<3>(k)) out.emplace_back(std::get<0>(k), std::get<1>(k), std::get<2>(k));
  }
  return out;
}

void resolve(int64_t item, int64_t B, int64_t K, bool skip_io, torch::Tensor topk, torch::Tensor seq_lens,
             torch::Tensor rpi, torch::Tensor hot, torch::Tensor tok, torch::Tensor lru, torch::Tensor host_locs,
             torch::Tensor host_kv, torch::Tensor device_kv, torch::Tensor out, torch::Tensor num_real,
             torch::Tensor plan_host, torch::Tensor plan_dev, torch::Tensor plan_counts, torch::Tensor counters,
             torch::Tensor resident, torch::Tensor req_to_token, torch::Tensor logical_to_device,
             torch::Tensor slot_history, torch::Tensor reuse_levels, torch::Tensor slot_map,
             torch::Tensor buffer_sizes, torch::Tensor state, torch::Tensor flat_host,
             torch::Tensor flat_dev, torch::Tensor spill, int64_t block, int64_t copiers, bool concurrent) {
  const auto it = table().find(Key{static_cast<int>(item), static_cast<int>(B), static_cast<int>(K), skip_io});
  TORCH_CHECK(it != table().end(), "no emulated instantiation for item ", item, " B ", B, " top_k ", K);
  it->second(Args{topk, seq_lens, rpi, hot, tok, lru, host_locs, host_kv, device_kv, out, num_real, plan_host,
                  plan_dev, plan_counts, counters, state, flat_host, flat_dev, spill, resident, req_to_token,
                  logical_to_device, slot_history, reuse_levels, slot_map, buffer_sizes, block, copiers, concurrent});
}

void replay(int64_t item, torch::Tensor plan_host, torch::Tensor plan_dev, torch::Tensor plan_counts,
            torch::Tensor num_real, torch::Tensor host_kv, torch::Tensor device_kv, torch::Tensor state,
            int64_t block, int64_t ctas, bool concurrent) {
  if (item == 1152) return run_replay<1152>(plan_host, plan_dev, plan_counts, num_real, host_kv, device_kv, state,
                                            block, ctas, concurrent);
  if (item == 584) return run_replay<584>(plan_host, plan_dev, plan_counts, num_real, host_kv, device_kv, state,
                                          block, ctas, concurrent);
  TORCH_CHECK(item == 656, "no emulated replay for item ", item);
  run_replay<656>(plan_host, plan_dev, plan_counts, num_real, host_kv, device_kv, state, block, ctas, concurrent);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("resolve", &resolve);
  m.def("replay", &replay);
  m.def("configs", &configs);
  // The layouts the Python mirrors (resolver/cuda.py) are checked against: (bytes, spills).
  m.def("planner_layout", [](int64_t B, int64_t K, bool reuse) -> std::tuple<int64_t, bool> {
#define HISPARSE_EMU_LAYOUT(b, k)                                                                  \
  if (B == b && K == k)                                                                            \
    return reuse ? std::tuple<int64_t, bool>{PlanLayout<b, k, true>::kBytes, hisparse::kPlanSpills<b, k, true>} \
                 : std::tuple<int64_t, bool>{PlanLayout<b, k>::kBytes, hisparse::kPlanSpills<b, k>};
    HISPARSE_EMU_LAYOUT(256, 64)
    HISPARSE_EMU_LAYOUT(64, 32)
    HISPARSE_EMU_LAYOUT(13, 5)
    HISPARSE_EMU_LAYOUT(4096, 2048)
    HISPARSE_EMU_LAYOUT(8192, 2048)
    HISPARSE_EMU_LAYOUT(17000, 2048)
    HISPARSE_EMU_LAYOUT(9108, 4096)
    HISPARSE_EMU_LAYOUT(12000, 4096)
    HISPARSE_EMU_LAYOUT(8192, 6144)
    HISPARSE_EMU_LAYOUT(10240, 8192)
#undef HISPARSE_EMU_LAYOUT
    return {-1, false};
  }, pybind11::arg("B"), pybind11::arg("K"), pybind11::arg("reuse") = false);
  m.def("planner_spill_bytes", [](int64_t K) -> int64_t {
    if (K == 16) return hisparse::PlanSpill<16>::kBytes;
    if (K == 2048) return hisparse::PlanSpill<2048>::kBytes;
    if (K == 6144) return hisparse::PlanSpill<6144>::kBytes;
    if (K == 8192) return hisparse::PlanSpill<8192>::kBytes;
    return -1;
  }, pybind11::arg("K"));
}
