# GENERATED from schema/canary.toml by codegen/ -- do not edit. Regenerate: python -m codegen  (or: nox -s generate)
"""kvcanary schema v1: enums, flags, table columns, constants and the record layout."""

from __future__ import annotations

from enum import IntEnum, IntFlag
from typing import Final

SCHEMA_VERSION: Final = 1


class FailReason(IntFlag):
    """Why a check failed (bit flags)."""

    VERIFY_CHAIN = 1  # stored prev_hash differs from the link value recomputed from the predecessor record (or the anchor)
    VERIFY_POSITION = 2  # stored position differs from the position the plan expects at this slot
    VERIFY_FINGERPRINT = 4  # stored fingerprint differs from a fresh fingerprint of the slot's real K/V bytes
    WRITE_TOKEN = 8  # a written token differs from token truth (expected-token pool, or expected chain value after the new tokens)
    WRITE_POSITION = 16  # a written position is not previous + 1 (chain-position assert) or not prefix_len + j (input assert)
    VERIFY_TOKEN = 32  # stored token differs from token truth (expected-token pool, or expected chain value at the prefix boundary)
    INPUT_ERROR = 64  # a device-side input value was out of range (slot, token, position); the entry was skipped, never accessed
    STRUCTURAL = 128  # a write's slot breaks the batch's structure: out_cache_loc differs from the slot req_to_token maps for the entry's (row, position), or a padding token writes a slot that is not reserved


FAIL_REASON_DOCS: Final[dict[FailReason, str]] = {
    FailReason.VERIFY_CHAIN: 'stored prev_hash differs from the link value recomputed from the predecessor record (or the anchor)',
    FailReason.VERIFY_POSITION: 'stored position differs from the position the plan expects at this slot',
    FailReason.VERIFY_FINGERPRINT: "stored fingerprint differs from a fresh fingerprint of the slot's real K/V bytes",
    FailReason.WRITE_TOKEN: 'a written token differs from token truth (expected-token pool, or expected chain value after the new tokens)',
    FailReason.WRITE_POSITION: 'a written position is not previous + 1 (chain-position assert) or not prefix_len + j (input assert)',
    FailReason.VERIFY_TOKEN: 'stored token differs from token truth (expected-token pool, or expected chain value at the prefix boundary)',
    FailReason.INPUT_ERROR: 'a device-side input value was out of range (slot, token, position); the entry was skipped, never accessed',
    FailReason.STRUCTURAL: "a write's slot breaks the batch's structure: out_cache_loc differs from the slot req_to_token maps for the entry's (row, position), or a padding token writes a slot that is not reserved",
}


class Stage(IntEnum):
    """When a canary launch runs."""

    HEAD = 0  # before the model forward; no fingerprints (new KV not yet written)
    TAIL = 1  # after the model forward; fingerprints the real KV
    SWEEP = 2  # periodic verify-only pass over the prefix cache, on TAIL buffers


class Half(IntEnum):
    """Which half of the KV a buffer guards."""

    K = 0  # keys
    V = 1  # values (absent for MLA-like pools)


class Group(IntEnum):
    """Pool group a buffer belongs to."""

    FULL = 0  # full-attention pool
    SWA = 1  # sliding-window pool, reached through the full->SWA slot map


class FingerprintMode(IntEnum):
    """How many bytes of each source row a fingerprint reads."""

    NONE = 0  # no fingerprint (field stays 0)
    PARTIAL = 1  # the first PARTIAL_READ_BYTES bytes of the row (at most READ_BYTES)
    ALL = 2  # read_bytes of the row (the whole token row by default)


class TokenTruth(IntEnum):
    """Where the kernels get the request's true tokens from."""

    OFF = 0  # no token truth: self-consistent wrong chains go unnoticed
    CHAIN = 1  # expected chain values per request (default, O(1) per request)
    POOL = 2  # expected-token pool, compared per verified entry


class ShapedArg(IntEnum):
    """How a bound op's argument follows the batch shape its stage sequence is called with (docs/ops-contract.md 9)."""

    BATCH_ROWS = 1  # a tensor cut to the batch's rows along its first dimension
    PLAN_ROWS = 2  # a tensor cut to max(rows, 1) rows (a plan sized to the batch)
    TOKENS = 3  # a tensor cut to the batch's new tokens along its first dimension
    NUM_TOKENS = 4  # an integer argument replaced by the batch's new tokens


