// CUDA plan_forward / plan_sweep / derive_roll / plan_roll (docs/ops-contract.md 2-3a): one block scans the batch in
// chunks of its width.
#include <tvm/ffi/function.h>

#include <algorithm>

#include "core/plan.cuh"
#include "core/roll_args.h"
#include "cuda/block_scan.cuh"
#include "cuda/cuda_common.cuh"

namespace kvcanary {
namespace cuda {
namespace {

constexpr int kPlanThreads = 512;

struct PlanForwardArgs {
  int64_t* plan;
  int64_t* status;
  const int64_t* req_pool_indices;
  const int64_t* prefix_lens;
  const int64_t* extend_lens;    // nullptr: no new tokens (the reuse plan)
  const int64_t* expect_prefix;  // nullptr: absent
  const int64_t* expect_new;     // nullptr: absent
  const int64_t* flag_mask;      // nullptr: absent (every flag kept)
  SlotTable table;
  int64_t bs;
  int64_t num_tokens;
  int64_t window;
  int64_t padding_row;
};

// Scan lanes: running token offset, segments, verify entries, write entries, input errors, overflow.
enum : int { kTok = 0, kSeg, kVer, kWri, kErr, kOvf, kLanes };

// Block b plans args[b]: block 0 the forward, block 1 (when launched) the reuse plan, concurrently in one launch.
// Block 0's thread 0 also increments the stage counter `tick` (tick_n elements; docs/ops-contract.md 2).
struct PlanForwardLaunch {
  PlanForwardArgs args[2];
  int64_t* tick;
  int64_t tick_n;
};

template <int kThreads>
__global__ void __launch_bounds__(kThreads, 1) plan_forward_kernel(PlanForwardLaunch launch) {
  await_prior_kernels();
  __shared__ BlockSumScratch<kThreads, kLanes> scratch;
  const PlanForwardArgs& a = launch.args[blockIdx.x];
  int64_t carry[kLanes] = {0, 0, 0, 0, 0, 0};
  for (int64_t base = 0; base < a.bs; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    const bool in = i < a.bs;
    const int64_t row = in ? a.req_pool_indices[i] : 0;
    const int64_t pre = in ? a.prefix_lens[i] : 0;
    const int64_t ext = in && a.extend_lens != nullptr ? a.extend_lens[i] : 0;
    // What a segment's row fill reads, prefetched into L1 before the two block scans (no effect on results; only
    // addresses inside their tensors): the fill then waits on L1, not on another global round trip.
    if (in) {
      if (a.expect_prefix != nullptr) prefetch_l1(a.expect_prefix + i);
      if (a.expect_new != nullptr) prefetch_l1(a.expect_new + i);
      if (a.flag_mask != nullptr) prefetch_l1(a.flag_mask + i);
      if (row >= 0 && row < a.table.rows && pre > 0 && pre <= a.table.cols) {
        prefetch_table(a.table, row, pre - 1);
        const int64_t vb = plan_forward_verify_begin(pre, a.window);
        if (vb > 0) prefetch_table(a.table, row, vb - 1);
      }
    }
    int64_t v[kLanes] = {in ? plan_token_term(ext, a.num_tokens) : 0, 0, 0, 0, 0, 0};
    int64_t total[kLanes];
    // First pass: the running token offset gives each request its write begin and so its outcome.
    block_exclusive_sum<kThreads, kLanes>(v, total, scratch);
    const int64_t wb = plan_token_cap(carry[kTok] + v[kTok], a.num_tokens);
    const PlanOutcome out = in ? plan_forward_classify(row, pre, ext, wb, a.table.rows, a.table.cols, a.num_tokens,
                                                       a.padding_row)
                               : PlanOutcome::kPadding;
    const bool seg = out == PlanOutcome::kSegment, pad_seg = out == PlanOutcome::kPaddingSegment;
    int64_t w[kLanes] = {0,
                         (seg || pad_seg) ? 1 : 0,
                         seg ? pre - plan_forward_verify_begin(pre, a.window) : 0,
                         (seg || pad_seg) ? ext : 0,
                         (out == PlanOutcome::kInputError || out == PlanOutcome::kOverflow) ? 1 : 0,
                         out == PlanOutcome::kOverflow ? 1 : 0};
    int64_t wtotal[kLanes];
    block_exclusive_sum<kThreads, kLanes>(w, wtotal, scratch);
    const int64_t mask = (seg || pad_seg) && a.flag_mask != nullptr ? a.flag_mask[i] : kKeepAllFlags;
    if (seg) {
      const int64_t s = carry[kSeg] + w[kSeg];
      plan_forward_fill(a.plan + s * kNumPlanCols, i, row, pre, ext, wb, a.window, carry[kVer] + w[kVer], a.table,
                        a.expect_prefix != nullptr, a.expect_prefix != nullptr ? a.expect_prefix[i] : 0,
                        a.expect_new != nullptr, a.expect_new != nullptr ? a.expect_new[i] : 0, mask);
    } else if (pad_seg) {
      plan_forward_fill_padding(a.plan + (carry[kSeg] + w[kSeg]) * kNumPlanCols, i, row, pre, ext, wb,
                                carry[kVer] + w[kVer], mask);
    }
    carry[kTok] = plan_token_cap(carry[kTok] + total[kTok], a.num_tokens);
#pragma unroll
    for (int k = kSeg; k < kLanes; ++k) carry[k] += wtotal[k];
  }
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0) {
      for (int64_t j = 0; j < launch.tick_n; ++j) ++launch.tick[j];
    }
    a.status[col(PlanStatusCol::NUM_SEGMENTS)] = carry[kSeg];
    a.status[col(PlanStatusCol::VERIFY_ENTRIES)] = carry[kVer];
    a.status[col(PlanStatusCol::WRITE_ENTRIES)] = carry[kWri];
    a.status[col(PlanStatusCol::INPUT_ERRORS)] = carry[kErr];
    a.status[col(PlanStatusCol::OVERFLOW)] = carry[kOvf] > 0 ? 1 : 0;
  }
}

// Chains of a plain sweep: the export's arrays.
struct SweepArrays {
  const int64_t* starts;
  const int64_t* lens;
  const int64_t* first_positions;
  const int64_t* prev_slots;
  const int64_t* expect_end;  // nullptr: absent
  __device__ SweepChain at(int64_t c) const {
    return SweepChain{starts[c], lens[c], first_positions[c], prev_slots[c],
                      expect_end != nullptr ? expect_end[c] : 0};
  }
};

// Chains of a rolling-sweep slice: entry i derived from the export (docs/ops-contract.md 3a); also names its chain.
struct RollChains {
  RollSource src;
  int64_t cursor;
  int64_t* chain_out;
  __device__ SweepChain at(int64_t i) const {
    const RollEntry e = plan_roll_entry(src, cursor, i);
    chain_out[i] = e.chain;
    return SweepChain{e.start, e.len, e.first_position, e.prev_slot, 0};
  }
};

// derive_roll's inverse map: a slot id held at several indices gets one of them (plan_roll checks slots[inv[s]] == s).
__global__ void __launch_bounds__(kPlanThreads)
    derive_inv_kernel(const int64_t* __restrict__ slots, int64_t N, int64_t* __restrict__ inv, int64_t m) {
  await_prior_kernels();
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * kPlanThreads + threadIdx.x; k < N;
       k += static_cast<int64_t>(gridDim.x) * kPlanThreads) {
    const int64_t s = slots[k];
    if (s >= 0 && s < m) inv[s] = k;
  }
}

