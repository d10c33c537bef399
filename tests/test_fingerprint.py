"""Fingerprint op: Python-int vectors over raw storage bytes, torch vs C++ CPU, validation, bit-flip detection."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.errors import CanaryInputError
from kvcanary.ops import hashes as H
from kvcanary.ops.fingerprint import check_fingerprint, fingerprint
from kvcanary.ops.types import Fingerprint, FingerprintSources, GroupView, SourceSpec
from kvcanary_schema import (
    FP_ALIGN_BYTES,
    FP_GAMMA,
    FP_POS_SEED,
    FP_SEED,
    PARTIAL_READ_BYTES,
    TOKEN_LIMIT,
    FingerprintMode,
    Stage,
)

BACKENDS = ["torch", "cpu"]
U64 = (1 << 64) - 1


def storage_bytes(t: torch.Tensor) -> tuple[bytes, int]:
    """All bytes of t's storage and the byte offset of t's first element in it (independent of types.py views)."""
    s = t.untyped_storage()
    return bytes(s), t.data_ptr() - s.data_ptr()


def fp_int(specs: list[SourceSpec], slot: int, position: int, mode: FingerprintMode, stride: int) -> int:
    """The contract's fingerprint with Python ints over raw storage bytes."""
    acc = 0
    for j, spec in enumerate(specs):
        if (j + position) % stride:
            continue
        t = spec.tensor
        raw, base = storage_bytes(t)
        esize = t.element_size()
        row_stride = t.stride(0) * esize
        row_bytes = (t[0].numel() if t.dim() > 1 else 1) * esize
        bpt = spec.bytes_per_token or row_bytes // spec.page_size
        rb = bpt if spec.read_bytes is None else spec.read_bytes
        if mode == FingerprintMode.PARTIAL:
            rb = min(rb, PARTIAL_READ_BYTES)
        off = base + (slot // spec.page_size) * row_stride + (slot % spec.page_size) * bpt
        for i in range(rb // 8):
            word = int.from_bytes(raw[off + 8 * i: off + 8 * i + 8], "little")
            key = (FP_SEED + ((j << 32) + i) * FP_GAMMA) & U64
            acc = (acc + H.splitmix64_int(word ^ key)) & U64
    return H.splitmix64_int(acc ^ H.splitmix64_int(position ^ FP_POS_SEED))


def fp_of(sources: FingerprintSources, half: int, slots: list[int], positions: list[int], mode: FingerprintMode,
          stride: int, backend: str) -> list[int]:
    out = fingerprint(sources, half, torch.tensor(slots, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                      mode, stride, backend=backend)
    return [H.to_u64(v) for v in out.tolist()]


def aligned_u8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random uint8 tensor whose base address is FP_ALIGN_BYTES-aligned."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_vector_bytes_00_to_1f(backend: str) -> None:
    row = torch.arange(32, dtype=torch.uint8).view(1, 32)  # one slot: bytes 00..1F
    src = FingerprintSources([[SourceSpec(row)]], num_slots=1)
    # Spelled out: words 0x0706050403020100 and 0x0F0E0D0C0B0A0908, source 0, position 5.
    w0, w1 = 0x0706050403020100, 0x0F0E0D0C0B0A0908
    t0 = H.splitmix64_int(w0 ^ FP_SEED)
    t1 = H.splitmix64_int(w1 ^ ((FP_SEED + FP_GAMMA) & U64))
    w2, w3 = 0x1716151413121110, 0x1F1E1D1C1B1A1918
    t2 = H.splitmix64_int(w2 ^ ((FP_SEED + 2 * FP_GAMMA) & U64))
    t3 = H.splitmix64_int(w3 ^ ((FP_SEED + 3 * FP_GAMMA) & U64))
    fin = lambda acc: H.splitmix64_int(acc ^ H.splitmix64_int(5 ^ FP_POS_SEED))  # noqa: E731
    assert fp_of(src, 0, [0], [5], FingerprintMode.ALL, 1, backend) == [fin((t0 + t1 + t2 + t3) & U64)]
    assert fp_of(src, 0, [0], [5], FingerprintMode.PARTIAL, 1, backend) == [fin((t0 + t1) & U64)]
    assert fp_of(src, 0, [0], [5], FingerprintMode.NONE, 1, backend) == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_sources_with_padded_row_stride(backend: str) -> None:
    gen = torch.Generator().manual_seed(1)
    page, bpt, pages = 3, 32, 5
    big = aligned_u8((pages, 256), gen)  # row stride 256 > page * bpt = 96
    spec = SourceSpec(big[:, : page * bpt], page_size=page)
    flat = aligned_u8((pages, page * bpt + 16), gen)  # row bytes 112 > 96, contiguous
    spec2 = SourceSpec(flat, page_size=page, bytes_per_token=bpt)
    src = FingerprintSources([[spec, spec2]], num_slots=pages * page)
    slots = list(range(pages * page))
    pos = [random.Random(s).randrange(1000) for s in slots]
    for mode in (FingerprintMode.ALL, FingerprintMode.PARTIAL):
        want = [fp_int([spec, spec2], s, p, mode, 1) for s, p in zip(slots, pos, strict=True)]
        assert fp_of(src, 0, slots, pos, mode, 1, backend) == want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stride", [1, 2, 3])
def test_layer_stride_selects_sources_by_position(backend: str, stride: int) -> None:
    gen = torch.Generator().manual_seed(stride)
    specs_k = [SourceSpec(aligned_u8((8, 48), gen)) for _ in range(4)]
    specs_v = [SourceSpec(aligned_u8((8, 64), gen), read_bytes=32) for _ in range(4)]
    src = FingerprintSources([specs_k, specs_v], num_slots=8)
    slots, pos = [0, 1, 2, 3, 4, 5, 6, 7, 3, 3, 3], [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12]
    for half, specs in enumerate((specs_k, specs_v)):
        want = [fp_int(specs, s, p, FingerprintMode.ALL, stride) for s, p in zip(slots, pos, strict=True)]
        assert fp_of(src, half, slots, pos, FingerprintMode.ALL, stride, backend) == want
    # A pure function of (bytes, position): the same slot at positions of the same residue agrees in source set.
    same = fp_of(src, 0, [3, 3], [10, 10], FingerprintMode.ALL, stride, backend)
    assert same[0] == same[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_position_is_mixed_in_and_slot_is_not(backend: str) -> None:
    row = torch.arange(64, dtype=torch.uint8).view(2, 32)
    row[1] = row[0]  # two slots with equal bytes
    src = FingerprintSources([[SourceSpec(row)]], num_slots=2)
    a, b, c = fp_of(src, 0, [0, 1, 0], [7, 7, 8], FingerprintMode.ALL, 1, backend)
    assert a == b and a != c


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_entries_are_zero(backend: str) -> None:
    gen = torch.Generator().manual_seed(3)
    src = FingerprintSources([[SourceSpec(aligned_u8((4, 32), gen))]], num_slots=4)
    got = fp_of(src, 0, [-1, 4, 1 << 40, 0, 1], [0, 0, 0, -1, TOKEN_LIMIT], FingerprintMode.ALL, 1, backend)
    assert got == [0, 0, 0, 0, 0]


@settings(max_examples=40, deadline=None)
@given(n_src=st.integers(1, 3), page=st.integers(1, 4), words=st.integers(1, 6), pad=st.integers(0, 3),
       stride=st.integers(1, 4), mode=st.sampled_from([FingerprintMode.PARTIAL, FingerprintMode.ALL]),
       seed=st.integers(0, 2**31))
def test_torch_and_cpu_agree_with_ints(n_src: int, page: int, words: int, pad: int, stride: int,
                                       mode: FingerprintMode, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    bpt = words * FP_ALIGN_BYTES
    pages = 5
    # read_bytes 0 (a source that hashes nothing) up to the whole token
    specs = [SourceSpec(aligned_u8((pages, page * bpt + pad * FP_ALIGN_BYTES), gen), page_size=page,
                        bytes_per_token=bpt, read_bytes=FP_ALIGN_BYTES * rng.randrange(words + 1))
             for _ in range(n_src)]
    n = pages * page
    src = FingerprintSources([specs], num_slots=n)
    slots = [rng.randrange(-2, n + 2) for _ in range(17)]
    pos = [rng.randrange(0, 100) for _ in range(17)]
    want = [fp_int(specs, s, p, mode, stride) if 0 <= s < n else 0 for s, p in zip(slots, pos, strict=True)]
    assert fp_of(src, 0, slots, pos, mode, stride, "torch") == want
    assert fp_of(src, 0, slots, pos, mode, stride, "cpu") == want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("multi", [False, True])
def test_random_bit_flips_always_change_the_fingerprint(backend: str, multi: bool) -> None:
    # 10^5 copies of one 256-byte slot row (x 2 sources), each with random flipped bits of its hashed bytes.
    n, bpt = 100_000, 256
    gen = torch.Generator().manual_seed(99 + multi)
    orig = aligned_u8((bpt,), gen)
    copies = [orig.repeat(n, 1), orig.flip(0).repeat(n, 1)]
    which = torch.randint(0, 2, (n,), generator=gen)
    flips = torch.randint(2, 9, (n,), generator=gen) if multi else torch.ones(n, dtype=torch.int64)
    for f in range(int(flips.max())):
        rows = torch.nonzero(flips > f).squeeze(1)
        bit = torch.randint(0, bpt * 8, (rows.shape[0],), generator=gen)
        for s in (0, 1):
            sel = rows[which[rows] == s]
            b = bit[which[rows] == s]
            copies[s][sel, b // 8] ^= (1 << (b % 8)).to(torch.uint8)
    src = FingerprintSources([[SourceSpec(copies[0]), SourceSpec(copies[1])]], num_slots=n)
    ref = FingerprintSources([[SourceSpec(orig.view(1, -1)), SourceSpec(orig.flip(0).contiguous().view(1, -1))]],
                             num_slots=1)
    pos = torch.full((n,), 1234, dtype=torch.int64)
    clean = fingerprint(ref, 0, torch.zeros(1, dtype=torch.int64), pos[:1], FingerprintMode.ALL, backend=backend)
    got = fingerprint(src, 0, torch.arange(n), pos, FingerprintMode.ALL, backend=backend)
    changed = (copies[0] != orig).any(1) | (copies[1] != orig.flip(0)).any(1)
    assert int(changed.sum()) >= 99_000  # multi-bit flips may cancel on the same bit: those rows are unchanged
    assert int((got[changed] == clean).sum()) == 0
    assert bool((got[~changed] == clean).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [FingerprintMode.PARTIAL, FingerprintMode.ALL])
def test_a_zero_byte_source_hashes_nothing(backend: str, mode: FingerprintMode) -> None:
    """READ_BYTES 0 (HalfCoverage.FIRST's V half): the fingerprint of no bytes, whatever the row holds."""
    gen = torch.Generator().manual_seed(3)
    rows = aligned_u8((6, 64), gen)
    src = FingerprintSources([[SourceSpec(rows, read_bytes=0)]], num_slots=6)
    before = fp_of(src, 0, list(range(6)), [9] * 6, mode, 1, backend)
    rows.bitwise_not_()
    assert fp_of(src, 0, list(range(6)), [9] * 6, mode, 1, backend) == before
    assert before == [H.splitmix64_int(0 ^ H.splitmix64_int(9 ^ FP_POS_SEED))] * 6


def test_source_validation_errors() -> None:
    gen = torch.Generator().manual_seed(5)
    good = aligned_u8((4, 64), gen)
    with pytest.raises(CanaryInputError, match="base address"):
        FingerprintSources([[SourceSpec(good.view(-1)[8:8 + 3 * 64].view(3, 64))]], num_slots=3)
    with pytest.raises(CanaryInputError, match="read_bytes"):
        FingerprintSources([[SourceSpec(good, read_bytes=24)]], num_slots=4)
    with pytest.raises(CanaryInputError, match="read_bytes"):
        FingerprintSources([[SourceSpec(good, read_bytes=80)]], num_slots=4)
    with pytest.raises(CanaryInputError, match="bytes_per_token"):
        FingerprintSources([[SourceSpec(good, bytes_per_token=40)]], num_slots=4)
    with pytest.raises(CanaryInputError, match="page_size"):
        FingerprintSources([[SourceSpec(good, page_size=2, bytes_per_token=48)]], num_slots=4)
    with pytest.raises(CanaryInputError, match="rows"):
        FingerprintSources([[SourceSpec(good)]], num_slots=5)
    with pytest.raises(CanaryInputError, match="row stride"):
        FingerprintSources([[SourceSpec(torch.zeros(4, 40, dtype=torch.uint8)[:, :32])]], num_slots=4)
    with pytest.raises(CanaryInputError, match="same non-zero number"):
        FingerprintSources([[SourceSpec(good)], [SourceSpec(good), SourceSpec(good)]], num_slots=4)
    with pytest.raises(CanaryInputError, match="contiguous"):
        FingerprintSources([[SourceSpec(torch.zeros(4, 64, dtype=torch.uint8)[:, ::2])]], num_slots=4)


def test_op_argument_errors() -> None:
    src = FingerprintSources([[SourceSpec(torch.zeros(4, 32, dtype=torch.uint8))]], num_slots=4)
    s = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(CanaryInputError, match="half"):
        fingerprint(src, 1, s, s, FingerprintMode.ALL)
    with pytest.raises(CanaryInputError, match="slots"):
        fingerprint(src, 0, s.to(torch.int32), s, FingerprintMode.ALL)
    with pytest.raises(CanaryInputError, match="positions"):
        fingerprint(src, 0, s, s[:2], FingerprintMode.ALL)
    with pytest.raises(CanaryInputError, match="layer_stride"):
        fingerprint(src, 0, s, s, FingerprintMode.ALL, 0)
    with pytest.raises(CanaryInputError, match="mode"):
        fingerprint(src, 0, s, s, 2)  # type: ignore[arg-type]
    with pytest.raises(CanaryInputError, match="backend"):
        fingerprint(src, 0, s, s, FingerprintMode.ALL, backend="tpu")
    with pytest.raises(CanaryInputError, match="backend 'cuda'"):
        fingerprint(src, 0, s, s, FingerprintMode.ALL, backend="cuda")
    group = GroupView(torch.zeros(4, 1, 4, dtype=torch.int64))
    with pytest.raises(CanaryInputError, match="HEAD"):
        check_fingerprint(Fingerprint(src), group, Stage.HEAD)
    with pytest.raises(CanaryInputError, match="slots"):
        check_fingerprint(Fingerprint(src), GroupView(torch.zeros(8, 1, 4, dtype=torch.int64)), Stage.TAIL)


def test_native_entry_rejects_bad_arguments() -> None:
    from kvcanary import _native
    mod = _native.module("cpu")
    src = FingerprintSources([[SourceSpec(torch.zeros(4, 32, dtype=torch.uint8))]], num_slots=4)
    s = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="half"):
        mod.fingerprint(src.table, 1, s, s, int(FingerprintMode.ALL), 1, 4, torch.empty_like(s))
    with pytest.raises(ValueError, match="layer_stride"):
        mod.fingerprint(src.table, 0, s, s, int(FingerprintMode.ALL), 0, 4, torch.empty_like(s))
    with pytest.raises(ValueError, match="mode"):
        mod.fingerprint(src.table, 0, s, s, 7, 1, 4, torch.empty_like(s))
    with pytest.raises(ValueError, match="shape"):
        mod.fingerprint(src.table, 0, s, s[:2], int(FingerprintMode.ALL), 1, 4, torch.empty_like(s))
    with pytest.raises(TypeError, match="int64"):
        mod.fingerprint(src.table, 0, s.int(), s, int(FingerprintMode.ALL), 1, 4, torch.empty_like(s))
