// CUDA per-stage bookkeeping (docs/ops-contract.md 10): one small block bumps the stage counter, folds the plan
// status into the window's running maximum (the two torch ops it replaces cost a Python call each) and mirrors the
// ring count into pinned host memory for the host's alarm (no copy or event per forward).
#include <tvm/ffi/function.h>

#include "core/tensor_checks.h"
#include "cuda/cuda_common.cuh"

namespace kvcanary {
namespace cuda {
namespace {

constexpr int kBookkeepThreads = 64;

// `mirror` is the device-mapped address of pinned host memory: thread 0, which bumped counter[0], writes the mirrored
// values, makes them visible system-wide, and only then the tag, so that a host reading the tag first never pairs a
// new tag with older values.
__global__ void __launch_bounds__(kBookkeepThreads) bookkeep_kernel(int64_t* counter, int64_t k, int64_t* acc,
                                                                    const int64_t* src, int64_t n,
                                                                    const int64_t* mirror_src, int64_t m,
                                                                    int64_t* mirror) {
  await_prior_kernels();
  for (int64_t j = threadIdx.x; j < k; j += kBookkeepThreads) ++counter[j];
  for (int64_t i = threadIdx.x; i < n; i += kBookkeepThreads) acc[i] = acc[i] > src[i] ? acc[i] : src[i];
  if (m > 0 && threadIdx.x == 0) {
    volatile int64_t* out = mirror;
    for (int64_t i = 0; i < m; ++i) out[1 + i] = mirror_src[i];
    __threadfence_system();
    out[0] = counter[0];
  }
}

}  // namespace

void bookkeep(TensorView counter, TensorView acc, TensorView src, TensorView mirror_src, TensorView mirror) {
  check_bookkeep_args(kDLCUDA, counter, acc, src, mirror_src, mirror);
  const int64_t n = acc.size(0);
  const int64_t k = counter.size(0);
  const int64_t m = mirror_src.size(0);
  if (k == 0 && n == 0) return;
  const DLDevice dev = counter.device();
  int64_t* out =
      m > 0 ? static_cast<int64_t*>(mapped_host(mirror.data_ptr(), "mirror", dev.device_id)) : nullptr;
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  launch_kernel(bookkeep_kernel, 1, kBookkeepThreads, stream_of(dev), dev.device_id,
                static_cast<int64_t*>(counter.data_ptr()), k, static_cast<int64_t*>(acc.data_ptr()),
                static_cast<const int64_t*>(src.data_ptr()), n, static_cast<const int64_t*>(mirror_src.data_ptr()),
                m, out);
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(bookkeep, kvcanary::cuda::bookkeep);
