// CUDA fingerprint (docs/ops-contract.md 1): one warp per slot in ALL mode (lanes split the row's 16-byte chunks,
// warp-reduce the wrapped sum, finalize once), one thread per slot in PARTIAL mode; grid sized from the SM count.
#include <tvm/ffi/function.h>

#include "core/fingerprint.cuh"
#include "cuda/cuda_common.cuh"

namespace kvcanary {
namespace cuda {
namespace {

constexpr int kFpThreads = 256;

struct FpLaunch {
  const int64_t* table;
  int64_t n_sources;
  int64_t half;
  const int64_t* slots;
  const int64_t* positions;
  int64_t n;
  int32_t mode;
  int64_t layer_stride;
  int64_t num_slots;
  int64_t* out;
};

__device__ __forceinline__ bool fp_item_ok(const FpLaunch& L, int64_t slot, int64_t position) {
  return slot >= 0 && slot < L.num_slots && chain_value_ok(position);
}

__global__ void __launch_bounds__(kFpThreads) fingerprint_warp_kernel(FpLaunch L) {
  await_prior_kernels();
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kFpThreads / kWarp);
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * kFpThreads + threadIdx.x) / kWarp; i < L.n; i += warps) {
    const int64_t slot = L.slots[i], position = L.positions[i];
    uint64_t fp = 0;
    if (fp_item_ok(L, slot, position)) {  // warp-uniform
      fp = fingerprint_warp(L.table, L.n_sources, L.half, slot, position, L.mode, L.layer_stride);
    }
    if (lane == 0) L.out[i] = static_cast<int64_t>(fp);
  }
}

__global__ void __launch_bounds__(kFpThreads) fingerprint_thread_kernel(FpLaunch L) {
  await_prior_kernels();
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kFpThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kFpThreads + threadIdx.x; i < L.n; i += threads) {
    const int64_t slot = L.slots[i], position = L.positions[i];
    L.out[i] = fp_item_ok(L, slot, position) ? static_cast<int64_t>(fingerprint_thread(
                                                   L.table, L.n_sources, L.half, slot, position, L.mode,
                                                   L.layer_stride))
                                             : 0;
  }
}

std::array<std::atomic<int>, kMaxDevices> g_fp_warp_occupancy{}, g_fp_thread_occupancy{};

}  // namespace

void fingerprint(TensorView table, int64_t half, TensorView slots, TensorView positions, int64_t mode,
                 int64_t layer_stride, int64_t num_slots, TensorView out) {
  const int64_t n = check_fingerprint_args(kDLCUDA, table, half, slots, positions, mode, layer_stride, num_slots, out);
  const DLDevice dev = table.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const cudaStream_t stream = stream_of(dev);
  if (n == 0) return;
  if (mode == static_cast<int64_t>(FingerprintMode::NONE)) {
    TVM_FFI_CHECK_CUDA_ERROR(cudaMemsetAsync(out.data_ptr(), 0, n * sizeof(int64_t), stream));
    return;
  }
  const FpLaunch L{static_cast<const int64_t*>(table.data_ptr()), table.size(1), half,
                   static_cast<const int64_t*>(slots.data_ptr()), static_cast<const int64_t*>(positions.data_ptr()),
                   n, static_cast<int32_t>(mode), layer_stride, num_slots, static_cast<int64_t*>(out.data_ptr())};
  const int64_t sms = sm_count(dev.device_id);
  if (mode == static_cast<int64_t>(FingerprintMode::PARTIAL)) {
    const int64_t full = sms * resident_blocks(fingerprint_thread_kernel, kFpThreads, dev.device_id,
                                               g_fp_thread_occupancy);
    const int64_t grid = std::min<int64_t>(full, ceil_div(n, kFpThreads));
    launch_kernel(fingerprint_thread_kernel, static_cast<unsigned>(grid), kFpThreads, stream, dev.device_id, L);
  } else {
    const int64_t full = sms * resident_blocks(fingerprint_warp_kernel, kFpThreads, dev.device_id,
                                               g_fp_warp_occupancy);
    const int64_t grid = std::min<int64_t>(full, ceil_div(n, kFpThreads / kWarp));
    launch_kernel(fingerprint_warp_kernel, static_cast<unsigned>(grid), kFpThreads, stream, dev.device_id, L);
  }
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(fingerprint, kvcanary::cuda::fingerprint);
