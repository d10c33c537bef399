"""Adapter types: validation with clear CanaryInputError messages; transfer copies."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvcanary.adapter import GroupSpec, PoolDescription, PrefixCacheExport, check_transfer_buffers, copy_transfer
from kvcanary.errors import CanaryInputError
from kvcanary_schema import Group

from .fake_engine import FakeEngine


def _pool(**changes: object) -> PoolDescription:
    return dataclasses.replace(FakeEngine().pool_description(), **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("changes,match", [
    ({"num_slots": 0}, "num_slots"), ({"padding_row": 99}, "padding_row"), ({"token_offset": -1}, "token_offset"),
    ({"groups": []}, "groups"), ({"req_rows": 0}, "req_rows"),
])
def test_pool_validation(changes: dict[str, object], match: str) -> None:
    with pytest.raises(CanaryInputError, match=match):
        _pool(**changes).validate()


@pytest.mark.parametrize("spec,match", [
    (GroupSpec(Group.FULL, 96, halves=3), "halves"),
    (GroupSpec(Group.FULL, 96, reserved_slots=200), "reserved_slots"),
    (GroupSpec(Group.FULL, 50), "table's 96 slots"),
    (GroupSpec(Group.FULL, 96, window=4), "window"),
    (GroupSpec(Group.SWA, 96, window=4), "swa_map"),
    (GroupSpec(Group.SWA, 96, swa_map=torch.zeros(10, dtype=torch.int64), window=4), "swa_map has 10"),
    (GroupSpec(Group.SWA, 96, swa_map=torch.zeros(96, dtype=torch.int64)), "window"),
    (GroupSpec(Group.FULL, 96, halves=2, sources=[[]]), "sources"),
])
def test_group_validation(spec: GroupSpec, match: str) -> None:
    with pytest.raises(CanaryInputError, match=match):
        _pool(groups=[spec]).validate()


def test_duplicate_group_kinds_refused() -> None:
    g = GroupSpec(Group.FULL, 96)
    with pytest.raises(CanaryInputError, match="one group per kind"):
        _pool(groups=[g, g]).validate()


def test_batch_validation() -> None:
    eng = FakeEngine()
    eng.add("a", [1, 2, 3])
    b = eng.batch()
    pool = eng.pool_description()
    b.validate(pool, 4, 16)
    with pytest.raises(CanaryInputError, match="req_capacity"):
        b.validate(pool, 0, 16)
    with pytest.raises(CanaryInputError, match="token_capacity"):
        b.validate(pool, 4, 2)
    for field, bad, match in [("positions", b.positions.float(), "batch.positions"),
                              ("prefix_lens", b.prefix_lens[:0], "batch.prefix_lens"),
                              ("request_ids", [], "request_ids"),
                              ("req_to_token", b.req_to_token[:, :3], "req_to_token"),
                              ("true_tokens", [[1], [2]], "true_tokens"),
                              ("extend_lens_host", [9], "sums to more")]:
        with pytest.raises(CanaryInputError, match=match):
            dataclasses.replace(b, **{field: bad}).validate(pool, 4, 16)


def test_extend_lengths_whose_int64_sum_wraps_are_rejected() -> None:
    eng = FakeEngine()
    for rid in "abcd":
        eng.add(rid, [1, 2])
    b = eng.batch()
    with pytest.raises(CanaryInputError, match="sums to more"):  # 4 * 2^62 wraps to 0
        dataclasses.replace(b, extend_lens_host=[1 << 62] * 4).validate(eng.pool_description(), 8, 16)


def test_export_validation() -> None:
    z = torch.zeros(2, dtype=torch.int64)
    PrefixCacheExport(z, z, z, z, z).validate(torch.device("cpu"))
    with pytest.raises(CanaryInputError, match="export.lens"):
        PrefixCacheExport(z, z, z[:1], z, z).validate(torch.device("cpu"))
    with pytest.raises(CanaryInputError, match="export.unlocked"):
        PrefixCacheExport(z, z, z, z, z, unlocked=z).validate(torch.device("cpu"))


def test_transfer_buffers() -> None:
    a = torch.arange(24, dtype=torch.int64).view(6, 4)
    b = torch.zeros(8, 4, dtype=torch.int64)
    copy_transfer([("x", a)], torch.tensor([1, 3]), [("x", b)], torch.tensor([7, 0]))
    assert b[7].tolist() == a[1].tolist() and b[0].tolist() == a[3].tolist() and int(b[1:7].abs().sum()) == 0
    with pytest.raises(CanaryInputError, match="unique"):
        check_transfer_buffers([("x", a), ("x", a)])
    with pytest.raises(CanaryInputError, match="differ in names"):
        copy_transfer([("x", a)], torch.tensor([1]), [("y", b)], torch.tensor([1]))


_BATCH_TENSORS = ["req_pool_indices", "prefix_lens", "extend_lens", "input_ids", "positions", "out_cache_loc"]


def _bad_forms(t: torch.Tensor) -> list[object]:
    """Wrong dtype, rank, length, device, layout and type of one batch tensor."""
    wide = torch.stack([t, t], 1)
    return [t.float(), t[:, None], t[:-1], t.to("meta"), wide[:, 0], t.tolist()]


@pytest.mark.parametrize("field", _BATCH_TENSORS)
def test_begin_forward_raises_check_tensors_error_before_any_launch(field: str) -> None:
    """Each bad form of each batch tensor raises exactly check_tensor's error, from begin_forward, before a launch."""
    from kvcanary.ops.types import check_tensor

    from .helpers import setup, step
    eng, m = setup(n_reqs=2, prompt_len=3)
    step(eng, m)
    b = eng.batch()
    want_shape = (b.batch_size,) if field in _BATCH_TENSORS[:3] else (b.num_tokens,)
    counters = m.state.sink.counters.clone()
    # input_ids defines the token count: a shorter one is reported against positions
    forms = _bad_forms(getattr(b, field))
    for bad in forms if field != "input_ids" else forms[:2] + forms[3:]:
        with pytest.raises(CanaryInputError) as want:
            check_tensor(bad, f"batch.{field}", dtype=(torch.int32, torch.int64), ndim=1, device=torch.device("cpu"),
                         shape=want_shape)
        with pytest.raises(CanaryInputError) as got:
            m.begin_forward(dataclasses.replace(b, **{field: bad}))
        assert str(got.value) == str(want.value)
    assert torch.equal(m.state.sink.counters, counters) and m.forwards == 1  # nothing ran
    m.begin_forward(b)  # the manager stays usable
