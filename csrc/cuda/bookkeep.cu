// CUDA per-stage bookkeeping (docs/ops-contract.md 10): one small block bumps the stage counter and folds the plan
// status into the window's running maximum (the two torch ops it replaces cost a Python call each).
#include <tvm/ffi/function.h>

#include "core/tensor_checks.h"
#include "cuda/cuda_common.cuh"

namespace kvcanary {
namespace cuda {
namespace {

constexpr int kBookkeepThreads = 64;

__global__ void __launch_bounds__(kBookkeepThreads) bookkeep_kernel(int64_t* counter, int64_t k, int64_t* acc,
                                                                    const int64_t* src, int64_t n) {
  await_prior_kernels();
  for (int64_t j = threadIdx.x; j < k; j += kBookkeepThreads) ++counter[j];
  for (int64_t i = threadIdx.x; i < n; i += kBookkeepThreads) acc[i] = acc[i] > src[i] ? acc[i] : src[i];
}

}  // namespace

void bookkeep(TensorView counter, TensorView acc, TensorView src) {
  check_bookkeep_args(kDLCUDA, counter, acc, src);
  const int64_t n = acc.size(0);
  const int64_t k = counter.size(0);
  if (k == 0 && n == 0) return;
  const DLDevice dev = counter.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  launch_kernel(bookkeep_kernel, 1, kBookkeepThreads, stream_of(dev), dev.device_id,
                static_cast<int64_t*>(counter.data_ptr()), k, static_cast<int64_t*>(acc.data_ptr()),
                static_cast<const int64_t*>(src.data_ptr()), n);
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(bookkeep, kvcanary::cuda::bookkeep);
