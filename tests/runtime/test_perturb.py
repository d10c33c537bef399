"""Every perturbation mode is caught by exactly the check its table entry names."""

from __future__ import annotations

import pytest
import torch
from kvcanary.adapter import copy_transfer
from kvcanary.config import CanaryConfig, PerturbConfig, PerturbMode
from kvcanary.errors import CanaryInputError
from kvcanary.manager import install
from kvcanary.perturb import EXPECTED
from kvcanary_schema import FailReason, Stage

from .fake_engine import FakeEngine
from .helpers import run, setup, step, total, violations

FP = {"fingerprint": "all"}
# Which other reasons may accompany the named one (a corrupted chain also breaks its successors' links, ...).
ALLOWED = {
    PerturbMode.REQ_TO_TOKEN: FailReason.VERIFY_CHAIN | FailReason.VERIFY_POSITION | FailReason.VERIFY_TOKEN
    | FailReason.VERIFY_FINGERPRINT | FailReason.WRITE_TOKEN,
    PerturbMode.REAL_KV_USED: FailReason.VERIFY_FINGERPRINT,
    PerturbMode.MULTI_BIT_FLIP: FailReason.VERIFY_FINGERPRINT,
    PerturbMode.REAL_KV_POST_FORWARD: FailReason.VERIFY_FINGERPRINT,
    PerturbMode.REAL_KV_UNUSED_CACHED: FailReason.VERIFY_FINGERPRINT,
    PerturbMode.NEXT_TOKEN_SWAP: FailReason.WRITE_TOKEN,
    PerturbMode.SLOT_SWAP: FailReason.VERIFY_TOKEN | FailReason.WRITE_TOKEN,
    # the stolen slot may also be another request's write seed in the same call: which record the seed read sees
    # is backend-dependent (docs/ops-contract.md §5), so a write-position/-token mismatch may accompany the verify
    PerturbMode.USE_AFTER_FREE: FailReason.VERIFY_CHAIN | FailReason.VERIFY_POSITION | FailReason.VERIFY_FINGERPRINT
    | FailReason.VERIFY_TOKEN | FailReason.WRITE_TOKEN | FailReason.WRITE_POSITION,
    PerturbMode.RECORD_FLIP: FailReason.VERIFY_CHAIN | FailReason.WRITE_TOKEN,
}


def _armed(mode: PerturbMode, seed: int, **cfg: object) -> tuple[FakeEngine, object]:
    pcfg = PerturbConfig({mode: 1.0}, warmup_steps=2, seed=seed)
    return setup(n_reqs=3, prompt_len=6, perturb=pcfg, **cfg)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", [PerturbMode.REQ_TO_TOKEN, PerturbMode.REAL_KV_USED, PerturbMode.MULTI_BIT_FLIP,
                                  PerturbMode.NEXT_TOKEN_SWAP, PerturbMode.SLOT_SWAP, PerturbMode.RECORD_FLIP,
                                  PerturbMode.USE_AFTER_FREE, PerturbMode.REAL_KV_POST_FORWARD])
def test_mode_caught_by_its_check(mode: PerturbMode, seed: int) -> None:
    eng, m = _armed(mode, seed, **FP)
    clean = run(eng, m, 2)  # warm-up: nothing fires
    assert total(clean) == 0 and not m.perturber.events
    r = step(eng, m)
    assert m.perturber.events, "the perturbation did not fire"
    ev = m.perturber.events[0]
    assert ev.reason == EXPECTED[mode].reason
    reports = [r] if r is not None else []
    if EXPECTED[mode].when != "this forward" and "stage of the buffer" not in EXPECTED[mode].when:
        m.config.perturb.probabilities  # noqa: B018 - keep firing is fine: every event is checked below
        reports.append(step(eng, m))  # type: ignore[arg-type]
    vs = violations([x for x in reports if x is not None])
    hits = [v for v in vs if v.tag == ev.tag and v.reasons & ev.reason]
    assert hits, f"{mode.value}: expected {ev.reason.name} @ {ev.tag.name}, got {[(v.tag.name, v.reasons) for v in vs]}"
    for v in vs:
        assert not v.reasons & ~ALLOWED[mode], f"{mode.value}: unexpected {v.reasons!r}"
        assert v.tag.stage != Stage.SWEEP


