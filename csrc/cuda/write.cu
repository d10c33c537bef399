// CUDA write (docs/ops-contract.md 5): the chain of each segment is an exclusive affine scan (core/write.cuh
// WriteCarry) over flat token tiles. A tile scans its tokens block-wide with segment heads; the carry of its first
// segment's earlier tokens comes, with a workspace, from the earlier tiles' published aggregates (a decoupled
// look-back), else by reducing those tokens itself; then it stores both halves. PARTIAL fingerprints (a few bytes
// per token) are hashed by the token's own thread, also
// on the one-block decode path. ALL fingerprints (the seal: every byte of every layer) use small tiles, down to one
// token per block, so that the rows spread over every SM, and the block's warps share the tile's (token, half,
// layer) rows (block_fp_sums).
#include <tvm/ffi/function.h>

#include <algorithm>

#include "core/write.cuh"
#include "cuda/block_scan.cuh"
#include "cuda/cuda_common.cuh"

namespace kvcanary {
namespace cuda {
namespace {

constexpr int kWriteThreads = 256;
constexpr int kWarpsPerBlock = kWriteThreads / kWarp;
constexpr int kItemsNoFp = 4;  // tokens per thread without fingerprints: 1024-token tiles

struct ScanElem {
  bool head;  // starts a run: nothing earlier composes into it
  WriteCarry c;
};

// The identity element: no head seen, the identity map.
__device__ __forceinline__ ScanElem scan_identity() { return ScanElem{false, write_carry_identity()}; }

__device__ __forceinline__ ScanElem scan_op(const ScanElem& x, const ScanElem& y) {
  return y.head ? y : ScanElem{x.head, write_carry_compose(x.c, y.c)};
}

// x with every field read from another lane by `shfl` (a __shfl_*_sync intrinsic wrapped in a generic lambda).
template <typename Shfl>
__device__ __forceinline__ ScanElem shfl_elem(const ScanElem& x, Shfl shfl) {
  ScanElem r;
  r.head = shfl(x.head ? 1 : 0) != 0;
  r.c.map.mul = shfl(x.c.map.mul);
  r.c.map.add = shfl(x.c.map.add);
  r.c.last_j = shfl(x.c.last_j);
  return r;
}
__device__ __forceinline__ ScanElem shfl_up_elem(const ScanElem& x, int d) {
  return shfl_elem(x, [d](auto v) { return __shfl_up_sync(0xffffffffu, v, d); });
}
__device__ __forceinline__ ScanElem shfl_down_elem(const ScanElem& x, int d) {
  return shfl_elem(x, [d](auto v) { return __shfl_down_sync(0xffffffffu, v, d); });
}

struct ScanShared {
  ScanElem warp_total[kWarpsPerBlock];
  WriteCarry carry_total[kWarpsPerBlock];
};

// Block-wide inclusive segmented scan of one element per thread.
__device__ __forceinline__ ScanElem block_segmented_scan(ScanElem x, ScanShared& sh) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const ScanElem y = shfl_up_elem(x, d);
    if (lane >= d) x = scan_op(y, x);
  }
  __syncthreads();
  if (lane == kWarp - 1) sh.warp_total[warp] = x;
  __syncthreads();
  ScanElem before = scan_identity();
  for (int w = 0; w < warp; ++w) before = scan_op(before, sh.warp_total[w]);
  return warp > 0 ? scan_op(before, x) : x;
}

__device__ __forceinline__ WriteCarry shfl_carry(const WriteCarry& x, int src, bool down) {
  WriteCarry r;
  if (down) {
    r.map.mul = __shfl_down_sync(0xffffffffu, x.map.mul, src);
    r.map.add = __shfl_down_sync(0xffffffffu, x.map.add, src);
    r.last_j = __shfl_down_sync(0xffffffffu, x.last_j, src);
  } else {
    r.map.mul = __shfl_sync(0xffffffffu, x.map.mul, src);
    r.map.add = __shfl_sync(0xffffffffu, x.map.add, src);
    r.last_j = __shfl_sync(0xffffffffu, x.last_j, src);
  }
  return r;
}

// Ordered composition of the 32 lanes' carries (lane 0 first), returned to every lane. After the step of distance
// d, a lane l that is a multiple of 2d holds lanes [l, l + 2d) composed in order (it reads lane l + d's [l + d,
// l + 2d) before that lane updates); other lanes hold values nobody reads. Every lane of the warp must call it.
__device__ __forceinline__ WriteCarry warp_compose_ordered(WriteCarry c) {
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) c = write_carry_compose(c, shfl_carry(c, d, true));
  return shfl_carry(c, 0, false);
}

constexpr int kCarryPerLane = 2;                          // consecutive entries a lane composes itself
constexpr int kCarryRow = kCarryPerLane * kWarp;          // entries one warp step covers (lanes in order)
constexpr int kCarryRows = 2;                             // warp steps whose loads are all issued before use

