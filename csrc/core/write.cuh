// Per-token write logic of docs/ops-contract.md 5 and its chain-scan carry, shared by the CPU loop and CUDA kernels.
//
// Driving a write (what csrc/cpu/write.cc does serially; a CUDA kernel does the same per segment and half with a
// block scan of WriteCarry over the segment's tokens):
//   nseg = plan_num_segments(args.status, args.plan_cap)
//   for seg in [0, nseg): row = args.plan + seg * kNumPlanCols
//     if WRITE_LEN == 0: continue
//     if !write_range_ok(args, row): write_emit_range_error(args, row, h) for every half; continue
//     seed[h] = write_seed_value(args, row, h) for every half   // read before any store
//     for j in [0, WRITE_LEN): write_structural(args, row, write_entry_load(args, row, j))   // half-independent
//     for half h:
//       if !seed[h].ok: write_emit_seed_error(args, row, h); continue
//       carry = write_carry_identity(); tally = {}
//       for j in [0, WRITE_LEN):                           // exclusive scan: entry j sees carry of 0..j-1
//         e = write_entry_load(args, row, j)
//         tally += write_entry_apply(args, row, h, e, chain_apply(carry.map, seed.h), write_prev_pos(args, row, carry, seed))
//         carry = write_carry_compose(carry, write_entry_carry(e))
//       write_tally_flush(args, h, tally)
//       write_expect_new(args, row, h, chain_apply(carry.map, seed.h), carry.last_j)
//   for every half: count(sink, tag_h, WRITE_RUNS, 1)
//
// Row layout of every write violation (group space except STRUCTURAL rows; EXPECTED_SLOT = NO_SLOT unless STRUCTURAL):
//   TAG = tag_h, REASONS, SLOT = group slot (the raw bad value for slot input errors), POSITION = PREFIX_LEN + j
//   (what the plan expects), STORED_POSITION = the written position p, BATCH_INDEX, REQ_ROW = ROW, STORED_TOKEN =
//   the written token t, EXPECTED_TOKEN = pool token or SKIP_TOKEN, STORED_HASH = prev_hash written (0 when not
//   written), EXPECTED_HASH = 0, STORED_FP = fingerprint written (0 when not written), EXPECTED_FP = 0.
//   Seed error rows: SLOT = SEED_SLOT, POSITION = PREFIX_LEN - 1, STORED_POSITION/TOKEN = 0.
//   EXPECT_NEW rows: REASONS = WRITE_TOKEN, the last written entry's SLOT/POSITION/STORED_POSITION/STORED_TOKEN,
//   STORED_HASH = chain value after the segment, EXPECTED_HASH = EXPECT_NEW, STORED_FP = 0.
//   STRUCTURAL rows (WriteCheck::STRUCTURAL; tag of half 0, table space): SLOT = out_cache_loc, EXPECTED_SLOT =
//   req_to_token[ROW, PREFIX_LEN + j] (NO_SLOT for a PADDING segment), POSITION = PREFIX_LEN + j, STORED_POSITION /
//   STORED_TOKEN = the entry's position / token; not counted as INPUT_ERRORS.
//   Range error rows (a plan row whose [WRITE_BEGIN, WRITE_BEGIN + WRITE_LEN) is not inside [0, num_tokens), or
//   WRITE_LEN < 0): REASONS = INPUT_ERROR, SLOT = NO_SLOT, POSITION = PREFIX_LEN, one per half, segment not written.
// Every INPUT_ERROR row also counts INPUT_ERRORS once for its half.
#pragma once

#include "fingerprint.cuh"
#include "hash.cuh"
#include "plan.cuh"
#include "resolve.cuh"
#include "sink.cuh"
#include "tensor_checks.h"

