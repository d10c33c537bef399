// Block-wide exclusive sums of K int64 (or uint64) lanes at once (one thread per item, kThreads a multiple of 32).
#pragma once

#include <cstdint>

namespace kvcanary {
namespace cuda {

#if defined(__CUDACC__)

// Shared scratch of a block scan: K values per warp.
template <int kThreads, int K, typename T = int64_t>
struct BlockSumScratch {
  T warp[kThreads / 32][K];
};

// v[k] becomes the exclusive prefix sum over threads of v[k]; total[k] the block total. All threads call it. T:
// int64_t, or uint64_t for sums that must wrap (unsigned overflow is defined).
template <int kThreads, int K, typename T = int64_t>
__device__ __forceinline__ void block_exclusive_sum(T (&v)[K], T (&total)[K], BlockSumScratch<kThreads, K, T>& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    inc[k] = v[k];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const T y = __shfl_up_sync(0xffffffffu, inc[k], o);
      if (lane >= o) inc[k] += y;
    }
  }
  __syncthreads();
  if (lane == 31) {
#pragma unroll
    for (int k = 0; k < K; ++k) s.warp[warp][k] = inc[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    T before = 0, all = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      const T x = s.warp[w][k];
      before += w < warp ? x : 0;
      all += x;
    }
    v[k] = before + inc[k] - v[k];
    total[k] = all;
  }
}

#endif  // __CUDACC__

}  // namespace cuda
}  // namespace kvcanary