// Ordered composition of the carries of entries [0, n) of a segment, by the whole block with coalesced loads:
// warp w owns the w-th contiguous chunk (whole rows of kCarryRow entries), a row's lane l holds its entries
// [kCarryPerLane * l, kCarryPerLane * (l + 1)), rows are composed lane-ordered by shuffles and in row order per
// warp, then the warps' chunks in warp order (compose is associative, not commutative).
__device__ __forceinline__ WriteCarry block_reduce_prefix(const WriteArgs& a, const int64_t* row, int64_t n,
                                                          ScanShared& sh) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t rows = (n + kCarryRow - 1) / kCarryRow;
  const int64_t chunk = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock * kCarryRow;
  const int64_t lo = warp * chunk, hi = lo + chunk < n ? lo + chunk : n;  // warp-uniform
  WriteCarry acc = write_carry_identity();  // the same in every lane of the warp
  for (int64_t base = lo; base < hi; base += kCarryRows * kCarryRow) {
    WriteEntry e[kCarryRows][kCarryPerLane];
#pragma unroll
    for (int r = 0; r < kCarryRows; ++r) {
#pragma unroll
      for (int u = 0; u < kCarryPerLane; ++u) {
        const int64_t j = base + r * kCarryRow + lane * kCarryPerLane + u;
        if (j < hi) e[r][u] = write_entry_load(a, row, j);
      }
    }
#pragma unroll
    for (int r = 0; r < kCarryRows; ++r) {
      WriteCarry c = write_carry_identity();
#pragma unroll
      for (int u = 0; u < kCarryPerLane; ++u) {
        const int64_t j = base + r * kCarryRow + lane * kCarryPerLane + u;
        if (j < hi) c = write_carry_compose(c, write_entry_carry(e[r][u]));
      }
      acc = write_carry_compose(acc, warp_compose_ordered(c));
    }
  }
  if (lane == 0) sh.carry_total[warp] = acc;
  __syncthreads();
  WriteCarry total = write_carry_identity();
#pragma unroll
  for (int w = 0; w < kWarpsPerBlock; ++w) total = write_carry_compose(total, sh.carry_total[w]);
  __syncthreads();
  return total;
}

// Entries a segment contributes to the dense write-entry space: WRITE_LEN when its range is valid, else 0 (a
// range error is reported once by block 0 and nothing is written).
__device__ __forceinline__ int64_t segment_entries(const WriteArgs& a, const int64_t* row) {
  const int64_t len = plan_at(row, PlanCol::WRITE_LEN);
  return len > 0 && write_range_ok(a, row) ? len : 0;
}

// A plan row with a write range error (reported once by block 0, not written).
__device__ __forceinline__ bool segment_range_error(const WriteArgs& a, const int64_t* row) {
  return plan_at(row, PlanCol::WRITE_LEN) != 0 && !write_range_ok(a, row);
}

// Row threadIdx.x's write fields, loaded together with the status (rows below plan_cap are in bounds whatever the
// status says): with at most kWriteThreads segments, a thread's first segment is its own row, so the status ->
// plan round trip is gone. Only the fields segment_entries / segment_range_error read are loaded. (It also prefetched
// the row's first token and seed record into L1; dropping that made the decode bracket 0.8 us faster on an H100,
// gpu/probe_variants.py w_noprefetch.)
struct OwnRow {
  int64_t v[kNumPlanCols];
  __device__ __forceinline__ explicit OwnRow(const WriteArgs& a) : v{} {
    if (static_cast<int64_t>(threadIdx.x) < a.plan_cap) {
      const int64_t* row = a.plan + static_cast<int64_t>(threadIdx.x) * kNumPlanCols;
      v[col(PlanCol::WRITE_BEGIN)] = plan_at(row, PlanCol::WRITE_BEGIN);
      v[col(PlanCol::WRITE_LEN)] = plan_at(row, PlanCol::WRITE_LEN);
    }
  }
  // Is segment s (< plan_cap) this thread's own row.
  __device__ __forceinline__ bool is(int64_t s) const { return s == static_cast<int64_t>(threadIdx.x); }
};

// The look-back workspace (int64): a header, then per tile its aggregate and the flag that publishes it. Zeroed once
// at allocation; each launch takes tile tickets in start order (a block waits only on tiles whose blocks already run),
// publishes with flag = generation + 1, and its last block to finish restores the ticket and done counters and bumps
// the generation, so every launch (a graph replay too) starts as the first did.
constexpr int64_t kWsTicket = 0, kWsDone = 1, kWsGen = 2, kWsHeader = 4;
constexpr int64_t kWsFlag = 0, kWsHead = 1, kWsMul = 2, kWsAdd = 3, kWsLastJ = 4, kWsTileCols = 8;

struct ScanWorkspace {
  int64_t* data;  // nullptr: none (the tile reduces its carry itself)
};
constexpr ScanWorkspace kNoWorkspace{nullptr};

