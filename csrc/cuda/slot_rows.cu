// CUDA slot-row fill (docs/ops-contract.md 12; 12a stages its row facts from the host first): one launch. Block
// b < bs fills request b's row (its threads stride over the positions) from the first position no later request naming
// the same row reaches, so a row named twice ends as the CPU's in-order loop leaves it; the blocks after them convert
// the write slots, kSlotRowsThreads each; a grid smaller than that strides over the same work.
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

// `later`: the most positions a later request naming this block's row fills.
__global__ void __launch_bounds__(kSlotRowsThreads) slot_rows_kernel(const SlotRowsParams p) {
  __shared__ unsigned long long later;
  await_prior_kernels();
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

// One slot_rows launch on the device's current stream: the row facts at `rows`, `starts`, `lens` (device memory).
void launch_slot_rows(const TensorView& table, const int64_t* rows, const int64_t* starts, const int64_t* lens,
                      const TensorView& src, const TensorView& out, const TensorView& write, const SlotRowsArgs& a,
                      cudaStream_t stream) {
  const int64_t jobs = a.bs + ceil_div(a.n, kSlotRowsThreads);
  if (jobs == 0) return;
  const int device_id = table.device().device_id;
  const SlotRowsParams p{table.data_ptr(), is_i32(table), rows, starts, lens, IndexVec{src.data_ptr(), is_i32(src)},
                         IndexVec{write.data_ptr(), is_i32(write)}, static_cast<int64_t*>(out.data_ptr()), a, jobs};
  const int64_t max_blocks = 8 * static_cast<int64_t>(sm_count(device_id));
  launch_kernel(slot_rows_kernel, static_cast<unsigned>(std::min(jobs, max_blocks)), kSlotRowsThreads, stream,
                device_id, p);
}

}  // namespace

void slot_rows(TensorView table, TensorView rows, TensorView starts, TensorView lens, TensorView src, TensorView out,
               TensorView write, int64_t stride, int64_t page) {
  const SlotRowsArgs a = check_slot_rows_args(kDLCUDA, table, rows, starts, lens, src, out, write, stride, page);
  tvm::ffi::CUDADeviceGuard guard(table.device().device_id);
  launch_slot_rows(table, static_cast<const int64_t*>(rows.data_ptr()), static_cast<const int64_t*>(starts.data_ptr()),
                   static_cast<const int64_t*>(lens.data_ptr()), src, out, write, a, stream_of(table.device()));
}

// docs/ops-contract.md 12a: the five fact rows into the pinned staging on the host, one copy of their first bs columns
// to the device, the slot_rows launch on them. `event` (a cudaEvent_t as int64, 0: none) guards the staging: awaited
// before the host writes it, recorded after the copy that reads it.
void stage_slot_rows(TensorView table, TensorView facts_in, TensorView staging, TensorView facts, TensorView src,
                     TensorView out, TensorView write, int64_t stride, int64_t page, int64_t event) {
  const StageSlotRowsArgs s =
      check_stage_slot_rows_args(kDLCUDA, table, facts_in, staging, facts, src, out, write, stride, page);
  const DLDevice dev = table.device();
  // pageable staging would make the copy synchronous: the same pinned rule as begin_decode's (an error before any
  // write); an empty one has no memory to pin
  if (s.width > 0) (void)mapped_host(s.staging, "staging", dev.device_id);
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const cudaStream_t stream = stream_of(dev);
  const auto guard_event = reinterpret_cast<cudaEvent_t>(event);
  if (guard_event != nullptr) TVM_FFI_CHECK_CUDA_ERROR(cudaEventSynchronize(guard_event));  // the last copy has run
  const int64_t bs = s.a.bs, pitch = s.width * static_cast<int64_t>(sizeof(int64_t));
  stage_facts(s.in, bs, s.staging, s.width);
  if (bs > 0) {
    TVM_FFI_CHECK_CUDA_ERROR(cudaMemcpy2DAsync(s.facts, pitch, s.staging, pitch, bs * sizeof(int64_t), kSlotFactRows,
                                               cudaMemcpyHostToDevice, stream));
  }
  if (guard_event != nullptr) TVM_FFI_CHECK_CUDA_ERROR(cudaEventRecord(guard_event, stream));
  const int64_t w = s.width;
  launch_slot_rows(table, s.facts + kFactRow * w, s.facts + kFactStart * w, s.facts + kFactKv * w, src, out, write,
                   s.a, stream);
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(slot_rows, kvcanary::cuda::slot_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(stage_slot_rows, kvcanary::cuda::stage_slot_rows);
