// GENERATED from schema/canary.toml by codegen/ -- do not edit. Regenerate: python -m codegen  (or: nox -s generate)
// kvcanary schema v1: constants, enums, table columns and record structs for C++ and CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvcanary {
namespace schema {

constexpr int32_t kSchemaVersion = 1;

// Why a check failed (bit flags).
enum class FailReason : int64_t {
  VERIFY_CHAIN = 1,  // stored prev_hash differs from the link value recomputed from the predecessor record (or the anchor)
  VERIFY_POSITION = 2,  // stored position differs from the position the plan expects at this slot
  VERIFY_FINGERPRINT = 4,  // stored fingerprint differs from a fresh fingerprint of the slot's real K/V bytes
  WRITE_TOKEN = 8,  // a written token differs from token truth (expected-token pool, or expected chain value after the new tokens)
  WRITE_POSITION = 16,  // a written position is not previous + 1 (chain-position assert) or not prefix_len + j (input assert)
  VERIFY_TOKEN = 32,  // stored token differs from token truth (expected-token pool, or expected chain value at the prefix boundary)
  INPUT_ERROR = 64,  // a device-side input value was out of range (slot, token, position); the entry was skipped, never accessed
  STRUCTURAL = 128,  // a write's slot breaks the batch's structure: out_cache_loc differs from the slot req_to_token maps for the entry's (row, position), or a padding token writes a slot that is not reserved
};

// When a canary launch runs.
enum class Stage : int32_t {
  HEAD = 0,  // before the model forward; no fingerprints (new KV not yet written)
  TAIL = 1,  // after the model forward; fingerprints the real KV
  SWEEP = 2,  // periodic verify-only pass over the prefix cache, on TAIL buffers
};

// Which half of the KV a buffer guards.
enum class Half : int32_t {
  K = 0,  // keys
  V = 1,  // values (absent for MLA-like pools)
};

// Pool group a buffer belongs to.
enum class Group : int32_t {
  FULL = 0,  // full-attention pool
  SWA = 1,  // sliding-window pool, reached through the full->SWA slot map
};

// How many bytes of each source row a fingerprint reads.
enum class FingerprintMode : int32_t {
  NONE = 0,  // no fingerprint (field stays 0)
  PARTIAL = 1,  // the first PARTIAL_READ_BYTES bytes of the row (at most READ_BYTES)
  ALL = 2,  // read_bytes of the row (the whole token row by default)
};

// Where the kernels get the request's true tokens from.
enum class TokenTruth : int32_t {
  OFF = 0,  // no token truth: self-consistent wrong chains go unnoticed
  CHAIN = 1,  // expected chain values per request (default, O(1) per request)
  POOL = 2,  // expected-token pool, compared per verified entry
};

// How a bound op's argument follows the batch shape its stage sequence is called with (docs/ops-contract.md 9).
enum class ShapedArg : int32_t {
  BATCH_ROWS = 1,  // a tensor cut to the batch's rows along its first dimension
  PLAN_ROWS = 2,  // a tensor cut to max(rows, 1) rows (a plan sized to the batch)
  TOKENS = 3,  // a tensor cut to the batch's new tokens along its first dimension
  NUM_TOKENS = 4,  // an integer argument replaced by the batch's new tokens
};

// Bits of the plan's FLAGS column.
enum class PlanFlag : int64_t {
  FIRST_IS_HEAD = 1,  // the first verified entry is a chain head: check prev_hash against the anchor
  SEED_IS_HEAD = 2,  // the write starts a chain: seed from the anchor
  EXPECT_PREFIX = 4,  // EXPECT_PREFIX is valid
  EXPECT_NEW = 8,  // EXPECT_NEW is valid
  PADDING = 16,  // a padding row's write segment: no verify range, nothing written; its tokens may write only reserved slots
};

// Optional checks and options of a write launch.
enum class WriteCheck : int64_t {
  CHAIN_POSITION = 1,  // each written position is the previous one + 1
  INPUTS = 2,  // positions equal prefix_len + j; tokens equal the expected-token pool
  STRUCTURAL = 4,  // out_cache_loc equals req_to_token[row, prefix_len + j]; padding tokens write only reserved slots (rows tagged with half 0)
  RECORD_CARRIES = 8,  // not a check: keep each entry's chain carry in the carries tensor (CUDA scan path; docs/ops-contract.md 5)
  REUSE_CARRIES = 16,  // not a check: take the chain carries a RECORD_CARRIES write of the same step and inputs kept, instead of scanning
};

// {Stage} x {Half} x {Group}: stamped into violation rows, row index of the counters.
enum class LaunchTag : int32_t {
  HEAD_K_FULL = 0,
  HEAD_V_FULL = 1,
  TAIL_K_FULL = 2,
  TAIL_V_FULL = 3,
  SWEEP_K_FULL = 4,
  SWEEP_V_FULL = 5,
  HEAD_K_SWA = 6,
  HEAD_V_SWA = 7,
  TAIL_K_SWA = 8,
  TAIL_V_SWA = 9,
  SWEEP_K_SWA = 10,
  SWEEP_V_SWA = 11,
};
constexpr int32_t kNumLaunchTags = 12;

// One row of the violation ring.
enum class ViolationCol : int32_t {
  TAG = 0,  // LaunchTag of the launch that found it
  REASONS = 1,  // FailReason bits
  SLOT = 2,  // slot in the group's pool (the raw bad value for INPUT_ERROR; the table-space out_cache_loc for STRUCTURAL)
  POSITION = 3,  // position the plan expected at this slot
  STORED_POSITION = 4,  // position stored in the record
  BATCH_INDEX = 5,  // request index in the batch (chain index for sweeps)
  REQ_ROW = 6,  // row of the slot table (req_to_token) the entry came from
  STORED_TOKEN = 7,  // token stored in the record (written token for write checks)
  EXPECTED_TOKEN = 8,  // token truth, or SKIP_TOKEN when not known
  STORED_HASH = 9,  // stored prev_hash (chain checks) or computed chain value (boundary checks)
  EXPECTED_HASH = 10,  // recomputed link / expected chain value
  STORED_FP = 11,  // stored fingerprint
  EXPECTED_FP = 12,  // fresh fingerprint (0 when not computed)
  STEP = 13,  // value of the step counter when found
  EXPECTED_SLOT = 14,  // STRUCTURAL rows: the table-space slot req_to_token maps for (REQ_ROW, POSITION), NO_SLOT for a padding token (only reserved slots allowed); NO_SLOT in other rows
};
constexpr int32_t kNumViolationCols = 15;

// Per-launch-tag health counters: counters[tag, column].
enum class CounterCol : int32_t {
  VERIFY_RUNS = 0,  // verify launches for this tag
  WRITE_RUNS = 1,  // write launches for this tag
  ENTRIES_CHECKED = 2,  // records verified
  ENTRIES_WRITTEN = 3,  // records written
  VIOLATIONS = 4,  // violation rows produced (exact, also when the ring dropped them)
  INPUT_ERRORS = 5,  // entries skipped because an input value was out of range
  SKIPPED = 6,  // entries not checked by design (reserved slot, evicted SWA slot)
};
constexpr int32_t kNumCounterCols = 7;

// One planned segment (a request's verify range and write segment, or one sweep chain).
enum class PlanCol : int32_t {
  BATCH_INDEX = 0,  // request index in the batch (chain index for sweeps)
  ROW = 1,  // row of the slot table
  IDX_BEGIN = 2,  // first verified index in the row
  IDX_END = 3,  // end of the verified indices (exclusive)
  POS_SHIFT = 4,  // position of index i is i + POS_SHIFT
  ENTRY_OFFSET = 5,  // exclusive prefix sum of verify lengths over planned segments
  FIRST_PREV_SLOT = 6,  // table-space slot of the predecessor of IDX_BEGIN (unused when FLAG_FIRST_IS_HEAD)
  WRITE_BEGIN = 7,  // flat token index of the first new token
  WRITE_LEN = 8,  // number of new tokens
  SEED_SLOT = 9,  // table-space slot whose record seeds the write (unused when FLAG_SEED_IS_HEAD)
  PREFIX_LEN = 10,  // tokens already in the KV before this forward
  EXPECT_PREFIX = 11,  // expected chain value after the prefix (valid with FLAG_EXPECT_PREFIX)
  EXPECT_NEW = 12,  // expected chain value after the new tokens (valid with FLAG_EXPECT_NEW)
  FLAGS = 13,  // PlanFlag bits
};
constexpr int32_t kNumPlanCols = 14;

// Device-side counts written by a plan launch.
enum class PlanStatusCol : int32_t {
  NUM_SEGMENTS = 0,  // planned segments (rows of the plan that are valid)
  VERIFY_ENTRIES = 1,  // sum of verify lengths
  WRITE_ENTRIES = 2,  // sum of write lengths
  INPUT_ERRORS = 3,  // requests/chains skipped for out-of-range values
  OVERFLOW = 4,  // 1 when the batch claims more tokens or slots than exist
};
constexpr int32_t kNumPlanStatusCols = 5;

// One entry of a write's carries (docs/ops-contract.md 5): a long write's exclusive chain carry, kept by the HEAD write for the TAIL write of the same forward. Row 0 of a carries tensor is its header (CarryHeaderCol); entry e is row 1 + e.
enum class CarryCol : int32_t {
  MUL = 0,  // affine chain map of the segment's earlier entries: multiplier (u64 bit-cast)
  ADD = 1,  // that map's addend (u64 bit-cast)
  LAST_J = 2,  // index in the segment of the last earlier written entry (-1 = none)
  SEGMENT = 3,  // plan row of the entry
  J = 4,  // index of the entry inside its segment
  K = 5,  // its flat token index, WRITE_BEGIN + J (the reader loads the token beside the plan row)
};
constexpr int32_t kNumCarryCols = 6;

// Row 0 of a carries tensor (columns < NUM_CARRY_COLS).
enum class CarryHeaderCol : int32_t {
  ARMED = 0,  // 1 when the rows hold every entry of the last recording write, 0 otherwise
  STEP = 1,  // the sink step of that write: only a write of the same step reuses the rows
  TOTAL = 2,  // entries recorded
  DONE = 3,  // blocks of the reusing launch that have read the header (its last one disarms)
};
constexpr int32_t kNumCarryHeaderCols = 4;

// One real-KV source of a fingerprint: a layer tensor viewed as byte rows.
enum class FpSourceCol : int32_t {
  PTR = 0,  // data pointer (validated and kept alive by the Python side)
  ROW_STRIDE = 1,  // bytes between consecutive pages (rows)
  PAGE_SIZE = 2,  // slots per row
  BYTES_PER_TOKEN = 3,  // bytes of one slot inside a row
  READ_BYTES = 4,  // bytes hashed in ALL mode (<= BYTES_PER_TOKEN; PARTIAL hashes at most this many; 0 = none)
};
constexpr int32_t kNumFpSourceCols = 5;

// Column index of a table enum, for indexing int64 rows.
template <typename E>
constexpr int32_t col(E e) { return static_cast<int32_t>(e); }
// Bit value of a flag enum.
template <typename E>
constexpr int64_t bits(E e) { return static_cast<int64_t>(e); }

// Hash constants (u64).
constexpr uint64_t SPLITMIX_MUL1 = 0xBF58476D1CE4E5B9ULL;  // splitmix64 finalizer multiplier 1
constexpr uint64_t SPLITMIX_MUL2 = 0x94D049BB133111EBULL;  // splitmix64 finalizer multiplier 2
constexpr uint64_t CHAIN_ANCHOR = 0x6B7663616E617279ULL;  // h_0 = splitmix64(CHAIN_ANCHOR)
constexpr uint64_t CHAIN_SEED = 0x4B56636861696E21ULL;  // g(t, p) = splitmix64(((p << 32) | t) ^ CHAIN_SEED)
constexpr uint64_t CHAIN_BASE = 0x9E3779B97F4A7C15ULL;  // h_{k+1} = h_k * CHAIN_BASE + g(t_k, p_k); odd, so invertible
constexpr uint64_t FP_SEED = 0x2545F4914F6CDD1DULL;  // word key base: key(j, i) = FP_SEED + ((j << 32) + i) * FP_GAMMA
constexpr uint64_t FP_GAMMA = 0xD1B54A32D192ED03ULL;  // odd word-key step
constexpr uint64_t FP_POS_SEED = 0x632BE59BD9B4E019ULL;  // fp = splitmix64(acc ^ splitmix64(position ^ FP_POS_SEED))

// Sentinels.
constexpr int64_t NO_SLOT = -1;  // no slot: skipped write, chain head, padding
constexpr int64_t SKIP_TOKEN = -1;  // token not known / not to be checked

// Layout sizes.
constexpr int64_t RECORD_BYTES = 32LL;  // bytes of one canary record
constexpr int64_t RECORD_ALIGN = 8LL;  // alignment of a record and of the record stride
constexpr int64_t FP_ALIGN_BYTES = 16LL;  // fingerprint rows, strides and read sizes are multiples of this (16-byte loads)
constexpr int64_t PARTIAL_READ_BYTES = 16LL;  // bytes read per source row in PARTIAL mode
constexpr int64_t TOKEN_LIMIT = 2147483648LL;  // tokens and positions must lie in [0, TOKEN_LIMIT)
constexpr int64_t MAX_HALVES = 2LL;  // halves per buffer (K, V)
constexpr int64_t STAGE_INLINE_ROWS = 64LL;  // CUDA begin_decode: a batch of at most this many rows carries its staging rows in the launch's parameters, not in pinned memory
constexpr int64_t INVALIDATE_INLINE_SLOTS = 960LL;  // CUDA invalidate of a host slot list: slots carried per launch in its parameters (int32, under the 4 KiB parameter limit)

// Default capacities and intervals.
constexpr int64_t DEFAULT_RING_CAPACITY = 1024LL;  // violation rows kept per reporting window
constexpr int64_t DEFAULT_REQ_CAPACITY = 1024LL;  // requests per forward the plan is sized for
constexpr int64_t DEFAULT_SWEEP_CAPACITY = 65536LL;  // cached chains one sweep plan holds
constexpr int64_t DEFAULT_SWEEP_SLICE = 512LL;  // rolling sweep: cached slots verified per forward (every cached slot within ceil(num_slots / slice) forwards)
constexpr int64_t DEFAULT_SWEEP_ROLL_INTERVAL = 4LL;  // rolling sweep: forwards between slices; a slice walks interval x SWEEP_SLICE slot ids (one export and one launch group per slice, the same rate)
constexpr int64_t DEFAULT_STATS_INTERVAL = 100LL;  // forwards between stats lines
constexpr int64_t DEFAULT_FP_LAYER_STRIDE = 1LL;  // source j is hashed at position p iff (j + p) % stride == 0

// Canary record kept beside one KV slot for one (stage, half).
struct alignas(RECORD_ALIGN) CanaryRecord {
  int64_t token;  // token id whose KV was written to the slot
  int64_t position;  // sequence position of that token
  int64_t prev_hash;  // chain value h_k of the history before this token (u64 bit-cast)
  int64_t kv_fingerprint;  // fingerprint of the slot's real K or V bytes; 0 when not fingerprinted
};
static_assert(sizeof(CanaryRecord) == RECORD_BYTES, "record size");
static_assert(offsetof(CanaryRecord, token) == 0, "record offset of token");
static_assert(offsetof(CanaryRecord, position) == 8, "record offset of position");
static_assert(offsetof(CanaryRecord, prev_hash) == 16, "record offset of prev_hash");
static_assert(offsetof(CanaryRecord, kv_fingerprint) == 24, "record offset of kv_fingerprint");

// One row of the violation ring.
struct ViolationRow {
  int64_t tag;  // LaunchTag of the launch that found it
  int64_t reasons;  // FailReason bits
  int64_t slot;  // slot in the group's pool (the raw bad value for INPUT_ERROR; the table-space out_cache_loc for STRUCTURAL)
  int64_t position;  // position the plan expected at this slot
  int64_t stored_position;  // position stored in the record
  int64_t batch_index;  // request index in the batch (chain index for sweeps)
  int64_t req_row;  // row of the slot table (req_to_token) the entry came from
  int64_t stored_token;  // token stored in the record (written token for write checks)
  int64_t expected_token;  // token truth, or SKIP_TOKEN when not known
  int64_t stored_hash;  // stored prev_hash (chain checks) or computed chain value (boundary checks)
  int64_t expected_hash;  // recomputed link / expected chain value
  int64_t stored_fp;  // stored fingerprint
  int64_t expected_fp;  // fresh fingerprint (0 when not computed)
  int64_t step;  // value of the step counter when found
  int64_t expected_slot;  // STRUCTURAL rows: the table-space slot req_to_token maps for (REQ_ROW, POSITION), NO_SLOT for a padding token (only reserved slots allowed); NO_SLOT in other rows
};
static_assert(sizeof(ViolationRow) == 15 * sizeof(int64_t), "violation row size");
static_assert(offsetof(ViolationRow, tag) == 0, "violation offset of tag");
static_assert(offsetof(ViolationRow, reasons) == 8, "violation offset of reasons");
static_assert(offsetof(ViolationRow, slot) == 16, "violation offset of slot");
static_assert(offsetof(ViolationRow, position) == 24, "violation offset of position");
static_assert(offsetof(ViolationRow, stored_position) == 32, "violation offset of stored_position");
static_assert(offsetof(ViolationRow, batch_index) == 40, "violation offset of batch_index");
static_assert(offsetof(ViolationRow, req_row) == 48, "violation offset of req_row");
static_assert(offsetof(ViolationRow, stored_token) == 56, "violation offset of stored_token");
static_assert(offsetof(ViolationRow, expected_token) == 64, "violation offset of expected_token");
static_assert(offsetof(ViolationRow, stored_hash) == 72, "violation offset of stored_hash");
static_assert(offsetof(ViolationRow, expected_hash) == 80, "violation offset of expected_hash");
static_assert(offsetof(ViolationRow, stored_fp) == 88, "violation offset of stored_fp");
static_assert(offsetof(ViolationRow, expected_fp) == 96, "violation offset of expected_fp");
static_assert(offsetof(ViolationRow, step) == 104, "violation offset of step");
static_assert(offsetof(ViolationRow, expected_slot) == 112, "violation offset of expected_slot");

}  // namespace schema
}  // namespace kvcanary