__device__ __forceinline__ int64_t load_acquire(const int64_t* p) {
  int64_t v;
  asm volatile("ld.acquire.gpu.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(int64_t* p, int64_t v) {
  asm volatile("st.release.gpu.global.s64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Publish tile t's aggregate (one thread).
__device__ __forceinline__ void ws_publish(const ScanWorkspace& ws, int64_t t, int64_t gen, const ScanElem& agg) {
  volatile int64_t* slot = ws.data + kWsHeader + t * kWsTileCols;
  slot[kWsHead] = agg.head ? 1 : 0;
  slot[kWsMul] = static_cast<int64_t>(agg.c.map.mul);
  slot[kWsAdd] = static_cast<int64_t>(agg.c.map.add);
  slot[kWsLastJ] = agg.c.last_j;
  store_release(ws.data + kWsHeader + t * kWsTileCols + kWsFlag, gen + 1);
}

// Tile t's aggregate once published (spins until then).
__device__ __forceinline__ ScanElem ws_wait(const ScanWorkspace& ws, int64_t t, int64_t gen) {
  const int64_t* slot = ws.data + kWsHeader + t * kWsTileCols;
  while (load_acquire(slot + kWsFlag) != gen + 1) __nanosleep(20);
  const volatile int64_t* v = slot;
  ScanElem e;
  e.head = v[kWsHead] != 0;
  e.c.map.mul = static_cast<uint64_t>(v[kWsMul]);
  e.c.map.add = static_cast<uint64_t>(v[kWsAdd]);
  e.c.last_j = v[kWsLastJ];
  return e;
}

// The ordered composition of tiles [0, t) back to the last segment head among them (warp 0 of the block; the result is
// valid in lane 0): 32 tiles per step, latest in lane 0, until a step holds a head.
__device__ __forceinline__ ScanElem ws_look_back(const ScanWorkspace& ws, int64_t t, int64_t gen) {
  const int lane = threadIdx.x % kWarp;
  ScanElem acc = scan_identity();
  for (int64_t base = t - 1; base >= 0; base -= kWarp) {
    const int64_t idx = base - lane;
    ScanElem x = idx >= 0 ? ws_wait(ws, idx, gen) : scan_identity();
    // lanes hold tiles latest-first: after the step of distance d, lane l holds lanes [l, l + 2d) composed earliest
    // (highest lane) first
#pragma unroll
    for (int d = 1; d < kWarp; d <<= 1) {
      const ScanElem y = shfl_down_elem(x, d);
      if (lane + d < kWarp) x = scan_op(y, x);
    }
    acc = scan_op(x, acc);
    if (__shfl_sync(0xffffffffu, acc.head ? 1 : 0, 0) != 0) break;  // earlier tiles cannot reach past a head
  }
  return acc;
}

// Tokens per tile of the fingerprint path: about two tiles per SM, 1..kWriteThreads tokens (a decode seal of 256
// tokens: one token's rows per block, all in flight at once, instead of 8 blocks whose warps walk 4 tokens x every
// layer one after another).
int64_t fp_tile(int64_t num_tokens, int device_id) {
  const int64_t want = ceil_div(num_tokens, 2 * static_cast<int64_t>(sm_count(device_id)));
  int64_t tile = 1;
  while (tile < want && tile < kWriteThreads) tile *= 2;
  return tile;
}

// Longest segment the one-block serial path takes (decode: 1; its entries are dependent round trips, the scan path
// loads a tile at once); longer ones go through the block scans.
constexpr int64_t kSerialMaxLen = 4;

// Block-wide inclusive max-scan of one int64 per thread.
__device__ __forceinline__ int64_t block_max_scan(int64_t v, int64_t* smem /* kWarpsPerBlock */) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const int64_t y = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d && y > v) v = y;
  }
  __syncthreads();
  if (lane == kWarp - 1) smem[warp] = v;
  __syncthreads();
  for (int w = 0; w < warp; ++w) v = smem[w] > v ? smem[w] : v;
  return v;
}

struct Item {
  const int64_t* row;  // segment row, nullptr: the token belongs to no writable segment
  WriteEntry e;
};

// The carries header of a RECORD_CARRIES launch (block 0, thread 0): armed when every entry's row fits.
__device__ __forceinline__ void carries_header(const WriteArgs& a, bool armed, int64_t total) {
  int64_t* hd = a.carries;
  hd[col(CarryHeaderCol::STEP)] = a.sink.step[0];
  hd[col(CarryHeaderCol::TOTAL)] = total;
  hd[col(CarryHeaderCol::DONE)] = 0;
  hd[col(CarryHeaderCol::ARMED)] = armed ? 1 : 0;
}

// A kept carry row (entry e's, or all -1 when e is past the carries: then it names no entry).
struct CarryRow {
  int64_t v[kNumCarryCols];
  __device__ __forceinline__ int64_t operator[](CarryCol c) const { return v[col(c)]; }
};
__device__ __forceinline__ CarryRow carry_row(const WriteArgs& a, int64_t e) {
  CarryRow r;
#pragma unroll
  for (int i = 0; i < kNumCarryCols; ++i) r.v[i] = e < a.carry_cap ? a.carries[(1 + e) * kNumCarryCols + i] : -1;
  return r;
}