namespace kvcanary {

// Raw, validated views of every write argument (built by the host entry).
struct WriteArgs {
  CanaryRecord* records;  // [num_slots, halves]
  int64_t halves;
  GroupView group;
  const int64_t* plan;  // [plan_cap, kNumPlanCols]
  int64_t plan_cap;
  const int64_t* status;  // [kNumPlanStatusCols]
  const int64_t* input_ids;  // [num_tokens]
  const int64_t* positions;  // [num_tokens]
  const int64_t* out_cache_loc;  // [num_tokens], table space
  int64_t num_tokens;
  SlotTable table;  // req_to_token [R, L] (read by the structural check only)
  int64_t tags[MAX_HALVES];
  SinkView sink;
  int64_t checks;  // WriteCheck bits
  const int64_t* pool_tokens;  // [pool_rows, pool_cols]; nullptr = no token pool
  const int64_t* pool_lens;  // [pool_rows]
  int64_t pool_rows;
  int64_t pool_cols;
  int64_t token_offset;
  const int64_t* fp_table;  // [halves_fp, fp_sources, kNumFpSourceCols]; nullptr = no fingerprint
  int64_t fp_sources;
  int32_t fp_mode;
  int64_t fp_layer_stride;
  int64_t* carries;  // [1 + carry_cap, kNumCarryCols] (row 0: CarryHeaderCol); nullptr unless a carry bit is set
  int64_t carry_cap;
};

KVC_HD CanaryRecord& write_record(const WriteArgs& a, int64_t slot, int64_t half) {
  return a.records[slot * a.halves + half];
}
KVC_HD int64_t plan_at(const int64_t* row, PlanCol c) { return row[col(c)]; }
KVC_HD bool plan_flag(const int64_t* row, PlanFlag f) { return (row[col(PlanCol::FLAGS)] & bits(f)) != 0; }
KVC_HD bool write_check(const WriteArgs& a, WriteCheck c) { return (a.checks & bits(c)) != 0; }

KVC_HD bool write_range_ok(const WriteArgs& a, const int64_t* row) {
  const int64_t wb = plan_at(row, PlanCol::WRITE_BEGIN), wl = plan_at(row, PlanCol::WRITE_LEN);
  return wb >= 0 && wl >= 0 && wb <= a.num_tokens && wl <= a.num_tokens - wb;
}

KVC_HD Violation write_row_base(const WriteArgs& a, const int64_t* row, int64_t half, int64_t reasons) {
  Violation v;
  v[ViolationCol::TAG] = a.tags[half];
  v[ViolationCol::REASONS] = reasons;
  v[ViolationCol::BATCH_INDEX] = plan_at(row, PlanCol::BATCH_INDEX);
  v[ViolationCol::REQ_ROW] = plan_at(row, PlanCol::ROW);
  return v;
}

KVC_HD void write_emit_input_error(const WriteArgs& a, Violation& v, int64_t half) {
  count(a.sink, a.tags[half], CounterCol::INPUT_ERRORS, 1);
  emit(a.sink, v);
}

KVC_HD void write_emit_range_error(const WriteArgs& a, const int64_t* row, int64_t half) {
  Violation v = write_row_base(a, row, half, bits(FailReason::INPUT_ERROR));
  v[ViolationCol::SLOT] = NO_SLOT;
  v[ViolationCol::POSITION] = plan_at(row, PlanCol::PREFIX_LEN);
  write_emit_input_error(a, v, half);
}

struct WriteSeed {
  bool ok;
  uint64_t h;  // chain value before the first new token
  int64_t prev_pos;  // position of the seed record (-1 for a chain head)
};

// Seed of one segment and half, without reporting (ok = false when the seed does not resolve).
KVC_HD WriteSeed write_seed_value(const WriteArgs& a, const int64_t* row, int64_t half) {
  if (plan_flag(row, PlanFlag::SEED_IS_HEAD)) return WriteSeed{true, chain_h0(), -1};
  const Resolved r = resolve_slot(a.group, plan_at(row, PlanCol::SEED_SLOT));
  if (r.status == SlotStatus::kOk) {
    const CanaryRecord& rec = write_record(a, r.slot, half);
    if (chain_value_ok(rec.token) && chain_value_ok(rec.position)) {
      return WriteSeed{true, chain_step(static_cast<uint64_t>(rec.prev_hash), rec.token, rec.position), rec.position};
    }
  }
  return WriteSeed{false, 0, 0};
}

// The INPUT_ERROR row of a seed that does not resolve.
KVC_HD void write_emit_seed_error(const WriteArgs& a, const int64_t* row, int64_t half) {
  const int64_t seed_slot = plan_at(row, PlanCol::SEED_SLOT);
  Violation v = write_row_base(a, row, half, bits(FailReason::INPUT_ERROR));
  v[ViolationCol::SLOT] = seed_slot;
  v[ViolationCol::POSITION] = plan_at(row, PlanCol::PREFIX_LEN) - 1;
  write_emit_input_error(a, v, half);
}

enum class WriteKind : int32_t { kPad = 0, kSlotError = 1, kEvicted = 2, kBadValue = 3, kWrite = 4 };

// One new token of a segment, resolved (half-independent).
struct WriteEntry {
  WriteKind kind;
  int64_t j;  // index inside the segment
  int64_t token;
  int64_t position;
  int64_t slot;  // group slot (kWrite, kBadValue) or the offending value (kSlotError)
  int64_t loc;  // out_cache_loc as given (table space)
};

// Entries of a PADDING segment are never written (kPad); only the structural check looks at them. k = WRITE_BEGIN + j
// (given apart, a reader that knows it loads the token before the plan row arrives).
KVC_HD WriteEntry write_entry_at(const WriteArgs& a, const int64_t* row, int64_t j, int64_t k) {
  const int64_t loc = a.out_cache_loc[k];
  WriteEntry e{WriteKind::kPad, j, a.input_ids[k], a.positions[k], loc, loc};
  if (loc < 0 || plan_flag(row, PlanFlag::PADDING)) return e;
  const Resolved r = resolve_slot(a.group, e.slot);
  e.slot = r.slot;
  if (r.status == SlotStatus::kInputError) {
    e.kind = WriteKind::kSlotError;
  } else if (r.status == SlotStatus::kEvicted) {
    e.kind = WriteKind::kEvicted;
  } else if (!chain_value_ok(e.token) || !chain_value_ok(e.position)) {
    e.kind = WriteKind::kBadValue;
  } else {
    e.kind = WriteKind::kWrite;
  }
  return e;
}
KVC_HD WriteEntry write_entry_load(const WriteArgs& a, const int64_t* row, int64_t j) {
  return write_entry_at(a, row, j, plan_at(row, PlanCol::WRITE_BEGIN) + j);
}

// Scan element: the affine chain map of a run of entries and the index of its last written entry (-1 = none).
struct WriteCarry {
  ChainMap map;
  int64_t last_j;
};
KVC_HD WriteCarry write_carry_identity() { return WriteCarry{chain_identity(), -1}; }
KVC_HD WriteCarry write_entry_carry(const WriteEntry& e) {
  if (e.kind != WriteKind::kWrite) return write_carry_identity();
  return WriteCarry{chain_token_map(e.token, e.position), e.j};
}
// "first then second" (associative).
KVC_HD WriteCarry write_carry_compose(const WriteCarry& first, const WriteCarry& second) {
  return WriteCarry{chain_compose(first.map, second.map), second.last_j >= 0 ? second.last_j : first.last_j};
}
// Position of the previous written entry of the segment (or of the seed) given the exclusive carry.
KVC_HD int64_t write_prev_pos(const WriteArgs& a, const int64_t* row, const WriteCarry& exclusive,
                              const WriteSeed& seed) {
  return exclusive.last_j >= 0 ? a.positions[plan_at(row, PlanCol::WRITE_BEGIN) + exclusive.last_j] : seed.prev_pos;
}

// The structural check of one entry (half-independent, reported with the tag of half 0): a request's entry must
// write the slot req_to_token maps for (ROW, PREFIX_LEN + j); a PADDING segment's entry only a slot that resolves
// reserved (or evicted: the group holds none there). Skipped entries (loc < 0) write nothing and pass; a table cell
// outside the table (a plan not from plan_forward) is not checked.
KVC_HD void write_structural(const WriteArgs& a, const int64_t* row, const WriteEntry& e) {
  if (!write_check(a, WriteCheck::STRUCTURAL) || e.loc < 0) return;
  const int64_t idx = plan_at(row, PlanCol::PREFIX_LEN) + e.j;
  int64_t expected = NO_SLOT;
  if (plan_flag(row, PlanFlag::PADDING)) {
    const SlotStatus st = resolve_slot(a.group, e.loc).status;
    if (st == SlotStatus::kReserved || st == SlotStatus::kEvicted) return;
  } else {
    const int64_t r = plan_at(row, PlanCol::ROW);
    if (r < 0 || r >= a.table.rows || idx < 0 || idx >= a.table.cols) return;
    expected = a.table.at(r, idx);
    if (expected == e.loc) return;
  }
  Violation v = write_row_base(a, row, 0, bits(FailReason::STRUCTURAL));
  v[ViolationCol::SLOT] = e.loc;
  v[ViolationCol::EXPECTED_SLOT] = expected;
  v[ViolationCol::POSITION] = idx;
  v[ViolationCol::STORED_POSITION] = e.position;
  v[ViolationCol::STORED_TOKEN] = e.token;
  emit(a.sink, v);
}

// Per-half counter increments of a run of entries (flushed once per run by the caller: one atomic per nonzero count).
struct WriteTally {
  int64_t written;
  int64_t input_errors;
  int64_t skipped;
};
KVC_HD WriteTally write_tally_add(WriteTally x, WriteTally y) {
  return WriteTally{x.written + y.written, x.input_errors + y.input_errors, x.skipped + y.skipped};
}
KVC_HD void write_tally_flush(const WriteArgs& a, int64_t half, const WriteTally& t) {
  count(a.sink, a.tags[half], CounterCol::ENTRIES_WRITTEN, t.written);
  count(a.sink, a.tags[half], CounterCol::INPUT_ERRORS, t.input_errors);
  count(a.sink, a.tags[half], CounterCol::SKIPPED, t.skipped);
}

// Expected token of the pool at position p of the segment's row, or SKIP_TOKEN when the pool does not cover it.
KVC_HD int64_t write_pool_token(const WriteArgs& a, const int64_t* row, int64_t p) {
  if (a.pool_tokens == nullptr) return SKIP_TOKEN;
  const int64_t r = plan_at(row, PlanCol::ROW);
  if (r < 0 || r >= a.pool_rows) return SKIP_TOKEN;
  const int64_t i = p + a.token_offset;
  if (i < 0 || i >= a.pool_lens[r] || i >= a.pool_cols) return SKIP_TOKEN;
  return a.pool_tokens[r * a.pool_cols + i];
}

// Handle one entry for one half: store the record (h_before = chain value before it, prev_pos = previous written
// position, fp = its fingerprint, 0 without sources) and emit its row if a check fails; non-written kinds emit/count
// their skip. Returns the counts.
KVC_HD WriteTally write_entry_store(const WriteArgs& a, const int64_t* row, int64_t half, const WriteEntry& e,
                                    uint64_t h_before, int64_t prev_pos, uint64_t fp) {
  if (e.kind == WriteKind::kPad) return WriteTally{0, 0, 0};
  if (e.kind == WriteKind::kEvicted) return WriteTally{0, 0, 1};
  const int64_t expected_pos = plan_at(row, PlanCol::PREFIX_LEN) + e.j;
  Violation v = write_row_base(a, row, half, 0);
  v[ViolationCol::SLOT] = e.slot;
  v[ViolationCol::POSITION] = expected_pos;
  v[ViolationCol::STORED_POSITION] = e.position;
  v[ViolationCol::STORED_TOKEN] = e.token;
  if (e.kind != WriteKind::kWrite) {  // kSlotError, kBadValue
    v[ViolationCol::REASONS] = bits(FailReason::INPUT_ERROR);
    emit(a.sink, v);
    return WriteTally{0, 1, 0};
  }
  int64_t reasons = 0;
  if (write_check(a, WriteCheck::CHAIN_POSITION) && e.position != prev_pos + 1) reasons |= bits(FailReason::WRITE_POSITION);
  int64_t expected_token = SKIP_TOKEN;
  if (write_check(a, WriteCheck::INPUTS)) {
    if (e.position != expected_pos) reasons |= bits(FailReason::WRITE_POSITION);
    expected_token = write_pool_token(a, row, e.position);
    if (expected_token != SKIP_TOKEN && e.token != expected_token) reasons |= bits(FailReason::WRITE_TOKEN);
  }
  write_record(a, e.slot, half) = CanaryRecord{e.token, e.position, static_cast<int64_t>(h_before),
                                               static_cast<int64_t>(fp)};
  if (reasons != 0) {
    v[ViolationCol::REASONS] = reasons;
    v[ViolationCol::EXPECTED_TOKEN] = expected_token;
    v[ViolationCol::STORED_HASH] = static_cast<int64_t>(h_before);
    v[ViolationCol::STORED_FP] = static_cast<int64_t>(fp);
    emit(a.sink, v);
  }
  return WriteTally{1, 0, 0};
}

// write_entry_store with the fingerprint computed serially (the CPU loop).
KVC_HD WriteTally write_entry_apply(const WriteArgs& a, const int64_t* row, int64_t half, const WriteEntry& e,
                                    uint64_t h_before, int64_t prev_pos) {
  const uint64_t fp = (a.fp_table == nullptr || e.kind != WriteKind::kWrite)
                          ? 0
                          : fingerprint_serial(a.fp_table, a.fp_sources, half, e.slot, e.position, a.fp_mode,
                                               a.fp_layer_stride);
  return write_entry_store(a, row, half, e, h_before, prev_pos, fp);
}

// The EXPECT_NEW boundary check of one segment and half: h_end = chain value after it, last_j = its last written
// entry (-1 = nothing written: no check).
KVC_HD void write_expect_new(const WriteArgs& a, const int64_t* row, int64_t half, uint64_t h_end, int64_t last_j) {
  if (!plan_flag(row, PlanFlag::EXPECT_NEW) || last_j < 0) return;
  const int64_t want = plan_at(row, PlanCol::EXPECT_NEW);
  if (static_cast<int64_t>(h_end) == want) return;
  const WriteEntry e = write_entry_load(a, row, last_j);
  Violation v = write_row_base(a, row, half, bits(FailReason::WRITE_TOKEN));
  v[ViolationCol::SLOT] = e.slot;
  v[ViolationCol::POSITION] = plan_at(row, PlanCol::PREFIX_LEN) + last_j;
  v[ViolationCol::STORED_POSITION] = e.position;
  v[ViolationCol::STORED_TOKEN] = e.token;
  v[ViolationCol::STORED_HASH] = static_cast<int64_t>(h_end);
  v[ViolationCol::EXPECTED_HASH] = want;
  emit(a.sink, v);
}

// The serial write of one segment with len > 0 entries and a valid range (the CPU backend's loop; on CUDA, one
// thread's segment of a decode-sized write); its counts are added to tally.
KVC_HD void write_segment_serial(const WriteArgs& a, const int64_t* row, int64_t len,
                                 WriteTally (&tally)[MAX_HALVES]) {
  // Every half's seed record is read first, before anything can be stored (a store in between would order the next
  // load after it): their loads overlap. A half's stores never touch another half's records, so the values are those
  // of the one-half-at-a-time loop.
  WriteSeed seeds[MAX_HALVES];
  for (int h = 0; h < MAX_HALVES; ++h) seeds[h] = h < a.halves ? write_seed_value(a, row, h) : WriteSeed{false, 0, 0};
  if (write_check(a, WriteCheck::STRUCTURAL)) {
    for (int64_t j = 0; j < len; ++j) write_structural(a, row, write_entry_load(a, row, j));
  }
  for (int64_t h = 0; h < a.halves; ++h) {
    const WriteSeed seed = h == 0 ? seeds[0] : seeds[1];  // selects: a runtime index would put seeds in local memory
    if (!seed.ok) {
      write_emit_seed_error(a, row, h);
      continue;
    }
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

// Host checks of every write argument and the raw view the per-token logic runs on (shared by CPU and CUDA).
inline WriteArgs make_write_args(TensorView records, TensorView swa_map, int64_t is_swa, int64_t reserved_slots,
                                 int64_t tag0, int64_t tag1, TensorView plan, TensorView status, TensorView table,
                                 TensorView input_ids, TensorView positions, TensorView out_cache_loc,
                                 TensorView ring_rows, TensorView ring_count, TensorView counters, TensorView step,
                                 int64_t checks, TensorView pool_tokens, TensorView pool_lens, int64_t has_pool,
                                 int64_t token_offset, TensorView fp_table, int64_t fp_mode, int64_t fp_layer_stride,
                                 int64_t table_page, TensorView carries) {
  static_assert(kNumCarryHeaderCols <= kNumCarryCols, "the carries header lives in row 0");
  check_i64_tensor(records, records, 3, "records", "records");
  constexpr int64_t kFields = static_cast<int64_t>(sizeof(CanaryRecord) / sizeof(int64_t));
  TVM_FFI_CHECK(records.size(2) == kFields && (records.size(1) == 1 || records.size(1) == MAX_HALVES), ValueError)
      << "records must be [num_slots, 1|2, " << kFields << "]";
  const int64_t num_slots = records.size(0), halves = records.size(1);
  check_plan_status(plan, status, records, "records");
  check_slot_table(table, records, "table", "records");
  check_i64_tensor(input_ids, records, 1, "input_ids", "records");
  const int64_t num_tokens = input_ids.size(0);
  check_i64_tensor(positions, records, 1, "positions", "records");
  check_dim(positions, 0, num_tokens, "positions");
  check_i64_tensor(out_cache_loc, records, 1, "out_cache_loc", "records");
  check_dim(out_cache_loc, 0, num_tokens, "out_cache_loc");
  check_i64_tensor(swa_map, records, 1, "swa_map", "records");
  TVM_FFI_CHECK(reserved_slots >= 0 && reserved_slots <= num_slots, ValueError)
      << "reserved_slots must be in [0, " << num_slots << "], got " << reserved_slots;
  const int64_t tags[2] = {tag0, tag1};
  for (int64_t hh = 0; hh < halves; ++hh) {
    TVM_FFI_CHECK(tags[hh] >= 0 && tags[hh] < kNumLaunchTags, ValueError)
        << "launch tag of half " << hh << " (" << tags[hh] << ") out of range";
  }
  check_sink(ring_rows, ring_count, counters, step, records, "records");
  check_i64_tensor(pool_tokens, records, has_pool ? 2 : pool_tokens.ndim(), "pool_tokens", "records");
  check_i64_tensor(pool_lens, records, 1, "pool_lens", "records");
  if (has_pool) {
    check_dim(pool_lens, 0, pool_tokens.size(0), "pool_lens");
    TVM_FFI_CHECK(token_offset >= 0, ValueError) << "token_offset must be >= 0, got " << token_offset;
  }
  const bool has_fp = fp_mode != static_cast<int64_t>(FingerprintMode::NONE);
  if (has_fp) {
    TVM_FFI_CHECK(fp_mode == static_cast<int64_t>(FingerprintMode::PARTIAL) ||
                      fp_mode == static_cast<int64_t>(FingerprintMode::ALL),
                  ValueError)
        << "fingerprint mode " << fp_mode << " is not a FingerprintMode";
    TVM_FFI_CHECK(fp_layer_stride >= 1, ValueError) << "fp_layer_stride must be >= 1, got " << fp_layer_stride;
    check_i64_tensor(fp_table, records, 3, "fp_table", "records");
    TVM_FFI_CHECK(fp_table.size(0) >= halves && fp_table.size(2) == kNumFpSourceCols && fp_table.size(1) >= 1,
                  ValueError)
        << "fp_table must be [H >= " << halves << ", n >= 1, " << kNumFpSourceCols << "]";
  }
  const bool record = (checks & bits(WriteCheck::RECORD_CARRIES)) != 0;
  const bool reuse = (checks & bits(WriteCheck::REUSE_CARRIES)) != 0;
  TVM_FFI_CHECK(!(record && reuse), ValueError) << "checks: RECORD_CARRIES and REUSE_CARRIES exclude each other";
  check_i64_tensor(carries, records, record || reuse ? 2 : carries.ndim(), "carries", "records");
  if (record || reuse) {
    TVM_FFI_CHECK(carries.size(0) >= 1 && carries.size(1) == kNumCarryCols, ValueError)
        << "carries must be [1 + entries, " << kNumCarryCols << "] with the carry bits";
  }
  WriteArgs a{};
  a.records = static_cast<CanaryRecord*>(records.data_ptr());
  a.halves = halves;
  a.group = GroupView{num_slots, reserved_slots, is_swa ? static_cast<const int64_t*>(swa_map.data_ptr()) : nullptr,
                      is_swa ? swa_map.size(0) : 0};
  a.plan = static_cast<const int64_t*>(plan.data_ptr());
  a.plan_cap = plan.size(0);
  a.status = static_cast<const int64_t*>(status.data_ptr());
  a.input_ids = static_cast<const int64_t*>(input_ids.data_ptr());
  a.positions = static_cast<const int64_t*>(positions.data_ptr());
  a.out_cache_loc = static_cast<const int64_t*>(out_cache_loc.data_ptr());
  a.num_tokens = num_tokens;
  a.table = slot_table_of(table, table_page, "table");
  a.tags[0] = tag0;
  a.tags[1] = tag1;
  a.sink = SinkView{static_cast<int64_t*>(ring_rows.data_ptr()), static_cast<int64_t*>(ring_count.data_ptr()),
                    ring_rows.size(0), static_cast<int64_t*>(counters.data_ptr()),
                    static_cast<const int64_t*>(step.data_ptr())};
  a.checks = checks;
  a.pool_tokens = has_pool ? static_cast<const int64_t*>(pool_tokens.data_ptr()) : nullptr;
  a.pool_lens = has_pool ? static_cast<const int64_t*>(pool_lens.data_ptr()) : nullptr;
  a.pool_rows = has_pool ? pool_tokens.size(0) : 0;
  a.pool_cols = has_pool ? pool_tokens.size(1) : 0;
  a.token_offset = token_offset;
  a.fp_table = has_fp ? static_cast<const int64_t*>(fp_table.data_ptr()) : nullptr;
  a.fp_sources = has_fp ? fp_table.size(1) : 0;
  a.fp_mode = static_cast<int32_t>(fp_mode);
  a.fp_layer_stride = fp_layer_stride;
  a.carries = record || reuse ? static_cast<int64_t*>(carries.data_ptr()) : nullptr;
  a.carry_cap = record || reuse ? carries.size(0) - 1 : 0;
  return a;
}

}  // namespace kvcanary
