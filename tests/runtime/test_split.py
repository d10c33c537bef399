"""The pieces of the bracket alone: Stripes, DeviceProgram (bound once, run at every shape; reuse check), Upload (fast
truth form)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.adapter import BatchView
from kvcanary.errors import CanaryInputError
from kvcanary.health import Coverage
from kvcanary.manager import CanaryManager
from kvcanary.stripes import Stripes
from kvcanary.truth import ChainHasher, chain_truth
from kvcanary.upload import Upload
from kvcanary_schema import CounterCol, Group, Half, LaunchTag, PlanCol, PlanFlag, PlanStatusCol, RecordField, Stage

from .fake_engine import FakeEngine
from .helpers import bracket, run, setup, total

TAIL_K = int(LaunchTag.of(Stage.TAIL, Half.K, Group.FULL))


def test_stripes_walk_the_older_slots_in_passes() -> None:
    s, cov = Stripes(stripe_size=2, window_links=1), Coverage()
    assert [s.end("a", 7, cov) for _ in range(4)] == [2, 4, 6, 2]  # 6 older slots: a pass of 3 stripes, again
    assert s.end("b", 1, cov) == 0 and cov.live["b"] == 1  # nothing older than the window
    assert s.end("a", 7, None) == 4 and s.end("a", 7, None) == 4  # a capture does not advance the cursor
    s.drop("a")
    assert s.end("a", 7, cov) == 2


def _forward(eng: FakeEngine, m: CanaryManager, fast: bool = False) -> None:
    b = eng.batch()
    if fast:
        b = _bulk(b)
    bracket(eng, m, b)


def _bulk(b: BatchView) -> BatchView:
    """The same batch in the bulk form: array host facts and the new tokens' truth (the engine feeds true tokens)."""
    return dataclasses.replace(b, req_pool_indices_host=np.asarray(b.req_pool_indices_host),
                               prefix_lens_host=np.asarray(b.prefix_lens_host),
                               extend_lens_host=np.asarray(b.extend_lens_host),
                               true_new_tokens=b.input_ids.cpu())


def test_program_binds_once_for_every_shape() -> None:
    eng, m = setup(n_reqs=4)
    _decode(eng, m, list(eng.reqs))  # prefill
    stages = m.program.stages(eng.req_to_token)
    post = stages["post", False]
    for n in (1, 3, 4, 2):
        _decode(eng, m, list(eng.reqs)[:n])
    assert m.program.stages(eng.req_to_token) is stages and stages["post", False] is post


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("shape", [(1025, 1), (1, 1 << 20), (-1, 1)])
def test_a_stage_past_its_bound_shape_raises(shape: tuple[int, int], backend: str) -> None:
    """Natively before any op of the stage runs; the torch reference's ops each check their own arguments."""
    eng, m = setup(n_reqs=1, backend=backend)
    _decode(eng, m, list(eng.reqs))
    pre = m.program.stages(eng.req_to_token)["pre", False]
    before = m.state.pre_tick.clone()
    with pytest.raises((ValueError, CanaryInputError), match="bound"):
        for op in pre:
            op(eng.req_to_token, *shape)
    assert backend == "torch" or torch.equal(m.state.pre_tick, before)  # the step tick (the first op) did not run


def _decode(eng: FakeEngine, m: CanaryManager, rids: list[str], shapes: set[tuple[int, int]] | None = None) -> int:
    """One decode forward of ``rids`` (its bound shape added to ``shapes``); the TAIL K records it wrote."""
    before = int(m.state.sink.counters[TAIL_K, CounterCol.ENTRIES_WRITTEN])
    b = eng.batch(rids=rids)
    m.begin_forward(b)
    if shapes is not None:
        shapes.add(m._shape)
    m.pre_forward()
    eng.forward(b)
    m.post_forward()
    m.end_forward()
    return int(m.state.sink.counters[TAIL_K, CounterCol.ENTRIES_WRITTEN]) - before