@pytest.mark.parametrize("seed", [0, 1])
def test_unused_cached_caught_by_sweep_only(seed: int) -> None:
    eng = FakeEngine()
    m = install(eng, CanaryConfig(fingerprint="all", sweep_interval=4, sweep_slice=0, stats_interval=0,
                                  perturb=PerturbConfig({PerturbMode.REAL_KV_UNUSED_CACHED: 1.0}, 0, seed)))
    eng.add("old", [40, 41, 42, 43])
    run(eng, m, 2)
    eng.finish("old")  # becomes an unlocked cached chain
    eng.add("new", [1, 2, 3])
    reports = run(eng, m, 4)  # forward 4 is a sweep step
    ev = m.perturber.events[0]
    assert ev.tag.stage == Stage.SWEEP
    vs = violations(reports)
    assert vs and all(v.tag == ev.tag and v.reasons == FailReason.VERIFY_FINGERPRINT for v in vs)
    assert m.sweeps_completed == 1


def test_transfer_corruption_caught_on_receiver() -> None:
    src, ms = setup(n_reqs=1, prompt_len=6)
    run(src, ms, 1)  # prefill on the sender
    dst = FakeEngine()
    md = install(dst, CanaryConfig(stats_interval=0, sweep_interval=0,
                                   perturb=PerturbConfig({PerturbMode.TRANSFER_CORRUPTION: 1.0}, 0, 3)))
    r = src.reqs["r0"]
    sent = src.req_to_token[r.row, :r.kv_len].long()
    q = dst.add("r0", [])
    q.history = list(r.history)
    recv = torch.tensor([dst.free.pop() for _ in range(r.kv_len)], dtype=torch.int64)  # relocated slots
    dst.req_to_token[q.row, :r.kv_len] = recv.int()
    q.kv_len = r.kv_len
    for h in range(src.halves):
        for layer in range(src.layers):
            dst.kv[h][layer][recv] = src.kv[h][layer][sent]
    bufs = ms.transfer_buffers()
    staged = [(n, t.clone()) for n, t in bufs]
    ev = md.perturber.on_transfer(staged, sent, step=1)
    assert ev is not None
    copy_transfer(staged, sent, md.transfer_buffers(), recv)
    vs = violations(run(dst, md, 1))
    assert any(v.tag == ev.tag and v.reasons & FailReason.VERIFY_CHAIN for v in vs)
    assert all(v.tag.stage == Stage.TAIL for v in vs)  # HEAD records arrived intact


def test_clean_transfer_is_silent() -> None:
    src, ms = setup(n_reqs=1, prompt_len=6, fingerprint="all")
    run(src, ms, 1)
    dst = FakeEngine()
    md = install(dst, CanaryConfig(stats_interval=0, sweep_interval=0, fingerprint="all"))
    r = src.reqs["r0"]
    sent = src.req_to_token[r.row, :r.kv_len].long()
    q = dst.add("r0", [])
    q.history = list(r.history)
    recv = torch.tensor([dst.free.pop() for _ in range(r.kv_len)], dtype=torch.int64)
    dst.req_to_token[q.row, :r.kv_len] = recv.int()
    q.kv_len = r.kv_len
    for h in range(src.halves):
        for layer in range(src.layers):
            dst.kv[h][layer][recv] = src.kv[h][layer][sent]
    copy_transfer(ms.transfer_buffers(), sent, md.transfer_buffers(), recv)
    assert total(run(dst, md, 3)) == 0


def test_warmup_gate_and_seed_determinism() -> None:
    def events(seed: int) -> list[str]:
        eng, m = _armed(PerturbMode.REQ_TO_TOKEN, seed)
        run(eng, m, 4)
        return [e.describe() for e in m.perturber.events]
    assert events(5) == events(5)
    eng, m = _armed(PerturbMode.REQ_TO_TOKEN, 0)
    run(eng, m, 2)
    assert not m.perturber.events


def test_fingerprint_modes_refused_without_fingerprint() -> None:
    with pytest.raises(CanaryInputError, match="real_kv_used"):
        install(FakeEngine(), CanaryConfig(fingerprint="none", perturb=PerturbConfig({PerturbMode.REAL_KV_USED: 1.0})))


def test_table_covers_every_mode() -> None:
    assert set(EXPECTED) == set(PerturbMode)
