// CUDA batch staging (docs/ops-contract.md 8b): one launch, a thread per row and per token of the bound shape; the
// staging rows are read in place from pinned host memory (its device-mapped address), so no separate copy is queued.
#include <tvm/ffi/function.h>

#include <algorithm>

#include "core/stage_batch.cuh"
#include "core/tensor_checks.h"
#include "core/truth_decode.h"
#include "cuda/cuda_common.cuh"

namespace kvcanary {
namespace cuda {
namespace {

constexpr int kStageThreads = 256;

__device__ __forceinline__ void stage_grid(const StageArgs& a) {
  const int64_t n = a.pad_rows > a.pad_tokens ? a.pad_rows : a.pad_tokens;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kStageThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kStageThreads) {
    if (i < a.pad_rows) stage_row(a, i);
    if (i < a.pad_tokens) stage_token(a, i);
  }
}

__global__ void __launch_bounds__(kStageThreads) stage_batch_kernel(StageArgs a) {
  await_prior_kernels();
  stage_grid(a);
}

// The staging rows of a batch of at most STAGE_INLINE_ROWS rows, passed by value in the launch (docs/ops-contract.md
// 8c): the host then writes no memory that a launch still in flight may read.
struct InlineStaging {
  int64_t v[kStagingRows][STAGE_INLINE_ROWS];
};

__global__ void __launch_bounds__(kStageThreads)
    stage_inline_kernel(StageArgs a, const __grid_constant__ InlineStaging s) {
  await_prior_kernels();
  a.staging = &s.v[0][0];  // the launch's parameter space (__grid_constant__: addressable, not copied)
  stage_grid(a);
}

// Checked arguments with the staging rows' device-mapped address (an input error for pageable staging).
StageArgs mapped(StageArgs a, int device_id) {
  if (a.bs > 0) a.staging = static_cast<const int64_t*>(mapped_host(a.staging, "staging", device_id));
  return a;
}

// The grid of a staging launch: a thread per row and per token of the bound shape (0: nothing to stage).
int64_t stage_blocks(const StageArgs& a, int device_id) {
  const int64_t n = std::max(a.pad_rows, a.pad_tokens);
  return std::min<int64_t>((n + kStageThreads - 1) / kStageThreads, 4 * static_cast<int64_t>(sm_count(device_id)));
}

// `a` from mapped(); `event` (0: none) is recorded after the launch, which reads the pinned staging rows in place.
void launch_stage(const StageArgs& a, const DLDevice& dev, cudaEvent_t event = nullptr) {
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const int64_t grid = stage_blocks(a, dev.device_id);
  const cudaStream_t stream = stream_of(dev);
  if (grid > 0) {
    launch_kernel(stage_batch_kernel, static_cast<unsigned>(grid), kStageThreads, stream, dev.device_id, a);
  }
  if (event != nullptr) TVM_FFI_CHECK_CUDA_ERROR(cudaEventRecord(event, stream));
}

// A steady decode of at most STAGE_INLINE_ROWS rows: the truth into the launch's own staging rows, the staging buffer
// neither read nor written (nor required pinned).
int64_t begin_decode_inline(StageArgs a, const TensorView& host_rows, const TensorView& host_pre,
                            const TensorView& host_ext, const TensorView& true_new, const TensorView& live,
                            const TensorView& h, const TensorView& n, int64_t offset, const TensorView& seen,
                            const TensorView& prefix, int64_t step, const TensorView& reuse, const DLDevice& dev) {
  InlineStaging s;
  a.staging_cols = STAGE_INLINE_ROWS;
  const int64_t got = begin_decode_host(a, &s.v[0][0], host_rows, host_pre, host_ext, true_new, live, h, n, offset,
                                        seen, prefix, step, reuse);
  if (got < 0) return got;
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const int64_t grid = stage_blocks(a, dev.device_id);
  if (grid > 0) {
    launch_kernel(stage_inline_kernel, static_cast<unsigned>(grid), kStageThreads, stream_of(dev), dev.device_id, a,
                  s);
  }
  return got;
}

}  // namespace

void stage_batch(TensorView req_pool_indices, TensorView prefix_lens, TensorView extend_lens, TensorView input_ids,
                 TensorView positions, TensorView out_cache_loc, TensorView staging, TensorView rows,
                 TensorView truth, TensorView tokens, int64_t pad_rows, int64_t pad_tokens, int64_t padding_row) {
  const TensorView src[6] = {req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc};
  launch_stage(mapped(check_stage_args(kDLCUDA, src, staging, rows, truth, tokens, pad_rows, pad_tokens,
                                        padding_row),
                      rows.device().device_id),
               rows.device());
}

// docs/ops-contract.md 8c: the steady decode's truth into the pinned staging rows on the host, then the staging
// launch that reads them in place (only after a steady decode: result >= 0); a batch of at most STAGE_INLINE_ROWS
// rows passes them in the launch instead. `event` (a cudaEvent_t as int64, 0: none) guards the pinned rows: awaited
// before the decode writes them, recorded after the launch that reads them (unused by a batch passed in the launch).
int64_t begin_decode(TensorView req_pool_indices, TensorView prefix_lens, TensorView extend_lens,
                     TensorView input_ids, TensorView positions, TensorView out_cache_loc, TensorView staging,
                     TensorView rows, TensorView truth, TensorView tokens, int64_t pad_rows, int64_t pad_tokens,
                     int64_t padding_row, TensorView host_rows, TensorView host_pre, TensorView host_ext,
                     TensorView true_new, TensorView live, TensorView h, TensorView n, int64_t offset,
                     TensorView seen, TensorView prefix, int64_t step, TensorView reuse, int64_t event) {
  const TensorView src[6] = {req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc};
  const StageArgs checked =
      check_stage_args(kDLCUDA, src, staging, rows, truth, tokens, pad_rows, pad_tokens, padding_row);
  if (checked.bs <= STAGE_INLINE_ROWS) {
    return begin_decode_inline(checked, host_rows, host_pre, host_ext, true_new, live, h, n, offset, seen, prefix,
                               step, reuse, rows.device());
  }
  // every check (the staging's pinning included) before the decode writes
  const StageArgs a = mapped(checked, rows.device().device_id);
  const auto guard = reinterpret_cast<cudaEvent_t>(event);
  if (guard != nullptr) TVM_FFI_CHECK_CUDA_ERROR(cudaEventSynchronize(guard));  // the rows' last reader has run
  const int64_t got = begin_decode_host(a, static_cast<int64_t*>(staging.data_ptr()), host_rows, host_pre, host_ext,
                                        true_new, live, h, n, offset, seen, prefix, step, reuse);
  if (got >= 0) launch_stage(a, rows.device(), guard);
  return got;
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(stage_batch, kvcanary::cuda::stage_batch);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(begin_decode, kvcanary::cuda::begin_decode);