def test_a_smaller_batch_of_the_same_bound_shape_leaves_no_stale_row() -> None:
    eng, m = setup(n_reqs=4, report_interval=1)
    rids = list(eng.reqs)
    assert _decode(eng, m, rids) == 20 and _decode(eng, m, rids) == 4  # prefill, decode: bound shapes (4, 32), (4, 4)
    assert _decode(eng, m, rids[:3]) == 3  # bound (4, 4) again: the last request's row and token are padding now
    st = m.state
    assert int(st.groups[0].status[PlanStatusCol.NUM_SEGMENTS]) == 3
    assert st.req_pool_indices[3] == eng.padding_row and st.extend_lens[3] == 0 and st.out_cache_loc[3] == -1
    assert _decode(eng, m, rids[:1]) == 1 and m.program.bound_shape(1, 1) == (1, 1)
    assert total(run(eng, m, 2)) == 0 and not m.health.problems


def test_varying_batches_run_at_a_shape_per_power_of_two() -> None:
    eng, m = setup(n_reqs=6)
    shapes: set[tuple[int, int]] = set()
    _decode(eng, m, list(eng.reqs), shapes)  # prefill
    sizes = [1, 2, 3, 4, 5, 6, 5, 3, 6, 1]
    written = [_decode(eng, m, list(eng.reqs)[:n], shapes) for n in sizes]
    assert written == sizes
    assert shapes == {(8, 32), (1, 1), (2, 2), (4, 4), (8, 8)}
    assert total(run(eng, m, 1)) == 0 and not m.health.problems


def test_a_pool_without_a_padding_row_keeps_the_exact_batch_size() -> None:
    """There a row of -1 is an input error (docs/ops-contract.md 2), so rows are not padded; tokens still are."""
    eng, m = setup(n_reqs=6, engine=FakeEngine(padding_row=-1))
    shapes: set[tuple[int, int]] = set()
    _decode(eng, m, list(eng.reqs), shapes)  # prefill
    sizes = [3, 5, 6, 5, 3]
    assert [_decode(eng, m, list(eng.reqs)[:n], shapes) for n in sizes] == sizes
    m.flush()
    assert not m.health.problems and m.metrics.counters["input_errors"] == 0
    assert shapes == {(6, 32), (3, 4), (5, 8), (6, 8)}


def test_reuse_check_runs_only_when_a_request_is_new() -> None:
    eng, m = setup(n_reqs=2)

    def tail_verifies() -> int:
        return int(m.state.sink.counters[TAIL_K, CounterCol.VERIFY_RUNS])
    runs = []
    for _ in range(3):
        before = tail_verifies()
        _forward(eng, m)
        runs.append(tail_verifies() - before)
    eng.add("late", [5, 6, 7])
    before = tail_verifies()
    _forward(eng, m)
    assert runs == [2, 1, 1] and tail_verifies() - before == 2  # TAIL verify + reuse verify on a new request
    m.flush()
    assert not m.health.problems


@pytest.mark.parametrize("flip", [RecordField.TOKEN, RecordField.PREV_HASH])
def test_bulk_truth_form_reports_like_the_list_form(flip: RecordField) -> None:
    out = []
    for fast in (False, True):
        eng, m = setup(n_reqs=3, mode="log")
        for k in range(6):
            if k == 4:
                r = eng.reqs["r1"]
                slot = int(eng.req_to_token[r.row, r.kv_len - 1])
                for g in (m.state.groups[0].head, m.state.groups[0].tail):
                    g.records[slot, 0, flip] += 1  # the newest record, before the next write seeds from it
            _forward(eng, m, fast)
        m.flush()
        rows = sorted((v.tag.name, int(v.reasons), v.slot, v.position) for r in m.reports for v in r.violations)
        out.append((rows, m.state.sink.counters.clone(), m.state.truth_rows.clone()))
    assert out[0][0] and out[0][0] == out[1][0]
    assert torch.equal(out[0][1], out[1][1]) and torch.equal(out[0][2], out[1][2])