// What a REUSE_CARRIES launch takes from the carries: total = entries (-1: none, it scans), first = this thread's
// first row (loaded beside the header, used after it), done = thread 0's DONE ticket. Block-uniform (thread 0 reads
// the header into shared memory) and grid-uniform: a block that scanned while another reused would wait on
// look-back aggregates nobody publishes. So the header changes only after every block has read it: each block's
// thread 0 takes a DONE ticket once its block has the header, and the block holding the last ticket disarms it when
// it ends (a kept scan is used once: a later launch of the same step without a recording write before it scans).
// ALL fingerprints (block-shared row sums) scan.
struct Reuse {
  int64_t total;
  CarryRow first;
  unsigned long long done;
};
__device__ __forceinline__ Reuse carries_reused(const WriteArgs& a, int64_t nseg, int64_t* s_total) {
  Reuse r{-1, {}, 0};
  if (a.carries == nullptr || (a.checks & bits(WriteCheck::REUSE_CARRIES)) == 0 ||
      a.fp_mode == static_cast<int32_t>(FingerprintMode::ALL)) {
    return r;
  }
  r.first = carry_row(a, static_cast<int64_t>(blockIdx.x) * kWriteThreads + threadIdx.x);
  if (threadIdx.x == 0) {
    const volatile int64_t* hd = a.carries;
    const int64_t armed = hd[col(CarryHeaderCol::ARMED)], step = hd[col(CarryHeaderCol::STEP)];
    const int64_t total = hd[col(CarryHeaderCol::TOTAL)];
    // every entry of a plan lies in [0, num_tokens) unless its ranges overlap (a plan not from plan_forward: scan)
    const bool fits = total >= 0 && total <= a.carry_cap && total <= a.num_tokens && (total == 0 || nseg > 0);
    *s_total = armed == 1 && step == a.sink.step[0] && fits ? total : -1;
  }
  __syncthreads();
  r.total = *s_total;
  if (threadIdx.x == 0 && r.total >= 0) {
    r.done = atomicAdd(reinterpret_cast<unsigned long long*>(a.carries + col(CarryHeaderCol::DONE)), 1ULL);
  }
  return r;
}

// The end of a block that reused the carries (thread 0): the holder of the last DONE ticket disarms the header.
__device__ __forceinline__ void carries_done(const WriteArgs& a, unsigned long long ticket) {
  if (ticket == gridDim.x - 1ULL) {
    a.carries[col(CarryHeaderCol::DONE)] = 0;
    a.carries[col(CarryHeaderCol::ARMED)] = 0;
  }
}

// Entries [0, r.total) of a write whose chain carries a RECORD_CARRIES write kept: each thread applies its entries as
// the scan path does (structural check, seeds, store, EXPECT_NEW), with the kept exclusive carry instead of a scan.
// A kept row that names no entry of this plan (carries not from this forward's recording write) is not applied and
// counts one INPUT_ERRORS per half.
template <bool kFp>
__device__ __forceinline__ void write_reused(const WriteArgs& a, int64_t nseg, const Reuse& r,
                                             WriteTally (&tally)[MAX_HALVES]) {
  const int64_t e0 = static_cast<int64_t>(blockIdx.x) * kWriteThreads + threadIdx.x;
  for (int64_t e = e0; e < r.total; e += static_cast<int64_t>(gridDim.x) * kWriteThreads) {
    const CarryRow c = e == e0 ? r.first : carry_row(a, e);
    const int64_t s = c[CarryCol::SEGMENT], j = c[CarryCol::J], k = c[CarryCol::K], last_j = c[CarryCol::LAST_J];
    const bool k_ok = k >= 0 && k < a.num_tokens, s_ok = s >= 0 && s < nseg;
    const int64_t* row = a.plan + (s_ok ? s : 0) * kNumPlanCols;
    // the token's loads go out beside the plan row's (k in bounds: total <= num_tokens, so num_tokens > 0 here)
    const WriteEntry en = write_entry_at(a, row, j, k_ok ? k : 0);
    if (!k_ok || !s_ok || j < 0 || j >= segment_entries(a, row) || k != plan_at(row, PlanCol::WRITE_BEGIN) + j ||
        last_j < -1 || last_j >= j) {
      for (int64_t h = 0; h < a.halves; ++h) ++tally[h].input_errors;
      continue;
    }
    const WriteCarry excl{ChainMap{static_cast<uint64_t>(c[CarryCol::MUL]), static_cast<uint64_t>(c[CarryCol::ADD])},
                          last_j};
    const WriteCarry incl = write_carry_compose(excl, write_entry_carry(en));
    write_structural(a, row, en);
    const bool last = j == plan_at(row, PlanCol::WRITE_LEN) - 1;
    for (int64_t h = 0; h < a.halves; ++h) {
      const WriteSeed seed = write_seed_value(a, row, h);
      if (!seed.ok) {
        if (j == 0) write_emit_seed_error(a, row, h);
        continue;
      }
      uint64_t fp = 0;
      if constexpr (kFp) {
        if (en.kind == WriteKind::kWrite) {
          fp = fingerprint_thread(a.fp_table, a.fp_sources, h, en.slot, en.position, a.fp_mode, a.fp_layer_stride);
        }
      }
      tally[h] = write_tally_add(tally[h], write_entry_store(a, row, h, en, chain_apply(excl.map, seed.h),
                                                             write_prev_pos(a, row, excl, seed), fp));
      if (last) write_expect_new(a, row, h, chain_apply(incl.map, seed.h), incl.last_j);
    }
  }
}

