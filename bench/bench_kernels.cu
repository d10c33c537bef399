// Benchmark-only kernels: the floor measurements (streaming 16-byte-load read bandwidth, random record gathers) and
// the baseline the chain-scan write is compared with (one thread per request, serial over its tokens).
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/base.h>
#include <tvm/ffi/function.h>

#include <cstdint>

#include "core/hash.cuh"

namespace {

using tvm::ffi::TensorView;

cudaStream_t stream_of(const TensorView& t) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(t.device().device_type, t.device().device_id));
}

int sms(const TensorView& t) {
  int v = 0;
  cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, t.device().device_id);
  return v;
}

// Sum of every 16-byte word of `data` (n16 words), 4 independent loads in flight per thread; one output per block.
__global__ void __launch_bounds__(512) read_kernel(const ulonglong2* __restrict__ data, int64_t n16, uint64_t* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint64_t acc = 0;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const ulonglong2 a = __ldcs(data + i), b = __ldcs(data + i + stride), c = __ldcs(data + i + 2 * stride),
                     d = __ldcs(data + i + 3 * stride);
    acc += a.x ^ a.y ^ b.x ^ b.y ^ c.x ^ c.y ^ d.x ^ d.y;
  }
  for (; i < n16; i += stride) {
    const ulonglong2 a = __ldcs(data + i);
    acc += a.x ^ a.y;
  }
  if (acc == 0x1234567ULL) out[blockIdx.x] = acc;  // keeps the loads; practically never stores
}

// `count` random reads of `words16` consecutive 16-byte words (a 32- or 64-byte record) out of n_records.
__global__ void __launch_bounds__(256) gather_kernel(const ulonglong2* __restrict__ data, int64_t n_records,
                                                     int words16, int64_t count, uint64_t seed, uint64_t* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint64_t acc = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint64_t r = kvcanary::splitmix64(seed + static_cast<uint64_t>(i)) % static_cast<uint64_t>(n_records);
    const ulonglong2* p = data + r * words16;
    for (int w = 0; w < words16; ++w) {
      const ulonglong2 v = p[w];
      acc += v.x ^ v.y;
    }
  }
  if (acc == 0x1234567ULL) out[blockIdx.x] = acc;
}

// SGLang-style baseline: one thread per request walks its new tokens serially (K half, no checks).
__global__ void serial_write_kernel(int64_t* records, const int64_t* ids, const int64_t* pos, const int64_t* loc,
                                    const int64_t* begins, const int64_t* lens, int64_t n_req) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n_req) return;
  uint64_t h = kvcanary::chain_h0();
  for (int64_t k = begins[r]; k < begins[r] + lens[r]; ++k) {
    const int64_t s = loc[k];
    if (s < 0) continue;
    int64_t* rec = records + s * 4;
    rec[0] = ids[k];
    rec[1] = pos[k];
    rec[2] = static_cast<int64_t>(h);
    rec[3] = 0;
    h = kvcanary::chain_step(h, ids[k], pos[k]);
  }
}

}  // namespace

void bench_read(TensorView data, TensorView out) {
  const int64_t n16 = data.numel() * data.dtype().bits / 8 / 16;
  const int grid = sms(data) * 4;
  read_kernel<<<grid, 512, 0, stream_of(data)>>>(static_cast<const ulonglong2*>(data.data_ptr()), n16,
                                                 static_cast<uint64_t*>(out.data_ptr()));
  TVM_FFI_CHECK_CUDA_ERROR(cudaGetLastError());
}

void bench_gather(TensorView data, int64_t record_bytes, int64_t count, int64_t seed, TensorView out) {
  const int64_t bytes = data.numel() * data.dtype().bits / 8;
  const int words16 = static_cast<int>(record_bytes / 16);
  const int grid = sms(data) * 8;
  gather_kernel<<<grid, 256, 0, stream_of(data)>>>(static_cast<const ulonglong2*>(data.data_ptr()),
                                                   bytes / record_bytes, words16, count, static_cast<uint64_t>(seed),
                                                   static_cast<uint64_t*>(out.data_ptr()));
  TVM_FFI_CHECK_CUDA_ERROR(cudaGetLastError());
}

void bench_serial_write(TensorView records, TensorView ids, TensorView pos, TensorView loc, TensorView begins,
                        TensorView lens) {
  const int64_t n = begins.numel();
  serial_write_kernel<<<static_cast<unsigned>((n + 127) / 128), 128, 0, stream_of(records)>>>(
      static_cast<int64_t*>(records.data_ptr()), static_cast<const int64_t*>(ids.data_ptr()),
      static_cast<const int64_t*>(pos.data_ptr()), static_cast<const int64_t*>(loc.data_ptr()),
      static_cast<const int64_t*>(begins.data_ptr()), static_cast<const int64_t*>(lens.data_ptr()), n);
  TVM_FFI_CHECK_CUDA_ERROR(cudaGetLastError());
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(bench_read, bench_read);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bench_gather, bench_gather);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bench_serial_write, bench_serial_write);