def _given(b: BatchView, hasher: ChainHasher, unknown: str | None) -> BatchView:
    """The same batch as an engine that hashes the truth itself hands it over (vLLM's scheduler): expected chains,
    no tokens; ``unknown``'s chains withheld (None)."""
    chains = [(None, None) if rid is None or rid == unknown else
              chain_truth(hasher, rid, hist, p, e) for rid, hist, p, e in
              zip(b.request_ids, b.true_tokens or (), b.prefix_lens_host, b.extend_lens_host, strict=True)]
    return dataclasses.replace(b, true_tokens=None, true_new_tokens=None, expected_chains=chains)


@pytest.mark.parametrize("unknown", [None, "r2"])
def test_given_chains_report_like_the_list_form(unknown: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given chains of held rows take the steady path (every forward after the first): the same reports, counters and
    staged truth as the list form, unknown chains dropped by the flag mask."""
    staged = []
    real = Upload._stage_given

    def counted(self: Upload, *a: Any) -> bool:
        staged.append(real(self, *a))
        return staged[-1]
    monkeypatch.setattr(Upload, "_stage_given", counted)
    out = []
    for with_chains in (False, True):
        eng, m = setup(n_reqs=3, mode="log")
        hasher = ChainHasher()
        for k in range(6):
            if k == 4:
                r = eng.reqs["r1"]
                slot = int(eng.req_to_token[r.row, r.kv_len - 1])
                m.state.groups[0].tail.records[slot, 0, RecordField.TOKEN] += 1
            b = eng.batch()
            if with_chains:
                b = _given(b, hasher, unknown)
            elif unknown is not None:
                b = dataclasses.replace(b, true_tokens=[None if rid == unknown else h for rid, h in
                                                        zip(b.request_ids, b.true_tokens or (), strict=True)])
            bracket(eng, m, b)
        m.flush()
        rows = sorted((v.tag.name, int(v.reasons), v.slot, v.position) for r in m.reports for v in r.violations)
        out.append((rows, m.state.sink.counters.clone(), m.state.truth_rows.clone()))
    assert staged == [True] * 5  # the first forward claims its rows (general path), the other five are steady
    assert out[0][0] and out[0][0] == out[1][0]
    assert torch.equal(out[0][1], out[1][1]) and torch.equal(out[0][2], out[1][2])


def _plan_expects(m: CanaryManager) -> list[int]:
    """The EXPECT_* flags of each planned segment of the FULL group's forward plan (after pre_forward)."""
    g = m.state.groups[0]
    n = int(g.status[PlanStatusCol.NUM_SEGMENTS])
    return (g.plan[:n, PlanCol.FLAGS] & int(PlanFlag.EXPECT_PREFIX | PlanFlag.EXPECT_NEW)).tolist()


@pytest.mark.parametrize("fast", [False, True])
def test_plan_drops_the_flags_of_unknown_truth(fast: bool) -> None:
    """Known truth: every segment expects its chains; no true tokens: the plan itself drops both flags (the staged
    flag mask), and the forward stays clean."""
    eng, m = setup(n_reqs=2)
    _forward(eng, m, fast)
    b = _bulk(eng.batch()) if fast else eng.batch()
    m.begin_forward(b)
    m.pre_forward()
    assert _plan_expects(m) == [int(PlanFlag.EXPECT_PREFIX | PlanFlag.EXPECT_NEW)] * 2
    eng.forward(b)
    m.post_forward()
    m.end_forward()
    b = dataclasses.replace(eng.batch(), true_tokens=None, true_new_tokens=None)
    m.begin_forward(b)
    m.pre_forward()
    assert _plan_expects(m) == [0, 0]
    eng.forward(b)
    m.post_forward()
    m.end_forward()
    assert m.flush() is not None and sum(r.total for r in m.reports) == 0


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("bad", ["token", "dtype", "extend"])
def test_a_steady_decode_with_bad_input_raises_before_any_change(bad: str, backend: str) -> None:
    """begin_decode checks the batch's arrays itself (validate_fit leaves them to it): a bad one raises this library's
    error, the row state stays as it was, and the same forward then runs clean."""
    eng, m = setup(n_reqs=2, backend=backend)
    for _ in range(3):
        _forward(eng, m, fast=True)
    b = _bulk(eng.batch())
    chains = m.upload.chains
    before = (chains.h.copy(), chains.n.copy(), m.upload.requests.seen.copy())
    if bad == "token":
        broken = dataclasses.replace(b, true_new_tokens=torch.full_like(b.true_new_tokens, 1 << 31))
    elif bad == "dtype":
        broken = dataclasses.replace(b, input_ids=b.input_ids.float())
    else:
        broken = dataclasses.replace(b, extend_lens_host=np.asarray(b.extend_lens_host) + 1)
    with pytest.raises(CanaryInputError, match={"token": "true tokens", "dtype": "batch.input_ids",
                                                 "extend": "extend_lens_host"}[bad]):
        m.begin_forward(broken)
    assert all((x == y).all() for x, y in zip(before, (chains.h, chains.n, m.upload.requests.seen), strict=True))
    bracket(eng, m, b)
    assert not m.upload.any_new and (chains.n != before[1]).any()  # the steady decode advanced the rows
    assert m.flush() is not None and sum(r.total for r in m.reports) == 0


@pytest.mark.parametrize("fast", [False, True])
def test_a_row_outside_the_slot_table_is_an_input_error_not_a_crash(fast: bool) -> None:
    """The host bookkeeping treats the row as padding; the plan counts it as an input error (health problem)."""
    eng, m = setup(n_reqs=2, mode="log")
    _forward(eng, m, fast)
    b = _bulk(eng.batch()) if fast else eng.batch()
    bad = m.pool.req_rows + 3
    rows = [bad, *list(b.req_pool_indices_host)[1:]]
    b = dataclasses.replace(b, req_pool_indices=torch.tensor(rows, dtype=b.req_pool_indices.dtype),
                            req_pool_indices_host=np.asarray(rows) if fast else rows)
    m.begin_forward(b)
    m.pre_forward()
    m.post_forward()
    m.end_forward()
    m.flush()
    assert "input_errors" in [p.kind for p in m.health.problems]
    assert m.upload.requests.owner.tolist().count(b.request_ids[0]) == 1  # its old row stays its own, nothing new


def _state(m: CanaryManager) -> list[np.ndarray]:
    """What a begin_forward leaves: the static batch buffers and the per-row truth and request state."""
    st, up = m.state, m.upload
    return [t.cpu().numpy().copy() for t in (st.batch_rows, st.truth_rows, st.batch_tokens)] + \
        [a.copy() for a in (up.chains.h, up.chains.n, up.requests.seen, up.requests.prefix)]


def _steady_against_general(backend: str, forwards: int, run: Callable[[FakeEngine, CanaryManager], None]
                            ) -> list[bool]:
    """``forwards`` forwards (``run`` brackets one) on two engines, one of them with begin_decode switched off (the
    general path only): after each forward both leave the same buffers and row state, and no window has a violation.
    Returns, per forward of the first engine, whether Upload.steady took it."""
    engines = [setup(n_reqs=3, backend=backend) for _ in range(2)]
    engines[1][1].upload._decodes = False
    taken: list[bool] = []
    steady = engines[0][1].upload.steady

    def spy(*args: object) -> list[object] | None:
        ids = steady(*args)  # type: ignore[arg-type]
        taken.append(ids is not None)
        return ids  # type: ignore[return-value]
    engines[0][1].upload.steady = spy  # type: ignore[method-assign]
    for i in range(forwards):
        for eng, m in engines:
            run(eng, m)
        got, want = (_state(m) for _, m in engines)
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), i
    for _, m in engines:
        assert m.flush() is not None and sum(r.total for r in m.reports) == 0
    return taken


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("view", [False, True])
def test_the_steady_path_leaves_what_the_general_path_leaves(backend: str, view: bool) -> None:
    """Padded steady decodes take Upload.steady (one native call), the prefill claims its rows then takes begin_decode,
    and they leave exactly the buffers and row state that the numpy path (begin_decode switched off) leaves for the
    same forwards; also when the slot table is a fresh view
    every forward (as vLLM's block_table[:n])."""
    def run(eng: FakeEngine, m: CanaryManager) -> None:
        b = _bulk(eng.batch(pad_to=4))
        bracket(eng, m, dataclasses.replace(b, req_to_token=b.req_to_token[:]) if view else b)
    # the prefill's requests are new to their rows, every decode is steady
    assert _steady_against_general(backend, 6, run) == [False] + [True] * 5


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_held_batch_keeps_its_own_rows_when_the_engine_reuses_its_array(backend: str) -> None:
    """Upload's held answer (reused while a decode stream's batches repeat) hands begin_decode its own copy of the
    rows: an engine that rewrites the array it passed, after the forward, changes nothing for a later batch of the same
    rows, which still takes the steady path and leaves what the general path leaves."""
    def run(eng: FakeEngine, m: CanaryManager) -> None:
        b = _bulk(eng.batch())
        rows = np.array(b.req_pool_indices_host, dtype=np.int64)
        bracket(eng, m, dataclasses.replace(b, req_pool_indices_host=rows))
        rows[:] = rows[::-1].copy()  # the engine's buffer, reused: other rows in another order
    assert _steady_against_general(backend, 5, run) == [False] + [True] * 4


