"""The per-forward bracket: clean runs, misuse refused, mode none, no syncs and no allocations in the device parts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kvcanary.config import CanaryConfig
from kvcanary.errors import BackendUnavailableError
from kvcanary.manager import CanaryBracketError, install
from kvcanary_schema import NO_SLOT, FailReason, RecordField
from torch.utils._python_dispatch import TorchDispatchMode

from .fake_engine import FakeEngine
from .helpers import run, setup, step, total


def test_clean_run_with_prefix_hits_padding_and_finish() -> None:
    eng, m = setup(n_reqs=3, fingerprint="all", sweep_interval=3)
    assert total(run(eng, m, 5, pad_to=4)) == 0
    eng.finish("r0")
    eng.add("r0b", [10, 11, 12, 13, 14, 99])  # prefix hit on r0's cached chain
    eng.finish("r1", cache=False)
    reports = run(eng, m, 6, pad_to=4)
    assert total(reports) == 0
    assert sum(r.input_errors for r in reports) == 0
    assert m.sweeps_completed >= 3
    assert not m.health.problems


def test_report_attribution_to_requests() -> None:
    eng, m = setup(n_reqs=2)
    run(eng, m, 2)
    r1 = eng.reqs["r1"]
    slot = int(eng.req_to_token[r1.row, 2])
    m.state.groups[0].head.records[slot, 0, 2] ^= 1  # prev_hash of r1's position 2 (HEAD, K)
    rep = step(eng, m)
    assert rep is not None and rep.total >= 1
    v = [v for v in rep.violations if v.slot == slot][0]
    assert v.request_id == "r1" and v.request_position == 2 and v.req_row == r1.row
    assert rep.request_ids == ["r1"]


@pytest.mark.parametrize("misuse", ["nested", "pre_first", "post_first", "end_early", "sweep_inside", "replay"])
def test_bracket_misuse_refused(misuse: str) -> None:
    eng, m = setup(n_reqs=1)
    b = eng.batch()
    with pytest.raises(CanaryBracketError):
        if misuse == "nested":
            m.begin_forward(b)
            m.begin_forward(b)
        elif misuse == "pre_first":
            m.pre_forward()
        elif misuse == "post_first":
            m.begin_forward(b)
            m.post_forward()
        elif misuse == "end_early":
            m.begin_forward(b)
            m.pre_forward()
            m.end_forward()
        elif misuse == "sweep_inside":
            m.begin_forward(b)
            m.sweep()
        else:
            m.begin_forward(b, kind="replay")  # never captured (and CPU has no graphs)


def test_context_manager_resets_on_error() -> None:
    eng, m = setup(n_reqs=1)
    with pytest.raises(ZeroDivisionError), m.forward(eng.batch()):
        m.pre_forward()
        raise ZeroDivisionError
    with m.forward(eng.batch()) as mm:  # usable again
        mm.pre_forward()
        mm.post_forward()


def test_mode_none_installs_nothing() -> None:
    eng = FakeEngine()
    m = install(eng, CanaryConfig(mode="none"))
    assert not m.enabled and not hasattr(m, "state")
    eng.add("a", [1, 2, 3])
    b = eng.batch()
    m.begin_forward(b)
    m.pre_forward()
    eng.forward(b)
    m.post_forward()
    assert m.end_forward() is None and m.transfer_buffers() == [] and m.flush() is None


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


_SYNC = ("_local_scalar_dense", "item", "nonzero", "to_copy", "_to_cpu")


def _allocating(op: str) -> bool:
    """True for aten ops that return fresh storage (neither in place, nor out=, nor a view)."""
    name = op.split(".")
    base, overload = name[1] if len(name) > 1 else op, name[-1]
    views = {"slice", "select", "view", "as_strided", "alias", "narrow", "expand", "unsqueeze", "squeeze", "t",
             "transpose", "permute", "unbind", "split", "detach", "_reshape_alias", "reshape"}
    return not (base.endswith("_") or overload == "out" or base in views)


@pytest.mark.parametrize("cfg", [{}, {"fingerprint": "all"}, {"coverage": "window", "stripe_size": 2},
                                 {"token_truth": "pool"}])
def test_device_parts_do_not_sync_or_allocate(cfg: dict[str, Any]) -> None:
    try:
        eng, m = setup(n_reqs=3, backend="cpu", **cfg)
        run(eng, m, 2)
    except BackendUnavailableError as e:  # pragma: no cover - no compiler
        pytest.skip(str(e))
    b = eng.batch()
    m.begin_forward(b)
    rec = _Recorder()
    with rec:
        m.pre_forward()
    eng.forward(b)
    with rec:
        m.post_forward()
    m.end_forward()
    probe, t = _Recorder(), torch.zeros(1)
    with probe:  # the recorder sees torch ops (the device parts may issue none: native sequences and bookkeeping)
        t.add_(1)
    assert probe.ops, "the recorder saw nothing"
    assert not [op for op in rec.ops if any(s in op for s in _SYNC)], rec.ops
    assert not [op for op in rec.ops if _allocating(op)], rec.ops


def test_capacity_checks_before_launch() -> None:
    eng = FakeEngine()
    m = install(eng, CanaryConfig(req_capacity=2, token_capacity=64, stats_interval=0, sweep_interval=0))
    for i in range(3):
        eng.add(f"x{i}", [1, 2])
    from kvcanary.errors import CanaryInputError
    with pytest.raises(CanaryInputError, match="req_capacity"):
        m.begin_forward(eng.batch())
    assert m.end_forward is not None  # the manager stays usable
    m2 = install(FakeEngine(), CanaryConfig(token_capacity=3, stats_interval=0, sweep_interval=0))
    e2 = FakeEngine()
    e2.add("y", [1, 2, 3, 4])
    with pytest.raises(CanaryInputError, match="token_capacity"):
        m2.begin_forward(e2.batch())


def test_device_step_and_phase_track_host() -> None:
    eng, m = setup(n_reqs=2)
    run(eng, m, 5)
    assert int(m.state.sink.step[0]) == 5
    assert m.state.phase.tolist() == [5, 5]
    assert torch.equal(m.state.sink.count, torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_invalidate_makes_a_freed_slot_fail_its_next_read(dtype: torch.dtype) -> None:
    eng, m = setup(n_reqs=2)
    assert total(run(eng, m, 2)) == 0
    r1 = eng.reqs["r1"]
    slot = int(eng.req_to_token[r1.row, 1])
    g = m.state.groups[0]
    before = [g.head.records.clone(), g.tail.records.clone()]
    n = g.spec.num_slots
    # slot 0 is reserved, the others outside the pool: left alone
    m.invalidate(torch.tensor([0, slot, -3, n, n + 7], dtype=dtype))
    for records, was in zip((g.head.records, g.tail.records), before, strict=True):  # both buffers
        changed = (records != was).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert changed == [slot] and int(records[slot, 0, RecordField.POSITION]) == NO_SLOT
    rep = step(eng, m)
    assert rep is not None
    hits = [v for v in rep.violations if v.slot == slot]
    assert hits and all(v.request_id == "r1" and FailReason.VERIFY_POSITION in v.reasons for v in hits)
    assert {v.slot for v in rep.violations} <= {slot, int(eng.req_to_token[r1.row, 2])}  # and the next link