class PlanFlag(IntFlag):
    """Bits of the plan's FLAGS column."""

    FIRST_IS_HEAD = 1  # the first verified entry is a chain head: check prev_hash against the anchor
    SEED_IS_HEAD = 2  # the write starts a chain: seed from the anchor
    EXPECT_PREFIX = 4  # EXPECT_PREFIX is valid
    EXPECT_NEW = 8  # EXPECT_NEW is valid
    PADDING = 16  # a padding row's write segment: no verify range, nothing written; its tokens may write only reserved slots


class WriteCheck(IntFlag):
    """Optional checks and options of a write launch."""

    CHAIN_POSITION = 1  # each written position is the previous one + 1
    INPUTS = 2  # positions equal prefix_len + j; tokens equal the expected-token pool
    STRUCTURAL = 4  # out_cache_loc equals req_to_token[row, prefix_len + j]; padding tokens write only reserved slots (rows tagged with half 0)
    RECORD_CARRIES = 8  # not a check: keep each entry's chain carry in the carries tensor (CUDA scan path; docs/ops-contract.md 5)
    REUSE_CARRIES = 16  # not a check: take the chain carries a RECORD_CARRIES write of the same step and inputs kept, instead of scanning


class LaunchTag(IntEnum):
    """{Stage} x {Half} x {Group}: stamped into violation rows, row index of the counters."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11

    @property
    def stage(self) -> Stage:
        """The stage this tag names."""
        return _TAG_PARTS[self][0]

    @property
    def half(self) -> Half:
        """The half this tag names."""
        return _TAG_PARTS[self][1]

    @property
    def group(self) -> Group:
        """The group this tag names."""
        return _TAG_PARTS[self][2]

    @classmethod
    def of(cls, stage: Stage, half: Half, group: Group) -> LaunchTag:
        """The tag for one (stage, half, group)."""
        return _TAG_OF[(stage, half, group)]


NUM_LAUNCH_TAGS: Final = 12
_TAG_PARTS: Final[dict[LaunchTag, tuple[Stage, Half, Group]]] = {
    LaunchTag.HEAD_K_FULL: (Stage.HEAD, Half.K, Group.FULL),
    LaunchTag.HEAD_V_FULL: (Stage.HEAD, Half.V, Group.FULL),
    LaunchTag.TAIL_K_FULL: (Stage.TAIL, Half.K, Group.FULL),
    LaunchTag.TAIL_V_FULL: (Stage.TAIL, Half.V, Group.FULL),
    LaunchTag.SWEEP_K_FULL: (Stage.SWEEP, Half.K, Group.FULL),
    LaunchTag.SWEEP_V_FULL: (Stage.SWEEP, Half.V, Group.FULL),
    LaunchTag.HEAD_K_SWA: (Stage.HEAD, Half.K, Group.SWA),
    LaunchTag.HEAD_V_SWA: (Stage.HEAD, Half.V, Group.SWA),
    LaunchTag.TAIL_K_SWA: (Stage.TAIL, Half.K, Group.SWA),
    LaunchTag.TAIL_V_SWA: (Stage.TAIL, Half.V, Group.SWA),
    LaunchTag.SWEEP_K_SWA: (Stage.SWEEP, Half.K, Group.SWA),
    LaunchTag.SWEEP_V_SWA: (Stage.SWEEP, Half.V, Group.SWA),
}
_TAG_OF: Final[dict[tuple[Stage, Half, Group], LaunchTag]] = {v: k for k, v in _TAG_PARTS.items()}


class ViolationCol(IntEnum):
    """One row of the violation ring."""

    TAG = 0  # LaunchTag of the launch that found it
    REASONS = 1  # FailReason bits
    SLOT = 2  # slot in the group's pool (the raw bad value for INPUT_ERROR; the table-space out_cache_loc for STRUCTURAL)
    POSITION = 3  # position the plan expected at this slot
    STORED_POSITION = 4  # position stored in the record
    BATCH_INDEX = 5  # request index in the batch (chain index for sweeps)
    REQ_ROW = 6  # row of the slot table (req_to_token) the entry came from
    STORED_TOKEN = 7  # token stored in the record (written token for write checks)
    EXPECTED_TOKEN = 8  # token truth, or SKIP_TOKEN when not known
    STORED_HASH = 9  # stored prev_hash (chain checks) or computed chain value (boundary checks)
    EXPECTED_HASH = 10  # recomputed link / expected chain value
    STORED_FP = 11  # stored fingerprint
    EXPECTED_FP = 12  # fresh fingerprint (0 when not computed)
    STEP = 13  # value of the step counter when found
    EXPECTED_SLOT = 14  # STRUCTURAL rows: the table-space slot req_to_token maps for (REQ_ROW, POSITION), NO_SLOT for a padding token (only reserved slots allowed); NO_SLOT in other rows


NUM_VIOLATION_COLS: Final = 15


class CounterCol(IntEnum):
    """Per-launch-tag health counters: counters[tag, column]."""

    VERIFY_RUNS = 0  # verify launches for this tag
    WRITE_RUNS = 1  # write launches for this tag
    ENTRIES_CHECKED = 2  # records verified
    ENTRIES_WRITTEN = 3  # records written
    VIOLATIONS = 4  # violation rows produced (exact, also when the ring dropped them)
    INPUT_ERRORS = 5  # entries skipped because an input value was out of range
    SKIPPED = 6  # entries not checked by design (reserved slot, evicted SWA slot)


NUM_COUNTER_COLS: Final = 7


class PlanCol(IntEnum):
    """One planned segment (a request's verify range and write segment, or one sweep chain)."""

    BATCH_INDEX = 0  # request index in the batch (chain index for sweeps)
    ROW = 1  # row of the slot table
    IDX_BEGIN = 2  # first verified index in the row
    IDX_END = 3  # end of the verified indices (exclusive)
    POS_SHIFT = 4  # position of index i is i + POS_SHIFT
    ENTRY_OFFSET = 5  # exclusive prefix sum of verify lengths over planned segments
    FIRST_PREV_SLOT = 6  # table-space slot of the predecessor of IDX_BEGIN (unused when FLAG_FIRST_IS_HEAD)
    WRITE_BEGIN = 7  # flat token index of the first new token
    WRITE_LEN = 8  # number of new tokens
    SEED_SLOT = 9  # table-space slot whose record seeds the write (unused when FLAG_SEED_IS_HEAD)
    PREFIX_LEN = 10  # tokens already in the KV before this forward
    EXPECT_PREFIX = 11  # expected chain value after the prefix (valid with FLAG_EXPECT_PREFIX)
    EXPECT_NEW = 12  # expected chain value after the new tokens (valid with FLAG_EXPECT_NEW)
    FLAGS = 13  # PlanFlag bits


NUM_PLAN_COLS: Final = 14


class PlanStatusCol(IntEnum):
    """Device-side counts written by a plan launch."""

    NUM_SEGMENTS = 0  # planned segments (rows of the plan that are valid)
    VERIFY_ENTRIES = 1  # sum of verify lengths
    WRITE_ENTRIES = 2  # sum of write lengths
    INPUT_ERRORS = 3  # requests/chains skipped for out-of-range values
    OVERFLOW = 4  # 1 when the batch claims more tokens or slots than exist


NUM_PLAN_STATUS_COLS: Final = 5


class CarryCol(IntEnum):
    """One entry of a write's carries (docs/ops-contract.md 5): a long write's exclusive chain carry, kept by the HEAD write for the TAIL write of the same forward. Row 0 of a carries tensor is its header (CarryHeaderCol); entry e is row 1 + e."""

    MUL = 0  # affine chain map of the segment's earlier entries: multiplier (u64 bit-cast)
    ADD = 1  # that map's addend (u64 bit-cast)
    LAST_J = 2  # index in the segment of the last earlier written entry (-1 = none)
    SEGMENT = 3  # plan row of the entry
    J = 4  # index of the entry inside its segment
    K = 5  # its flat token index, WRITE_BEGIN + J (the reader loads the token beside the plan row)


NUM_CARRY_COLS: Final = 6


class CarryHeaderCol(IntEnum):
    """Row 0 of a carries tensor (columns < NUM_CARRY_COLS)."""

    ARMED = 0  # 1 when the rows hold every entry of the last recording write, 0 otherwise
    STEP = 1  # the sink step of that write: only a write of the same step reuses the rows
    TOTAL = 2  # entries recorded
    DONE = 3  # blocks of the reusing launch that have read the header (its last one disarms)


NUM_CARRY_HEADER_COLS: Final = 4


class FpSourceCol(IntEnum):
    """One real-KV source of a fingerprint: a layer tensor viewed as byte rows."""

    PTR = 0  # data pointer (validated and kept alive by the Python side)
    ROW_STRIDE = 1  # bytes between consecutive pages (rows)
    PAGE_SIZE = 2  # slots per row
    BYTES_PER_TOKEN = 3  # bytes of one slot inside a row
    READ_BYTES = 4  # bytes hashed in ALL mode (<= BYTES_PER_TOKEN; PARTIAL hashes at most this many; 0 = none)


NUM_FP_SOURCE_COLS: Final = 5


class RecordField(IntEnum):
    """Canary record kept beside one KV slot for one (stage, half). Value = int64 column of the field."""

    TOKEN = 0  # token id whose KV was written to the slot
    POSITION = 1  # sequence position of that token
    PREV_HASH = 2  # chain value h_k of the history before this token (u64 bit-cast)
    KV_FINGERPRINT = 3  # fingerprint of the slot's real K or V bytes; 0 when not fingerprinted


RECORD_FIELDS: Final[tuple[tuple[str, int], ...]] = (
    ('token', 0),  # (name, byte offset)
    ('position', 8),  # (name, byte offset)
    ('prev_hash', 16),  # (name, byte offset)
    ('kv_fingerprint', 24),  # (name, byte offset)
)
RECORD_NUM_FIELDS: Final = 4

# Hash constants (u64).
SPLITMIX_MUL1: Final = 0xBF58476D1CE4E5B9  # splitmix64 finalizer multiplier 1
SPLITMIX_MUL2: Final = 0x94D049BB133111EB  # splitmix64 finalizer multiplier 2
CHAIN_ANCHOR: Final = 0x6B7663616E617279  # h_0 = splitmix64(CHAIN_ANCHOR)
CHAIN_SEED: Final = 0x4B56636861696E21  # g(t, p) = splitmix64(((p << 32) | t) ^ CHAIN_SEED)
CHAIN_BASE: Final = 0x9E3779B97F4A7C15  # h_{k+1} = h_k * CHAIN_BASE + g(t_k, p_k); odd, so invertible
FP_SEED: Final = 0x2545F4914F6CDD1D  # word key base: key(j, i) = FP_SEED + ((j << 32) + i) * FP_GAMMA
FP_GAMMA: Final = 0xD1B54A32D192ED03  # odd word-key step
FP_POS_SEED: Final = 0x632BE59BD9B4E019  # fp = splitmix64(acc ^ splitmix64(position ^ FP_POS_SEED))

# Sentinels.
NO_SLOT: Final = -1  # no slot: skipped write, chain head, padding
SKIP_TOKEN: Final = -1  # token not known / not to be checked

# Layout sizes.
RECORD_BYTES: Final = 32  # bytes of one canary record
RECORD_ALIGN: Final = 8  # alignment of a record and of the record stride
FP_ALIGN_BYTES: Final = 16  # fingerprint rows, strides and read sizes are multiples of this (16-byte loads)
PARTIAL_READ_BYTES: Final = 16  # bytes read per source row in PARTIAL mode
TOKEN_LIMIT: Final = 2147483648  # tokens and positions must lie in [0, TOKEN_LIMIT)
MAX_HALVES: Final = 2  # halves per buffer (K, V)
STAGE_INLINE_ROWS: Final = 64  # CUDA begin_decode: a batch of at most this many rows carries its staging rows in the launch's parameters, not in pinned memory
INVALIDATE_INLINE_SLOTS: Final = 960  # CUDA invalidate of a host slot list: slots carried per launch in its parameters (int32, under the 4 KiB parameter limit)

# Default capacities and intervals.
DEFAULT_RING_CAPACITY: Final = 1024  # violation rows kept per reporting window
DEFAULT_REQ_CAPACITY: Final = 1024  # requests per forward the plan is sized for
DEFAULT_SWEEP_CAPACITY: Final = 65536  # cached chains one sweep plan holds
DEFAULT_SWEEP_SLICE: Final = 512  # rolling sweep: cached slots verified per forward (every cached slot within ceil(num_slots / slice) forwards)
DEFAULT_SWEEP_ROLL_INTERVAL: Final = 4  # rolling sweep: forwards between slices; a slice walks interval x SWEEP_SLICE slot ids (one export and one launch group per slice, the same rate)
DEFAULT_STATS_INTERVAL: Final = 100  # forwards between stats lines
DEFAULT_FP_LAYER_STRIDE: Final = 1  # source j is hashed at position p iff (j + p) % stride == 0