def test_a_capture_leaves_the_rows_chains_where_they_were() -> None:
    """Nothing runs at a capture: Upload.begin(capture=True) stages the batch's truth but leaves the rows' chains, so
    the real forward of the same batch that follows is still a steady decode, staging the same truth (before, it found
    its rows one token ahead and caught up from the true histories, one Python step per request)."""
    eng, m = setup(n_reqs=3)
    for _ in range(3):
        _forward(eng, m, fast=True)
    b = _bulk(eng.batch())
    chains = m.upload.chains
    h, n = chains.h.copy(), chains.n.copy()
    shape = m.program.bound_shape(b.batch_size, b.num_tokens)
    m.upload.begin(b, m.forwards + 1, True, shape)
    staged = m.state.truth_rows.clone()
    assert np.array_equal(chains.h, h) and np.array_equal(chains.n, n)
    assert m.upload.steady(b, m.forwards + 1, shape)
    assert torch.equal(m.state.truth_rows, staged) and (chains.n != n).any()


_KEYS = st.sampled_from(["a", "b", "c", None])


def _object_array(keys: list[Any]) -> np.ndarray:
    return np.array(keys + [()], dtype=object)[:-1]  # 1-D whatever the keys are


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["held", "held", "claim", "drop"]),
                          st.lists(st.tuples(st.integers(0, 3), _KEYS), min_size=1, max_size=3)), max_size=14),
       st.sampled_from([list, tuple, _object_array]))