// derive_roll's running chain ends: one block scans max(lens, 0) in chunks of its width, in uint64 (sums wrap as the
// CPU op's and torch's do).
__global__ void __launch_bounds__(kPlanThreads)
    derive_ends_kernel(const int64_t* __restrict__ lens, int64_t n, int64_t* __restrict__ ends) {
  await_prior_kernels();
  __shared__ BlockSumScratch<kPlanThreads, 1, uint64_t> scratch;
  uint64_t carry = 0;
  for (int64_t base = 0; base < n; base += kPlanThreads) {
    const int64_t i = base + threadIdx.x;
    const uint64_t len = i < n && lens[i] > 0 ? static_cast<uint64_t>(lens[i]) : 0;
    uint64_t v[1] = {len}, total[1];
    block_exclusive_sum<kPlanThreads, 1, uint64_t>(v, total, scratch);
    if (i < n) ends[i] = static_cast<int64_t>(carry + v[0] + len);
    carry += total[0];
  }
}

enum : int { kSSeg = 0, kSVer, kSErr, kSLanes };

// One block plans chains 0..n-1 in chunks of its width: validity and entry counts by block scans, then the fill.
template <typename Chains>
__global__ void __launch_bounds__(kPlanThreads, 1)
    plan_sweep_kernel(Chains chains, int64_t* plan, int64_t* status, int64_t n, int64_t n_slots, bool has_expect_end) {
  await_prior_kernels();
  __shared__ BlockSumScratch<kPlanThreads, kSLanes> scratch;
  int64_t carry[kSLanes] = {0, 0, 0};
  for (int64_t base = 0; base < n; base += kPlanThreads) {
    const int64_t c = base + threadIdx.x;
    const bool in = c < n;
    const SweepChain ch = in ? chains.at(c) : SweepChain{0, 0, 0, NO_SLOT, 0};
    const bool ok = in && plan_sweep_valid(ch.start, ch.len, ch.first_position, n_slots);
    int64_t v[kSLanes] = {ok ? 1 : 0, ok ? ch.len : 0, (in && !ok) ? 1 : 0};
    int64_t total[kSLanes];
    block_exclusive_sum<kPlanThreads, kSLanes>(v, total, scratch);
    if (ok) {
      plan_sweep_fill(plan + (carry[kSSeg] + v[kSSeg]) * kNumPlanCols, c, ch.start, ch.len, ch.first_position,
                      ch.prev_slot, carry[kSVer] + v[kSVer], has_expect_end, ch.expect_end);
    }
#pragma unroll
    for (int k = 0; k < kSLanes; ++k) carry[k] += total[k];
  }
  if (threadIdx.x == 0) {
    status[col(PlanStatusCol::NUM_SEGMENTS)] = carry[kSSeg];
    status[col(PlanStatusCol::VERIFY_ENTRIES)] = carry[kSVer];
    status[col(PlanStatusCol::WRITE_ENTRIES)] = 0;
    status[col(PlanStatusCol::INPUT_ERRORS)] = carry[kSErr];
    status[col(PlanStatusCol::OVERFLOW)] = 0;
  }
}

