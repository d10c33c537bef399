// CUDA window staging (docs/ops-contract.md 13): one launch of one block. Every thread reads its share of the head and
// the kept rows into the pinned snapshot (device-mapped) before the barrier, so the reset after it cannot change what
// is staged; every thread fences its writes system-wide before the barrier, and thread 0 fences again before the tag.
#include <tvm/ffi/function.h>

#include "core/stage_window.h"
#include "cuda/cuda_common.cuh"

namespace kvcanary {
namespace cuda {
namespace {

constexpr int kWindowThreads = 512;

__global__ void __launch_bounds__(kWindowThreads)
    stage_window_kernel(const int64_t* head, const int64_t* count, const int64_t* rows, int64_t* reset, int64_t* out,
                        const WindowArgs a, int64_t tag) {
  await_prior_kernels();
  const int64_t n = a.h + kept_rows(*count, a.cap) * a.cols;
  for (int64_t i = threadIdx.x; i < n; i += kWindowThreads) out[1 + i] = i < a.h ? head[i] : rows[i - a.h];
  __threadfence_system();  // this thread's snapshot writes, visible before the tag
  __syncthreads();
  for (int64_t i = threadIdx.x; i < a.r; i += kWindowThreads) reset[i] = 0;
  if (threadIdx.x == 0) {
    __threadfence_system();  // cumulative: the block's writes, seen by thread 0 through the barrier, before the tag
    *static_cast<volatile int64_t*>(out) = tag;
  }
}

}  // namespace

void stage_window(TensorView head, TensorView count, TensorView rows, TensorView reset, TensorView dst, int64_t tag) {
  const WindowArgs a = check_stage_window_args(kDLCUDA, head, count, rows, reset, dst);
  const DLDevice dev = head.device();
  auto* out = static_cast<int64_t*>(mapped_host(dst.data_ptr(), "dst", dev.device_id));
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  launch_kernel(stage_window_kernel, 1, kWindowThreads, stream_of(dev), dev.device_id,
                static_cast<const int64_t*>(head.data_ptr()), static_cast<const int64_t*>(count.data_ptr()),
                static_cast<const int64_t*>(rows.data_ptr()), static_cast<int64_t*>(reset.data_ptr()), out, a, tag);
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(stage_window, kvcanary::cuda::stage_window);
