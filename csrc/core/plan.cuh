// Plan segments (docs/ops-contract.md 2-3): per-request / per-chain classification and row filling, shared by CPU and CUDA.
#pragma once

#include "resolve.cuh"

namespace kvcanary {

// kPadding: a padding row that contributes nothing; kPaddingSegment: a padding row whose tokens get a PADDING
// segment (their slots are structurally checked by the write, nothing is verified or written).
enum class PlanOutcome : int32_t { kSegment = 0, kPadding = 1, kInputError = 2, kOverflow = 3, kPaddingSegment = 4 };

// A request's contribution to the running token offset: max(ext, 0) capped at num_tokens + 1. The contract's
// offset is an unbounded sum; capping each term and the running sum at num_tokens + 1 changes no outcome (any
// offset past num_tokens overflows every later request) and keeps every scan free of wrap-around.
KVC_HD int64_t plan_token_term(int64_t ext, int64_t num_tokens) {
  return ext < 0 ? 0 : (ext > num_tokens + 1 ? num_tokens + 1 : ext);
}
KVC_HD int64_t plan_token_cap(int64_t tok, int64_t num_tokens) { return tok > num_tokens + 1 ? num_tokens + 1 : tok; }

// What request i becomes, given its write begin wb (the capped running offset before it).
KVC_HD PlanOutcome plan_forward_classify(int64_t row, int64_t pre, int64_t ext, int64_t wb, int64_t num_rows,
                                         int64_t row_len, int64_t num_tokens, int64_t padding_row) {
  if (padding_row >= 0 && row == padding_row) {
    const bool tokens_ok = row < num_rows && ext > 0 && ext <= num_tokens - wb;
    return tokens_ok ? PlanOutcome::kPaddingSegment : PlanOutcome::kPadding;
  }
  if (row < 0 || row >= num_rows || pre < 0 || ext < 0 || pre > row_len || ext > row_len - pre)
    return PlanOutcome::kInputError;
  if (ext > num_tokens - wb) return PlanOutcome::kOverflow;
  return PlanOutcome::kSegment;
}

// First verified index of a valid request: the last `window` positions of the prefix (window 0 = all).
KVC_HD int64_t plan_forward_verify_begin(int64_t pre, int64_t window) {
  return (window > 0 && pre > window) ? pre - window : 0;
}

// The flag mask of a forward plan without one: every flag kept.
constexpr int64_t kKeepAllFlags = -1;

// Fill one plan row (NUM_PLAN_COLS int64) for a request classified kSegment; its FLAGS are ANDed with flag_mask.
KVC_HD void plan_forward_fill(int64_t* out, int64_t i, int64_t row, int64_t pre, int64_t ext, int64_t wb,
                              int64_t window, int64_t entry_offset, const SlotTable& table, bool has_expect_prefix,
                              int64_t expect_prefix, bool has_expect_new, int64_t expect_new, int64_t flag_mask) {
  const int64_t vb = plan_forward_verify_begin(pre, window);
  int64_t flags = 0;
  if (vb == 0) flags |= bits(PlanFlag::FIRST_IS_HEAD);
  if (pre == 0) flags |= bits(PlanFlag::SEED_IS_HEAD);
  if (has_expect_prefix) flags |= bits(PlanFlag::EXPECT_PREFIX);
  if (has_expect_new) flags |= bits(PlanFlag::EXPECT_NEW);
  out[col(PlanCol::BATCH_INDEX)] = i;
  out[col(PlanCol::ROW)] = row;
  out[col(PlanCol::IDX_BEGIN)] = vb;
  out[col(PlanCol::IDX_END)] = pre;
  out[col(PlanCol::POS_SHIFT)] = 0;
  out[col(PlanCol::ENTRY_OFFSET)] = entry_offset;
  out[col(PlanCol::FIRST_PREV_SLOT)] = vb > 0 ? table.at(row, vb - 1) : NO_SLOT;
  out[col(PlanCol::WRITE_BEGIN)] = wb;
  out[col(PlanCol::WRITE_LEN)] = ext;
  out[col(PlanCol::SEED_SLOT)] = pre > 0 ? table.at(row, pre - 1) : NO_SLOT;
  out[col(PlanCol::PREFIX_LEN)] = pre;
  out[col(PlanCol::EXPECT_PREFIX)] = has_expect_prefix ? expect_prefix : 0;
  out[col(PlanCol::EXPECT_NEW)] = has_expect_new ? expect_new : 0;
  out[col(PlanCol::FLAGS)] = flags & flag_mask;
}

// Fill one plan row for a padding row classified kPaddingSegment (no verify range, no seed, no expectations).
KVC_HD void plan_forward_fill_padding(int64_t* out, int64_t i, int64_t row, int64_t pre, int64_t ext, int64_t wb,
                                      int64_t entry_offset, int64_t flag_mask) {
  out[col(PlanCol::BATCH_INDEX)] = i;
  out[col(PlanCol::ROW)] = row;
  out[col(PlanCol::IDX_BEGIN)] = 0;
  out[col(PlanCol::IDX_END)] = 0;
  out[col(PlanCol::POS_SHIFT)] = 0;
  out[col(PlanCol::ENTRY_OFFSET)] = entry_offset;
  out[col(PlanCol::FIRST_PREV_SLOT)] = NO_SLOT;
  out[col(PlanCol::WRITE_BEGIN)] = wb;
  out[col(PlanCol::WRITE_LEN)] = ext;
  out[col(PlanCol::SEED_SLOT)] = NO_SLOT;
  out[col(PlanCol::PREFIX_LEN)] = pre;
  out[col(PlanCol::EXPECT_PREFIX)] = 0;
  out[col(PlanCol::EXPECT_NEW)] = 0;
  out[col(PlanCol::FLAGS)] =
      (bits(PlanFlag::FIRST_IS_HEAD) | bits(PlanFlag::SEED_IS_HEAD) | bits(PlanFlag::PADDING)) & flag_mask;
}

// A sweep chain is planned iff its range lies in the flat slots [0, n) and its first position is >= 0.
KVC_HD bool plan_sweep_valid(int64_t start, int64_t len, int64_t first_position, int64_t n) {
  return start >= 0 && len >= 0 && start <= n && len <= n - start && first_position >= 0;
}

// Wrapping int64 add (u64 semantics, identical to torch's int64 arithmetic).
KVC_HD int64_t wrap_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}
KVC_HD int64_t wrap_sub(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b));
}

