"""Coverage policy `window`: newest links every forward, a rotating stripe of older slots; worst-case time-to-detect."""

from __future__ import annotations

import math

import pytest
from kvcanary_schema import RecordField, Stage

from .helpers import setup, step


def _forwards_to_detect(index: int, stripe: int, links: int, prompt: int, stage: Stage) -> tuple[int, int]:
    """Corrupt the record at ``index`` of a running request; (forwards until reported, older slots at detection)."""
    eng, m = setup(n_reqs=1, prompt_len=prompt, coverage="window", stripe_size=stripe, window_links=links)
    for _ in range(1 + index % 3):  # vary the stripe cursor's phase
        step(eng, m)
    r = eng.reqs["r0"]
    slot, succ = eng.req_to_token[r.row, index:index + 2].tolist()
    g = m.state.groups[0]
    (g.head if stage == Stage.HEAD else g.tail).records[slot, 1, RecordField.POSITION] += 1000
    for n in range(1, 200):
        older = r.kv_len - links
        rep = step(eng, m)
        if rep is not None and rep.total:
            assert all(v.slot in (slot, succ) and v.tag.stage == stage for v in rep.violations)  # it or its link
            return n, older
    raise AssertionError("never detected")


@pytest.mark.parametrize("stripe,links", [(3, 1), (8, 2)])
def test_worst_case_time_to_detect(stripe: int, links: int) -> None:
    prompt = 20
    for index in range(prompt - links):
        for stage in [(Stage.HEAD, Stage.TAIL)[index % 2]]:
            n, older = _forwards_to_detect(index, stripe, links, prompt, stage)
            # the stated bound: 2 * ceil((prefix_len - window_links) / stripe_size) forwards of the request
            assert n <= 2 * math.ceil(older / stripe), (index, stage, n, older)


def test_static_prefix_bound_is_one_pass() -> None:
    """A request whose prefix does not grow (e.g. waiting on a long extend elsewhere): one pass suffices."""
    stripe, prompt = 3, 20
    for index in range(0, prompt - 1, 2):
        eng, m = setup(n_reqs=1, prompt_len=prompt, coverage="window", stripe_size=stripe, window_links=1)
        step(eng, m)
        r = eng.reqs["r0"]
        for _ in range(index % 4):
            m.begin_forward(_frozen(eng))
            m.pre_forward()
            m.post_forward()
            m.end_forward()
        slot = int(eng.req_to_token[r.row, index])
        m.state.groups[0].head.records[slot, 0, RecordField.POSITION] += 9
        n = 0
        for n in range(1, 50):  # noqa: B007 - n is read after the loop
            m.begin_forward(_frozen(eng))
            m.pre_forward()
            m.post_forward()
            rep = m.end_forward()
            if rep is not None and rep.total:
                break
        assert n <= math.ceil((prompt - 1) / stripe), (index, n)


def _frozen(eng: object) -> object:
    """A verify-only forward of r0 (no new tokens): the prefix stays put."""
    from kvcanary.adapter import BatchView
    r = eng.reqs["r0"]  # type: ignore[attr-defined]
    t = eng.req_to_token  # type: ignore[attr-defined]
    import torch
    z = torch.zeros(0, dtype=torch.int64)
    one = torch.tensor
    return BatchView(one([r.row]), one([r.kv_len]), one([0]), t, z, z, z, ["r0"], [r.row], [r.kv_len], [0],
                     [r.history])


def test_newest_links_checked_every_forward() -> None:
    for links in (1, 3):
        for back in range(1, links + 1):
            eng, m = setup(n_reqs=1, prompt_len=20, coverage="window", stripe_size=2, window_links=links)
            step(eng, m)
            r = eng.reqs["r0"]
            slot = int(eng.req_to_token[r.row, r.kv_len - back])
            m.state.groups[0].head.records[slot, 0, RecordField.POSITION] += 5
            rep = step(eng, m)
            assert rep is not None and rep.total >= 1, (links, back)


def test_full_policy_detects_in_one_forward() -> None:
    eng, m = setup(n_reqs=1, prompt_len=20)
    step(eng, m)
    slot = int(eng.req_to_token[eng.reqs["r0"].row, 3])
    m.state.groups[0].tail.records[slot, 0, RecordField.POSITION] += 7
    rep = step(eng, m)
    assert rep is not None and rep.total >= 1


def test_window_policy_checks_fewer_entries() -> None:
    from kvcanary_schema import CounterCol
    counts = {}
    for policy in ("full", "window"):
        eng, m = setup(n_reqs=2, prompt_len=40, coverage=policy, stripe_size=4, window_links=1)
        for _ in range(3):
            step(eng, m)
        counts[policy] = int(m.state.sink.counters[:, CounterCol.ENTRIES_CHECKED].sum())
    assert counts["window"] < counts["full"] / 3
