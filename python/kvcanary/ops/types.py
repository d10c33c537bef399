"""Shared argument types of the canary operations: group view, sink, token pool, fingerprint sources."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from kvcanary_schema import (
    FP_ALIGN_BYTES,
    NUM_COUNTER_COLS,
    NUM_FP_SOURCE_COLS,
    NUM_LAUNCH_TAGS,
    NUM_VIOLATION_COLS,
    RECORD_NUM_FIELDS,
    FingerprintMode,
    FpSourceCol,
    Group,
    Half,
    LaunchTag,
    Stage,
)

from kvcanary.errors import CanaryInputError

Backend = Literal["torch", "cpu", "cuda"]
BACKENDS: tuple[Backend, ...] = ("torch", "cpu", "cuda")


def is_power_of_two(v: object) -> bool:
    """True for an int (not a bool) that is a power of two >= 1."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


def check_backend(backend: str, device: torch.device) -> Backend:
    """Validate a backend name against the device of the data."""
    if backend not in BACKENDS:
        raise CanaryInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cpu" and device.type != "cpu":
        raise CanaryInputError(f"backend 'cpu' needs CPU tensors, got {device}")
    if backend == "cuda" and device.type != "cuda":
        raise CanaryInputError(f"backend 'cuda' needs CUDA tensors, got {device}")
    return backend


