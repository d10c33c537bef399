// CUDA-side helpers shared by the kernels: launch geometry, stream, warp/block primitives, warp fingerprints.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/base.h>
#include <tvm/ffi/extra/cuda/device_guard.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <utility>

#include "core/fingerprint.cuh"
#include "core/resolve.cuh"
#include "core/sink.cuh"
#include "core/tensor_checks.h"

namespace kvcanary {
namespace cuda {

constexpr int kWarp = 32;
constexpr int kMaxDevices = 64;

// A device attribute that is never 0 (a count, a compute capability), read once per device and cached (host only, no
// stream work: capture-safe).
template <cudaDeviceAttr kAttr>
inline int device_attribute(int device_id) {
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  TVM_FFI_ICHECK(device_id >= 0 && device_id < kMaxDevices) << "device id " << device_id;
  int v = cache[device_id].load(std::memory_order_relaxed);
  if (v == 0) {
    TVM_FFI_CHECK_CUDA_ERROR(cudaDeviceGetAttribute(&v, kAttr, device_id));
    cache[device_id].store(v, std::memory_order_relaxed);
  }
  return v;
}

inline int sm_count(int device_id) { return device_attribute<cudaDevAttrMultiProcessorCount>(device_id); }

// Resident blocks per SM of a kernel at a block size, computed once per (kernel, device) by the caller's static.
template <typename Kernel>
inline int resident_blocks(Kernel kernel, int threads, int device_id, std::array<std::atomic<int>, kMaxDevices>& cache) {
  int v = cache[device_id].load(std::memory_order_relaxed);
  if (v == 0) {
    TVM_FFI_CHECK_CUDA_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, threads, 0));
    if (v < 1) v = 1;
    cache[device_id].store(v, std::memory_order_relaxed);
  }
  return v;
}

// The device-mapped address of pinned (page-locked) host memory; a clear error naming `what` for pageable memory, which
// a kernel cannot reach. The device address is the current context's: a thread that has made no CUDA call yet (an
// engine's stop from a request thread) has no current context, the lookup then fails or gives no device address, and
// CUDADeviceGuard sets none when the device is already the current one. So a failed lookup makes the device's primary
// context current (cudaSetDevice, and cudaFree(nullptr), the documented way to force a context) and retries once; the
// hot path is untouched.
inline void* mapped_host(const void* host, const char* what, int device_id) {
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, host);
  if (err != cudaSuccess || attr.type != cudaMemoryTypeHost || attr.devicePointer == nullptr) {
    (void)cudaGetLastError();  // the failed lookup's error must not surface at the next launch check
    int previous = 0;
    TVM_FFI_CHECK_CUDA_ERROR(cudaGetDevice(&previous));
    TVM_FFI_CHECK_CUDA_ERROR(cudaSetDevice(device_id));
    TVM_FFI_CHECK_CUDA_ERROR(cudaFree(nullptr));
    err = cudaPointerGetAttributes(&attr, host);
    (void)cudaGetLastError();
    if (previous != device_id) TVM_FFI_CHECK_CUDA_ERROR(cudaSetDevice(previous));
  }
  TVM_FFI_CHECK(err == cudaSuccess && attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr, ValueError)
      << what << " must be pinned host memory (torch pin_memory=True) on the CUDA backend (lookup: "
      << cudaGetErrorName(err) << ", memory type " << static_cast<int>(attr.type) << ", device address "
      << (attr.devicePointer != nullptr ? "set" : "none") << ")";
  return attr.devicePointer;
}

// The caller's stream for a device (tvm-ffi sets it to torch's current stream, or the capture stream).
inline cudaStream_t stream_of(DLDevice dev) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(dev.device_type, dev.device_id));
}

// Programmatic dependent launch (sm_90 and later): a kernel launched by launch_kernel may be scheduled while the
// previous kernel of its stream still runs (that kernel lets it, see await_prior_kernels), so its launch latency hides
// behind that kernel's tail; a captured graph keeps this as a programmatic edge. Earlier devices: plain stream order.
inline bool dependent_launch_ok(int device_id) {
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(device_id) >= 9;
}