void check_sweep_plan_out(const TensorView& plan, const TensorView& status, const TensorView& slots, int64_t n) {
  check_cuda(plan, "plan");
  check_plan_out(plan, status, plan, "plan", n);
  check_i64_tensor(slots, plan, 1, "slots", "plan");
}

template <typename Chains>
void launch_sweep_plan(const TensorView& plan, const TensorView& status, const Chains& chains, int64_t n,
                       int64_t n_slots, bool has_expect_end) {
  const DLDevice dev = plan.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  launch_kernel(plan_sweep_kernel<Chains>, 1, kPlanThreads, stream_of(dev), dev.device_id, chains,
                static_cast<int64_t*>(plan.data_ptr()), static_cast<int64_t*>(status.data_ptr()), n, n_slots,
                has_expect_end);
}

}  // namespace

void plan_forward(TensorView plan, TensorView status, TensorView req_pool_indices, TensorView prefix_lens,
                  TensorView extend_lens, TensorView req_to_token, TensorView expect_prefix, int64_t has_expect_prefix,
                  TensorView expect_new, int64_t has_expect_new, TensorView flag_mask, int64_t has_flag_mask,
                  int64_t num_tokens, int64_t window, int64_t padding_row, int64_t table_page, TensorView reuse_plan,
                  TensorView reuse_status, TensorView reuse_lens, int64_t has_reuse, TensorView tick) {
  check_cuda(plan, "plan");
  const int64_t bs = check_chain_arrays(plan, "plan", req_pool_indices, "req_pool_indices",
                                        {{&prefix_lens, "prefix_lens"}, {&extend_lens, "extend_lens"}});
  check_plan_out(plan, status, plan, "plan", bs);
  check_slot_table(req_to_token, plan, "req_to_token", "plan");
  TVM_FFI_CHECK(num_tokens >= 0, ValueError) << "num_tokens must be >= 0, got " << num_tokens;
  TVM_FFI_CHECK(window >= 0, ValueError) << "window must be >= 0, got " << window;
  TVM_FFI_CHECK(padding_row >= -1, ValueError) << "padding_row must be >= -1, got " << padding_row;
  check_optional(expect_prefix, has_expect_prefix, plan, bs, "expect_prefix", "plan");
  check_optional(expect_new, has_expect_new, plan, bs, "expect_new", "plan");
  check_optional(flag_mask, has_flag_mask, plan, bs, "flag_mask", "plan");
  if (has_reuse) {
    check_plan_out(reuse_plan, reuse_status, plan, "plan", bs);
    check_i64_tensor(reuse_lens, plan, 1, "reuse_lens", "plan");
    check_dim(reuse_lens, 0, bs, "reuse_lens");
  }
  check_i64_tensor(tick, plan, 1, "tick", "plan");
  PlanForwardArgs a{static_cast<int64_t*>(plan.data_ptr()),
                    static_cast<int64_t*>(status.data_ptr()),
                    static_cast<const int64_t*>(req_pool_indices.data_ptr()),
                    static_cast<const int64_t*>(prefix_lens.data_ptr()),
                    static_cast<const int64_t*>(extend_lens.data_ptr()),
                    has_expect_prefix ? static_cast<const int64_t*>(expect_prefix.data_ptr()) : nullptr,
                    has_expect_new ? static_cast<const int64_t*>(expect_new.data_ptr()) : nullptr,
                    has_flag_mask ? static_cast<const int64_t*>(flag_mask.data_ptr()) : nullptr,
                    slot_table_of(req_to_token, table_page, "req_to_token"),
                    bs,
                    num_tokens,
                    window,
                    padding_row};
  const DLDevice dev = plan.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  PlanForwardLaunch launch{{a, a}, static_cast<int64_t*>(tick.data_ptr()), tick.size(0)};
  if (has_reuse) {  // the reuse plan: prefix_lens = reuse_lens, no new tokens, window 0, no expected values or mask
    PlanForwardArgs& r = launch.args[1];
    r.plan = static_cast<int64_t*>(reuse_plan.data_ptr());
    r.status = static_cast<int64_t*>(reuse_status.data_ptr());
    r.prefix_lens = static_cast<const int64_t*>(reuse_lens.data_ptr());
    r.extend_lens = nullptr;
    r.expect_prefix = nullptr;
    r.expect_new = nullptr;
    r.flag_mask = nullptr;
    r.window = 0;
  }
  // The narrowest block that holds the batch (up to kPlanThreads): a block scan's barriers and per-warp sums grow with
  // its warps, and the plan is two such scans on a decode step's critical path.
  const auto go = [&](auto kernel, int threads) {
    launch_kernel(kernel, has_reuse ? 2 : 1, threads, stream_of(dev), dev.device_id, launch);
  };
  if (bs <= 64) {
    go(plan_forward_kernel<64>, 64);
  } else if (bs <= 128) {
    go(plan_forward_kernel<128>, 128);
  } else if (bs <= 256) {
    go(plan_forward_kernel<256>, 256);
  } else {
    go(plan_forward_kernel<kPlanThreads>, kPlanThreads);
  }
}