def check_tensor(t: object, name: str, *, dtype: torch.dtype | tuple[torch.dtype, ...] = torch.int64,
                 ndim: int | None = None, device: torch.device | None = None,
                 shape: tuple[int | None, ...] | None = None) -> torch.Tensor:
    """Raise CanaryInputError unless ``t`` is a contiguous tensor of the given dtype/rank/device/shape."""
    if not isinstance(t, torch.Tensor):
        raise CanaryInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise CanaryInputError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise CanaryInputError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, want in enumerate(shape):
            if want is not None and t.shape[axis] != want:
                raise CanaryInputError(f"{name}.shape[{axis}] must be {want}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise CanaryInputError(f"{name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise CanaryInputError(f"{name} must be contiguous")
    return t


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share bytes (compared by address, so on the same device)."""
    pa, pb = a.data_ptr(), b.data_ptr()
    na, nb = a.numel() * a.element_size(), b.numel() * b.element_size()
    return na > 0 and nb > 0 and pa < pb + nb and pb < pa + na


def check_tensors(tensors: Sequence[tuple[str, object]], *, dtype: tuple[torch.dtype, ...],
                  shape: tuple[int, ...], device: torch.device) -> None:
    """:func:`check_tensor` of several (name, tensor) pairs of one contract (every dim given): valid ones cost one
    expression, not a call; the first invalid one raises check_tensor's error."""
    for name, t in tensors:
        if not (isinstance(t, torch.Tensor) and t.dtype in dtype and t.shape == shape and t.device == device
                and t.is_contiguous()):
            check_tensor(t, name, dtype=dtype, ndim=len(shape), device=device, shape=shape)


@dataclass(frozen=True)
class GroupView:
    """One pool group's canary records of one stage, and how table-space slots reach them."""

    records: torch.Tensor  # int64 [num_slots, H, RECORD_NUM_FIELDS]
    group: Group = Group.FULL
    reserved_slots: int = 0
    swa_map: torch.Tensor | None = None  # int64 [M]: table slot -> group slot, NO_SLOT = not resident

    def __post_init__(self) -> None:
        check_tensor(self.records, "records", ndim=3)
        if self.records.shape[2] != RECORD_NUM_FIELDS or self.records.shape[1] not in (1, 2):
            raise CanaryInputError(f"records must be [num_slots, 1|2, {RECORD_NUM_FIELDS}], got "
                                   f"{tuple(self.records.shape)}")
        if not 0 <= self.reserved_slots <= self.records.shape[0]:
            raise CanaryInputError(f"reserved_slots must be in [0, {self.records.shape[0]}], got {self.reserved_slots}")
        if (self.swa_map is None) != (self.group == Group.FULL):
            raise CanaryInputError("swa_map must be given exactly for SWA groups")
        if self.swa_map is not None:
            check_tensor(self.swa_map, "swa_map", ndim=1, device=self.records.device)

    @property
    def num_slots(self) -> int:
        """Slots of the group's pool."""
        return int(self.records.shape[0])

    @property
    def halves(self) -> int:
        """1 (K only) or 2 (K and V)."""
        return int(self.records.shape[1])

    def tags(self, stage: Stage) -> list[int]:
        """Launch tag of each half for one stage."""
        key = (stage, self.halves, self.group)
        got = _TAGS.get(key)
        if got is None:  # built once per key: enum construction costs microseconds, and every bind asks
            got = _TAGS[key] = tuple(int(LaunchTag.of(stage, Half(h), self.group)) for h in range(self.halves))
        return list(got)


_TAGS: dict[tuple[Stage, int, Group], tuple[int, ...]] = {}


@dataclass
class Sink:
    """Where violations and counters go: ring rows, exact ring count, per-tag counters, step counter."""

    rows: torch.Tensor  # int64 [cap, NUM_VIOLATION_COLS]
    count: torch.Tensor  # int64 [1]
    counters: torch.Tensor  # int64 [NUM_LAUNCH_TAGS, NUM_COUNTER_COLS]
    step: torch.Tensor  # int64 [1]
    # the tensors and device of the last validate that passed (a sink's tensors are fixed once validated, as bound
    # ops that hold them assume; every bind of a forward's ops validates the same sink)
    _valid: tuple[object, ...] = field(default=(), init=False, repr=False, compare=False)

    @classmethod
    def allocate(cls, capacity: int, device: torch.device | str = "cpu") -> Sink:
        """A zeroed sink with room for ``capacity`` detailed rows per window."""
        if capacity < 1:
            raise CanaryInputError(f"ring capacity must be >= 1, got {capacity}")
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        return cls(zeros(capacity, NUM_VIOLATION_COLS), zeros(1), zeros(NUM_LAUNCH_TAGS, NUM_COUNTER_COLS), zeros(1))

    def validate(self, device: torch.device) -> None:
        """Raise CanaryInputError unless every tensor has its contract shape on ``device``."""
        last = self._valid
        if last and last[0] is self.rows and last[1] is self.count and last[2] is self.counters and \
                last[3] is self.step and last[4] == device:
            return
        check_tensor(self.rows, "ring rows", ndim=2, device=device, shape=(None, NUM_VIOLATION_COLS))
        check_tensor(self.count, "ring count", ndim=1, device=device, shape=(1,))
        check_tensor(self.counters, "counters", ndim=2, device=device, shape=(NUM_LAUNCH_TAGS, NUM_COUNTER_COLS))
        check_tensor(self.step, "step", ndim=1, device=device, shape=(1,))
        self._valid = (self.rows, self.count, self.counters, self.step, device)

    @property
    def capacity(self) -> int:
        """Detailed rows kept per window."""
        return int(self.rows.shape[0])

    def drain(self) -> tuple[torch.Tensor, int, int]:
        """(kept rows, total violations, dropped) of the window; resets the ring count (syncs: host side only)."""
        total = int(self.count.item())
        kept = self.rows[: min(total, self.capacity)].clone()
        self.count.zero_()
        return kept, total, max(0, total - self.capacity)


@dataclass(frozen=True)
class TokenPool:
    """Expected-token pool (token truth per entry): pool[row, p + offset] is the true token at position p."""

    tokens: torch.Tensor  # int64 [R, L]
    lens: torch.Tensor  # int64 [R]: valid length of each row
    offset: int = 0  # +1 for EAGLE-style draft pools

    def __post_init__(self) -> None:
        check_tensor(self.tokens, "token pool", ndim=2)
        check_tensor(self.lens, "token pool lens", ndim=1, device=self.tokens.device, shape=(self.tokens.shape[0],))
        if self.offset < 0:
            raise CanaryInputError(f"token offset must be >= 0, got {self.offset}")


@dataclass(frozen=True)
class SourceSpec:
    """One real-KV source: a layer tensor whose dim 0 indexes pages (rows) of ``page_size`` slots."""

    tensor: torch.Tensor
    page_size: int = 1
    bytes_per_token: int | None = None  # default: row bytes / page_size
    read_bytes: int | None = None  # default: bytes_per_token; 0: the source hashes nothing (its fingerprint term is 0)


@dataclass
class FingerprintSources:
    """Per half, the n real-KV sources hashed into a slot's fingerprint, and their device table."""

    halves: list[list[SourceSpec]]
    num_slots: int
    rows: list[list[torch.Tensor]] = field(init=False)  # uint8 [num_rows, row_stride] views, for the reference
    table: torch.Tensor = field(init=False)  # int64 [H, n, NUM_FP_SOURCE_COLS]

    def __post_init__(self) -> None:
        if not self.halves or len(self.halves) > 2 or len({len(h) for h in self.halves}) != 1 or not self.halves[0]:
            raise CanaryInputError("fingerprint sources: 1 or 2 halves with the same non-zero number of sources each")
        device = self.halves[0][0].tensor.device
        entries, self.rows = [], []
        for h, specs in enumerate(self.halves):
            row_views = []
            for j, spec in enumerate(specs):
                view, entry = _source_entry(spec, self.num_slots, device, f"source[{h}][{j}]")
                row_views.append(view)
                entries.append(entry)
            self.rows.append(row_views)
        n = len(self.halves[0])
        self.table = torch.tensor(entries, dtype=torch.int64).view(len(self.halves), n, NUM_FP_SOURCE_COLS).to(device)

    @property
    def num_sources(self) -> int:
        """Sources per half."""
        return len(self.halves[0])

    @property
    def device(self) -> torch.device:
        """Device of the sources (and the table)."""
        return self.table.device


def _source_entry(spec: SourceSpec, num_slots: int, device: torch.device, name: str) -> tuple[torch.Tensor, list[int]]:
    t = spec.tensor
    if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.numel() == 0:
        raise CanaryInputError(f"{name}: a non-empty tensor is required")
    if t.device != device:
        raise CanaryInputError(f"{name}: on {t.device}, other sources on {device}")
    rows = t.shape[0]
    row_elems = t[0].numel() if t.dim() > 1 else 1
    if t.dim() > 1 and not t[0].is_contiguous() or (t.dim() > 1 and t.stride(-1) != 1):
        raise CanaryInputError(f"{name}: each row must be contiguous")
    esize = t.element_size()
    row_stride, row_bytes = t.stride(0) * esize, row_elems * esize
    if spec.page_size < 1:
        raise CanaryInputError(f"{name}: page_size must be >= 1, got {spec.page_size}")
    bpt = spec.bytes_per_token if spec.bytes_per_token is not None else row_bytes // spec.page_size
    rb = spec.read_bytes if spec.read_bytes is not None else bpt
    a = FP_ALIGN_BYTES
    for what, v in (("base address", t.data_ptr()), ("row stride", row_stride), ("bytes_per_token", bpt),
                    ("read_bytes", rb)):
        if v % a != 0:
            raise CanaryInputError(f"{name}: {what} ({v}) must be a multiple of {a}")
    if not 0 <= rb <= bpt or spec.page_size * bpt > row_bytes:  # read_bytes 0: the source hashes nothing
        raise CanaryInputError(f"{name}: need 0 <= read_bytes ({rb}) <= bytes_per_token ({bpt}) and "
                               f"page_size*bytes_per_token <= row bytes ({row_bytes})")
    if rows * spec.page_size < num_slots:
        raise CanaryInputError(f"{name}: {rows} rows x page_size {spec.page_size} < {num_slots} slots")
    view = torch.as_strided(t, (rows, row_elems), (t.stride(0), 1)).view(torch.uint8) if t.dim() > 1 else \
        t.view(torch.uint8).view(rows, esize)
    entry = [0] * NUM_FP_SOURCE_COLS
    entry[FpSourceCol.PTR], entry[FpSourceCol.ROW_STRIDE] = t.data_ptr(), row_stride
    entry[FpSourceCol.PAGE_SIZE], entry[FpSourceCol.BYTES_PER_TOKEN], entry[FpSourceCol.READ_BYTES] = \
        spec.page_size, bpt, rb
    return view, entry


@dataclass(frozen=True)
class Fingerprint:
    """What a TAIL/SWEEP launch fingerprints: sources, mode and layer stride.

    ``share`` S (a power of two): a TAIL verify checks the fingerprint of the entry at position p of a segment with
    PREFIX_LEN L only when (p + L) % S == 0 (docs/ops-contract.md 4), so a decoding request's read slots each come
    round once in any S of its forwards; SWEEP verifies and writes ignore it (they check / store every entry).
    """

    sources: FingerprintSources
    mode: FingerprintMode = FingerprintMode.ALL
    layer_stride: int = 1
    share: int = 1

    def __post_init__(self) -> None:
        if self.layer_stride < 1:
            raise CanaryInputError(f"fingerprint layer_stride must be >= 1, got {self.layer_stride}")
        if not is_power_of_two(self.share):
            raise CanaryInputError(f"fingerprint share must be a power of two >= 1, got {self.share!r}")
        if self.mode == FingerprintMode.NONE:
            raise CanaryInputError("use fingerprint=None instead of mode NONE")