// The marks of one tile of several segments: at the first in-tile position p of every segment overlapping it,
// s_mark[p] = the segment and s_first_j[p] = its index there; returns the latest marked position before this thread's
// first item (-1: none). Block-wide (barriers). Threads own segments [c_lo, c_hi) starting at dense entry off.
template <int kItems>
__device__ __forceinline__ int64_t mark_tile(const WriteArgs& a, const OwnRow& own, int64_t c_lo, int64_t c_hi,
                                             int64_t off, int64_t tile_start, int64_t tile_end, int64_t tile,
                                             int64_t* s_mark, int64_t* s_first_j, int64_t* s_reduce) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int64_t p = threadIdx.x; p < tile; p += kWriteThreads) s_mark[p] = -1;
  __syncthreads();
  for (int64_t s = c_lo; s < c_hi && off < tile_end; ++s) {
    const int64_t n = own.is(s) ? segment_entries(a, own.v) : segment_entries(a, a.plan + s * kNumPlanCols);
    if (n > 0 && off + n > tile_start) {
      const int64_t first = off > tile_start ? off : tile_start;
      s_mark[first - tile_start] = s;
      s_first_j[first - tile_start] = first - off;
    }
    off += n;
  }
  __syncthreads();
  int64_t mark_pos = -1;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int64_t p = static_cast<int64_t>(threadIdx.x) * kItems + i;
    if (p < tile && s_mark[p] >= 0) mark_pos = p;
  }
  const int64_t mark_incl = block_max_scan(mark_pos, s_reduce);
  int64_t mark_before = __shfl_up_sync(0xffffffffu, mark_incl, 1);
  __syncthreads();
  if (lane == kWarp - 1) s_reduce[warp] = mark_incl;
  __syncthreads();
  if (lane == 0) mark_before = warp > 0 ? s_reduce[warp - 1] : -1;
  __syncthreads();
  return mark_before;
}