// Fill one plan row for a valid sweep chain c.
KVC_HD void plan_sweep_fill(int64_t* out, int64_t c, int64_t start, int64_t len, int64_t first_position,
                            int64_t prev_slot, int64_t entry_offset, bool has_expect_end, int64_t expect_end) {
  int64_t flags = 0;
  if (prev_slot == NO_SLOT) flags |= bits(PlanFlag::FIRST_IS_HEAD);
  if (has_expect_end) flags |= bits(PlanFlag::EXPECT_PREFIX);
  out[col(PlanCol::BATCH_INDEX)] = c;
  out[col(PlanCol::ROW)] = 0;
  out[col(PlanCol::IDX_BEGIN)] = start;
  out[col(PlanCol::IDX_END)] = start + len;
  out[col(PlanCol::POS_SHIFT)] = first_position - start;
  out[col(PlanCol::ENTRY_OFFSET)] = entry_offset;
  out[col(PlanCol::FIRST_PREV_SLOT)] = prev_slot;
  out[col(PlanCol::WRITE_BEGIN)] = 0;
  out[col(PlanCol::WRITE_LEN)] = 0;
  out[col(PlanCol::SEED_SLOT)] = NO_SLOT;
  out[col(PlanCol::PREFIX_LEN)] = wrap_add(first_position, len);
  out[col(PlanCol::EXPECT_PREFIX)] = has_expect_end ? expect_end : 0;
  out[col(PlanCol::EXPECT_NEW)] = 0;
  out[col(PlanCol::FLAGS)] = flags;
}

// One entry of a rolling-sweep slice (docs/ops-contract.md 3a) as a sweep chain: a single cached slot, or an empty
// chain (len 0) when the slot id holds no eligible cached slot. `chain` is the export chain it belongs to, -1 if none.
struct RollEntry {
  int64_t start, len, first_position, prev_slot, chain;
};

// Read-only views of the export a slice is planned from. inv[s] (s < m) is the flat export index of table slot s
// (< 0: not cached), taken only where slots[inv[s]] == s (an entry an earlier export left is harmless, so deriving inv
// from a new export need not clear it); ends[c] is the running sum of max(lens, 0) through chain c. Chains must lie
// back to back (starts[c] = ends[c] - max(lens[c], 0)): an index inside a chain that does not is not eligible, nor one
// of a locked chain when `unlocked` is given (non-zero = unlocked). Every read stays inside its array whatever the
// values.
struct RollSource {
  const int64_t* inv;
  int64_t m;  // table slot ids: inv has at least m entries
  const int64_t* slots;
  int64_t n_slots;
  const int64_t* starts;
  const int64_t* lens;
  const int64_t* ends;
  const int64_t* first_positions;
  const int64_t* prev_slots;
  const int64_t* unlocked;  // nullptr: every chain is eligible
  int64_t n;                // chains
};

// Entry i of the slice starting at table slot id `cursor` (0 <= cursor < m): slot id (cursor + i) mod m.
KVC_HD RollEntry plan_roll_entry(const RollSource& src, int64_t cursor, int64_t i) {
  const RollEntry none{0, 0, 0, NO_SLOT, -1};
  const int64_t s = (cursor + i) % src.m, k = src.inv[s];
  if (k < 0 || k >= src.n_slots || src.slots[k] != s || src.n == 0) return none;
  int64_t lo = 0, hi = src.n;  // first chain whose end lies past k
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (src.ends[mid] > k) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  if (lo == src.n) return none;
  const int64_t c = lo, len = src.lens[c] > 0 ? src.lens[c] : 0, start = src.starts[c];
  if (start < 0 || start != wrap_sub(src.ends[c], len) || k < start) return none;
  if (src.unlocked != nullptr && src.unlocked[c] == 0) return none;
  const int64_t off = k - start;
  return RollEntry{k, 1, wrap_add(src.first_positions[c], off), off > 0 ? src.slots[k - 1] : src.prev_slots[c], c};
}

// Planned segments a consumer may read: status NUM_SEGMENTS clamped to [0, capacity].
KVC_HD int64_t plan_num_segments(const int64_t* status, int64_t capacity) {
  const int64_t n = status[col(PlanStatusCol::NUM_SEGMENTS)];
  return n < 0 ? 0 : (n > capacity ? capacity : n);
}

// The segment holding flat verify entry e: the last segment with ENTRY_OFFSET <= e (binary search; offsets are
// non-decreasing in a plan produced by plan_forward/plan_sweep). Returns -1 when num_segments == 0.
KVC_HD int64_t plan_segment_of_entry(const int64_t* plan, int64_t num_segments, int64_t e) {
  int64_t lo = 0, hi = num_segments - 1, found = -1;
  while (lo <= hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (plan[mid * kNumPlanCols + col(PlanCol::ENTRY_OFFSET)] <= e) {
      found = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return found;
}

}  // namespace kvcanary
