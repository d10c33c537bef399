// Verify (docs/ops-contract.md 4): per-segment and per-entry checks shared by the CPU loop and the CUDA kernels.
#pragma once

#include "fingerprint.cuh"
#include "plan.cuh"
#include "resolve.cuh"
#include "sink.cuh"

namespace kvcanary {

// Expected-token pool; tokens == nullptr means no pool.
struct TokenPoolView {
  const int64_t* tokens;  // [rows, cols]
  const int64_t* lens;    // [rows]
  int64_t rows;
  int64_t cols;
  int64_t offset;
};

// Fingerprint sources; mode NONE (table == nullptr) means no fingerprint.
struct FpView {
  const int64_t* table;  // [H, n_sources, NUM_FP_SOURCE_COLS]
  int64_t n_sources;
  int32_t mode;
  int64_t layer_stride;
  int64_t share;  // a power of two >= 1: the share of entries whose fingerprint is checked (verify_fp_selected)
};

// Everything one verify call reads (records [num_slots, halves, RECORD_NUM_FIELDS]) and where it reports.
struct VerifyParams {
  const int64_t* records;
  int64_t halves;
  GroupView group;
  SlotTable table;
  int64_t tags[MAX_HALVES];
  SinkView sink;
  TokenPoolView pool;
  FpView fp;
};

KVC_HD const CanaryRecord* record_at(const int64_t* records, int64_t halves, int64_t slot, int64_t half) {
  return reinterpret_cast<const CanaryRecord*>(records) + (slot * halves + half);
}

// link(rec) = rec.prev_hash * CHAIN_BASE + g(rec.token, rec.position); false when the record has no link.
KVC_HD bool record_link(const CanaryRecord& rec, uint64_t* out) {
  if (!chain_value_ok(rec.token) || !chain_value_ok(rec.position)) return false;
  *out = chain_step(static_cast<uint64_t>(rec.prev_hash), rec.token, rec.position);
  return true;
}

KVC_HD bool verify_wants_fp(const VerifyParams& P) {
  return P.fp.mode != static_cast<int32_t>(FingerprintMode::NONE);
}

// Whether entry (segment, position)'s fingerprint is checked under the share S = P.fp.share (a power of two):
// (position + PREFIX_LEN) % S == 0. A decoding request's PREFIX_LEN grows by one per forward, so each of its read
// slots comes round once in any S consecutive forwards of it. Masking with S - 1 equals the u64 remainder, and is
// the same on int64 in every backend (two's complement), whatever the signs.
KVC_HD bool verify_fp_selected(const VerifyParams& P, const int64_t* seg, int64_t position) {
  const uint64_t key = static_cast<uint64_t>(position) + static_cast<uint64_t>(seg[col(PlanCol::PREFIX_LEN)]);
  return (key & static_cast<uint64_t>(P.fp.share - 1)) == 0;
}

// A segment verify can read without going out of bounds: ROW in the table, 0 <= IDX_BEGIN <= IDX_END <= cols.
// Plans from plan_forward/plan_sweep always pass; a bad one (a plan paired with another table) is skipped whole
// and reported by verify_emit_bad_segment.
KVC_HD bool verify_segment_ok(const VerifyParams& P, const int64_t* seg) {
  const int64_t row = seg[col(PlanCol::ROW)], b = seg[col(PlanCol::IDX_BEGIN)], e = seg[col(PlanCol::IDX_END)];
  return row >= 0 && row < P.table.rows && b >= 0 && b <= e && e <= P.table.cols;
}

// One INPUT_ERROR row per half for a bad segment: SLOT = NO_SLOT, POSITION = 0, the request columns; the caller
// counts INPUT_ERRORS += 1 per half.
KVC_HD void verify_emit_bad_segment(const VerifyParams& P, const int64_t* seg) {
  for (int64_t h = 0; h < P.halves; ++h) {
    Violation v;
    v[ViolationCol::TAG] = P.tags[h];
    v[ViolationCol::REASONS] = bits(FailReason::INPUT_ERROR);
    v[ViolationCol::SLOT] = NO_SLOT;
    v[ViolationCol::BATCH_INDEX] = seg[col(PlanCol::BATCH_INDEX)];
    v[ViolationCol::REQ_ROW] = seg[col(PlanCol::ROW)];
    emit(P.sink, v);
  }
}

// Where entry idx of a (valid) segment lives and what its chain predecessor is.
struct VerifyEntry {
  Resolved slot;     // kOk: check; kEvicted/kReserved: SKIPPED; kInputError: INPUT_ERROR row (slot = bad value)
  int64_t position;  // idx + POS_SHIFT (wrapping)
  bool has_pred;     // the link check runs (anchor, or a predecessor that resolved kOk)
  bool anchor;       // the expected prev_hash is h_0
  int64_t pred_slot; // group slot of the predecessor when has_pred && !anchor
};

KVC_HD VerifyEntry verify_locate(const VerifyParams& P, const int64_t* seg, int64_t idx) {
  const int64_t row = seg[col(PlanCol::ROW)], begin = seg[col(PlanCol::IDX_BEGIN)];
  VerifyEntry e;
  e.slot = resolve_slot(P.group, P.table.at(row, idx));
  e.position = wrap_add(idx, seg[col(PlanCol::POS_SHIFT)]);
  e.anchor = idx == begin && (seg[col(PlanCol::FLAGS)] & bits(PlanFlag::FIRST_IS_HEAD)) != 0;
  e.has_pred = e.anchor;
  e.pred_slot = NO_SLOT;
  if (!e.anchor) {
    const int64_t pt = idx > begin ? P.table.at(row, idx - 1) : seg[col(PlanCol::FIRST_PREV_SLOT)];
    const Resolved pr = resolve_slot(P.group, pt);  // silently: a predecessor that does not resolve skips the link
    if (pr.status == SlotStatus::kOk) {
      e.has_pred = true;
      e.pred_slot = pr.slot;
    }
  }
  return e;
}

// INPUT_ERROR rows (one per half) for an entry whose slot did not resolve; the caller counts INPUT_ERRORS.
KVC_HD void verify_emit_input_error(const VerifyParams& P, const int64_t* seg, const VerifyEntry& e) {
  for (int64_t h = 0; h < P.halves; ++h) {
    Violation v;
    v[ViolationCol::TAG] = P.tags[h];
    v[ViolationCol::REASONS] = bits(FailReason::INPUT_ERROR);
    v[ViolationCol::SLOT] = e.slot.slot;
    v[ViolationCol::POSITION] = e.position;
    v[ViolationCol::BATCH_INDEX] = seg[col(PlanCol::BATCH_INDEX)];
    v[ViolationCol::REQ_ROW] = seg[col(PlanCol::ROW)];
    emit(P.sink, v);
  }
}

// The fingerprint check of verify_check_record: selected (mode, share) and the stored value differs from `fp` (0 for
// a position outside [0, TOKEN_LIMIT)).
KVC_HD bool verify_fp_fails(const VerifyParams& P, const int64_t* seg, const VerifyEntry& e, const CanaryRecord& rec,
                            uint64_t fp) {
  if (!verify_wants_fp(P) || !verify_fp_selected(P, seg, e.position)) return false;
  return static_cast<uint64_t>(rec.kv_fingerprint) != (chain_value_ok(e.position) ? fp : 0);
}

// Whether two records agree on every field verify_check_record checks except the fingerprint: then, given equal
// predecessor links (verify_same_pred), their checks have the same outcome but for VERIFY_FINGERPRINT.
KVC_HD bool same_chain_fields(const CanaryRecord& a, const CanaryRecord& b) {
  return a.token == b.token && a.position == b.position && a.prev_hash == b.prev_hash;
}

// Whether the predecessor links the link check would compare against are the same for both halves.
KVC_HD bool verify_same_pred(const VerifyEntry& e, const bool pred_ok[2], const uint64_t pred_link[2]) {
  if (!e.has_pred || e.anchor) return true;  // no predecessor link is read
  return pred_ok[0] == pred_ok[1] && (!pred_ok[0] || pred_link[0] == pred_link[1]);
}

// Checks of one kOk entry for half h; `fp` is the fresh fingerprint of (slot, position, h) when verify_wants_fp and
// verify_fp_selected (computed by the caller: serially on the CPU, per lane or block-cooperatively on the GPU),
// ignored otherwise (no fingerprint check, EXPECTED_FP = 0) and replaced by 0 when the position is outside
// [0, TOKEN_LIMIT) (the caller need not compute it there). Emits a row when
// a check fails; returns the reasons. The caller counts ENTRIES_CHECKED.
//
// Chain-type reasons: the link check fails with VERIFY_CHAIN (a predecessor without a link expects 0 and always
// fails); the prefix-boundary check (EXPECT_PREFIX, last index) fails with VERIFY_TOKEN when link(rec) differs,
// and with VERIFY_CHAIN when the record itself has no link. STORED_HASH is link(rec) only when the boundary
// mismatch is the sole chain-type failure, else rec.prev_hash; EXPECTED_HASH is the expected link when the link
// check failed, else EXPECT_PREFIX for a boundary mismatch, else 0.
//
// verify_check_record is the same check given the entry's record `rec` and, when e.has_pred && !e.anchor, the
// predecessor's link (`pred_ok` false: the predecessor has no link); the CUDA kernel passes both from registers.
KVC_HD int64_t verify_check_record(const VerifyParams& P, const int64_t* seg, int64_t idx, const VerifyEntry& e,
                                   int64_t h, const CanaryRecord& rec, bool pred_ok, uint64_t pred_link, uint64_t fp) {
  const int64_t r_token = rec.token, r_pos = rec.position, r_prev = rec.prev_hash, r_fp = rec.kv_fingerprint;
  const int64_t row = seg[col(PlanCol::ROW)];
  int64_t reasons = 0;
  if (r_pos != e.position) reasons |= bits(FailReason::VERIFY_POSITION);

  bool chain_bad = false;
  uint64_t chain_expected = 0;
  if (e.has_pred) {
    bool ok = true;
    if (e.anchor) {
      chain_expected = chain_h0();
    } else {
      ok = pred_ok;
      chain_expected = ok ? pred_link : 0;
    }
    chain_bad = !ok || static_cast<uint64_t>(r_prev) != chain_expected;
  }
  if (chain_bad) reasons |= bits(FailReason::VERIFY_CHAIN);

  bool bnd_mismatch = false;
  uint64_t own_link = 0;
  if ((seg[col(PlanCol::FLAGS)] & bits(PlanFlag::EXPECT_PREFIX)) != 0 && idx == seg[col(PlanCol::IDX_END)] - 1) {
    if (!record_link(rec, &own_link)) {
      reasons |= bits(FailReason::VERIFY_CHAIN);
    } else if (own_link != static_cast<uint64_t>(seg[col(PlanCol::EXPECT_PREFIX)])) {
      bnd_mismatch = true;
      reasons |= bits(FailReason::VERIFY_TOKEN);
    }
  }

  int64_t expected_token = SKIP_TOKEN;
  if (P.pool.tokens != nullptr && row < P.pool.rows) {
    const int64_t q = wrap_add(e.position, P.pool.offset);
    if (q >= 0 && q < P.pool.lens[row] && q < P.pool.cols) {
      expected_token = P.pool.tokens[row * P.pool.cols + q];
      if (r_token != expected_token) reasons |= bits(FailReason::VERIFY_TOKEN);
    }
  }

  const bool want_fp = verify_wants_fp(P) && verify_fp_selected(P, seg, e.position);
  if (!chain_value_ok(e.position)) fp = 0;  // as the fingerprint op: a position outside [0, TOKEN_LIMIT) hashes to 0
  if (verify_fp_fails(P, seg, e, rec, fp)) reasons |= bits(FailReason::VERIFY_FINGERPRINT);

  if (reasons != 0) {
    Violation v;
    v[ViolationCol::TAG] = P.tags[h];
    v[ViolationCol::REASONS] = reasons;
    v[ViolationCol::SLOT] = e.slot.slot;
    v[ViolationCol::POSITION] = e.position;
    v[ViolationCol::STORED_POSITION] = r_pos;
    v[ViolationCol::BATCH_INDEX] = seg[col(PlanCol::BATCH_INDEX)];
    v[ViolationCol::REQ_ROW] = row;
    v[ViolationCol::STORED_TOKEN] = r_token;
    v[ViolationCol::EXPECTED_TOKEN] = expected_token;
    v[ViolationCol::STORED_HASH] = (bnd_mismatch && !chain_bad) ? static_cast<int64_t>(own_link) : r_prev;
    v[ViolationCol::EXPECTED_HASH] = chain_bad      ? static_cast<int64_t>(chain_expected)
                                     : bnd_mismatch ? seg[col(PlanCol::EXPECT_PREFIX)]
                                                    : 0;
    v[ViolationCol::STORED_FP] = r_fp;
    v[ViolationCol::EXPECTED_FP] = want_fp ? static_cast<int64_t>(fp) : 0;
    emit(P.sink, v);
  }
  return reasons;
}

KVC_HD int64_t verify_check_half(const VerifyParams& P, const int64_t* seg, int64_t idx, const VerifyEntry& e,
                                 int64_t h, uint64_t fp) {
  uint64_t pred_link = 0;
  const bool pred_ok = e.has_pred && !e.anchor &&
                       record_link(*record_at(P.records, P.halves, e.pred_slot, h), &pred_link);
  return verify_check_record(P, seg, idx, e, h, *record_at(P.records, P.halves, e.slot.slot, h), pred_ok, pred_link,
                             fp);
}

}  // namespace kvcanary
