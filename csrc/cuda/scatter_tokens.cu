// CUDA scatter_tokens (docs/ops-contract.md 7): one block per request; the request's token offset is the block's
// reduction of the earlier requests' saturated counts (as in csrc/cpu/scatter_tokens.cc), then a strided copy.
#include <tvm/ffi/function.h>

#include "core/common.cuh"
#include "cuda/cuda_common.cuh"

namespace kvcanary {
namespace cuda {
namespace {

constexpr int kScatterThreads = 256;

struct ScatterLaunch {
  int64_t* pool;
  int64_t* lens;
  const int64_t* rows;
  const int64_t* starts;
  const int64_t* counts;
  const int64_t* tokens;
  int64_t* status;
  int64_t R, L, n, T;
};

__device__ __forceinline__ int64_t saturated_count(int64_t c, int64_t T) { return c <= 0 ? 0 : (c < T + 1 ? c : T + 1); }

__global__ void __launch_bounds__(kScatterThreads) scatter_tokens_kernel(ScatterLaunch a) {
  await_prior_kernels();
  __shared__ int64_t s_reduce[kScatterThreads / kWarp];
  __shared__ int64_t s_off;
  for (int64_t i = blockIdx.x; i < a.n; i += gridDim.x) {
    int64_t part = 0;
    for (int64_t k = threadIdx.x; k < i; k += kScatterThreads) part += saturated_count(a.counts[k], a.T);
    part = warp_sum_i64(part);
    __syncthreads();
    if (threadIdx.x % kWarp == 0) s_reduce[threadIdx.x / kWarp] = part;
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t off = 0;
      for (int w = 0; w < kScatterThreads / kWarp; ++w) off += s_reduce[w];
      s_off = off;
    }
    __syncthreads();
    const int64_t off = s_off;
    const int64_t row = a.rows[i], start = a.starts[i], cnt = a.counts[i];
    const bool ok = row >= 0 && row < a.R && start >= 0 && cnt >= 0 && start <= a.L && cnt <= a.L - start &&
                    off <= a.T && cnt <= a.T - off;
    if (ok) {
      for (int64_t k = threadIdx.x; k < cnt; k += kScatterThreads) a.pool[row * a.L + start + k] = a.tokens[off + k];
      if (threadIdx.x == 0) a.lens[row] = start + cnt;
    } else if (threadIdx.x == 0) {
      atomic_add_i64(a.status, 1);
    }
  }
}

}  // namespace

void scatter_tokens(TensorView pool_tokens, TensorView pool_lens, TensorView rows, TensorView starts,
                    TensorView counts, TensorView tokens, TensorView status) {
  check_scatter_args(kDLCUDA, pool_tokens, pool_lens, rows, starts, counts, tokens, status);
  const int64_t R = pool_tokens.size(0), L = pool_tokens.size(1), n = rows.size(0), T = tokens.size(0);
  if (n == 0) return;
  const ScatterLaunch a{static_cast<int64_t*>(pool_tokens.data_ptr()), static_cast<int64_t*>(pool_lens.data_ptr()),
                        static_cast<const int64_t*>(rows.data_ptr()), static_cast<const int64_t*>(starts.data_ptr()),
                        static_cast<const int64_t*>(counts.data_ptr()), static_cast<const int64_t*>(tokens.data_ptr()),
                        static_cast<int64_t*>(status.data_ptr()), R, L, n, T};
  const DLDevice dev = pool_tokens.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const int64_t grid = std::min<int64_t>(n, 8 * static_cast<int64_t>(sm_count(dev.device_id)));
  launch_kernel(scatter_tokens_kernel, static_cast<unsigned>(grid), kScatterThreads, stream_of(dev), dev.device_id, a);
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(scatter_tokens, kvcanary::cuda::scatter_tokens);
