// CUDA write (docs/ops-contract.md 5): the chain of each segment is an exclusive affine scan (core/write.cuh
// WriteCarry) over flat token tiles. A tile takes the carry of its first segment's earlier tokens by reducing them
// itself (no inter-block communication, no workspace: graph-safe), scans its tokens block-wide with segment heads,
// then stores both halves. PARTIAL fingerprints (a few bytes per token) are hashed by the token's own thread, also
// on the one-block decode path. ALL fingerprints (the seal: every byte of every layer) use small tiles, down to one
// token per block, so that the rows spread over every SM, and the block's warps share the tile's (token, half,
// layer) rows (block_fp_sums).
#include <tvm/ffi/function.h>

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

__device__ __forceinline__ ScanElem shfl_up_elem(const ScanElem& x, int d) {
  ScanElem r;
  r.head = __shfl_up_sync(0xffffffffu, x.head ? 1 : 0, d) != 0;
  r.c.map.mul = __shfl_up_sync(0xffffffffu, x.c.map.mul, d);
  r.c.map.add = __shfl_up_sync(0xffffffffu, x.c.map.add, d);
  r.c.last_j = __shfl_up_sync(0xffffffffu, x.c.last_j, d);
  return r;
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
// plan round trip is gone. Only the fields segment_entries / segment_range_error / prefetch read are loaded.
struct OwnRow {
  int64_t v[kNumPlanCols];
  __device__ __forceinline__ explicit OwnRow(const WriteArgs& a) : v{} {
    if (static_cast<int64_t>(threadIdx.x) < a.plan_cap) {
      const int64_t* row = a.plan + static_cast<int64_t>(threadIdx.x) * kNumPlanCols;
      v[col(PlanCol::WRITE_BEGIN)] = plan_at(row, PlanCol::WRITE_BEGIN);
      v[col(PlanCol::WRITE_LEN)] = plan_at(row, PlanCol::WRITE_LEN);
      v[col(PlanCol::SEED_SLOT)] = plan_at(row, PlanCol::SEED_SLOT);
      v[col(PlanCol::FLAGS)] = plan_at(row, PlanCol::FLAGS);
      v[col(PlanCol::ROW)] = plan_at(row, PlanCol::ROW);
      v[col(PlanCol::PREFIX_LEN)] = plan_at(row, PlanCol::PREFIX_LEN);
    }
  }
  // Speculative L1 prefetches (no effect on results; only addresses inside their tensors): the row's first new
  // token and its seed record, read later by whichever thread holds them. One-block launches only (decode): with
  // several blocks the reader is usually on another SM.
  __device__ __forceinline__ void prefetch(const WriteArgs& a) const {
    if (gridDim.x != 1 || static_cast<int64_t>(threadIdx.x) >= a.plan_cap || plan_at(v, PlanCol::WRITE_LEN) <= 0 ||
        !write_range_ok(a, v)) {
      return;
    }
    const int64_t k = plan_at(v, PlanCol::WRITE_BEGIN);
    prefetch_l1(a.input_ids + k);
    prefetch_l1(a.positions + k);
    prefetch_l1(a.out_cache_loc + k);
    const int64_t trow = plan_at(v, PlanCol::ROW), tcol = plan_at(v, PlanCol::PREFIX_LEN);
    if (write_check(a, WriteCheck::STRUCTURAL) && !plan_flag(v, PlanFlag::PADDING) && trow >= 0 &&
        trow < a.table.rows && tcol >= 0 && tcol < a.table.cols) {
      prefetch_table(a.table, trow, tcol);  // the structural check's cell of the first new token
    }
    if (plan_flag(v, PlanFlag::SEED_IS_HEAD)) return;
    const Resolved r = resolve_slot(a.group, plan_at(v, PlanCol::SEED_SLOT));
    if (r.status != SlotStatus::kOk) return;
    for (int64_t h = 0; h < a.halves; ++h) prefetch_l1(&write_record(a, r.slot, h));
  }
  // Is segment s (< plan_cap) this thread's own row.
  __device__ __forceinline__ bool is(int64_t s) const { return s == static_cast<int64_t>(threadIdx.x); }
};

// The serial loop of core/write.cuh (what the CPU backend runs) for one segment with len > 0 entries and a valid
// range, by one thread; its counts go to tally.
__device__ __forceinline__ void write_segment_serial(const WriteArgs& a, const int64_t* row, int64_t len,
                                                     WriteTally (&tally)[MAX_HALVES]) {
  if (write_check(a, WriteCheck::STRUCTURAL)) {
    for (int64_t j = 0; j < len; ++j) write_structural(a, row, write_entry_load(a, row, j));
  }
  for (int64_t h = 0; h < a.halves; ++h) {
    const WriteSeed seed = write_seed(a, row, h);  // emits the seed INPUT_ERROR row itself
    if (!seed.ok) continue;
    WriteCarry carry = write_carry_identity();
    for (int64_t j = 0; j < len; ++j) {
      const WriteEntry e = write_entry_load(a, row, j);
      tally[h] = write_tally_add(tally[h], write_entry_apply(a, row, h, e, chain_apply(carry.map, seed.h),
                                                             write_prev_pos(a, row, carry, seed)));
      carry = write_carry_compose(carry, write_entry_carry(e));
    }
    write_expect_new(a, row, h, chain_apply(carry.map, seed.h), carry.last_j);
  }
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

template <int kItems, bool kFp>
__global__ void __launch_bounds__(kWriteThreads) write_kernel(WriteArgs a, int64_t tile) {
  __shared__ ScanShared sh;
  __shared__ BlockSumScratch<kWriteThreads, 1> sh_sum;
  __shared__ int64_t s_mark[kWriteThreads * kItems];     // segment whose first in-tile entry is here, -1 = none
  __shared__ int64_t s_first_j[kWriteThreads * kItems];  // that entry's index inside its segment
  __shared__ int64_t s_reduce[3 * MAX_HALVES * kWarpsPerBlock];
  __shared__ unsigned long long s_fp_acc[kFp ? kWriteThreads * MAX_HALVES : 1];
  __shared__ int64_t s_fp_slot[kFp ? kWriteThreads : 1];
  __shared__ int64_t s_fp_pos[kFp ? kWriteThreads : 1];

  const int64_t nseg = write_num_segments(a);
  const OwnRow own(a);
  own.prefetch(a);
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
  // Small batches of short segments (decode): one block, each thread runs its own segment's serial loop (the CPU
  // backend's, PARTIAL fingerprints included: a few bytes per token), with no block scan. Block-uniform decision;
  // range errors were reported above.
  bool serial = false;
  if constexpr (kItems == 1) {
    if (gridDim.x == 1 && nseg <= kWriteThreads &&
        (!kFp || a.fp_mode == static_cast<int32_t>(FingerprintMode::PARTIAL))) {
      const int64_t len = static_cast<int64_t>(threadIdx.x) < nseg ? segment_entries(a, own.v) : 0;
      serial = __syncthreads_or(len > kSerialMaxLen ? 1 : 0) == 0;
      if (serial && len > 0) write_segment_serial(a, a.plan + static_cast<int64_t>(threadIdx.x) * kNumPlanCols, len,
                                                  tally);
    }
  }
  if (!serial) {  // block-uniform
    // Dense entry space: segment s owns entries [off_s, off_s + entries_s). Each thread sums a chunk of segments.
    const int64_t chunk = (nseg + kWriteThreads - 1) / kWriteThreads;
    const int64_t c_lo = threadIdx.x * chunk, c_hi = c_lo + chunk < nseg ? c_lo + chunk : nseg;
    int64_t chunk_off[1] = {0}, total_arr[1];
    for (int64_t s = c_lo; s < c_hi; ++s) {
      chunk_off[0] += own.is(s) ? segment_entries(a, own.v) : segment_entries(a, a.plan + s * kNumPlanCols);
    }
    block_exclusive_sum<kWriteThreads, 1>(chunk_off, total_arr, sh_sum);
    const int64_t total = total_arr[0];

    for (int64_t tile_start = static_cast<int64_t>(blockIdx.x) * tile; tile_start < total;
         tile_start += static_cast<int64_t>(gridDim.x) * tile) {
      const int64_t tile_end = tile_start + tile < total ? tile_start + tile : total;
      // Mark the first in-tile position of every segment overlapping the tile.
      for (int64_t p = threadIdx.x; p < tile; p += kWriteThreads) s_mark[p] = -1;
      __syncthreads();
      int64_t off = chunk_off[0];
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

      // Load this thread's entries (kItems consecutive positions) and their carries.
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
          if (s_mark[p] >= 0) cur = p;
          if (cur >= 0) {
            const int64_t* row = a.plan + s_mark[cur] * kNumPlanCols;
            const int64_t j = s_first_j[cur] + (p - cur);
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
      if (first_j > 0) carry_in = block_reduce_prefix(a, first_row, first_j, sh);

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
  }
}

}  // namespace

void write(TensorView records, TensorView swa_map, int64_t is_swa, int64_t reserved_slots, int64_t tag0, int64_t tag1,
           TensorView plan, TensorView status, TensorView table, TensorView input_ids, TensorView positions,
           TensorView out_cache_loc, TensorView ring_rows, TensorView ring_count, TensorView counters, TensorView step,
           int64_t checks, TensorView pool_tokens, TensorView pool_lens, int64_t has_pool, int64_t token_offset,
           TensorView fp_table, int64_t fp_mode, int64_t fp_layer_stride, int64_t table_page) {
  check_cuda(records, "records");
  const WriteArgs a = make_write_args(records, swa_map, is_swa, reserved_slots, tag0, tag1, plan, status, table,
                                      input_ids, positions, out_cache_loc, ring_rows, ring_count, counters, step,
                                      checks, pool_tokens, pool_lens, has_pool, token_offset, fp_table, fp_mode,
                                      fp_layer_stride, table_page);
  const DLDevice dev = records.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const cudaStream_t stream = stream_of(dev);
  // At least one block: it reports range errors and counts the run even with no tokens.
  const bool partial = a.fp_mode == static_cast<int32_t>(FingerprintMode::PARTIAL);
  if ((a.fp_table == nullptr || partial) && a.num_tokens <= kWriteThreads) {  // decode-sized: one item per thread
    if (a.fp_table == nullptr) {
      write_kernel<1, false><<<1, kWriteThreads, 0, stream>>>(a, kWriteThreads);
    } else {
      write_kernel<1, true><<<1, kWriteThreads, 0, stream>>>(a, kWriteThreads);
    }
  } else if (a.fp_table == nullptr) {
    const int64_t tile = kWriteThreads * kItemsNoFp;
    const int64_t grid = a.num_tokens > 0 ? ceil_div(a.num_tokens, tile) : 1;
    write_kernel<kItemsNoFp, false><<<static_cast<unsigned>(grid), kWriteThreads, 0, stream>>>(a, tile);
  } else {
    // Small tiles so that the fingerprint reads spread over every SM: about two tiles per SM, 1..256 tokens (a
    // decode seal of 256 tokens: one token's rows per block, all in flight at once, instead of 8 blocks whose warps
    // walk 4 tokens x every layer one after another).
    const int64_t want = ceil_div(a.num_tokens, 2 * static_cast<int64_t>(sm_count(dev.device_id)));
    int64_t tile = 1;
    while (tile < want && tile < kWriteThreads) tile *= 2;
    const int64_t grid = a.num_tokens > 0 ? ceil_div(a.num_tokens, tile) : 1;
    write_kernel<1, true><<<static_cast<unsigned>(grid), kWriteThreads, 0, stream>>>(a, tile);
  }
  check_launch();
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(write, kvcanary::cuda::write);