// Launch `kernel` (whose first statement must be await_prior_kernels()) on `stream` as a programmatic dependent launch
// where the device has it; throws on a launch error.
template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), dim3 grid, int threads, cudaStream_t stream, int device_id,
                          Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = dependent_launch_ok(device_id) ? 1 : 0;
  TVM_FFI_CHECK_CUDA_ERROR(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

inline void check_cuda(const tvm::ffi::TensorView& t, const char* name) {
  check_device_type(t, kDLCUDA, name);
}

// An int64 pointer, or nullptr for an absent optional tensor (0 elements).
inline const int64_t* opt_ptr(const tvm::ffi::TensorView& t) {
  return t.numel() == 0 ? nullptr : static_cast<const int64_t*>(t.data_ptr());
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#if defined(__CUDACC__)

// The first statement of every kernel (launch_kernel's contract): waits until every earlier kernel of the stream has
// finished and its memory is visible (this kernel may have been scheduled before that), then lets the next kernel of
// the stream be scheduled, which waits the same way before touching memory. No memory access may precede it. Wait
// first, trigger second: a later kernel of another library that reads before its own wait (its prologue) then still
// finds every kernel before this one finished.
__device__ __forceinline__ void await_prior_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ uint64_t warp_sum_u64(uint64_t v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ int64_t warp_sum_i64(int64_t v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block totals of K per-thread counts, left in thread 0's v (other threads' v unspecified); all threads call it.
template <int kThreads, int K>
__device__ __forceinline__ void block_sum_to_thread0(int64_t (&v)[K], int64_t* smem /* K * kThreads/32 */) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum_i64(v[k]);
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) smem[warp * K + k] = v[k];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      int64_t s = 0;
      for (int w = 0; w < kThreads / kWarp; ++w) s += smem[w * K + k];
      v[k] = s;
    }
  }
}

// Wrapped sum of the word terms of source j's row of `slot`, this lane's share (16-byte chunks lane, lane+32, ...).
__device__ __forceinline__ uint64_t fp_lane_terms(const FpSource& s, int64_t j, int64_t slot, int64_t words, int lane) {
  const ulonglong2* row = reinterpret_cast<const ulonglong2*>(fp_row(s, slot));
  const int64_t chunks = words / 2;
  uint64_t acc = 0;
  int64_t c = lane;
  // Four independent 16-byte loads in flight per lane before the first use.
  for (; c + 3 * kWarp < chunks; c += 4 * kWarp) {
    ulonglong2 w[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) w[u] = __ldcs(row + c + u * kWarp);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t i = 2 * (c + u * kWarp);
      acc += fp_word_term(w[u].x, j, i) + fp_word_term(w[u].y, j, i + 1);
    }
  }
  for (; c < chunks; c += kWarp) {
    const ulonglong2 w = __ldcs(row + c);
    acc += fp_word_term(w.x, j, 2 * c) + fp_word_term(w.y, j, 2 * c + 1);
  }
  return acc;
}

// Warp-cooperative fingerprint of (slot, position, half): every lane of a converged warp calls it with the same
// arguments and gets the same value, equal bit for bit to fingerprint_serial (the wrapped sum is order-free).
__device__ __forceinline__ uint64_t fingerprint_warp(const int64_t* table, int64_t n_sources, int64_t half,
                                                     int64_t slot, int64_t position, int32_t mode,
                                                     int64_t layer_stride) {
  const int lane = threadIdx.x % kWarp;
  uint64_t acc = 0;
  for (int64_t j = 0; j < n_sources; ++j) {
    if (!fp_source_selected(j, position, layer_stride)) continue;
    const FpSource s = fp_source_at(table, n_sources, half, j);
    acc += fp_lane_terms(s, j, slot, fp_read_words(s, mode), lane);
  }
  return fp_finalize(warp_sum_u64(acc), position);
}

