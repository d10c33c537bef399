"""In-process tests of the transfer layout, the message framing and the seeded fault switch."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.disagg.errors import TransferProtocolError
from kvcanary.disagg.layout import SEGMENT_ALIGN, TransferItem, TransferLayout
from kvcanary.disagg.transport import (
    HEADER_WORDS,
    Delivery,
    FaultName,
    FaultSpec,
    FaultSwitch,
    Hdr,
    Message,
    MsgKind,
    decode,
    decode_header,
    encode,
)
from kvcanary.errors import CanaryInputError
from kvcanary_schema import Group, Stage


def _pools(seed: int, full: int = 40, swa: int = 20) -> list[TransferItem]:
    g = torch.Generator().manual_seed(seed)
    return [
        TransferItem("c.full.head", torch.randint(-2**62, 2**62, (full, 2, 4), generator=g), Group.FULL, True,
                     stage=Stage.HEAD),
        TransferItem("kv.k0", torch.randn(full, 3, 5, generator=g).to(torch.bfloat16), Group.FULL, False, 0),
        TransferItem("kv.v0", torch.randn(full, 3, 5, generator=g), Group.FULL, False, 0),
        TransferItem("kv.k1", torch.randn(swa, 2, 7, generator=g).to(torch.float16), Group.SWA, False, 1),
        TransferItem("kv.v1", torch.randn(swa, 2, 7, generator=g).to(torch.float16), Group.SWA, False, 1),
        TransferItem("c.full.tail", torch.randint(-2**62, 2**62, (full, 2, 4), generator=g), Group.FULL, True,
                     stage=Stage.TAIL),
        TransferItem("c.swa.tail", torch.randint(-2**62, 2**62, (swa, 2, 4), generator=g), Group.SWA, True,
                     stage=Stage.TAIL),
    ]


def _zeroed(items: list[TransferItem]) -> list[TransferItem]:
    return [TransferItem(i.name, torch.zeros_like(i.tensor), i.group, i.canary, i.layer, i.stage) for i in items]


@pytest.mark.parametrize("seed", range(5))
def test_gather_scatter_relocates_every_row(seed: int) -> None:
    """Rows of the source slots land, bit for bit, in different destination slots; other rows stay untouched."""
    rng = random.Random(seed)
    src_items = _pools(seed)
    dst_items = _zeroed(src_items)
    src, dst = TransferLayout(src_items), TransferLayout(dst_items)
    assert src.digest == dst.digest
    n, m = rng.randint(1, 39), rng.randint(0, 19)
    s_full, d_full = torch.randperm(40)[:n], torch.randperm(40)[:n]
    s_swa, d_swa = torch.randperm(20)[:m], torch.randperm(20)[:m]
    buf = src.gather(s_full, s_swa)
    assert buf.dtype == torch.uint8 and buf.numel() == src.payload_bytes(n, m)
    assert all(seg.offset % SEGMENT_ALIGN == 0 for seg in src.segments(n, m))
    dst.scatter(buf, d_full, d_swa)
    for a, b in zip(src_items, dst_items, strict=True):
        s_idx, d_idx = (s_full, d_full) if a.group == Group.FULL else (s_swa, d_swa)
        assert torch.equal(a.tensor[s_idx].view(torch.uint8), b.tensor[d_idx].view(torch.uint8)), a.name
        untouched = torch.ones(b.tensor.shape[0], dtype=torch.bool)
        untouched[d_idx] = False
        assert not b.tensor[untouched].view(torch.uint8).any(), a.name


def test_split_bytes_and_missing_items() -> None:
    items = _pools(1)
    lay = TransferLayout(items)
    kv, canary = lay.split_bytes(10, 4)
    assert canary == 10 * 64 + 10 * 64 + 4 * 64
    assert kv == 10 * 15 * 2 + 10 * 15 * 4 + 2 * 4 * 14 * 2
    dst = _zeroed(items)
    slots, swa = torch.arange(10), torch.arange(4)
    TransferLayout(dst).scatter(lay.gather(slots, swa), slots, swa, missing=frozenset({5, 6}))
    assert torch.equal(dst[0].tensor[:10], items[0].tensor[:10])
    assert not dst[5].tensor.any() and not dst[6].tensor.any()


def test_layout_validation() -> None:
    items = _pools(2)
    with pytest.raises(CanaryInputError, match="duplicate"):
        TransferLayout([items[0], items[0]])
    with pytest.raises(CanaryInputError, match="contiguous"):
        TransferLayout([TransferItem("x", torch.zeros(4, 6)[:, ::2], Group.FULL, False, 0)])
    with pytest.raises(CanaryInputError, match="stage"):
        TransferLayout([TransferItem("x", torch.zeros(4, 6), Group.FULL, True)])
    lay = TransferLayout(items)
    with pytest.raises(CanaryInputError, match="payload"):
        lay.scatter(torch.zeros(3, dtype=torch.uint8), torch.arange(2), torch.arange(1))
    other = TransferLayout([*items[:-1], TransferItem("c.swa.tail", torch.zeros(20, 1, 4, dtype=torch.int64),
                                                      Group.SWA, True, stage=Stage.TAIL)])
    assert other.digest != lay.digest


def test_message_roundtrip_and_checksum() -> None:
    msg = Message(MsgKind.OFFER, 7, req_key=3, prefix_len=5, first_token=9, full_rows=5, swa_rows=2,
                  payload_bytes=1234, status=0, digest=77, body=(1, 2, 3, 4, 5))
    h, body = encode(msg)
    assert h.shape == (HEADER_WORDS,)
    assert decode_header(h) == 5
    assert decode(h, body) == msg
    for word in range(int(Hdr.CHECKSUM)):  # any changed header word or body token fails the checksum
        bad = h.clone()
        bad[word] ^= 1 << 40
        with pytest.raises(TransferProtocolError):
            decode_header(bad)
            decode(bad, body)
    bad_body = body.clone()
    bad_body[2] += 1
    with pytest.raises(TransferProtocolError, match="checksum"):
        decode(h, bad_body)
    h2, _ = encode(msg, corrupt_checksum=True)
    with pytest.raises(TransferProtocolError, match="checksum"):
        decode(h2, body)
    huge = h.clone()
    huge[Hdr.BODY_LEN] = 1 << 40
    with pytest.raises(TransferProtocolError, match="body length"):
        decode_header(huge)


def _deliveries(lay: TransferLayout, n: int, count: int, seed: int) -> list[Delivery]:
    out = []
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        buf = torch.randint(0, 256, (lay.payload_bytes(n, 4),), dtype=torch.uint8, generator=g)
        out.append(Delivery(i, Message(MsgKind.OFFER, req_key=100 + i, full_rows=n, swa_rows=4), buf))
    return out


def _run(switch: FaultSwitch, ds: list[Delivery]) -> list[Delivery]:
    got = []
    for d in ds:
        got += switch.deliver(d)
    return got + switch.flush()


def test_fault_switch_none_is_identity() -> None:
    lay = TransferLayout(_pools(3))
    ds = _deliveries(lay, 10, 4, 0)
    before = [d.payload.clone() for d in ds]
    got = _run(FaultSwitch(FaultSpec(), lay), ds)
    assert [d.index for d in got] == [0, 1, 2, 3]
    assert all(torch.equal(d.payload, b) and not d.missing for d, b in zip(got, before, strict=True))


@pytest.mark.parametrize("seed", range(20))
def test_fault_switch_corrupt_flips_one_kv_byte(seed: int) -> None:
    lay = TransferLayout(_pools(3))
    ds = _deliveries(lay, 10, 3, seed)
    before = [d.payload.clone() for d in ds]
    switch = FaultSwitch(FaultSpec(FaultName.CORRUPT, target=1, seed=seed), lay)
    got = _run(switch, ds)
    diff = (got[1].payload != before[1]).nonzero().flatten()
    assert diff.numel() == 1 and int(got[1].payload[diff] ^ before[1][diff]) == 0xFF
    off = int(diff)
    item = next(i for i, s in enumerate(lay.segments(10, 4)) if s.offset <= off < s.offset + s.nbytes)
    assert not lay.items[item].canary
    assert torch.equal(got[0].payload, before[0]) and torch.equal(got[2].payload, before[2])
    assert switch.fired[0]["req_key"] == 101


def test_fault_switch_truncations() -> None:
    lay = TransferLayout(_pools(4))
    got = _run(FaultSwitch(FaultSpec(FaultName.TRUNCATE_LAYERS, target=0), lay), _deliveries(lay, 8, 2, 0))
    assert {lay.items[i].name for i in got[0].missing} == {"kv.k1", "kv.v1"} and not got[1].missing
    got = _run(FaultSwitch(FaultSpec(FaultName.TRUNCATE_LAYERS, target=0, layers=2), lay), _deliveries(lay, 8, 1, 0))
    assert {lay.items[i].name for i in got[0].missing} == {"kv.k0", "kv.v0", "kv.k1", "kv.v1"}
    got = _run(FaultSwitch(FaultSpec(FaultName.TRUNCATE_TAIL, target=1), lay), _deliveries(lay, 8, 2, 0))
    assert {lay.items[i].name for i in got[1].missing} == {"c.full.tail", "c.swa.tail"} and not got[0].missing


def _same_rows(lay: TransferLayout, a: torch.Tensor, b: torch.Tensor, n: int, m: int) -> bool:
    """Equal item rows (alignment padding between segments is not part of any item)."""
    return all(torch.equal(lay.view(a, i, n, m), lay.view(b, i, n, m)) for i in range(len(lay.items)))


def test_fault_switch_swap_and_stale() -> None:
    lay = TransferLayout(_pools(5))
    ds = _deliveries(lay, 12, 4, 1)
    before = [d.payload.clone() for d in ds]
    got = _run(FaultSwitch(FaultSpec(FaultName.SWAP, target=1), lay), ds)
    assert [d.index for d in got] == [0, 1, 2, 3]
    assert _same_rows(lay, got[1].payload, before[2], 12, 4) and _same_rows(lay, got[2].payload, before[1], 12, 4)
    assert not _same_rows(lay, got[1].payload, before[1], 12, 4)
    assert torch.equal(got[0].payload, before[0]) and torch.equal(got[3].payload, before[3])
    ds = _deliveries(lay, 12, 3, 2)
    before = [d.payload.clone() for d in ds]
    got = _run(FaultSwitch(FaultSpec(FaultName.STALE, target=2), lay), ds)
    assert _same_rows(lay, got[2].payload, before[1], 12, 4) and torch.equal(got[1].payload, before[1])
    with pytest.raises(CanaryInputError):
        FaultSpec(FaultName.STALE, target=0)
    # the swap partner is released by flush() when no second transfer comes
    ds = _deliveries(lay, 12, 2, 3)
    got = _run(FaultSwitch(FaultSpec(FaultName.SWAP, target=1), lay), ds)
    assert [d.index for d in got] == [0, 1]


def test_fault_switch_stale_with_shorter_earlier_request() -> None:
    """A stale payload of a shorter request overwrites only the rows it has."""
    lay = TransferLayout(_pools(6))
    g = torch.Generator().manual_seed(0)
    short = Delivery(0, Message(MsgKind.OFFER, req_key=1, full_rows=5, swa_rows=2),
                     torch.randint(0, 256, (lay.payload_bytes(5, 2),), dtype=torch.uint8, generator=g))
    long = Delivery(1, Message(MsgKind.OFFER, req_key=2, full_rows=9, swa_rows=4),
                    torch.randint(0, 256, (lay.payload_bytes(9, 4),), dtype=torch.uint8, generator=g))
    a, b = short.payload.clone(), long.payload.clone()
    got = _run(FaultSwitch(FaultSpec(FaultName.STALE, target=1), lay), [short, long])
    for i in range(len(lay.items)):
        new, old_long, old_short = (lay.view(got[1].payload, i, 9, 4), lay.view(b, i, 9, 4), lay.view(a, i, 5, 2))
        k = old_short.shape[0]
        assert torch.equal(new[:k], old_short) and torch.equal(new[k:], old_long[k:])


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.int32)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_relocation_property(data: st.DataObject) -> None:
    """Any item list (dtypes, row shapes, FULL/SWA), any distinct source/destination slots: exact relocation."""
    n_items = data.draw(st.integers(1, 6))
    full_slots, swa_slots = data.draw(st.integers(1, 24)), data.draw(st.integers(1, 12))
    src_items = []
    for i in range(n_items):
        group = data.draw(st.sampled_from([Group.FULL, Group.SWA]))
        shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=0, max_size=2)))
        dtype = data.draw(st.sampled_from(_DTYPES))
        rows = full_slots if group == Group.FULL else swa_slots
        t = torch.randint(0, 120, (rows, *shape)).to(dtype)
        src_items.append(TransferItem(f"i{i}", t, group, False, i))
    dst_items = _zeroed(src_items)
    n, m = data.draw(st.integers(0, full_slots)), data.draw(st.integers(0, swa_slots))
    perm = data.draw(st.permutations(range(full_slots)))
    perm_swa = data.draw(st.permutations(range(swa_slots)))
    s_full, d_full = torch.tensor(perm[:n], dtype=torch.int64), torch.tensor(perm[::-1][:n], dtype=torch.int64)
    s_swa, d_swa = torch.tensor(perm_swa[:m], dtype=torch.int64), torch.tensor(perm_swa[::-1][:m], dtype=torch.int64)
    src, dst = TransferLayout(src_items), TransferLayout(dst_items)
    buf = src.gather(s_full, s_swa)
    assert buf.numel() == src.payload_bytes(n, m) and buf.numel() % SEGMENT_ALIGN == 0
    kv, canary = src.split_bytes(n, m)
    assert canary == 0 and kv == sum(int(i.tensor[0].numel()) * i.tensor.element_size() *
                                     (n if i.group == Group.FULL else m) for i in src_items)
    dst.scatter(buf, d_full, d_swa)
    for a, b in zip(src_items, dst_items, strict=True):
        s_idx, d_idx = (s_full, d_full) if a.group == Group.FULL else (s_swa, d_swa)
        for j in range(s_idx.numel()):  # row by row: independent of the vectorized copy
            assert torch.equal(a.tensor[int(s_idx[j])], b.tensor[int(d_idx[j])])
