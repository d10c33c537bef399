"""kvcanary inside vLLM 0.32 (CPU build): clean runs, faults injected from outside vLLM's code, bad configuration."""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm.config")

import torch  # noqa: E402
from kvcanary_schema import FailReason, Stage  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm_util import BLOCK, Driver, close, connectors, make_llm, tiny_llama  # noqa: E402

BLOCKS = 40  # 1280 tokens of KV for 8 running requests of up to ~370 tokens: preemption
EXTRA = {"fingerprint": "all", "layer_coverage": "all", "sweep_interval": 4, "stats_interval": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"), layers=2)


def workload(seed: int = 7) -> tuple[list[dict[str, Any]], list[SamplingParams]]:
    """Prefix sharing, prompts longer than the token budget, more KV than the cache holds, greedy and seeded."""
    rng = random.Random(seed)
    shared = [[rng.randrange(1, 500) for _ in range(rng.choice([40, 70, 96]))] for _ in range(4)]
    prompts, params = [], []
    for i in range(40):
        body = [rng.randrange(1, 500) for _ in range(rng.randint(10, 200))]
        prompts.append({"prompt_token_ids": shared[i % 4] + body})
        greedy = i % 2 == 0
        # sampled requests draw from the engine's seeded generator (LLM(seed=0)): vLLM 0.32's CPU runner cannot
        # rewind a per-request generator after a chunked prefill ("CPU Generator does not use offset")
        params.append(SamplingParams(max_tokens=rng.randint(24, 72), ignore_eos=True, detokenize=False,
                                     temperature=0.0 if greedy else 0.8))
    return prompts, params


@pytest.fixture(scope="module")
def plain_outputs(model: str) -> list[list[int]]:
    llm = make_llm(model, connector=False, blocks=BLOCKS)
    try:
        prompts, params = workload()
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    finally:
        close(llm)


@pytest.fixture(scope="module")
def llm(model: str, plain_outputs: list[list[int]]) -> Any:
    engine = make_llm(model, EXTRA, blocks=BLOCKS)
    yield engine
    close(engine)


def test_clean_run_matches_vllm_without_the_connector(llm: Any, plain_outputs: list[list[int]]) -> None:
    sched, conn = connectors(llm)
    before = conn.worker.canary.forwards
    prompts, params = workload()
    out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    conn.worker.canary.flush()
    steps = conn.worker.canary.forwards - before
    counts = sched.sched.counts
    print(f"clean run: {steps} engine steps, {dict(counts)}, sweeps {conn.worker.canary.sweeps_completed}")
    assert steps >= 300
    assert counts["preempted"] > 0 and counts["prefix_hits"] > 0 and counts["chunked"] > 0
    assert counts["mixed_steps"] > 0
    assert conn.worker.canary.sweeps_completed > 0
    assert sum(r.total for r in conn.worker.reports) == 0, conn.worker.reports[0].violations[:3]
    # no input errors and no watchdog problem either (violations alone would not show them)
    assert not conn.worker.canary.health.problems, conn.worker.canary.health.problems
    assert out == plain_outputs


# ---- faults ----------------------------------------------------------------------------------------------------

def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


def _start(d: Driver, name: str, tokens: list[int], max_tokens: int = 24, steps: int = 4) -> str:
    d.add(name, tokens, max_tokens)
    for _ in range(steps):
        d.step()
    return d.internal(name)


def _expect(found: list[Any], reason: FailReason, rid: str, step: int | None = None) -> list[Any]:
    hits = [v for v in found if v.reasons & reason and v.request_id == rid and (step is None or v.step == step)]
    got = [(v.reasons, v.request_id, v.step) for v in found][:6]
    assert hits, f"no {reason.name} for {rid} at step {step}; got {got}"
    return hits


def _fresh(llm: Any) -> Driver:
    d = Driver(llm)
    d.run()
    llm.reset_prefix_cache()
    d.violations()
    return d


def test_bit_flip_in_a_cached_block_any_layer(llm: Any) -> None:
    d = _fresh(llm)
    rng = random.Random(1)
    prefix = _prompt(rng, 3 * BLOCK)
    d.add("donor", prefix + _prompt(rng, 10), 4)
    d.run()
    assert not d.violations()
    # the donor's blocks stay cached; flip one bit of V, layer 1, in its second block, token 5, head 1
    block = next(b for b in d.sched.sched.export().blocks if d.sched.sched.first_pos[b] == BLOCK)
    kv = d.worker.kv_caches[d.worker.layers[1]]
    v_run = d.worker.canary.pool.groups[0].sources[0][1 * 2 + 1].tensor  # V half, layer 1, head 1
    assert v_run.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    v_run[block, 5].view(torch.int16)[3] ^= 1 << 4
    victim = _start(d, "reader", prefix + _prompt(rng, 5), steps=1)
    step = d.forwards
    hits = _expect(d.violations(), FailReason.VERIFY_FINGERPRINT, victim, step)
    assert {v.slot for v in hits} == {block * BLOCK + 5}
    assert {v.tag.stage for v in hits} == {Stage.TAIL}
    # quarantine: the corrupted block left vLLM's prefix cache (later hits recompute it)
    d.step()
    assert d.pool.blocks[block].block_hash is None
    d.run()


def test_block_hash_collision_hands_out_another_prefix(llm: Any) -> None:
    d = _fresh(llm)
    rng = random.Random(2)
    a, b = _prompt(rng, 2 * BLOCK + 9), _prompt(rng, 2 * BLOCK + 9)
    d.add("a", a, 2)
    d.step()
    hashes = list(d.sched.sched.reqs[d.internal("a")].block_hashes)
    donor_blocks = d.blocks(d.internal("a"))[:2]
    d.run()
    kvm = d.sched.sched.manager
    orig = kvm.get_computed_blocks

    def collide(request: Any) -> Any:  # a hash collision: b's prompt blocks resolve to a's cached blocks
        if request.request_id.startswith("b-"):
            real = request.block_hashes
            request.block_hashes = hashes[:len(real)]
            try:
                return orig(request)
            finally:
                request.block_hashes = real
        return orig(request)

    kvm.get_computed_blocks = collide
    try:
        victim = _start(d, "b", b, steps=1)
    finally:
        del kvm.get_computed_blocks
    assert d.blocks(victim)[:2] == donor_blocks  # the collision took effect
    _expect(d.violations(), FailReason.VERIFY_TOKEN, victim, d.forwards)
    d.run()


def test_two_requests_block_tables_swapped(llm: Any) -> None:
    d = _fresh(llm)
    rng = random.Random(3)
    r1 = _start(d, "s1", _prompt(rng, 50), 30, steps=0)
    r2 = _start(d, "s2", _prompt(rng, 50), 30, steps=3)
    ib = d.runner.input_batch
    i, j = ib.req_id_to_index[r1], ib.req_id_to_index[r2]
    table = ib.block_table[0].block_table.np
    table[[i, j]] = table[[j, i]]
    d.step()
    found = d.violations()
    _expect(found, FailReason.VERIFY_TOKEN, r1, d.forwards)
    _expect(found, FailReason.VERIFY_TOKEN, r2, d.forwards)
    table[[i, j]] = table[[j, i]]
    d.run()


def test_freed_block_handed_to_a_new_request_while_in_use(llm: Any) -> None:
    d = _fresh(llm)
    rng = random.Random(4)
    old = _start(d, "old", _prompt(rng, 2 * BLOCK + 3), 40, steps=3)
    stolen = d.blocks(old)[0]
    pool = d.pool
    orig = pool.get_new_blocks

    def double_allocate(n: int) -> Any:  # the allocator hands out a block the old request still reads
        blocks = orig(n)
        pool.blocks[stolen].ref_cnt += 1
        return [pool.blocks[stolen], *blocks[1:]]

    pool.get_new_blocks = double_allocate
    try:
        new = _start(d, "new", _prompt(rng, 20), 4, steps=1)
    finally:
        del pool.get_new_blocks
    assert d.blocks(new)[0] == stolen
    # the new request's prefill overwrites the block (KV and records) in the same forward in which the old request
    # reads it: the block is shared, so the old request's rows are checked after that forward
    found = d.violations()
    _expect(found, FailReason.VERIFY_CHAIN | FailReason.VERIFY_FINGERPRINT, old, d.forwards)
    d.step()  # and its records from the next forward on
    _expect(d.violations(), FailReason.VERIFY_CHAIN, old, d.forwards)
    d.run()


def test_whole_block_overwrite(llm: Any) -> None:
    d = _fresh(llm)
    rng = random.Random(5)
    r = _start(d, "w", _prompt(rng, 3 * BLOCK + 1), 40, steps=3)
    src, dst = d.blocks(r)[0], d.blocks(r)[1]
    for name in d.worker.layers:
        d.worker.kv_caches[name][dst].copy_(d.worker.kv_caches[name][src])
    d.step()
    hits = _expect(d.violations(), FailReason.VERIFY_FINGERPRINT, r, d.forwards)
    assert {v.slot // BLOCK for v in hits} == {dst}
    d.run()


def test_prefix_hit_on_blocks_computed_in_the_same_forward_is_clean(llm: Any) -> None:
    """vLLM lets a request hit blocks another request of the same step computes; those rows are checked after the
    forward (their HEAD would otherwise read records not written yet)."""
    d = _fresh(llm)
    rng = random.Random(6)
    shared = _prompt(rng, BLOCK)
    before = d.sched.sched.counts["same_step_hits"]
    for k in range(3):
        d.add(f"same{k}", shared + _prompt(rng, 5), 6)
    d.run()
    assert d.sched.sched.counts["same_step_hits"] > before
    assert not d.violations()
    assert all(len(d.outputs[f"same{k}"]) == 6 for k in range(3))


def test_log_mode_internal_failure_turns_the_canary_off_not_the_engine(llm: Any) -> None:
    """(Last in this module: it switches the shared engine's canary off.)"""
    d = _fresh(llm)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected internal failure")

    d.worker.canary.begin_forward = broken
    d.add("after", list(range(1, 30)), 6)
    d.run()
    assert len(d.outputs["after"]) == 6
    assert d.worker.canary is None and "injected" in str(d.conn.failures[-1])
