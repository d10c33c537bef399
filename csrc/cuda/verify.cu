// CUDA verify (docs/ops-contract.md 4): both halves in one launch, entries derived from the plan segments on the
// device, one 16-byte-vector gather of a slot's K and V records per entry, the predecessor's link passed from the
// neighbouring lane; PARTIAL fingerprints per lane; ALL fingerprints by the whole block (rows dealt to its warps),
// with few entries spread one or a few per block over the grid; a persistent grid sized from the SM count.
#include <tvm/ffi/function.h>

#include <algorithm>

#include "core/verify_args.h"
#include "cuda/cuda_common.cuh"

namespace kvcanary {
namespace cuda {
namespace {

constexpr int kVerifyThreads = 256;
constexpr int64_t kSmemSegments = 2048;

struct VerifyLaunch {
  VerifyParams P;
  const int64_t* plan;
  int64_t plan_cap;
  const int64_t* status;
  bool vec;  // records 16-byte aligned: vector loads
};

// The last segment with ENTRY_OFFSET <= e among [0, n) (offsets from shared memory when they fit, else the plan).
__device__ __forceinline__ int64_t segment_of(const int64_t* s_off, const int64_t* plan, int64_t n, int64_t e) {
  int64_t lo = 0, hi = n - 1, found = -1;
  while (lo <= hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    const int64_t off = n <= kSmemSegments ? s_off[mid] : plan[mid * kNumPlanCols + col(PlanCol::ENTRY_OFFSET)];
    if (off <= e) {
      found = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return found;
}

struct EntryRef {
  int64_t s;           // segment, -1 = none
  const int64_t* seg;  // its plan row (the plan's first row when none)
  int64_t idx;         // table column
  bool valid;          // a readable entry: the segment passes verify_segment_ok and idx is inside it
};

// Entry e of the dense entry space (e >= total: none).
__device__ __forceinline__ EntryRef entry_ref(const VerifyLaunch& L, const int64_t* s_off, int64_t nseg,
                                              int64_t total, int64_t e) {
  EntryRef r{-1, L.plan, 0, false};
  if (e < total) r.s = segment_of(s_off, L.plan, nseg, e);
  if (r.s >= 0) {
    r.seg = L.plan + r.s * kNumPlanCols;
    r.idx = r.seg[col(PlanCol::IDX_BEGIN)] + (e - r.seg[col(PlanCol::ENTRY_OFFSET)]);
    r.valid = verify_segment_ok(L.P, r.seg) && r.idx >= r.seg[col(PlanCol::IDX_BEGIN)] &&
              r.idx < r.seg[col(PlanCol::IDX_END)];
  }
  return r;
}

// Entries of the plan's dense entry space from its last segment: ENTRY_OFFSET + max(len, 0), clamped to
// [0, nseg * cols] (a plan with garbage offsets must not loop for long: valid segments hold at most cols entries).
__device__ __forceinline__ int64_t plan_entries_total(const int64_t* last, int64_t nseg, int64_t cols) {
  const int64_t len = last[col(PlanCol::IDX_END)] - last[col(PlanCol::IDX_BEGIN)];
  const int64_t total = last[col(PlanCol::ENTRY_OFFSET)] + (len > 0 ? len : 0);
  const int64_t most = nseg * cols;
  return total < 0 ? 0 : (total > most ? most : total);
}

// Row threadIdx.x's fields, read together with the status (rows below plan_cap are in bounds whatever the status
// says): with at most kVerifyThreads segments, the offsets, the entry total and block 0's bad-segment checks need
// no status -> plan round trip. Only the fields verify_segment_ok / plan_entries_total read are loaded.
struct OwnSeg {
  int64_t v[kNumPlanCols];
  __device__ __forceinline__ explicit OwnSeg(const VerifyLaunch& L) : v{} {
    if (static_cast<int64_t>(threadIdx.x) < L.plan_cap) {
      const int64_t* row = L.plan + static_cast<int64_t>(threadIdx.x) * kNumPlanCols;
      v[col(PlanCol::ROW)] = row[col(PlanCol::ROW)];
      v[col(PlanCol::IDX_BEGIN)] = row[col(PlanCol::IDX_BEGIN)];
      v[col(PlanCol::IDX_END)] = row[col(PlanCol::IDX_END)];
      v[col(PlanCol::ENTRY_OFFSET)] = row[col(PlanCol::ENTRY_OFFSET)];
    }
  }
};

// Entries a block takes per step in ALL mode: ceil(total / grid), 1..kVerifyThreads.
__device__ __forceinline__ int64_t verify_per_block(int64_t total) {
  const int64_t n = (total + gridDim.x - 1) / gridDim.x;
  return n < 1 ? 1 : (n > kVerifyThreads ? kVerifyThreads : n);
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// kHalves == P.halves: a compile-time half count keeps the records of both halves in registers (loop-unrolled), so
// an entry's record and predecessor gathers are all in flight before the first use. kBlockFp == (P.fp.mode == ALL):
// the block-cooperative fingerprint path, compiled only where it runs (the register-capped per-entry code of the
// other modes keeps its registers).
template <int kHalves, bool kBlockFp>
__global__ void __launch_bounds__(kVerifyThreads, kHalves == 2 ? 3 : 4) verify_kernel(VerifyLaunch L) {
  await_prior_kernels();
  __shared__ int64_t s_off[kSmemSegments];  // ENTRY_OFFSET of every segment when they fit
  __shared__ int64_t s_reduce[3 * kVerifyThreads / kWarp];
  __shared__ int64_t s_total;
  constexpr int kFpItems = kBlockFp ? kVerifyThreads : 1;
  __shared__ int64_t s_fp_slot[kFpItems];  // ALL mode: the block's entries to fingerprint (-1 = none)
  __shared__ int64_t s_fp_pos[kFpItems];
  __shared__ unsigned long long s_fp_acc[kFpItems * MAX_HALVES];
  const VerifyParams& P = L.P;
  const int64_t nseg = plan_num_segments(L.status, L.plan_cap);
  if (nseg == 0) {  // grid-uniform (an empty reuse plan every steady decode forward): only the run is counted
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      for (int64_t h = 0; h < kHalves; ++h) count(P.sink, P.tags[h], CounterCol::VERIFY_RUNS, 1);
    }
    return;
  }
  const OwnSeg own(L);
  const int lane = threadIdx.x % kWarp;
  const int64_t gthreads = static_cast<int64_t>(gridDim.x) * kVerifyThreads;
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * kVerifyThreads + threadIdx.x;

  int64_t checked = 0, skipped = 0, errors = 0;
  // Bad segments (a plan paired with another table): one INPUT_ERROR row per half, entries not read.
  for (int64_t s = gtid; s < nseg; s += gthreads) {
    const int64_t* seg = L.plan + s * kNumPlanCols;
    // s == threadIdx.x only in block 0's first step: the thread's own row.
    if (s == static_cast<int64_t>(threadIdx.x) ? !verify_segment_ok(P, own.v) : !verify_segment_ok(P, seg)) {
      verify_emit_bad_segment(P, seg);
      ++errors;
    }
  }
  int64_t total = 0;
  const bool want_fp = verify_wants_fp(P);
  // ALL mode reads whole rows of every selected layer per entry: latency-bound unless many warps load at once. So a
  // block takes only per_block = ceil(total / grid) entries per step (at most one per thread) and its warps share
  // their rows: 512 sweep entries of 4 layers become 512 blocks of 4 concurrent row loads, not 2 blocks whose warps
  // each walk 32 entries x 4 layers. Grid-uniform (total and grid are), so every block agrees on the entry mapping.
  constexpr bool block_fp = kBlockFp;
  int64_t per_block = kVerifyThreads;
  if (nseg <= kVerifyThreads) {  // block-uniform: every row is some thread's own row
    if (static_cast<int64_t>(threadIdx.x) < nseg) s_off[threadIdx.x] = own.v[col(PlanCol::ENTRY_OFFSET)];
    if (static_cast<int64_t>(threadIdx.x) == nseg - 1) s_total = plan_entries_total(own.v, nseg, P.table.cols);
    __syncthreads();
    if (nseg > 0) total = s_total;
    if (block_fp) per_block = verify_per_block(total);
  } else {
    total = plan_entries_total(L.plan + (nseg - 1) * kNumPlanCols, nseg, P.table.cols);
    if (block_fp) per_block = verify_per_block(total);
    if (nseg <= kSmemSegments && static_cast<int64_t>(blockIdx.x) * per_block < total) {
      for (int64_t s = threadIdx.x; s < nseg; s += kVerifyThreads) {
        s_off[s] = L.plan[s * kNumPlanCols + col(PlanCol::ENTRY_OFFSET)];
      }
      __syncthreads();
    }
  }
  constexpr int64_t halves = kHalves;
  const int64_t step = static_cast<int64_t>(gridDim.x) * per_block;
  const int64_t mine = static_cast<int64_t>(threadIdx.x) < per_block ? static_cast<int64_t>(threadIdx.x) : -1;

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * per_block; base < total; base += step) {
    const EntryRef cur = entry_ref(L, s_off, nseg, total, mine >= 0 ? base + mine : total);
    const int64_t s = cur.s, idx = cur.idx;
    const int64_t* seg = cur.seg;
    const bool valid = cur.valid;
    VerifyEntry ent{};
    bool ok = false;
    if (valid) {
      ent = verify_locate(P, seg, idx);
      ok = ent.slot.status == SlotStatus::kOk;
      if (ent.slot.status == SlotStatus::kInputError) {
        verify_emit_input_error(P, seg, ent);
        ++errors;
      } else if (!ok) {
        ++skipped;
      }
    }
    // The predecessor of entry idx is entry idx - 1 of the same segment, held by the previous lane when it is there;
    // otherwise (lane 0, a segment's first entry) this lane gathers it itself, issued together with its own record.
    const int64_t prev_s = __shfl_up_sync(0xffffffffu, valid ? s : -1, 1);
    const bool own_pred =
        ok && ent.has_pred && !ent.anchor && !(lane > 0 && prev_s == s && idx > seg[col(PlanCol::IDX_BEGIN)]);
    CanaryRecord rec[MAX_HALVES] = {};
    CanaryRecord pred_rec[MAX_HALVES] = {};
    if (ok) ++checked;
#pragma unroll
    for (int64_t h = 0; h < halves; ++h) {
      if (ok) rec[h] = load_record(P.records, ent.slot.slot * halves + h, L.vec);
      if (own_pred) pred_rec[h] = load_record(P.records, ent.pred_slot * halves + h, L.vec);
    }
    // Whether this entry's fingerprint is checked (the share; a position inside [0, TOKEN_LIMIT)). (An L1 prefetch
    // of the PARTIAL bytes here, beside the record gathers, doubled this register-capped kernel's spills; the verify
    // runs at the random-gather rate, so it was left out.)
    const bool fp_here = ok && want_fp && chain_value_ok(ent.position) && verify_fp_selected(P, seg, ent.position);
    // While those gathers are in flight, pull this thread's next entry's records into L2 (no registers held): its
    // gather in the next iteration then waits on L2, not DRAM. Only a slot that resolves is prefetched (in bounds).
    // Only while the entry search runs on shared memory (a search over the plan in global memory costs more).
    if (nseg <= kSmemSegments) {
      const EntryRef nxt = entry_ref(L, s_off, nseg, total, mine >= 0 ? base + step + mine : total);
      if (nxt.valid) {
        const Resolved r = resolve_slot(P.group, P.table.at(nxt.seg[col(PlanCol::ROW)], nxt.idx));
        if (r.status == SlotStatus::kOk) {
#pragma unroll
          for (int64_t h = 0; h < halves; ++h) prefetch_l2(record_at(P.records, halves, r.slot, h));
        }
      }
    }
    // A slot's V record normally repeats its K record's token, position and chain value (only the fingerprint
    // differs): then V's link is K's, and its checks other than the fingerprint have K's outcome (see below).
    // (Not on the ALL path: it is bound by the row reads, and the extra state spills there.)
    const bool v_mirrors_k = halves == 2 && !block_fp && ok && same_chain_fields(rec[0], rec[1]);
    bool link_ok[MAX_HALVES] = {false, false};
    uint64_t link[MAX_HALVES] = {0, 0};
    if (ok) {
      link_ok[0] = record_link(rec[0], &link[0]);
      if (halves == 2) {
        link_ok[1] = v_mirrors_k ? link_ok[0] : record_link(rec[1], &link[1]);
        if (v_mirrors_k) link[1] = link[0];
      }
    }
    uint64_t pred_link[MAX_HALVES];
    bool pred_ok[MAX_HALVES];
#pragma unroll
    for (int h = 0; h < MAX_HALVES; ++h) {
      pred_link[h] = __shfl_up_sync(0xffffffffu, link[h], 1);
      pred_ok[h] = __shfl_up_sync(0xffffffffu, link_ok[h] ? 1 : 0, 1) != 0;
    }
    if (own_pred) {
#pragma unroll
      for (int64_t h = 0; h < halves; ++h) pred_ok[h] = record_link(pred_rec[h], &pred_link[h]);
    }
    uint64_t fpv[MAX_HALVES] = {0, 0};
    if constexpr (block_fp) {
      __syncthreads();  // the previous step's readers of s_fp_* are done
      if (mine >= 0) {
        s_fp_slot[mine] = fp_here ? ent.slot.slot : -1;
        s_fp_pos[mine] = ent.position;
#pragma unroll
        for (int h = 0; h < MAX_HALVES; ++h) s_fp_acc[mine * MAX_HALVES + h] = 0;
      }
      __syncthreads();
      block_fp_sums(P.fp.table, P.fp.n_sources, halves, per_block, s_fp_slot, s_fp_pos, P.fp.mode,
                    P.fp.layer_stride, s_fp_acc);
      __syncthreads();
      if (fp_here) {
#pragma unroll
        for (int64_t h = 0; h < halves; ++h) fpv[h] = fp_finalize(s_fp_acc[mine * MAX_HALVES + h], ent.position);
      }
    }
    // V's full check is skipped when it mirrors a K entry that passed every non-fingerprint check with the same
    // predecessor link: its outcome is then K's (clean) but for the fingerprint, checked here. Rows and counts are
    // those of the full check (the rare failing case runs it).
    const bool v_may_mirror = v_mirrors_k && verify_same_pred(ent, pred_ok, pred_link);
    int64_t k_reasons = 0;
#pragma unroll 1  // one copy of the check code (a register-tight kernel); the records are all in flight by now
    for (int64_t h = 0; h < halves; ++h) {
      // Selects, not rec[h]: a runtime index into the per-half arrays would place them in local memory.
      const bool v = h == 1;
      const uint64_t fp = fp_here && !block_fp ? fingerprint_thread(P.fp.table, P.fp.n_sources, h, ent.slot.slot,
                                                                    ent.position, P.fp.mode, P.fp.layer_stride)
                                               : (v ? fpv[1] : fpv[0]);
      if (!ok) continue;
      const CanaryRecord r_h = v ? rec[1] : rec[0];
      if (v && v_may_mirror && (k_reasons & ~bits(FailReason::VERIFY_FINGERPRINT)) == 0 &&
          !verify_fp_fails(P, seg, ent, r_h, fp)) {
        continue;
      }
      const int64_t r = verify_check_record(P, seg, idx, ent, h, r_h, v ? pred_ok[1] : pred_ok[0],
                                            v ? pred_link[1] : pred_link[0], fp);
      if (!v) k_reasons = r;
    }
  }
  int64_t counts[3] = {checked, skipped, errors};
  block_sum_to_thread0<kVerifyThreads, 3>(counts, s_reduce);
  if (threadIdx.x == 0) {
    for (int64_t h = 0; h < halves; ++h) {
      count(P.sink, P.tags[h], CounterCol::ENTRIES_CHECKED, counts[0]);
      count(P.sink, P.tags[h], CounterCol::SKIPPED, counts[1]);
      count(P.sink, P.tags[h], CounterCol::INPUT_ERRORS, counts[2]);
      if (blockIdx.x == 0) count(P.sink, P.tags[h], CounterCol::VERIFY_RUNS, 1);
    }
  }
}

std::array<std::atomic<int>, kMaxDevices> g_verify_occupancy[MAX_HALVES][2]{};

}  // namespace

void verify(TensorView records, TensorView swa_map, int64_t has_swa_map, int64_t reserved_slots, int64_t tag_k,
            int64_t tag_v, TensorView plan, TensorView status, TensorView table, TensorView ring_rows,
            TensorView ring_count, TensorView counters, TensorView step, TensorView pool_tokens, TensorView pool_lens,
            int64_t has_pool, int64_t token_offset, TensorView fp_table, int64_t fp_mode, int64_t fp_layer_stride,
            int64_t table_page, int64_t fp_share, int64_t max_segment_entries) {
  const VerifyArgs a = make_verify_args(kDLCUDA, records, swa_map, has_swa_map, reserved_slots, tag_k, tag_v, plan,
                                        status, table, ring_rows, ring_count, counters, step, pool_tokens, pool_lens,
                                        has_pool, token_offset, fp_table, fp_mode, fp_layer_stride, table_page,
                                        fp_share, max_segment_entries);
  const int64_t halves = a.P.halves;
  VerifyLaunch L{};
  L.P = a.P;
  L.plan = a.plan;
  L.plan_cap = a.plan_cap;
  L.status = a.status;
  L.vec = reinterpret_cast<uintptr_t>(records.data_ptr()) % 16 == 0;

  const DLDevice dev = records.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  // Persistent grid sized from the SM count, but no larger than the most entries the plan's shape allows (each
  // valid segment holds at most table.cols entries): small forwards launch few blocks. ALL mode may give each block
  // a single entry (verify_per_block), so its bound is one block per entry.
  const bool all = a.want_fp && a.P.fp.mode == static_cast<int32_t>(FingerprintMode::ALL);
  auto* kernel = halves == 2 ? (all ? verify_kernel<2, true> : verify_kernel<2, false>)
                             : (all ? verify_kernel<1, true> : verify_kernel<1, false>);
  const int64_t full = static_cast<int64_t>(sm_count(dev.device_id)) *
                       resident_blocks(kernel, kVerifyThreads, dev.device_id,
                                       g_verify_occupancy[halves - 1][all ? 1 : 0]);
  // entries per segment: at most a table row, or the caller's bound (a plan of window W: W entries per request)
  const int64_t per_seg =
      a.max_segment_entries > 0 ? std::min(a.P.table.cols, a.max_segment_entries) : a.P.table.cols;
  const int64_t most =
      per_seg > 0 && plan.size(0) > (int64_t{1} << 40) / per_seg ? (int64_t{1} << 40) : plan.size(0) * per_seg;
  const int64_t per_block_max = all ? 1 : kVerifyThreads;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(full, ceil_div(most, per_block_max))));
  launch_kernel(kernel, grid, kVerifyThreads, stream_of(dev), dev.device_id, L);
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(verify, kvcanary::cuda::verify);
