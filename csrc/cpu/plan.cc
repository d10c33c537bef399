// CPU entry points of the plan ops (docs/ops-contract.md 2-3). Native signatures (identical in csrc/cuda/plan.cu):
//   plan_forward(plan, status, req_pool_indices, prefix_lens, extend_lens, req_to_token,
//                expect_prefix, has_expect_prefix, expect_new, has_expect_new, flag_mask, has_flag_mask, num_tokens,
//                window, padding_row, table_page, reuse_plan, reuse_status, reuse_lens, has_reuse, tick)
//     (all scalars and has_* flags int64)
//     plan int64 [cap, NUM_PLAN_COLS], status int64 [NUM_PLAN_STATUS_COLS] (overwritten), req_pool_indices /
//     prefix_lens / extend_lens int64 [bs] (cap >= bs), req_to_token int32|int64 [R, L], expect_* and flag_mask
//     int64 [bs] or a 0-element int64 tensor with has_* = 0 (flag_mask: request i's rows get FLAGS &= flag_mask[i]); num_tokens >= 0, window >= 0, padding_row >= -1, table_page >= 1
//     (slots per table entry: 1 = req_to_token, else a block table with slot = table[r, c / page] * page + c % page);
//     has_reuse: reuse_plan int64 [cap >= bs, NUM_PLAN_COLS] / reuse_status [NUM_PLAN_STATUS_COLS] also receive the
//     plan of (req_pool_indices, prefix_lens = reuse_lens int64 [bs], no new tokens, window 0, no expected values, no
//     flag mask), in the same call (0-element int64 tensors when has_reuse = 0); tick int64 [k]: each element += 1 once
//     per call (k = 0: none; the pre stage's step and phase counter).
//   plan_sweep(plan, status, slots, starts, lens, first_positions, prev_slots, expect_end, has_expect_end)
//     slots int64 [N]; starts / lens / first_positions / prev_slots int64 [n] (cap >= n); expect_end int64 [n] or
//     a 0-element int64 tensor with has_expect_end = 0.
//   derive_roll(slots, lens, inv, ends, num_slot_ids)
//     what plan_roll needs of a new export (docs/ops-contract.md 3a): slots int64 [N], lens / ends int64 [n] (ends
//     written), inv int64 [>= num_slot_ids] (inv[slots[k]] = k where 0 <= slots[k] < num_slot_ids; the rest kept).
//   plan_roll(plan, status, chain_out, slots, starts, lens, ends, first_positions, prev_slots, unlocked, has_unlocked,
//             inv, num_slot_ids, cursor)
//     a rolling-sweep slice of width W = len(chain_out) (docs/ops-contract.md 3a): chain_out int64 [W] (written),
//     slots int64 [N], starts / lens / ends / first_positions / prev_slots int64 [n], unlocked int64 [n] or empty
//     with has_unlocked = 0, inv int64 [>= num_slot_ids], num_slot_ids >= 1, 0 <= cursor < num_slot_ids; cap >= W.
#include <tvm/ffi/function.h>

#include "core/plan.cuh"
#include "core/roll_args.h"
#include "core/tensor_checks.h"

