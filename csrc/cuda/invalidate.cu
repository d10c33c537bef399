// CUDA invalidate (docs/ops-contract.md 11). Slots on the device are read by the kernel. A host list (an engine's
// freed block ids) is filtered on the host and carried in the launches' parameters, INVALIDATE_INLINE_SLOTS slots a
// launch: no copy, no staging buffer, no sync, and the caller may reuse the list as soon as the call returns.
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/invalidate.h"
#include "cuda/cuda_common.cuh"

namespace kvcanary {
namespace cuda {
namespace {

constexpr int kInvalidateThreads = 128;

struct Records {
  CanaryRecord* rec;
  int64_t S, per;  // slots per buffer; records per slot (buffers x halves), slot-major within a buffer
  int64_t H;
};

struct InlineSlots {
  int32_t v[INVALIDATE_INLINE_SLOTS];
};

// Thread i poisons record (i % per) of the i / per-th slot: j = buffer * H + half.
__device__ __forceinline__ void poison(const Records& r, int64_t s, int64_t j) {
  r.rec[((j / r.H) * r.S + s) * r.H + j % r.H] = poisoned_record();
}

template <typename T>
__global__ void __launch_bounds__(kInvalidateThreads)
    invalidate_kernel(Records r, const T* __restrict__ slots, int64_t n, int64_t reserved) {
  await_prior_kernels();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kInvalidateThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kInvalidateThreads + threadIdx.x; i < n * r.per; i += stride) {
    const int64_t s = slots[i / r.per];
    if (s >= reserved && s < r.S) poison(r, s, i % r.per);
  }
}

// The slots were filtered on the host: each lies in [reserved, S).
__global__ void __launch_bounds__(kInvalidateThreads)
    invalidate_inline_kernel(Records r, const __grid_constant__ InlineSlots s, int64_t n) {
  await_prior_kernels();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kInvalidateThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kInvalidateThreads + threadIdx.x; i < n * r.per; i += stride)
    poison(r, s.v[i / r.per], i % r.per);
}

}  // namespace

void invalidate(TensorView records, TensorView slots, int64_t reserved) {
  const bool host = check_invalidate_args(kDLCUDA, records, slots, reserved, true);
  const Records r{static_cast<CanaryRecord*>(records.data_ptr()), records.size(1), records.size(0) * records.size(2),
                  records.size(2)};
  TVM_FFI_CHECK(!host || r.S <= std::numeric_limits<int32_t>::max(), ValueError)
      << "a host slot list needs records of at most 2^31 - 1 slots, got " << r.S;
  const int64_t n = slots.size(0);
  if (n == 0) return;
  const DLDevice dev = records.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const cudaStream_t stream = stream_of(dev);
  const int64_t max_blocks = 8 * static_cast<int64_t>(sm_count(dev.device_id));
  const auto grid = [&](int64_t items) {
    return static_cast<unsigned>(std::min(ceil_div(items, kInvalidateThreads), max_blocks));
  };
  if (!host) {
    if (is_i64(slots)) {
      launch_kernel(invalidate_kernel<int64_t>, grid(n * r.per), kInvalidateThreads, stream, dev.device_id, r,
                    static_cast<const int64_t*>(slots.data_ptr()), n, reserved);
    } else {
      launch_kernel(invalidate_kernel<int32_t>, grid(n * r.per), kInvalidateThreads, stream, dev.device_id, r,
                    static_cast<const int32_t*>(slots.data_ptr()), n, reserved);
    }
    return;
  }
  InlineSlots chunk;
  int64_t k = 0;
  const auto flush = [&] {
    launch_kernel(invalidate_inline_kernel, grid(k * r.per), kInvalidateThreads, stream, dev.device_id, r, chunk, k);
    k = 0;
  };
  for_each_kept_slot(slots, reserved, r.S, [&](int64_t s) {
    chunk.v[k++] = static_cast<int32_t>(s);
    if (k == INVALIDATE_INLINE_SLOTS) flush();
  });
  if (k > 0) flush();
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(invalidate, kvcanary::cuda::invalidate);