def test_held_answers_match_the_owners_after_every_claim_and_drop(ops: list[tuple[str, list[tuple[int, Any]]]],
                                                                  container: Any) -> None:
    """Upload._held reuses its last answer for a batch of the same rows and ids: after any claim or drop in between it
    still answers what the rows' owners say now (the ids as held and the live mask, or None), whether the engine's ids
    come as a list, a tuple or an object array."""
    _, m = setup(n_reqs=0)
    up, req = m.upload, m.upload.requests
    pad = m.pool.padding_row
    last: list[tuple[int, Any]] = []
    for op, batch in ops:
        if op == "claim":
            rows, ka = np.array([r for r, _ in batch], np.int64), np.array([k for _, k in batch], dtype=object)
            req.claim(rows, ka, np.flatnonzero(req.unclaimed(rows, ka, np.not_equal(ka, None))))
        elif op == "drop":
            for _, k in batch:
                req.drop(k)
        # the last batch queried first (its answer is the one kept), then this one twice (the second reuses it)
        for b in ([last] if last else []) + [batch, batch]:
            rows, keys = np.array([r for r, _ in b], np.int64), [k for _, k in b]
            got = up._held(rows, container(keys))
            if req.owner[rows].tolist() != keys:
                assert got is None
                continue
            assert got is not None and got[0] == keys
            assert got[1].tolist() == [r != pad and k is not None for r, k in b]
        last = batch
