// CUDA slot-row fill (docs/ops-contract.md 12): one launch. Block b < bs fills request b's row (its threads stride over
// the positions) from the first position no later request naming the same row reaches, so a row named twice ends as
// the CPU's in-order loop leaves it; the blocks after them convert the write slots, kSlotRowsThreads each; a grid
// smaller than that strides over the same work.
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

}  // namespace

void slot_rows(TensorView table, TensorView rows, TensorView starts, TensorView lens, TensorView src, TensorView out,
               TensorView write, int64_t stride, int64_t page) {
  const SlotRowsArgs a = check_slot_rows_args(kDLCUDA, table, rows, starts, lens, src, out, write, stride, page);
  const int64_t jobs = a.bs + ceil_div(a.n, kSlotRowsThreads);
  if (jobs == 0) return;
  const DLDevice dev = table.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const SlotRowsParams p{table.data_ptr(), is_i32(table), static_cast<const int64_t*>(rows.data_ptr()),
                         static_cast<const int64_t*>(starts.data_ptr()), static_cast<const int64_t*>(lens.data_ptr()),
                         IndexVec{src.data_ptr(), is_i32(src)}, IndexVec{write.data_ptr(), is_i32(write)},
                         static_cast<int64_t*>(out.data_ptr()), a, jobs};
  const int64_t max_blocks = 8 * static_cast<int64_t>(sm_count(dev.device_id));
  launch_kernel(slot_rows_kernel, static_cast<unsigned>(std::min(jobs, max_blocks)), kSlotRowsThreads,
                stream_of(dev), dev.device_id, p);
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(slot_rows, kvcanary::cuda::slot_rows);
