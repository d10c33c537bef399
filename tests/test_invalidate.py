"""invalidate (docs/ops-contract.md 11): a hand vector, torch vs C++ CPU vs a Python-list model, bad arguments."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary import _native
from kvcanary.errors import CanaryInputError
from kvcanary.ops.invalidate import bind_invalidate, invalidate
from kvcanary_schema import NO_SLOT, RECORD_NUM_FIELDS, RecordField

BACKENDS = ["torch", "cpu"]


def model(records: list, slots: list[int], reserved: int) -> list:
    """The contract on nested lists [B][S][H][F]."""
    poisoned = [NO_SLOT if f == RecordField.POSITION else 0 for f in range(RECORD_NUM_FIELDS)]
    for s in slots:
        if reserved <= s < len(records[0]):
            for buf in records:
                buf[s] = [list(poisoned) for _ in buf[s]]
    return records


def records_of(b: int, s: int, h: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2**40, 2**40, (b, s, h, RECORD_NUM_FIELDS), generator=gen, dtype=torch.int64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_hand_vector(backend: str, dtype: torch.dtype) -> None:
    rec = records_of(2, 6, 2)
    want = rec.clone()
    for s in (3, 5):  # 3 twice; 0 reserved; 6, 9 and -1 outside the pool
        want[:, s] = 0
        want[:, s, :, RecordField.POSITION] = NO_SLOT
    invalidate(rec, torch.tensor([3, 0, 9, -1, 6, 5, 3], dtype=dtype), 1, backend)
    assert torch.equal(rec, want)
    assert rec[1, 5, 1].tolist() == [0, NO_SLOT, 0, 0]


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(0, 40), h=st.integers(1, 2), data=st.data())
def test_matches_the_list_model(b: int, s: int, h: int, data: st.DataObject) -> None:
    reserved = data.draw(st.integers(0, s))
    slots = data.draw(st.lists(st.integers(-5, s + 5), max_size=30))
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    base = records_of(b, s, h, seed=len(slots))
    want = model(base.tolist(), slots, reserved)
    for backend in BACKENDS:
        rec = base.clone()
        invalidate(rec, torch.tensor(slots, dtype=dtype), reserved, backend)
        assert rec.tolist() == want, backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bound_call_takes_each_list(backend: str) -> None:
    rec = records_of(1, 8, 1)
    run = bind_invalidate(rec, 2, backend)
    run(torch.tensor([4]))
    run(torch.tensor([], dtype=torch.int64))
    run(torch.tensor([1, 7], dtype=torch.int32))
    assert rec[0, :, 0, RecordField.POSITION].eq(NO_SLOT).nonzero().flatten().tolist() == [4, 7]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_raise_before_any_change(backend: str) -> None:
    rec = records_of(2, 5, 2)
    was = rec.clone()
    slots = torch.tensor([1, 2])
    cases: list[tuple[object, object, object, str]] = [
        (rec.float(), slots, 0, "records"), (rec[0], slots, 0, "records"), (rec[..., :3], slots, 0, "records"),
        (rec.transpose(0, 1), slots, 0, "records"), (records_of(1, 5, 3), slots, 0, "records"),
        (rec[:0], slots, 0, "records"), (rec, slots, -1, "reserved"), (rec, slots, 6, "reserved"),
        (rec, slots, True, "reserved"), (rec, slots.float(), 0, "slots"), (rec, slots.view(1, 2), 0, "slots"),
        (rec, torch.arange(4)[::2], 0, "slots"), (rec, slots.to("meta"), 0, "slots"), (rec, [1, 2], 0, "slots"),
    ]
    for records, s, reserved, match in cases:
        with pytest.raises(CanaryInputError, match=match):
            invalidate(records, s, reserved, backend)  # type: ignore[arg-type]
    assert torch.equal(rec, was)


def test_native_entry_validates_again() -> None:
    fn = _native.module("cpu").invalidate
    rec = records_of(2, 5, 1)
    was = rec.clone()
    for records, slots, reserved in ((rec, torch.tensor([1.0]), 0), (rec, torch.tensor([1]), 6),
                                     (rec.view(10, 1, 4), torch.tensor([1]), 0), (rec[..., :2], torch.tensor([1]), 0),
                                     (rec, torch.tensor([[1]]), 0), (rec, torch.tensor([1]), -1)):
        with pytest.raises((TypeError, ValueError)):
            fn(records, slots, reserved)
    assert torch.equal(rec, was)