void plan_sweep(TensorView plan, TensorView status, TensorView slots, TensorView starts, TensorView lens,
                TensorView first_positions, TensorView prev_slots, TensorView expect_end, int64_t has_expect_end) {
  const int64_t n = check_chain_arrays(plan, "plan", starts, "starts",
                                       {{&lens, "lens"}, {&first_positions, "first_positions"},
                                        {&prev_slots, "prev_slots"}});
  check_sweep_plan_out(plan, status, slots, n);
  check_optional(expect_end, has_expect_end, plan, n, "expect_end", "plan");
  const SweepArrays chains{static_cast<const int64_t*>(starts.data_ptr()), static_cast<const int64_t*>(lens.data_ptr()),
                           static_cast<const int64_t*>(first_positions.data_ptr()),
                           static_cast<const int64_t*>(prev_slots.data_ptr()),
                           has_expect_end ? static_cast<const int64_t*>(expect_end.data_ptr()) : nullptr};
  launch_sweep_plan(plan, status, chains, n, slots.size(0), has_expect_end != 0);
}

void derive_roll(TensorView slots, TensorView lens, TensorView inv, TensorView ends, int64_t num_slot_ids) {
  check_derive_roll_args(kDLCUDA, slots, lens, inv, ends, num_slot_ids);
  const int64_t N = slots.size(0), n = lens.size(0);
  const DLDevice dev = slots.device();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const cudaStream_t stream = stream_of(dev);
  if (N > 0) {
    const int64_t grid =
        std::min<int64_t>(ceil_div(N, kPlanThreads), 8 * static_cast<int64_t>(sm_count(dev.device_id)));
    launch_kernel(derive_inv_kernel, static_cast<unsigned>(grid), kPlanThreads, stream, dev.device_id,
                  static_cast<const int64_t*>(slots.data_ptr()), N, static_cast<int64_t*>(inv.data_ptr()),
                  num_slot_ids);
  }
  if (n > 0) {
    launch_kernel(derive_ends_kernel, 1, kPlanThreads, stream, dev.device_id,
                  static_cast<const int64_t*>(lens.data_ptr()), n, static_cast<int64_t*>(ends.data_ptr()));
  }
}

void plan_roll(TensorView plan, TensorView status, TensorView chain_out, TensorView slots, TensorView starts,
               TensorView lens, TensorView ends, TensorView first_positions, TensorView prev_slots, TensorView unlocked,
               int64_t has_unlocked, TensorView inv, int64_t num_slot_ids, int64_t cursor) {
  check_i64_tensor(chain_out, plan, 1, "chain_out", "plan");
  const int64_t width = chain_out.size(0);
  check_sweep_plan_out(plan, status, slots, width);
  const RollSource src = roll_source(slots, starts, lens, ends, first_positions, prev_slots, unlocked, has_unlocked,
                                     inv, num_slot_ids, cursor);
  launch_sweep_plan(plan, status, RollChains{src, cursor, static_cast<int64_t*>(chain_out.data_ptr())}, width,
                    slots.size(0), false);
}

}  // namespace cuda
}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan_forward, kvcanary::cuda::plan_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan_sweep, kvcanary::cuda::plan_sweep);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(derive_roll, kvcanary::cuda::derive_roll);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan_roll, kvcanary::cuda::plan_roll);
