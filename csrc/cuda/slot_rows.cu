// CUDA slot-row fill (docs/ops-contract.md 12; 12a stages its row facts from the host first, or passes a small batch's
// in the launch): one launch. Block b < bs fills request b's row (its threads stride over the positions) from the
// first position no later request naming the same row reaches, so a row named twice ends as the CPU's in-order loop
// leaves it; the blocks after them convert the write slots, kSlotRowsThreads each; a grid smaller than that strides
// over the same work.
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>

#include "core/slot_rows.h"
#include "cuda/cuda_common.cuh"

namespace kvcanary {
namespace cuda {
namespace {

constexpr int kSlotRowsThreads = 256;

struct SlotRowsParams {
  void* table;
  bool t32;
  const int64_t *rows, *starts, *lens;
  IndexVec src, write;
  int64_t* out;
  SlotRowsArgs a;
  int64_t jobs;  // bs row jobs, then the write slots' chunks
};

// The fill's jobs, by the calling block. `later`: the most positions a later request naming this block's row fills.
__device__ __forceinline__ void slot_rows_jobs(const SlotRowsParams& p) {
  __shared__ unsigned long long later;
  const SlotRowsArgs& a = p.a;
  for (int64_t b = blockIdx.x; b < p.jobs; b += gridDim.x) {
    if (b < a.bs) {  // block-uniform branch: the barriers below are reached by every thread
      const int64_t row = p.rows[b], start = p.starts[b];
      const int64_t k = filled_positions(row, start, p.lens[b], a);
      if (threadIdx.x == 0) later = 0;
      __syncthreads();
      unsigned long long mine = 0;
      for (int64_t i = b + 1 + threadIdx.x; k > 0 && i < a.bs; i += kSlotRowsThreads) {
        if (p.rows[i] == row) mine = max(mine, static_cast<unsigned long long>(filled_positions(row, p.starts[i],
                                                                                                  p.lens[i], a)));
      }
      if (mine > 0) atomicMax(&later, mine);
      __syncthreads();
      for (int64_t j = static_cast<int64_t>(later) + threadIdx.x; j < k; j += kSlotRowsThreads) {
        fill_slot(p.table, p.t32, row, j, p.src[start + j], a);
      }
      __syncthreads();  // every thread has read `later` before the next request's block resets it
    } else {
      const int64_t k = (b - a.bs) * kSlotRowsThreads + threadIdx.x;
      if (k < a.n) p.out[k] = table_slot(p.write[k], a.stride, a.page);
    }
  }
}

__global__ void __launch_bounds__(kSlotRowsThreads) slot_rows_kernel(const SlotRowsParams p) {
  await_prior_kernels();
  slot_rows_jobs(p);
}

// The staged fact rows of a batch of at most STAGE_INLINE_ROWS requests, passed by value in the launch
// (docs/ops-contract.md 12a): the host then writes no memory that a copy still in flight may read.
struct InlineFacts {
  int64_t v[kSlotFactRows][STAGE_INLINE_ROWS];
};

// The fill reading its row facts from the launch's parameter space (__grid_constant__: addressable, not copied), which
// also writes them into the device facts (row pitch `width`) for the work queued after it.
__global__ void __launch_bounds__(kSlotRowsThreads)
    slot_rows_inline_kernel(SlotRowsParams p, const __grid_constant__ InlineFacts f, int64_t* facts, int64_t width) {
  await_prior_kernels();
  const int64_t bs = p.a.bs;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kSlotRowsThreads + threadIdx.x; i < kSlotFactRows * bs;
       i += static_cast<int64_t>(gridDim.x) * kSlotRowsThreads) {
    facts[(i / bs) * width + i % bs] = f.v[i / bs][i % bs];
  }
  p.rows = f.v[kFactRow];
  p.starts = f.v[kFactStart];
  p.lens = f.v[kFactKv];
  slot_rows_jobs(p);
}

// A fill's parameters: the row facts at `rows`, `starts`, `lens` (device memory, or set by the inline kernel).
SlotRowsParams slot_rows_params(const TensorView& table, const int64_t* rows, const int64_t* starts,
                                const int64_t* lens, const TensorView& src, const TensorView& out,
                                const TensorView& write, const SlotRowsArgs& a) {
  return SlotRowsParams{table.data_ptr(), is_i32(table), rows, starts, lens, IndexVec{src.data_ptr(), is_i32(src)},
                        IndexVec{write.data_ptr(), is_i32(write)}, static_cast<int64_t*>(out.data_ptr()), a,
                        a.bs + ceil_div(a.n, kSlotRowsThreads)};
}

// One launch of a fill `kernel` (slot_rows_kernel, or the inline one with its `extra` arguments) on `stream`, a grid
// of its jobs with at most 8 blocks per SM (they stride over the rest); nothing for no jobs.
template <typename Kernel, typename... Extra>
void launch_fill(Kernel kernel, const SlotRowsParams& p, int device_id, cudaStream_t stream, Extra... extra) {
  if (p.jobs == 0) return;
  const auto grid = static_cast<unsigned>(std::min(p.jobs, 8 * static_cast<int64_t>(sm_count(device_id))));
  launch_kernel(kernel, grid, kSlotRowsThreads, stream, device_id, p, extra...);
}

// Whether `stream` is capturing a graph (a launch's parameters would then be fixed for every replay).
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TVM_FFI_CHECK_CUDA_ERROR(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

void slot_rows(TensorView table, TensorView rows, TensorView starts, TensorView lens, TensorView src, TensorView out,
               TensorView write, int64_t stride, int64_t page) {
  const SlotRowsArgs a = check_slot_rows_args(kDLCUDA, table, rows, starts, lens, src, out, write, stride, page);
  const int device_id = table.device().device_id;
  tvm::ffi::CUDADeviceGuard guard(device_id);
  launch_fill(slot_rows_kernel,
              slot_rows_params(table, static_cast<const int64_t*>(rows.data_ptr()),
                               static_cast<const int64_t*>(starts.data_ptr()),
                               static_cast<const int64_t*>(lens.data_ptr()), src, out, write, a),
              device_id, stream_of(table.device()));
}

// docs/ops-contract.md 12a: a batch of at most STAGE_INLINE_ROWS requests, outside a capture, passes its five fact rows
// in the fill's launch (staging untouched, the event unused); any other writes them into the pinned staging on the
// host, copies their first bs columns to the device and launches the fill on them. `event` (a cudaEvent_t as int64, 0:
// none) guards the staging: awaited before the host writes it, recorded after the copy that reads it.
void stage_slot_rows(TensorView table, TensorView facts_in, TensorView staging, TensorView facts, TensorView src,
                     TensorView out, TensorView write, int64_t stride, int64_t page, int64_t event) {
  const StageSlotRowsArgs s =
      check_stage_slot_rows_args(kDLCUDA, table, facts_in, staging, facts, src, out, write, stride, page);
  const DLDevice dev = table.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const cudaStream_t stream = stream_of(dev);
  const int64_t bs = s.a.bs, w = s.width;
  if (bs <= STAGE_INLINE_ROWS && !capturing(stream)) {
    InlineFacts f;
    stage_facts(s.in, bs, &f.v[0][0], STAGE_INLINE_ROWS);
    launch_fill(slot_rows_inline_kernel, slot_rows_params(table, nullptr, nullptr, nullptr, src, out, write, s.a),
                dev.device_id, stream, f, s.facts, w);
    return;
  }
  // pageable staging would make the copy synchronous: an error before any write (an empty one has no memory to pin)
  if (w > 0) (void)mapped_host(s.staging, "staging", dev.device_id);
  const auto guard_event = reinterpret_cast<cudaEvent_t>(event);
  if (guard_event != nullptr) TVM_FFI_CHECK_CUDA_ERROR(cudaEventSynchronize(guard_event));  // the last copy has run
  const int64_t pitch = w * static_cast<int64_t>(sizeof(int64_t));
  stage_facts(s.in, bs, s.staging, w);
  if (bs > 0) {
    TVM_FFI_CHECK_CUDA_ERROR(cudaMemcpy2DAsync(s.facts, pitch, s.staging, pitch, bs * sizeof(int64_t), kSlotFactRows,
                                               cudaMemcpyHostToDevice, stream));
  }
  if (guard_event != nullptr) TVM_FFI_CHECK_CUDA_ERROR(cudaEventRecord(guard_event, stream));
  launch_fill(slot_rows_kernel,
              slot_rows_params(table, s.facts + kFactRow * w, s.facts + kFactStart * w, s.facts + kFactKv * w, src,
                               out, write, s.a),
              dev.device_id, stream);
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(slot_rows, kvcanary::cuda::slot_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(stage_slot_rows, kvcanary::cuda::stage_slot_rows);