namespace kvcanary {

namespace {

void set_status(int64_t* st, int64_t segments, int64_t verify_entries, int64_t write_entries, int64_t errors,
                int64_t overflow) {
  st[col(PlanStatusCol::NUM_SEGMENTS)] = segments;
  st[col(PlanStatusCol::VERIFY_ENTRIES)] = verify_entries;
  st[col(PlanStatusCol::WRITE_ENTRIES)] = write_entries;
  st[col(PlanStatusCol::INPUT_ERRORS)] = errors;
  st[col(PlanStatusCol::OVERFLOW)] = overflow;
}

// The sweep plan of chains 0..n-1 given by chain(c) (docs/ops-contract.md 3): invalid chains are counted, the others
// become segments in order.
template <typename ChainAt>
void fill_sweep(TensorView plan, TensorView status, int64_t n, int64_t num_slots, bool has_expect_end,
                ChainAt chain) {
  auto* out = static_cast<int64_t*>(plan.data_ptr());
  int64_t segments = 0, verify_entries = 0, errors = 0;
  for (int64_t c = 0; c < n; ++c) {
    const SweepChain ch = chain(c);
    if (!plan_sweep_valid(ch.start, ch.len, ch.first_position, num_slots)) {
      ++errors;
      continue;
    }
    plan_sweep_fill(out + segments * kNumPlanCols, c, ch.start, ch.len, ch.first_position, ch.prev_slot,
                    verify_entries, has_expect_end, ch.expect_end);
    verify_entries += ch.len;
    ++segments;
  }
  set_status(static_cast<int64_t*>(status.data_ptr()), segments, verify_entries, 0, errors, 0);
}

// One plan_forward over bs requests into out/st; ext == nullptr: every request has 0 new tokens; ep / en / mask ==
// nullptr: absent.
void plan_forward_loop(int64_t* out, int64_t* st, const int64_t* rpi, const int64_t* pre, const int64_t* ext_or_null,
                       int64_t bs, const SlotTable& table, int64_t num_tokens, int64_t window, int64_t padding_row,
                       const int64_t* ep, const int64_t* en, const int64_t* mask) {
  int64_t tok = 0, segments = 0, verify_entries = 0, write_entries = 0, errors = 0, overflow = 0;
  for (int64_t i = 0; i < bs; ++i) {
    const int64_t wb = tok, ext = ext_or_null != nullptr ? ext_or_null[i] : 0;
    tok = plan_token_cap(tok + plan_token_term(ext, num_tokens), num_tokens);
    const int64_t flag_mask = mask != nullptr ? mask[i] : kKeepAllFlags;
    switch (plan_forward_classify(rpi[i], pre[i], ext, wb, table.rows, table.cols, num_tokens, padding_row)) {
      case PlanOutcome::kPadding:
        break;
      case PlanOutcome::kPaddingSegment:
        plan_forward_fill_padding(out + segments * kNumPlanCols, i, rpi[i], pre[i], ext, wb, verify_entries,
                                  flag_mask);
        write_entries += ext;
        ++segments;
        break;
      case PlanOutcome::kInputError:
        ++errors;
        break;
      case PlanOutcome::kOverflow:
        ++errors;
        overflow = 1;
        break;
      case PlanOutcome::kSegment:
        plan_forward_fill(out + segments * kNumPlanCols, i, rpi[i], pre[i], ext, wb, window, verify_entries, table,
                          ep != nullptr, ep != nullptr ? ep[i] : 0, en != nullptr, en != nullptr ? en[i] : 0,
                          flag_mask);
        verify_entries += pre[i] - plan_forward_verify_begin(pre[i], window);
        write_entries += ext;
        ++segments;
        break;
    }
  }
  set_status(st, segments, verify_entries, write_entries, errors, overflow);
}

}  // namespace

void plan_forward(TensorView plan, TensorView status, TensorView req_pool_indices, TensorView prefix_lens,
                  TensorView extend_lens, TensorView req_to_token, TensorView expect_prefix, int64_t has_expect_prefix,
                  TensorView expect_new, int64_t has_expect_new, TensorView flag_mask, int64_t has_flag_mask,
                  int64_t num_tokens, int64_t window, int64_t padding_row, int64_t table_page, TensorView reuse_plan,
                  TensorView reuse_status, TensorView reuse_lens, int64_t has_reuse, TensorView tick) {
  check_device_type(req_pool_indices, kDLCPU, "req_pool_indices");
  const int64_t bs = check_chain_arrays(req_pool_indices, "req_pool_indices", req_pool_indices, "req_pool_indices",
                                        {{&prefix_lens, "prefix_lens"}, {&extend_lens, "extend_lens"}});
  check_slot_table(req_to_token, req_pool_indices, "req_to_token", "req_pool_indices");
  check_plan_out(plan, status, req_pool_indices, "req_pool_indices", bs);
  check_optional(expect_prefix, has_expect_prefix, req_pool_indices, bs, "expect_prefix", "req_pool_indices");
  check_optional(expect_new, has_expect_new, req_pool_indices, bs, "expect_new", "req_pool_indices");
  check_optional(flag_mask, has_flag_mask, req_pool_indices, bs, "flag_mask", "req_pool_indices");
  if (has_reuse) {
    check_plan_out(reuse_plan, reuse_status, req_pool_indices, "req_pool_indices", bs);
    check_i64_tensor(reuse_lens, req_pool_indices, 1, "reuse_lens", "req_pool_indices");
    check_dim(reuse_lens, 0, bs, "reuse_lens");
  }
  check_i64_tensor(tick, req_pool_indices, 1, "tick", "req_pool_indices");
  TVM_FFI_CHECK(num_tokens >= 0, ValueError) << "num_tokens must be >= 0, got " << num_tokens;
  TVM_FFI_CHECK(window >= 0, ValueError) << "window must be >= 0, got " << window;
  TVM_FFI_CHECK(padding_row >= -1, ValueError) << "padding_row must be >= -1, got " << padding_row;

  const SlotTable table = slot_table_of(req_to_token, table_page, "req_to_token");
  const auto* rpi = static_cast<const int64_t*>(req_pool_indices.data_ptr());
  plan_forward_loop(static_cast<int64_t*>(plan.data_ptr()), static_cast<int64_t*>(status.data_ptr()), rpi,
                    static_cast<const int64_t*>(prefix_lens.data_ptr()),
                    static_cast<const int64_t*>(extend_lens.data_ptr()), bs, table, num_tokens, window, padding_row,
                    has_expect_prefix ? static_cast<const int64_t*>(expect_prefix.data_ptr()) : nullptr,
                    has_expect_new ? static_cast<const int64_t*>(expect_new.data_ptr()) : nullptr,
                    has_flag_mask ? static_cast<const int64_t*>(flag_mask.data_ptr()) : nullptr);
  if (has_reuse) {  // the reuse plan: prefix_lens = reuse_lens, no new tokens, window 0, no expected values or mask
    plan_forward_loop(static_cast<int64_t*>(reuse_plan.data_ptr()), static_cast<int64_t*>(reuse_status.data_ptr()),
                      rpi, static_cast<const int64_t*>(reuse_lens.data_ptr()), nullptr, bs, table, num_tokens, 0,
                      padding_row, nullptr, nullptr, nullptr);
  }
  auto* t = static_cast<int64_t*>(tick.data_ptr());
  for (int64_t j = 0; j < tick.size(0); ++j) ++t[j];
}

void plan_sweep(TensorView plan, TensorView status, TensorView slots, TensorView starts, TensorView lens,
                TensorView first_positions, TensorView prev_slots, TensorView expect_end, int64_t has_expect_end) {
  check_i64_tensor(slots, slots, 1, "slots", "slots");
  check_device_type(slots, kDLCPU, "slots");
  const int64_t n = check_chain_arrays(slots, "slots", starts, "starts",
                                       {{&lens, "lens"}, {&first_positions, "first_positions"},
                                        {&prev_slots, "prev_slots"}});
  check_optional(expect_end, has_expect_end, slots, n, "expect_end", "slots");
  check_plan_out(plan, status, slots, "slots", n);

  const auto* st = static_cast<const int64_t*>(starts.data_ptr());
  const auto* ln = static_cast<const int64_t*>(lens.data_ptr());
  const auto* fp = static_cast<const int64_t*>(first_positions.data_ptr());
  const auto* pv = static_cast<const int64_t*>(prev_slots.data_ptr());
  const auto* ee = static_cast<const int64_t*>(expect_end.data_ptr());
  fill_sweep(plan, status, n, slots.size(0), has_expect_end != 0, [&](int64_t c) {
    return SweepChain{st[c], ln[c], fp[c], pv[c], has_expect_end ? ee[c] : 0};
  });
}

void derive_roll(TensorView slots, TensorView lens, TensorView inv, TensorView ends, int64_t num_slot_ids) {
  check_derive_roll_args(kDLCPU, slots, lens, inv, ends, num_slot_ids);
  const auto* sl = static_cast<const int64_t*>(slots.data_ptr());
  auto* iv = static_cast<int64_t*>(inv.data_ptr());
  for (int64_t k = 0; k < slots.size(0); ++k)
    if (sl[k] >= 0 && sl[k] < num_slot_ids) iv[sl[k]] = k;
  const auto* ln = static_cast<const int64_t*>(lens.data_ptr());
  auto* en = static_cast<int64_t*>(ends.data_ptr());
  int64_t run = 0;
  for (int64_t c = 0; c < lens.size(0); ++c) en[c] = run = wrap_add(run, ln[c] > 0 ? ln[c] : 0);
}

void plan_roll(TensorView plan, TensorView status, TensorView chain_out, TensorView slots, TensorView starts,
               TensorView lens, TensorView ends, TensorView first_positions, TensorView prev_slots, TensorView unlocked,
               int64_t has_unlocked, TensorView inv, int64_t num_slot_ids, int64_t cursor) {
  check_i64_tensor(slots, slots, 1, "slots", "slots");
  check_device_type(slots, kDLCPU, "slots");
  check_i64_tensor(chain_out, slots, 1, "chain_out", "slots");
  const int64_t width = chain_out.size(0);
  const RollSource src = roll_source(slots, starts, lens, ends, first_positions, prev_slots, unlocked, has_unlocked,
                                     inv, num_slot_ids, cursor);
  check_plan_out(plan, status, slots, "slots", width);
  auto* chains = static_cast<int64_t*>(chain_out.data_ptr());
  fill_sweep(plan, status, width, slots.size(0), false, [&](int64_t i) {
    const RollEntry e = plan_roll_entry(src, cursor, i);
    chains[i] = e.chain;
    return SweepChain{e.start, e.len, e.first_position, e.prev_slot, 0};
  });
}

}  // namespace kvcanary

TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan_forward, kvcanary::plan_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan_sweep, kvcanary::plan_sweep);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(derive_roll, kvcanary::derive_roll);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan_roll, kvcanary::plan_roll);
