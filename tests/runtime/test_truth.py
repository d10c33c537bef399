"""Token truth: chain values by default, pool alternative, off misses self-consistent faults, draft +1 offset."""

from __future__ import annotations

import pytest
from kvcanary.adapter import BatchView, PoolDescription
from kvcanary.config import TOKEN_TRUTH_FAULTS, CanaryConfig, PerturbConfig, PerturbMode
from kvcanary.manager import install
from kvcanary_schema import FailReason

from .fake_engine import FakeEngine, kv_value
from .helpers import bracket, run, setup, total, violations


@pytest.mark.parametrize("truth", ["chain", "pool", "off"])
def test_slot_swap_needs_token_truth(truth: str) -> None:
    eng, m = setup(n_reqs=2, prompt_len=6, token_truth=truth,
                   perturb=PerturbConfig({PerturbMode.SLOT_SWAP: 1.0}, warmup_steps=1, seed=0))
    reports = run(eng, m, 3)
    assert m.perturber.events
    vs = violations(reports)
    if truth == "off":
        assert total(reports) == 0  # a swapped, self-consistent chain is invisible without token truth
    else:
        assert any(v.reasons & FailReason.VERIFY_TOKEN for v in vs)


def test_prefix_hit_on_wrong_chain_needs_token_truth() -> None:
    for truth, caught in (("chain", True), ("off", False)):
        eng, m = setup(n_reqs=0, token_truth=truth)
        eng.add("a", [1, 2, 3, 4])
        eng.add("b", [5, 6, 7, 8])
        run(eng, m, 1)
        eng.finish("a")
        eng.finish("b")
        c = eng.add("c", [1, 2, 3, 4, 9])  # hits a's chain ...
        c_slots = eng.cache[1].slots  # ... but the cache hands out b's slots (a radix bug)
        eng.req_to_token[c.row, :4] = eng.req_to_token.new_tensor(c_slots)
        reports = run(eng, m, 1)
        assert (total(reports) > 0) == caught
        if caught:
            assert all(v.reasons & (FailReason.VERIFY_TOKEN | FailReason.WRITE_TOKEN) for v in violations(reports))


def test_pool_truth_appends_incrementally() -> None:
    eng, m = setup(n_reqs=2, token_truth="pool", input_asserts=True)
    assert total(run(eng, m, 4)) == 0
    tp = m.state.token_pool
    assert tp is not None
    r = eng.reqs["r0"]
    assert tp.tokens[r.row, : r.kv_len].tolist() == r.history[: r.kv_len]
    assert int(tp.lens[r.row]) == r.kv_len
    assert m.upload.pool_done[r.row] == r.kv_len  # only the new tokens were appended each forward


def test_no_truth_given_means_no_false_positive() -> None:
    eng, m = setup(n_reqs=2)
    for _ in range(3):
        b = eng.batch()
        b = BatchView(b.req_pool_indices, b.prefix_lens, b.extend_lens, b.req_to_token, b.input_ids, b.positions,
                      b.out_cache_loc, b.request_ids, b.req_pool_indices_host, b.prefix_lens_host,
                      b.extend_lens_host, None)
        bracket(eng, m, b)
    m.flush()
    assert m.reports and all(r.total == 0 for r in m.reports)


class DraftEngine(FakeEngine):
    """A draft pool: the slot at position p holds KV computed for the true token at p + 1."""

    def pool_description(self) -> PoolDescription:
        p = super().pool_description()
        return PoolDescription(p.num_slots, p.req_rows, p.max_context, p.groups, p.device, p.page_size,
                               p.padding_row, token_offset=1)

    def forward(self, batch: BatchView) -> None:
        for s, tok, p in zip(batch.out_cache_loc.tolist(), batch.input_ids.tolist(), batch.positions.tolist(),
                             strict=True):
            for h in range(self.halves):
                for layer in range(self.layers):
                    self.kv[h][layer][s] = kv_value(tok, p, layer, h, self.dim)
        for i, rid in enumerate(batch.request_ids):
            r = self.reqs[rid]  # type: ignore[index]
            r.kv_len = batch.prefix_lens_host[i] + batch.extend_lens_host[i]
            r.history.append(len(r.history) * 13 % 101 + 2)


def _draft_batch(eng: FakeEngine, shift: int) -> BatchView:
    """Draft-pool batch: every request extends to len(history) - 1 with tokens shifted by ``shift``."""
    rows, pres, exts, ids, poss, locs, names, truth = [], [], [], [], [], [], [], []
    for rid, r in eng.reqs.items():
        pre, n = r.kv_len, len(r.history) - 1 - r.kv_len
        slots = [eng.free.pop(0) for _ in range(n)]
        eng.req_to_token[r.row, pre:pre + n] = eng.req_to_token.new_tensor(slots)
        rows.append(r.row)
        pres.append(pre)
        exts.append(n)
        ids += r.history[pre + shift:pre + n + shift]
        poss += list(range(pre, pre + n))
        locs += slots
        names.append(rid)
        truth.append(r.history)
    t = eng.req_to_token.new_tensor
    import torch
    i64 = torch.int64
    return BatchView(t(rows).to(i64), t(pres).to(i64), t(exts).to(i64), eng.req_to_token, t(ids).to(i64),
                     t(poss).to(i64), t(locs).to(i64), names, rows, pres, exts, truth)


@pytest.mark.parametrize("shift,caught", [(1, False), (0, True)])
def test_draft_offset(shift: int, caught: bool) -> None:
    eng = DraftEngine()
    m = install(eng, CanaryConfig(stats_interval=0, sweep_interval=0))
    eng.add("d0", [3, 4, 5, 6, 7])
    eng.add("d1", [8, 9, 10])
    reports = []
    for _ in range(4):
        b = _draft_batch(eng, shift)
        m.begin_forward(b)
        m.pre_forward()
        DraftEngine.forward(eng, b)
        m.post_forward()
        reports.append(m.end_forward())
    vs = violations([r for r in reports if r is not None])
    assert bool(vs) == caught
    if caught:  # stored without the +1 offset: the written tokens contradict the truth
        assert any(v.reasons & FailReason.WRITE_TOKEN for v in vs)


def test_fault_table_is_stated() -> None:
    assert any("slot" in k for k in TOKEN_TRUTH_FAULTS) and all(TOKEN_TRUTH_FAULTS.values())