template <int kItems, bool kFp>
__global__ void __launch_bounds__(kWriteThreads) write_kernel(WriteArgs a, int64_t tile, ScanWorkspace ws) {
  await_prior_kernels();
  __shared__ ScanShared sh;
  __shared__ BlockSumScratch<kWriteThreads, 1> sh_sum;
  __shared__ int64_t s_mark[kWriteThreads * kItems];     // segment whose first in-tile entry is here, -1 = none
  __shared__ int64_t s_first_j[kWriteThreads * kItems];  // that entry's index inside its segment
  __shared__ int64_t s_reduce[3 * MAX_HALVES * kWarpsPerBlock];
  __shared__ unsigned long long s_fp_acc[kFp ? kWriteThreads * MAX_HALVES : 1];
  __shared__ int64_t s_fp_slot[kFp ? kWriteThreads : 1];
  __shared__ int64_t s_fp_pos[kFp ? kWriteThreads : 1];

  const int64_t nseg = plan_num_segments(a.status, a.plan_cap);
  const OwnRow own(a);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;

  // Whole-segment range errors and the per-call run counters: block 0 only.
  if (blockIdx.x == 0) {
    for (int64_t s = threadIdx.x; s < nseg; s += kWriteThreads) {
      const int64_t* row = a.plan + s * kNumPlanCols;
      if (own.is(s) ? segment_range_error(a, own.v) : segment_range_error(a, row)) {
        for (int64_t h = 0; h < a.halves; ++h) write_emit_range_error(a, row, h);
      }
    }
    if (threadIdx.x == 0) {
      for (int64_t h = 0; h < a.halves; ++h) count(a.sink, a.tags[h], CounterCol::WRITE_RUNS, 1);
    }
  }

  WriteTally tally[MAX_HALVES] = {{0, 0, 0}, {0, 0, 0}};
  __shared__ int64_t s_reused;
  const Reuse reuse = carries_reused(a, nseg, &s_reused);
  const int64_t reused = reuse.total;
  const bool record = a.carries != nullptr && (a.checks & bits(WriteCheck::RECORD_CARRIES)) != 0;
  // Small batches of short segments (decode): one block, each thread runs its own segment's serial loop (the CPU
  // backend's, PARTIAL fingerprints included: a few bytes per token), with no block scan. Block-uniform decision;
  // range errors were reported above.
  bool serial = false;
  if constexpr (kItems == 1) {
    if (reused < 0 && gridDim.x == 1 && nseg <= kWriteThreads &&
        (!kFp || a.fp_mode == static_cast<int32_t>(FingerprintMode::PARTIAL))) {
      const int64_t len = static_cast<int64_t>(threadIdx.x) < nseg ? segment_entries(a, own.v) : 0;
      serial = __syncthreads_or(len > kSerialMaxLen ? 1 : 0) == 0;
      if (serial && record && threadIdx.x == 0) carries_header(a, false, 0);  // nothing kept: the reader scans
      if (serial && len > 0) write_segment_serial(a, a.plan + static_cast<int64_t>(threadIdx.x) * kNumPlanCols, len,
                                                  tally);
      // Block-uniform. Each thread flushes its own counts: a block-wide sum (two barriers that wait for the slowest
      // serial loop, 64-bit shuffles) or even a warp sum cost a one-token write half its time on an H100, 6.5 -> 3.2 us
      // (gpu/probe_variants.py: w_nosum, wf_redux, wf_own). A thread's counts are at most kSerialMaxLen per half, one
      // atomic each where nonzero: at most kWriteThreads per counter.
      if (serial && ws.data == nullptr) {
        for (int64_t h = 0; h < a.halves; ++h) write_tally_flush(a, h, tally[h]);
        return;
      }
    }
  }
  // With a workspace (several blocks, one tile each): this block's tile is its ticket, and the launch's generation.
  __shared__ int64_t s_ws[2];
  if (ws.data != nullptr && reused < 0) {  // a reusing launch takes no tickets (it never looks back)
    if (threadIdx.x == 0) {
      s_ws[0] = static_cast<int64_t>(atomicAdd(reinterpret_cast<unsigned long long*>(ws.data + kWsTicket), 1ULL));
      s_ws[1] = load_acquire(ws.data + kWsGen);
    }
    __syncthreads();
  }
  if (reused >= 0) {  // grid-uniform
    write_reused<kFp>(a, nseg, reuse, tally);
  } else if (!serial) {  // block-uniform
    // Dense entry space: segment s owns entries [off_s, off_s + entries_s). Each thread sums a chunk of segments.
    // One segment (a single prefill, block-uniform): entry e is its j = e, so no offsets, marks or max scan.
    const bool one = nseg == 1;
    const int64_t chunk = (nseg + kWriteThreads - 1) / kWriteThreads;
    const int64_t c_lo = threadIdx.x * chunk, c_hi = c_lo + chunk < nseg ? c_lo + chunk : nseg;
    int64_t chunk_off[1] = {0}, total_arr[1];
    if (one) {
      total_arr[0] = own.is(0) ? segment_entries(a, own.v) : segment_entries(a, a.plan);
    } else {
      for (int64_t s = c_lo; s < c_hi; ++s) {
        chunk_off[0] += own.is(s) ? segment_entries(a, own.v) : segment_entries(a, a.plan + s * kNumPlanCols);
      }
      block_exclusive_sum<kWriteThreads, 1>(chunk_off, total_arr, sh_sum);
    }
    const int64_t total = total_arr[0];
    if (record && blockIdx.x == 0 && threadIdx.x == 0) carries_header(a, total <= a.carry_cap, total);

    // with a workspace the grid covers every tile once (the host launches it so): one iteration
    for (int64_t tile_start = (ws.data != nullptr ? s_ws[0] : static_cast<int64_t>(blockIdx.x)) * tile;
         tile_start < total; tile_start += static_cast<int64_t>(gridDim.x) * tile) {
      const int64_t tile_end = tile_start + tile < total ? tile_start + tile : total;
      int64_t mark_before = -1;
      if (one) {  // the tile's first position is marked (read after the scan's barriers)
        if (threadIdx.x == 0) {
          s_mark[0] = 0;
          s_first_j[0] = tile_start;
        }
      } else {
        mark_before = mark_tile<kItems>(a, own, c_lo, c_hi, chunk_off[0], tile_start, tile_end, tile, s_mark,
                                        s_first_j, s_reduce);
      }

      // Load this thread's entries (kItems consecutive positions) and their carries.
      Item it[kItems];
      ScanElem local = scan_identity();
      ScanElem pre_item[kItems];  // inclusive within the thread, before composing earlier threads
      int64_t cur = mark_before;
  #pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const int64_t p = static_cast<int64_t>(threadIdx.x) * kItems + i;
        it[i].row = nullptr;
        ScanElem x{true, write_carry_identity()};
        if (p < tile && tile_start + p < tile_end) {
          if (!one && s_mark[p] >= 0) cur = p;
          if (one || cur >= 0) {
            const int64_t* row = one ? a.plan : a.plan + s_mark[cur] * kNumPlanCols;
            const int64_t j = one ? tile_start + p : s_first_j[cur] + (p - cur);
            it[i].row = row;
            it[i].e = write_entry_load(a, row, j);
            x = ScanElem{j == 0, write_entry_carry(it[i].e)};
          }
        }
        local = scan_op(local, x);
        pre_item[i] = local;
      }
      // Block scan of the per-thread totals; the exclusive prefix of this thread is the previous thread's inclusive.
      const ScanElem inc = block_segmented_scan(local, sh);
      // the inclusive value of the thread holding the tile's last position is the tile's aggregate (positions past
      // the tile are heads; a partial tile is the last one: nobody reads its aggregate)
      if (ws.data != nullptr && threadIdx.x == (tile - 1) / kItems) ws_publish(ws, tile_start / tile, s_ws[1], inc);
      ScanElem excl_thread = shfl_up_elem(inc, 1);
      __syncthreads();
      if (lane == kWarp - 1) sh.warp_total[warp] = inc;
      __syncthreads();
      if (lane == 0) excl_thread = warp > 0 ? sh.warp_total[warp - 1] : scan_identity();
      __syncthreads();

      // The tile's first segment may have started in an earlier tile: fold its earlier entries (block-uniform).
      WriteCarry carry_in = write_carry_identity();
      const int64_t* first_row = a.plan + s_mark[0] * kNumPlanCols;  // position 0 is always marked
      const int64_t first_j = s_first_j[0];
      if (first_j > 0 && ws.data != nullptr) {  // block-uniform
        if (warp == 0) {
          const ScanElem before = ws_look_back(ws, tile_start / tile, s_ws[1]);
          if (lane == 0) sh.carry_total[0] = before.c;
        }
        __syncthreads();
        carry_in = sh.carry_total[0];
        __syncthreads();
      } else if (first_j > 0) {
        carry_in = block_reduce_prefix(a, first_row, first_j, sh);
      }

    // Exclusive carry of each item: earlier items of the thread, earlier threads, and carry_in when the item's run
    // reaches back to the tile start (then it is the tile's first segment, which began in an earlier tile).
    WriteCarry excl[kItems], incl[kItems];
  #pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const ScanElem before = i == 0 ? excl_thread : scan_op(excl_thread, pre_item[i - 1]);
      const bool head = it[i].row == nullptr || it[i].e.j == 0;
      WriteCarry ex = head ? write_carry_identity() : before.c;
      if (!head && !before.head && it[i].row == first_row) ex = write_carry_compose(carry_in, ex);
      excl[i] = ex;
      incl[i] = write_carry_compose(ex, it[i].row != nullptr ? write_entry_carry(it[i].e) : write_carry_identity());
      const int64_t entry = tile_start + static_cast<int64_t>(threadIdx.x) * kItems + i;
      if (record && it[i].row != nullptr && entry < a.carry_cap) {
        int64_t* c = a.carries + (1 + entry) * kNumCarryCols;
        c[col(CarryCol::MUL)] = static_cast<int64_t>(ex.map.mul);
        c[col(CarryCol::ADD)] = static_cast<int64_t>(ex.map.add);
        c[col(CarryCol::LAST_J)] = ex.last_j;
        c[col(CarryCol::SEGMENT)] = (it[i].row - a.plan) / kNumPlanCols;
        c[col(CarryCol::J)] = it[i].e.j;
        c[col(CarryCol::K)] = plan_at(it[i].row, PlanCol::WRITE_BEGIN) + it[i].e.j;
      }
    }

    uint64_t fpv[MAX_HALVES] = {0, 0};  // the fingerprints of this thread's token (kFp: kItems == 1)
    if constexpr (kFp) {
      const bool want = it[0].row != nullptr && it[0].e.kind == WriteKind::kWrite;
      if (a.fp_mode == static_cast<int32_t>(FingerprintMode::PARTIAL)) {
        if (want) {
          for (int64_t h = 0; h < a.halves; ++h) {
            fpv[h] = fingerprint_thread(a.fp_table, a.fp_sources, h, it[0].e.slot, it[0].e.position, a.fp_mode,
                                        a.fp_layer_stride);
          }
        }
      } else {  // block-uniform; s_fp_* were last read before the previous tile's closing barrier
        s_fp_slot[threadIdx.x] = want ? it[0].e.slot : -1;
        s_fp_pos[threadIdx.x] = want ? it[0].e.position : 0;
        for (int h = 0; h < MAX_HALVES; ++h) s_fp_acc[threadIdx.x * MAX_HALVES + h] = 0;
        __syncthreads();
        block_fp_sums(a.fp_table, a.fp_sources, a.halves, tile_end - tile_start, s_fp_slot, s_fp_pos, a.fp_mode,
                      a.fp_layer_stride, s_fp_acc);
        __syncthreads();
        if (want) {
          for (int64_t h = 0; h < a.halves; ++h) {
            fpv[h] = fp_finalize(s_fp_acc[threadIdx.x * MAX_HALVES + h], it[0].e.position);
          }
        }
      }
    }

    const int64_t* seed_row = nullptr;  // consecutive items of one segment share its seeds
    WriteSeed seeds[MAX_HALVES] = {{false, 0, 0}, {false, 0, 0}};
  #pragma unroll
    for (int i = 0; i < kItems; ++i) {
      if (it[i].row == nullptr) continue;
      const int64_t* row = it[i].row;
      const WriteEntry& e = it[i].e;
      write_structural(a, row, e);
      if (row != seed_row) {
        for (int64_t h = 0; h < a.halves; ++h) seeds[h] = write_seed_value(a, row, h);
        seed_row = row;
      }
      for (int64_t h = 0; h < a.halves; ++h) {
        const WriteSeed& seed = seeds[h];
        if (!seed.ok) {
          if (e.j == 0) write_emit_seed_error(a, row, h);
          continue;
        }
        const WriteTally t = write_entry_store(a, row, h, e, chain_apply(excl[i].map, seed.h),
                                               write_prev_pos(a, row, excl[i], seed), fpv[h]);
        tally[h] = write_tally_add(tally[h], t);
        if (e.j == plan_at(row, PlanCol::WRITE_LEN) - 1) {
          write_expect_new(a, row, h, chain_apply(incl[i].map, seed.h), incl[i].last_j);
        }
      }
    }
    __syncthreads();
    }  // tile loop
  }  // !serial
  int64_t counts[3 * MAX_HALVES] = {tally[0].written, tally[0].input_errors, tally[0].skipped,
                                    tally[1].written, tally[1].input_errors, tally[1].skipped};
  block_sum_to_thread0<kWriteThreads, 3 * MAX_HALVES>(counts, s_reduce);
  if (threadIdx.x == 0) {
    for (int64_t h = 0; h < a.halves; ++h) {
      write_tally_flush(a, h, WriteTally{counts[3 * h], counts[3 * h + 1], counts[3 * h + 2]});
    }
    if (reused >= 0) carries_done(a, reuse.done);
    // the launch's last block restores the workspace for the next launch (every block has read what it needed)
    if (ws.data != nullptr && reused < 0 &&
        atomicAdd(reinterpret_cast<unsigned long long*>(ws.data + kWsDone), 1ULL) == gridDim.x - 1ULL) {
      volatile int64_t* header = ws.data;
      header[kWsTicket] = 0;
      header[kWsDone] = 0;
      store_release(ws.data + kWsGen, s_ws[1] + 1);
    }
  }
}

}  // namespace