// Wrapped word sums of the fingerprints of `items` (slot, position) pairs, every half, by every warp of the block.
// The rows (item, half, source) are dealt to the warps round-robin, so a few items with many layers (a decode seal,
// a sweep slice) keep every warp loading instead of one warp walking an item's layers one after another. A row's
// sum is added into s_acc[item * MAX_HALVES + half] with a shared-memory atomic: the wrapped u64 sum is order-free,
// so s_acc ends equal to fingerprint_serial's acc bit for bit (finalize with fp_finalize). s_slot[i] < 0: item i
// has no fingerprint. The caller zeroes s_acc and fills s_slot / s_pos before a barrier, and reads s_acc after
// another; every thread of the block calls it.
__device__ __forceinline__ void block_fp_sums(const int64_t* table, int64_t n_sources, int64_t halves, int64_t items,
                                              const int64_t* s_slot, const int64_t* s_pos, int32_t mode,
                                              int64_t layer_stride, unsigned long long* s_acc) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int64_t per_item = halves * n_sources;
  for (int64_t r = warp; r < items * per_item; r += warps) {
    const int64_t item = r / per_item, h = (r % per_item) / n_sources, j = r % n_sources;
    const int64_t slot = s_slot[item], pos = s_pos[item];
    if (slot < 0 || !fp_source_selected(j, pos, layer_stride)) continue;  // warp-uniform (shared values)
    const FpSource s = fp_source_at(table, n_sources, h, j);
    const uint64_t acc = warp_sum_u64(fp_lane_terms(s, j, slot, fp_read_words(s, mode), lane));
    if (lane == 0) atomicAdd(&s_acc[item * MAX_HALVES + h], static_cast<unsigned long long>(acc));
  }
}

// One thread's fingerprint with 16-byte loads (PARTIAL mode: one chunk per source).
__device__ __forceinline__ uint64_t fingerprint_thread(const int64_t* table, int64_t n_sources, int64_t half,
                                                       int64_t slot, int64_t position, int32_t mode,
                                                       int64_t layer_stride) {
  uint64_t acc = 0;
  for (int64_t j = 0; j < n_sources; ++j) {
    if (!fp_source_selected(j, position, layer_stride)) continue;
    const FpSource s = fp_source_at(table, n_sources, half, j);
    const ulonglong2* row = reinterpret_cast<const ulonglong2*>(fp_row(s, slot));
    const int64_t chunks = fp_read_words(s, mode) / 2;
    for (int64_t c = 0; c < chunks; ++c) {
      const ulonglong2 w = __ldcs(row + c);
      acc += fp_word_term(w.x, j, 2 * c) + fp_word_term(w.y, j, 2 * c + 1);
    }
  }
  return fp_finalize(acc, position);
}

// 32-byte record as two 16-byte loads (records are 16-byte aligned when `vec`, else 8-byte loads).
__device__ __forceinline__ CanaryRecord load_record(const int64_t* records, int64_t index, bool vec) {
  CanaryRecord r;
  if (vec) {
    const longlong2* p = reinterpret_cast<const longlong2*>(records + index * RECORD_BYTES / 8);
    const longlong2 a = p[0], b = p[1];
    r.token = a.x;
    r.position = a.y;
    r.prev_hash = b.x;
    r.kv_fingerprint = b.y;
  } else {
    const int64_t* p = records + index * RECORD_BYTES / 8;
    r.token = p[0];
    r.position = p[1];
    r.prev_hash = p[2];
    r.kv_fingerprint = p[3];
  }
  return r;
}

__device__ __forceinline__ void store_record(int64_t* records, int64_t index, const CanaryRecord& r, bool vec) {
  if (vec) {
    longlong2* p = reinterpret_cast<longlong2*>(records + index * RECORD_BYTES / 8);
    p[0] = make_longlong2(r.token, r.position);
    p[1] = make_longlong2(r.prev_hash, r.kv_fingerprint);
  } else {
    int64_t* p = records + index * RECORD_BYTES / 8;
    p[0] = r.token;
    p[1] = r.position;
    p[2] = r.prev_hash;
    p[3] = r.kv_fingerprint;
  }
}

// Speculative L1 prefetch (no effect on results; the caller passes an address inside its tensor).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// L1 prefetch of the table entry holding position (r, c) (the caller checks it is inside the table).
__device__ __forceinline__ void prefetch_table(const SlotTable& t, int64_t r, int64_t c) {
  const int64_t k = r * t.stride + c / t.page;
  prefetch_l1(t.is_i32 ? static_cast<const void*>(static_cast<const int32_t*>(t.data) + k)
                       : static_cast<const void*>(static_cast<const int64_t*>(t.data) + k));
}

#endif  // __CUDACC__

}  // namespace cuda
}  // namespace kvcanary