void write(TensorView records, TensorView swa_map, int64_t is_swa, int64_t reserved_slots, int64_t tag0, int64_t tag1,
           TensorView plan, TensorView status, TensorView table, TensorView input_ids, TensorView positions,
           TensorView out_cache_loc, TensorView ring_rows, TensorView ring_count, TensorView counters, TensorView step,
           int64_t checks, TensorView pool_tokens, TensorView pool_lens, int64_t has_pool, int64_t token_offset,
           TensorView fp_table, int64_t fp_mode, int64_t fp_layer_stride, int64_t table_page, TensorView workspace,
           TensorView carries) {
  check_cuda(records, "records");
  const WriteArgs a = make_write_args(records, swa_map, is_swa, reserved_slots, tag0, tag1, plan, status, table,
                                      input_ids, positions, out_cache_loc, ring_rows, ring_count, counters, step,
                                      checks, pool_tokens, pool_lens, has_pool, token_offset, fp_table, fp_mode,
                                      fp_layer_stride, table_page, carries);
  check_i64_tensor(workspace, records, 1, "workspace", "records");
  const int64_t ws_tiles = workspace.size(0) > kWsHeader ? (workspace.size(0) - kWsHeader) / kWsTileCols : 0;
  const DLDevice dev = records.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const cudaStream_t stream = stream_of(dev);
  // The look-back when the workspace holds every tile of a launch of several blocks, one tile each, and the write is
  // longer than one large tile: below that a tile's own reduction of its segment's earlier tokens is at most one
  // pass, cheaper than the ticket's round trip (a decode seal: one token per tile, nothing to look back over).
  const auto ws_for = [&](int64_t grid, int64_t tile) {
    const bool use = grid > 1 && a.num_tokens > kWriteThreads * kItemsNoFp && grid <= ws_tiles &&
                     grid * tile >= a.num_tokens;
    return use ? ScanWorkspace{static_cast<int64_t*>(workspace.data_ptr())} : kNoWorkspace;
  };
  const auto blocks = [&](int64_t tile) { return a.num_tokens > 0 ? ceil_div(a.num_tokens, tile) : int64_t{1}; };
  // At least one block: it reports range errors and counts the run even with no tokens.
  const bool partial = a.fp_mode == static_cast<int32_t>(FingerprintMode::PARTIAL);
  const auto go = [&](auto kernel, int64_t grid, int64_t tile, ScanWorkspace ws) {
    launch_kernel(kernel, static_cast<unsigned>(grid), kWriteThreads, stream, dev.device_id, a, tile, ws);
  };
  if ((a.fp_table == nullptr || partial) && a.num_tokens <= kWriteThreads) {  // decode-sized: one item per thread
    go(a.fp_table == nullptr ? write_kernel<1, false> : write_kernel<1, true>, 1, kWriteThreads, kNoWorkspace);
  } else if (a.fp_table == nullptr && ws_for(blocks(kWriteThreads), kWriteThreads).data != nullptr) {
    // the look-back makes small tiles cheap: one token per thread, every tile in flight at once
    const int64_t grid = blocks(kWriteThreads);
    go(write_kernel<1, false>, grid, kWriteThreads, ws_for(grid, kWriteThreads));
  } else if (a.fp_table == nullptr) {  // no workspace: large tiles, each reducing its own carry
    const int64_t tile = kWriteThreads * kItemsNoFp;
    go(write_kernel<kItemsNoFp, false>, blocks(tile), tile, kNoWorkspace);
  } else {
    const int64_t tile = fp_tile(a.num_tokens, dev.device_id), grid = blocks(tile);
    go(write_kernel<1, true>, grid, tile, ws_for(grid, tile));
  }
}

int64_t write_workspace_size(int64_t max_tokens, int64_t device_id) {
  TVM_FFI_CHECK(max_tokens >= 0, ValueError) << "max_tokens must be >= 0, got " << max_tokens;
  // fingerprint tiles hold >= max_tokens / (2 SMs) tokens, others kWriteThreads
  const int64_t tiles = std::max(2 * static_cast<int64_t>(sm_count(static_cast<int>(device_id))),
                                 ceil_div(max_tokens, static_cast<int64_t>(kWriteThreads)));
  return kWsHeader + kWsTileCols * tiles;
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(write, kvcanary::cuda::write);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(write_workspace_size, kvcanary::cuda::write_workspace_size);
