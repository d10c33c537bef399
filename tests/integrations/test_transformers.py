"""kvcanary inside transformers 5.23.0 continuous batching: clean runs, injected faults, install/uninstall (CPU)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hf_util import (  # skips the module without transformers 5.23.0
    PAGE,
    cb_config,
    distinct_prompts,
    full_alloc,
    gen_config,
    generate,
    run_manager,
    shared_prefix_prompts,
    tiny_llama,
    tiny_qwen3,
    wrap_instance,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.config import CanaryConfig
from kvcanary.errors import CanaryInputError
from kvcanary.integrations import transformers as kt
from kvcanary.ops.slot_rows import slot_rows
from kvcanary.report import CanaryViolationError, Violation
from kvcanary.truth import new_token_truth
from kvcanary_schema import NO_SLOT, FailReason, Group, Half, LaunchTag, Stage

VERIFY_ANY = FailReason.VERIFY_CHAIN | FailReason.VERIFY_POSITION | FailReason.VERIFY_TOKEN
WRAPPED_NAMES = ("_generation_step", "prepare_batch_tensors", "update", "free_blocks",
                 "mark_complete_blocks", "copy_blocks", "search_prefix_match", "evict_cached_blocks", "reset",
                 "_create_batch_processor", "get_result", "stop", "init_continuous_batching", "generate_batch")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models: intra-op threads only add contention on a 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny_llama()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return shared_prefix_prompts()


@pytest.fixture(scope="module")
def baseline(llama: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Tokens without kvcanary (max_batch_tokens=24: chunked prefill, later prompts hit cached prefix blocks)."""
    return generate(llama, prompts, max_batch_tokens=24)


def raise_config(**over: Any) -> CanaryConfig:
    """RAISE mode, fingerprints of every layer and half, torch reference backend."""
    kw: dict[str, Any] = {"mode": "raise", "fingerprint": "all", "layer_coverage": "all", "half_coverage": "each",
                          "sweep_interval": 0,
                          "backend": "torch"}
    kw.update(over)
    return CanaryConfig(**kw)


def no_wrappers_left(*objs: Any) -> bool:
    return all(name not in vars(o) for o in objs for name in WRAPPED_NAMES)


def tags(vs: list[Violation]) -> set[LaunchTag]:
    return {v.tag for v in vs}


# ---------------------------------------------------------------------------------------------------------- clean runs


def test_clean_shared_prefix_generate_batch(llama: Any, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    """Prefix hits + de-dup + chunked prefill + sweeps: zero violations, the same tokens, everything restored."""
    handle = kt.install(llama, raise_config(sweep_interval=2))
    try:
        out = generate(llama, prompts, max_batch_tokens=24)
        canary = handle.last_canary
    finally:
        handle.uninstall()
    assert out == baseline
    assert handle.total_violations == 0 and handle.errors == []
    st = handle.stats
    assert st["forwards"] >= 8 and st["prefix_hits"] >= 2 and st["prefix_hit_tokens"] >= 2 * PAGE, st
    assert st["requests_released"] == len(prompts) and st.get("write_problems", 0) == 0, st
    assert canary is not None and canary.sweeps_completed >= 2
    assert canary.metrics.counters["entries_checked"] > 0 and canary.metrics.counters["entries_written"] > 0
    # no input errors and no watchdog problem (a clean run flags none; violations alone would not show them)
    assert canary.metrics.counters["input_errors"] == 0 and not canary.health.problems, canary.health.problems
    assert no_wrappers_left(llama)
    assert generate(llama, prompts, max_batch_tokens=24) == baseline  # still fine after uninstall


def test_clean_sequential_prefix_hits_manager(llama: Any, prompts: list[list[int]], baseline: list[list[int]]) -> None:
    """install(manager): sequential requests hit the blocks of finished ones (cached, unreferenced), sweeps on."""
    mgr = llama.init_continuous_batching(generation_config=gen_config(8), continuous_batching_config=cb_config(24))
    with kt.install(mgr, raise_config(sweep_interval=3)) as handle:
        mgr.start()
        try:
            got = []
            for i, p in enumerate(prompts):
                mgr.add_request(p, request_id=f"s{i}", max_new_tokens=8)
                r = mgr.get_result(request_id=f"s{i}", timeout=60)
                assert r is not None and r.error is None
                got.append(r.generated_tokens)
        finally:
            mgr.stop(block=True)
        assert handle.stats["prefix_hit_tokens"] >= 3 * 2 * PAGE, handle.stats
    mgr.destroy()
    assert got == baseline and handle.total_violations == 0 and handle.errors == []
    assert no_wrappers_left(mgr, llama)


def test_clean_persistent_manager_across_calls(llama: Any, prompts: list[list[int]]) -> None:
    """persistent_manager=True: the second generate_batch hits blocks the first one cached (records kept)."""
    with kt.install(llama, raise_config(sweep_interval=2)) as handle:
        for chunk in (prompts[:2], prompts[2:]):
            llama.generate_batch(chunk, generation_config=gen_config(4), continuous_batching_config=cb_config(),
                                 warmup=False, persistent_manager=True)
        assert len(handle.canaries) == 1 and handle.stats["prefix_hit_tokens"] >= 2 * 2 * PAGE, handle.stats
        llama.destroy_cached_continuous_batching_manager()
    assert handle.total_violations == 0 and handle.errors == [] and no_wrappers_left(llama)


@pytest.mark.parametrize("over", [{}, {"token_truth": "pool", "coverage": "window", "stripe_size": 8,
                                      "fingerprint": "partial", "input_asserts": True}])
def test_clean_under_memory_pressure(llama: Any, over: dict[str, Any]) -> None:
    """16 blocks for 6 requests: cached blocks are evicted and a request is soft-reset (freed, re-prefilled under the
    same id); sweeps every forward see only valid chains. Also with the expected-token pool and window coverage."""
    prompts = shared_prefix_prompts(40, (5, 9, 17, 3, 21, 30))

    def run() -> list[list[int]]:
        out = llama.generate_batch(prompts, generation_config=gen_config(20),
                                   continuous_batching_config=cb_config(64, num_blocks=16), warmup=False)
        return [r.generated_tokens for r in out.values()]

    ref = run()
    with kt.install(llama, raise_config(sweep_interval=1, **over)) as handle:
        out = run()
        canary = handle.last_canary
    st = handle.stats
    assert out == ref and handle.total_violations == 0
    assert st["evictions"] >= 1 and st["requests_released"] > len(prompts), st  # a soft reset released one twice
    assert canary is not None and canary.sweeps_completed == st["forwards"]


def test_evictions_of_nothing_change_nothing(llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under its safety margin transformers tries an eviction every step. A try that evicts nothing changes nothing,
    so the hashes are not rescanned for it: fewer scans than tries, still clean, and the wrappers' time counted."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache as cache_cls
    tries, scans = [0], [0]
    evict, forget = cache_cls.evict_cached_blocks, kt.HFPoolAdapter.forget_hashes

    def counted_evict(self: Any) -> Any:
        tries[0] += 1
        return evict(self)

    def counted_forget(self: kt.HFPoolAdapter) -> None:
        scans[0] += 1
        forget(self)
    monkeypatch.setattr(cache_cls, "evict_cached_blocks", counted_evict)
    monkeypatch.setattr(kt.HFPoolAdapter, "forget_hashes", counted_forget)
    prompts = shared_prefix_prompts(40, (5, 9, 17, 3, 21, 30))
    with kt.install(llama, raise_config(sweep_roll_interval=1)) as handle:
        llama.generate_batch(prompts, generation_config=gen_config(20),
                             continuous_batching_config=cb_config(64, num_blocks=16), warmup=False)
    assert handle.total_violations == 0 and handle.stats["evictions"] >= 1
    assert tries[0] > handle.stats["evictions"] and scans[0] < tries[0], (tries, scans, handle.stats)
    st = handle.stats  # the wrappers' own host time, outside the bracket, and the total
    assert st["lifecycle_us"] > 0 and st["snapshot_us"] > 0 and st["bracket_us"] > 0
    assert handle.host_us == st["bracket_us"] + st["snapshot_us"] + st["lifecycle_us"]


def test_clean_fork_copies_records(llama: Any, prompts: list[list[int]]) -> None:
    """num_return_sequences=3: forks copy their partial blocks, and the canary records with them."""
    handle = kt.install(llama, raise_config())
    try:
        out = llama.generate_batch(prompts[:2], generation_config=gen_config(5, do_sample=True, num_return_sequences=3),
                                   continuous_batching_config=cb_config(), warmup=False)
    finally:
        handle.uninstall()
    assert len(out) == 6 and all(r.error is None for r in out.values())
    assert handle.stats["blocks_copied"] > 0 and handle.total_violations == 0, handle.stats


def test_fork_without_record_copy_is_detected(llama: Any, prompts: list[list[int]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The record copy is what keeps forks clean: without it the children's copied slots fail verification."""
    monkeypatch.setattr(kt.HFPoolAdapter, "copy_records", lambda self, canary, src, dst: None)
    handle = kt.install(llama, raise_config(mode="log"))
    try:
        llama.generate_batch(prompts[:1], generation_config=gen_config(4, do_sample=True, num_return_sequences=2),
                             continuous_batching_config=cb_config(), warmup=False)
    finally:
        handle.uninstall()
    vs = handle.violations
    assert vs and {v.request_id for v in vs} == {"req_0__child#0"}


def test_clean_qwen3(prompts: list[list[int]]) -> None:
    model = tiny_qwen3()
    ref = generate(model, prompts[:3], max_new_tokens=5, max_batch_tokens=24)
    with kt.install(model, raise_config(sweep_interval=2)) as handle:
        out = generate(model, prompts[:3], max_new_tokens=5, max_batch_tokens=24)
    assert out == ref and handle.total_violations == 0 and handle.stats["prefix_hits"] >= 1


def test_clean_eager_attention(prompts: list[list[int]]) -> None:
    """attn_implementation='eager' runs as 'paged|eager', whose KV writes go through the same wrapped update."""
    model = tiny_llama()
    model.set_attn_implementation("eager")
    ref = generate(model, prompts[:3], max_new_tokens=4, max_batch_tokens=24)
    with kt.install(model, raise_config()) as handle:
        out = generate(model, prompts[:3], max_new_tokens=4, max_batch_tokens=24)
    assert out == ref and handle.total_violations == 0 and handle.stats.get("write_problems", 0) == 0


def test_log_mode_keeps_generating(llama: Any, prompts: list[list[int]]) -> None:
    """LOG mode never raises: the run finishes and the violations are on the handle (here: a reused block)."""
    handle = kt.install(llama, raise_config(mode="log"))
    try:
        res = run_manager(llama, distinct_prompts(), max_new_tokens=6, max_batch_tokens=24,
                          inject=reuse_live_block(victim="r0", thief="r1"))
    finally:
        handle.uninstall()
    assert len(res) == 2 and handle.errors == []
    assert "r0" in {v.request_id for v in handle.violations}


def stray_writes_from(forward: int, counts: dict[str, int]) -> Callable[[Any], None]:
    """From the ``forward``-th forward on (0-based), layer 1 writes its KV through a copy of the batch's write index:
    the same slots, so the KV and the canary's records stay right; only the write check can see it."""
    def inject(proc: Any) -> None:
        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def update(key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: Any) -> Any:
                counts["forwards"] += layer_idx == 0
                if layer_idx != 1 or counts["forwards"] <= forward:
                    return orig(key_states, value_states, layer_idx, kwargs)
                counts["stray"] += 1
                index = kwargs["write_index"]  # transformers updates kwargs in place: swap this one entry back
                kwargs["write_index"] = index.clone() if isinstance(index, torch.Tensor) else [i.clone() for i in index]
                try:
                    return orig(key_states, value_states, layer_idx, kwargs)
                finally:
                    kwargs["write_index"] = index
            return update
        wrap_instance(proc.cache, "update", make)
    return inject


@pytest.mark.parametrize("start", [0, 5])
def test_kv_writes_outside_the_batch_view_are_detected(llama: Any, start: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer writing KV through another index than the batch's is reported: at once on a forward of a new batch
    shape (start 0: the first forward), else by the next periodic check (start 5: decode forwards of shapes already
    checked; a check every 4 forwards here). A shape that failed stays checked on every forward."""
    monkeypatch.setattr(kt, "WRITE_CHECK_INTERVAL", 4)
    counts: dict[str, int] = {"forwards": 0, "stray": 0}
    seen: list[tuple[int, int]] = []  # (layer writes, stray writes) of each checked forward
    check = kt._Session._check_writes

    def spy(self: Any, shape: tuple[int, int]) -> None:
        seen.append((self.layer_writes, self.stray_writes))
        check(self, shape)
    monkeypatch.setattr(kt._Session, "_check_writes", spy)
    handle = kt.install(llama, raise_config(mode="log"))
    try:
        run_manager(llama, distinct_prompts(), max_new_tokens=12, inject=stray_writes_from(start, counts))
    finally:
        handle.uninstall()
    st = handle.stats
    assert counts["stray"] > 0 and st["write_problems"] >= 1 and st["forwards"] == counts["forwards"], (counts, st)
    assert (2, 1) in seen and all(writes == 2 for writes, _ in seen), seen  # each check saw both layers' writes
    if start == 0:
        assert st["write_problems"] == st["write_checks"] == st["forwards"], st
    else:
        assert st["write_checks"] < st["forwards"], st


def test_kv_writes_are_checked_on_new_shapes_and_periodically(llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Clean run: every new batch shape's first forward is checked and one forward in WRITE_CHECK_INTERVAL; the
    others run without the hook (it counts no write)."""
    monkeypatch.setattr(kt, "WRITE_CHECK_INTERVAL", 5)
    hooked: list[bool] = []
    arm = kt._Session._arm_write_check

    def spy(self: Any, batch: Any) -> bool:
        check = arm(self, batch)
        hooked.append(getattr(full_alloc(self.proc).update, "__kvcanary__", False))
        return check
    monkeypatch.setattr(kt._Session, "_arm_write_check", spy)
    handle = kt.install(llama, raise_config())
    try:
        run_manager(llama, distinct_prompts(), max_new_tokens=16)
    finally:
        handle.uninstall()
    st = handle.stats
    assert st.get("write_problems", 0) == 0 and 0 < st["write_checks"] == sum(hooked) < st["forwards"], st
    assert all(hooked[i] for i in range(0, len(hooked), 5)), hooked


# ------------------------------------------------------------------------------------------------------ injected faults


def expect_violation(run: Callable[[], object]) -> CanaryViolationError:
    with pytest.raises(CanaryViolationError) as info:
        run()
    return info.value


@pytest.mark.parametrize("half", [Half.K, Half.V])
def test_corrupt_cached_prefix_block_before_hit(llama: Any, prompts: list[list[int]], half: Half) -> None:
    """Flip one K (V) element of layer 1 in a cached block; the next request hitting it fails TAIL's fingerprint."""
    corrupted: dict[str, int] = {}

    def corrupt(mgr: Any, i: int) -> None:
        if i != 0:
            return
        alloc = full_alloc(mgr.batch_processor)
        block = alloc.ledger.hash_to_block[kt_block_hash(prompts[0][:PAGE])]
        assert block in alloc.ledger.cached_blocks
        slot = block * alloc.block_physical_stride + 3
        row = alloc._kv_token_views[1][int(half)][slot]
        row[0, 0] = row[0, 0] * -3.0 + 1.0
        corrupted["block"] = block

    handle = kt.install(llama, raise_config())
    try:
        err = expect_violation(lambda: run_manager(llama, prompts[:2], sequential=True, between=corrupt,
                                                   max_new_tokens=3))
    finally:
        handle.uninstall()
    tag = LaunchTag.of(Stage.TAIL, half, Group.FULL)
    hits = [v for v in err.violations if v.tag == tag]
    assert hits and err.request_ids == ["r1"], err
    v = hits[0]
    assert v.reasons & FailReason.VERIFY_FINGERPRINT and v.position == 3 and v.request_id == "r1"
    assert v.slot == corrupted["block"] * PAGE + 3
    # HEAD (no fingerprint) saw nothing: the records are intact (the rolling sweep's slice of that step may pass the
    # block too)
    assert tags(err.violations) <= {tag, LaunchTag.of(Stage.SWEEP, half, Group.FULL)}


def test_sweep_catches_corruption_of_a_block_nobody_reads(llama: Any, prompts: list[list[int]]) -> None:
    """A cached block that no later request hits is only reachable by the sweep (SWEEP tag, no request)."""
    def corrupt(mgr: Any, i: int) -> None:
        if i == 0:
            alloc = full_alloc(mgr.batch_processor)
            h0 = kt_block_hash(prompts[0][:PAGE])
            shared = {alloc.ledger.hash_to_block[h] for h in (h0, kt_block_hash_chain(h0, prompts[0][PAGE:2 * PAGE]))}
            (block,) = set(alloc.ledger.cached_blocks) - shared  # r0's third block: positions 32..47
            alloc._kv_token_views[0][0][block * alloc.block_physical_stride + 7].mul_(2.0)

    with kt.install(llama, raise_config(sweep_interval=1)):
        err = expect_violation(lambda: run_manager(llama, prompts[:2], sequential=True, between=corrupt,
                                                   max_new_tokens=6))
    assert tags(err.violations) == {LaunchTag.SWEEP_K_FULL} and err.request_ids == []
    assert [(v.position, v.reasons) for v in err.violations] == [(2 * PAGE + 7, FailReason.VERIFY_FINGERPRINT)]


def test_rolling_sweep_catches_a_bit_flip_in_a_block_completed_during_decode(
        llama: Any, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The default policy's per-forward fingerprint samples the first layer's K: one flipped bit in layer 1 of a running
    request's own block, completed during its decode, is seen only by the rolling sweep against the seal. So a block a
    decode completes must join the sweep's export while its request still runs (SWEEP tag, that block's position)."""
    target, done = 3, {}  # r0's block 3 (positions 48..63) completes 19 tokens into its decode (a 45-token prompt)
    view = kt.HFPoolAdapter.batch_view

    def flip_once(self: kt.HFPoolAdapter, io: Any, batch: Any) -> Any:
        bt = self.alloc.block_table.get("r0", [])
        if not done and len(bt) > target and bt[target] in self.alloc.ledger.block_to_hash:
            slot = bt[target] * self.alloc.block_physical_stride + 5
            self.alloc._kv_token_views[1][0][slot].view(-1)[-1:].view(torch.int32)[0] ^= 1  # a mantissa bit
            done["slot"] = bt[target] * PAGE + 5
        return view(self, io, batch)
    monkeypatch.setattr(kt.HFPoolAdapter, "batch_view", flip_once)
    assert len(prompts[0]) == 45
    with kt.install(llama, CanaryConfig(mode="raise", backend="torch", sweep_roll_interval=1)):
        err = expect_violation(lambda: run_manager(llama, prompts[:1], max_new_tokens=3 * PAGE))
    assert done and tags(err.violations) == {LaunchTag.SWEEP_K_FULL}
    assert {(v.slot, v.position) for v in err.violations} == {(done["slot"], target * PAGE + 5)}
    assert all(v.reasons & FailReason.VERIFY_FINGERPRINT for v in err.violations)


def kt_block_hash_chain(parent: int, tokens: list[int]) -> int:
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash

    return int(compute_block_hash(parent, tokens))


def kt_block_hash(tokens: list[int]) -> int:
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash

    return int(compute_block_hash(None, tokens))


def test_corrupt_read_index(llama: Any) -> None:
    """Swap two read-index entries of one request (attention reads position P where 0 should be)."""
    seen: dict[str, Any] = {}

    def inject(proc: Any) -> None:
        io = proc.inputs_and_outputs

        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def prepare_batch_tensors(*a: Any, **k: Any) -> Any:
                out = orig(*a, **k)
                if "rid" not in seen and io.true_read_sizes[0] > 0:
                    start = 0
                    for fs in io.requests_in_batch:
                        past = fs.state.position_offset - fs.query_length
                        if past >= 2 * PAGE:
                            rs = io.read_index_storage[0]
                            a0, a1 = rs[start].item(), rs[start + PAGE].item()
                            rs[start], rs[start + PAGE] = a1, a0
                            seen["rid"] = fs.state.request_id
                            break
                        start += past + fs.query_length
                return out
            return prepare_batch_tensors
        wrap_instance(io, "prepare_batch_tensors", make)

    with kt.install(llama, raise_config()):
        err = expect_violation(lambda: run_manager(llama, distinct_prompts(), inject=inject))
    assert err.request_ids == [seen["rid"]]
    head = [v for v in err.violations if v.tag == LaunchTag.HEAD_K_FULL]
    assert {v.position for v in head} >= {0, PAGE}
    assert all(v.reasons & FailReason.VERIFY_POSITION for v in head if v.position in (0, PAGE))


def test_corrupt_block_table(llama: Any) -> None:
    """Point a request's first block-table entry at a never-written block before the batch is prepared."""
    seen: dict[str, Any] = {}

    def inject(proc: Any) -> None:
        alloc = full_alloc(proc)
        io = proc.inputs_and_outputs

        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def prepare_batch_tensors(*a: Any, **k: Any) -> Any:
                batch = k["requests_in_batch"]
                if "rid" not in seen:
                    for fs in batch:
                        if fs.state.position_offset >= PAGE:
                            rid = fs.state.request_id
                            used = {b for t in alloc.block_table.values() for b in t}
                            fresh = min(b for b in range(2 * alloc.blocks_per_sector, 100) if b not in used)
                            alloc.block_table[rid][0] = fresh
                            seen["rid"] = rid
                            break
                return orig(*a, **k)
            return prepare_batch_tensors
        wrap_instance(io, "prepare_batch_tensors", make)

    with kt.install(llama, raise_config()):
        err = expect_violation(lambda: run_manager(llama, distinct_prompts(), inject=inject))
    assert err.request_ids == [seen["rid"]]
    head = [v for v in err.violations if v.tag in (LaunchTag.HEAD_K_FULL, LaunchTag.HEAD_V_FULL)]
    assert head and all(v.reasons & VERIFY_ANY for v in head)
    assert {v.position for v in head} >= set(range(1, PAGE))  # a zeroed record claims position 0 everywhere


def reuse_live_block(victim: str, thief: str) -> Callable[[Any], None]:
    """The block pool hands ``thief`` the first block of ``victim`` while the victim still references it."""
    def inject(proc: Any) -> None:
        alloc = full_alloc(proc)
        pool = proc.cache.pool
        asking: dict[str, str] = {}
        armed = [True]

        def make_alloc(orig: Callable[..., Any]) -> Callable[..., Any]:
            def allocate_cache_to_request(request_id: str, past: int, q: int) -> Any:
                asking["rid"] = request_id
                try:
                    return orig(request_id, past, q)
                finally:
                    asking.pop("rid", None)
            return allocate_cache_to_request

        def make_get(orig: Callable[..., Any]) -> Callable[..., Any]:
            def get_free_blocks(index: int, num_blocks: int) -> list[int]:
                vt = alloc.block_table.get(victim)
                if armed[0] and num_blocks > 0 and asking.get("rid") == thief and vt:
                    armed[0] = False
                    return [vt[0], *orig(index, num_blocks - 1)]
                return list(orig(index, num_blocks))
            return get_free_blocks

        wrap_instance(alloc, "allocate_cache_to_request", make_alloc)
        wrap_instance(pool, "get_free_blocks", make_get)
    return inject


@pytest.mark.parametrize("fingerprint", ["all", "none"])
def test_use_after_free_block_reuse(llama: Any, fingerprint: str) -> None:
    """r1 is handed r0's still-referenced first block and writes positions 0..2 into it.

    With fingerprints, r0's TAIL of that very forward sees its KV changed under intact records; without, r1's
    records break r0's chain at position 3 at r0's next HEAD.
    """
    with kt.install(llama, raise_config(fingerprint=fingerprint)):
        err = expect_violation(lambda: run_manager(llama, distinct_prompts(), max_batch_tokens=24,
                                                   inject=reuse_live_block(victim="r0", thief="r1")))
    assert err.request_ids == ["r0"]
    if fingerprint == "all":
        assert tags(err.violations) == {LaunchTag.TAIL_K_FULL, LaunchTag.TAIL_V_FULL}
        assert {v.position for v in err.violations} == {0, 1, 2}
        assert all(v.reasons == FailReason.VERIFY_FINGERPRINT for v in err.violations)
    else:
        assert LaunchTag.HEAD_K_FULL in tags(err.violations)
        assert all(v.reasons & VERIFY_ANY for v in err.violations)
        assert any(v.position == 3 and v.reasons & FailReason.VERIFY_CHAIN for v in err.violations)


def test_swap_two_requests_blocks(llama: Any) -> None:
    """Swap the first blocks of two live requests: both read the other's KV; both are reported."""
    done: list[bool] = []

    def inject(proc: Any) -> None:
        alloc = full_alloc(proc)

        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def prepare_batch_tensors(*a: Any, **k: Any) -> Any:
                batch = k["requests_in_batch"]
                if not done and len(batch) == 2 and all(fs.state.position_offset >= PAGE for fs in batch):
                    t0, t1 = (alloc.block_table[fs.state.request_id] for fs in batch)
                    t0[0], t1[0] = t1[0], t0[0]
                    done.append(True)
                return orig(*a, **k)
            return prepare_batch_tensors
        wrap_instance(proc.inputs_and_outputs, "prepare_batch_tensors", make)

    with kt.install(llama, raise_config()):
        err = expect_violation(lambda: run_manager(llama, distinct_prompts(), inject=inject))
    assert done and sorted(err.request_ids) == ["r0", "r1"]
    assert all(v.reasons & VERIFY_ANY for v in err.violations)
    # the swapped block itself is a self-consistent chain: the break shows at the first position after it
    assert {(v.request_id, v.position) for v in err.violations if v.reasons & FailReason.VERIFY_CHAIN} >= \
        {("r0", PAGE), ("r1", PAGE)}


def test_raise_surfaces_from_generate_batch(llama: Any, prompts: list[list[int]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A violation in the generation thread (which transformers swallows) is raised by generate_batch itself."""
    orig_view = kt.HFPoolAdapter.batch_view
    calls = [0]

    def corrupt_view(self: kt.HFPoolAdapter, io: Any, scheduled: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:  # a decode step: damage the newest record of request 0 through the slot table
            alloc = self.alloc
            rid = scheduled.ids[0]
            slot = alloc.block_table[rid][0] * alloc.block_physical_stride + 1
            alloc._kv_token_views[0][0][slot].zero_()
        return orig_view(self, io, scheduled)

    monkeypatch.setattr(kt.HFPoolAdapter, "batch_view", corrupt_view)
    with kt.install(llama, raise_config()) as handle:
        with pytest.raises(CanaryViolationError) as info:
            generate(llama, prompts[:2], max_new_tokens=5)
    assert info.value is handle.errors[0]
    tags = {v.tag for v in info.value.violations}  # the rolling sweep may see the same record in the same window
    assert LaunchTag.TAIL_K_FULL in tags and tags <= {LaunchTag.TAIL_K_FULL, LaunchTag.SWEEP_K_FULL}
    assert all(v.reasons == FailReason.VERIFY_FINGERPRINT and v.position == 1 for v in info.value.violations)


@pytest.mark.parametrize("mode", ["raise", "log"])
def test_internal_failure(llama: Any, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A failure of the canary side in the generation thread: RAISE hands it to the caller; LOG logs it, turns the
    canary off on that cache and lets generation finish."""
    def broken(self: kt.HFPoolAdapter, io: Any, reqs: Any) -> Any:
        raise KeyError("boom")

    ref = generate(llama, prompts[:1], max_new_tokens=3)
    monkeypatch.setattr(kt.HFPoolAdapter, "batch_view", broken)
    with kt.install(llama, raise_config(mode=mode)) as handle:
        if mode == "raise":
            with pytest.raises(kt.TransformersIntegrationError, match="boom") as info:
                generate(llama, prompts[:1], max_new_tokens=3)
            assert isinstance(info.value.__cause__, KeyError)
        else:
            assert generate(llama, prompts[:1], max_new_tokens=3) == ref
            assert len(handle.failures) == 1 and handle.errors == [] and handle.stats["unbracketed_steps"] == 2


@pytest.mark.parametrize("mode", ["raise", "log"])
def test_request_past_max_context_is_an_input_error(llama: Any, mode: str) -> None:
    """A request longer than the slot table: the plan would skip it and later sweeps would flag its never-written
    blocks. It is refused before any canary launch: RAISE raises CanaryInputError, LOG turns the canary off on that
    cache (generation unchanged, no violation)."""
    ps = distinct_prompts((45, 50))
    ref = generate(llama, ps, max_new_tokens=3)
    with kt.install(llama, raise_config(mode=mode, sweep_interval=1), max_context=40) as handle:
        if mode == "raise":
            with pytest.raises(CanaryInputError, match="max_context=40"):
                generate(llama, ps, max_new_tokens=3)
        else:
            assert generate(llama, ps, max_new_tokens=3) == ref
            assert len(handle.failures) == 1 and isinstance(handle.failures[0], CanaryInputError)
        assert handle.total_violations == 0


# ------------------------------------------------------------------------------------------------- install / refusals


def test_version_gate(llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.22.0")
    with pytest.raises(kt.TransformersIntegrationError, match="5.23.0"):
        kt.install(llama, raise_config())
    assert no_wrappers_left(llama)


@pytest.mark.parametrize("over", [{"use_async_batching": True}, {"cpu_offload_space": 1.0}])
def test_refuses_unguardable_configs(llama: Any, over: dict[str, Any]) -> None:
    with kt.install(llama, raise_config()):
        with pytest.raises(kt.TransformersIntegrationError, match=next(iter(over))):
            llama.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=cb_config(**over))
    assert no_wrappers_left(llama)


def test_refuses_sliding_window_models() -> None:
    """Sliding-window groups use a ring of slots (and turn prefix sharing off): not guarded yet, refused clearly."""
    model = tiny_qwen3(sliding_window=32)
    with kt.install(model, raise_config()):
        with pytest.raises(kt.TransformersIntegrationError, match="full-attention-only"):
            model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=cb_config())


def test_mode_none_installs_nothing(llama: Any) -> None:
    handle = kt.install(llama, CanaryConfig(mode="none"))
    assert not handle.installed and no_wrappers_left(llama)
    handle.uninstall()


def test_uninstall_refused_while_running_and_restores_exactly(llama: Any) -> None:
    """uninstall() needs a stopped manager, then puts back the very objects it found (here a user's own wrapper)."""
    mgr = llama.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=cb_config())
    plain = mgr.get_result

    def users_get_result(*a: Any, **k: Any) -> Any:
        return plain(*a, **k)

    mgr.get_result = users_get_result
    handle = kt.install(mgr, raise_config())
    assert mgr.get_result is not users_get_result
    with pytest.raises(kt.TransformersIntegrationError, match="already installed"):
        kt.install(mgr, raise_config())
    mgr.start()
    try:
        with pytest.raises(kt.TransformersIntegrationError, match="stop"):
            handle.uninstall()
    finally:
        mgr.stop(block=True)
    handle.uninstall()
    mgr.destroy()
    assert mgr.get_result is users_get_result
    del mgr.get_result
    assert no_wrappers_left(mgr)


def test_history_sequence() -> None:
    h = kt._History([1, 2, 3], [4, 5])
    assert len(h) == 5 and list(h) == [1, 2, 3, 4, 5] and h[-1] == 5 and h[3] == 4
    assert h[1:4] == [2, 3, 4] and h[0:2] == [1, 2] and h[3:5] == [4, 5] and h[::2] == [1, 3, 5] and h[4:2] == []


class _State:
    """The two token lists of a transformers RequestState that the batch view reads."""

    def __init__(self, prompt: list[int], generated: list[int]) -> None:
        self.initial_tokens, self.generated_tokens = prompt, generated


_tokens = st.lists(st.integers(0, 255), max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_tokens, _tokens, st.integers(0, 14), st.integers(0, 3)), max_size=5), st.booleans(),
       st.integers(0, 3))
def test_batch_new_tokens_match_the_fold_of_plain_histories(reqs: list[tuple[list[int], list[int], int, int]],
                                                             decode: bool, spare: int) -> None:
    """_Batch.new_tokens (a decode batch read from the states' lists, else the fold over lazy histories) equals
    new_token_truth over plain prompt + generated lists, positions past a history's end included."""
    ext = [1 if decode else e for *_, e in reqs]
    states = [_State(p, g) for p, g, _, _ in reqs]
    batch = kt._Batch([f"r{i}" for i in range(len(reqs))], states, [q for _, _, q, _ in reqs], ext)
    n = sum(ext) + spare
    want = new_token_truth([p + g for p, g, _, _ in reqs], batch.pre, ext, n)
    assert batch.new_tokens(n).tolist() == want.tolist()
    hist = kt._Histories(states)
    assert len(hist) == len(reqs) and [list(h) for h in hist] == [p + g for p, g, _, _ in reqs]
    assert [list(h) for h in hist[1:]] == [p + g for p, g, _, _ in reqs[1:]]


def test_export_holds_the_ledgers_chains(llama: Any, prompts: list[list[int]]) -> None:
    """A build of the sweep's export is every chain the ledger holds, found independently of the integration's
    records: each request's blocks by walking its tokens through transformers' own block hashes (first position and
    parent from the walk), unlocked exactly where cached. A hash dropped where no wrapper sees it (the ledger edited
    directly) takes its block and the chains that follow it out of the export."""
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash

    tokens: dict[str, list[int]] = {}  # per request, the tokens of its last block completion

    def inject(proc: Any) -> None:
        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def mark(request_id: str, token_ids: list[int], new_new_blocks: int) -> Any:
                tokens[request_id] = list(token_ids)
                return orig(request_id, token_ids, new_new_blocks)
            return mark
        wrap_instance(full_alloc(proc), "mark_complete_blocks", make)

    def walked(ledger: Any) -> dict[int, tuple[int, int]]:
        want: dict[int, tuple[int, int]] = {}
        for toks in tokens.values():
            h, prev = None, -1
            for i in range(len(toks) // PAGE):
                h = compute_block_hash(h, toks[i * PAGE:(i + 1) * PAGE])
                b = ledger.hash_to_block.get(h)
                if b is None:
                    break
                want[b], prev = (i * PAGE, prev), b
        return want

    def exported(ad: kt.HFPoolAdapter) -> tuple[dict[int, tuple[int, int]], dict[int, bool]]:
        e = ad._build_export()  # what the export holds once built (prefix_cache_export may hand out an older one)
        assert e is not None and e.unlocked is not None
        slots, unlocked = e.slots.tolist(), e.unlocked.tolist()
        got, unl = {}, {}
        for c, (s0, n, first, prev) in enumerate(zip(e.starts.tolist(), e.lens.tolist(), e.first_positions.tolist(),
                                                     e.prev_slots.tolist(), strict=True)):
            b = slots[s0] // PAGE
            assert n == PAGE and slots[s0:s0 + n] == list(range(b * PAGE, (b + 1) * PAGE))
            assert prev == NO_SLOT or prev % PAGE == PAGE - 1
            got[b], unl[b] = (first, -1 if prev == NO_SLOT else prev // PAGE), unlocked[c]
        return got, unl

    sizes: list[int] = []

    def check(mgr: Any, i: int) -> None:
        (session,) = [s for s in handle.iter_sessions() if s.proc is mgr.batch_processor]
        ad, ledger = session.adapter, session.adapter.alloc.ledger
        got, unl = exported(ad)
        want = walked(ledger)
        assert got == want and unl == {b: b in ledger.cached_blocks for b in got}
        sizes.append(len(got))
        if i == len(prompts) - 1:
            b = next(b for b, (first, _) in want.items() if first == PAGE)  # a block with a parent and a child
            ledger.hash_to_block.pop(ledger.block_to_hash.pop(b))
            ad.touch()
            after, _ = exported(ad)
            assert b not in after and not any(parent == b for _, parent in after.values())
            assert after.items() <= want.items() and len(after) < len(want) - 1

    with kt.install(llama, raise_config()) as handle:
        run_manager(llama, prompts, sequential=True, between=check, inject=inject, max_new_tokens=4)
    assert len(sizes) == len(prompts) and sizes[0] > 0 and sizes[-1] > sizes[0]


@contextmanager
def installed_adapter(llama: Any) -> Iterator[kt.HFPoolAdapter]:
    """The adapter of a canary installed on a warmed-up manager of ``llama`` that has run nothing."""
    mgr = llama.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=cb_config())
    handle = kt.install(mgr, raise_config())
    mgr.warmup()
    try:
        (session,) = list(handle.iter_sessions())
        yield session.adapter
    finally:
        handle.uninstall()
        mgr.destroy()


def test_dense_slots(llama: Any) -> None:
    """Sparse transformers rows -> dense slots: token rows map 1:1, V/other-layer rows and negatives to NO_SLOT."""
    with installed_adapter(llama) as ad:
        stride = ad.stride
        assert stride == 2 * PAGE * 2 and ad.num_slots == ad.total_blocks * PAGE
        s = torch.tensor([0, 5, stride + 15, stride + 16, 7 * stride + 3, -1, 3 * stride - 1])
        out = torch.zeros(7, dtype=torch.int64)  # the write slots' conversion of the adapter's slot_rows call
        slot_rows(ad.req_to_token, *(torch.zeros(0, dtype=torch.int64),) * 3, s[:0], out, s, ad.stride, ad.page,
                  ad.backend)
        assert out.tolist() == [0, 5, PAGE + 15, -1, 7 * PAGE + 3, -1, -1]


def test_batch_view_views_follow_the_buffers(llama: Any) -> None:
    """The batch view's views of transformers' buffers (write index row 0, input ids, positions) and of its own write
    slots are made once per token count, and again once a buffer is replaced or the write slots outgrow theirs: never a
    view of a buffer the forward no longer uses. The read index's row 0 likewise, once per buffer."""
    with installed_adapter(llama) as ad:
        io = SimpleNamespace(write_index_storage=torch.arange(128).view(2, 64), input_ids=torch.arange(64) + 1000,
                             position_ids=torch.arange(64) + 2000, read_index_storage=torch.arange(256).view(2, 128))

        def views(n: int) -> tuple[torch.Tensor, ...]:
            got = ad._views(io, n)
            bases = (io.write_index_storage, io.input_ids, io.position_ids, ad._out)
            for v, b in zip(got, bases, strict=True):
                assert v.shape == (n,) and v.data_ptr() == b.data_ptr() and torch.equal(v, b.view(-1)[:n])
            row = io.read_index_storage[0]
            assert ad._read_row.data_ptr() == row.data_ptr() and torch.equal(ad._read_row, row)
            return got

        first = views(5)
        assert views(5) is first and views(3) is not first  # the same count again: the same views
        io.input_ids = torch.arange(64) + 3000  # transformers replaced a buffer
        replaced = views(5)
        assert replaced is not first and views(5) is replaced
        io.read_index_storage = torch.arange(512).view(2, 256) + 7  # the read index replaced: a new row
        assert views(5) is not replaced
        grown = views(ad._out.shape[0] + 1)  # the write slots outgrow their buffer: a new one
        assert grown[3].data_ptr() != replaced[3].data_ptr() and views(5) is not replaced


def test_export_is_reused_only_while_the_cache_lost_nothing(llama: Any, prompts: list[list[int]]) -> None:
    """The sweep's export is the same object while nothing changed; after changes that only gained blocks, the same
    object for ``EXPORT_REUSES`` more calls, then a rebuild equal to one from the ledger; after a lost block, a rebuild
    at once. Every export handed out holds only chains a fresh build holds too: a reused export lacks new blocks, never
    holds a block that left the cache."""
    seen: list[tuple[bool, bool, bool, bool]] = []

    def chains(e: Any) -> set[tuple[int, int, int]]:
        return set(zip(e.slots[e.starts].tolist(), e.first_positions.tolist(), e.prev_slots.tolist(), strict=True))

    def equal(a: Any, b: Any) -> bool:
        return all(torch.equal(getattr(a, f), getattr(b, f))
                   for f in ("slots", "starts", "lens", "first_positions", "prev_slots", "unlocked"))

    def check(mgr: Any, i: int) -> None:
        (session,) = [s for s in handle.iter_sessions() if s.proc is mgr.batch_processor]
        ad, ledger = session.adapter, session.adapter.alloc.ledger
        first = ad.prefix_cache_export()
        subset = chains(first) <= chains(ad._build_export())
        # a block leaves the cache (its hash dropped, as an eviction does), then is forgotten as the wrappers do, or
        # (every other request) not: a path the integration does not see, found by the ledger's count
        b = next(iter(ledger.cached_blocks))
        ledger.hash_to_block.pop(ledger.block_to_hash.pop(b))
        ledger.cached_blocks.pop(b)
        if i % 2 == 0:
            ad.forget_hashes()
        after = ad.prefix_cache_export()
        lost = after is not first and b * PAGE not in set(after.slots.tolist()) and equal(after, ad._build_export())
        reused = [ad.prefix_cache_export()]  # nothing changed
        for _ in range(kt.EXPORT_REUSES + 1):
            ad.touch()  # a lifecycle call that drops nothing
            reused.append(ad.prefix_cache_export())
        rebuilt = all(e is after for e in reused[:-1]) and reused[-1] is not after and equal(reused[-1], after)
        seen.append((subset, lost, rebuilt, chains(after) <= chains(reused[-1])))

    with kt.install(llama, raise_config()) as handle:
        run_manager(llama, prompts[:3], sequential=True, between=check, max_new_tokens=4)
    assert seen == [(True, True, True, True)] * 3


def test_decode_steps_reuse_the_export(llama: Any, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps that complete no block and free nothing hand the sweep the cached export (every scheduled
    request's allocation call that adds no block changes nothing)."""
    counts = {"export": 0, "build": 0}
    export, build = kt.HFPoolAdapter.prefix_cache_export, kt.HFPoolAdapter._build_export

    def counted(name: str, fn: Any) -> Any:
        def run(self: Any) -> Any:
            counts[name] += 1
            return fn(self)
        return run
    monkeypatch.setattr(kt.HFPoolAdapter, "prefix_cache_export", counted("export", export))
    monkeypatch.setattr(kt.HFPoolAdapter, "_build_export", counted("build", build))
    with kt.install(llama, raise_config(sweep_roll_interval=1)) as handle:  # an export every step
        run_manager(llama, prompts[:2], max_new_tokens=24)
    assert handle.total_violations == 0
    assert counts["export"] >= 24 and counts["build"] <= counts["export"] // 2, counts


def test_benchmark_attributes_the_canary_host_time_per_step() -> None:
    """bench_transformers on a tiny CPU model: every canary config's rows carry its per-step host time and the
    attributed overhead, from the handle's ``host_us`` (no profiled timeline on CPU: the verdict is the pairs'); the
    control model's row carries its pairs with the baseline and nothing of a canary; each canary row also its pairs
    with the control (5 pairs: too few for an interval, so no verdict)."""
    from bench.bench_transformers import CONTROL, LLAMA_TINY, VARIANTS, build_model, measure
    from bench.bench_transformers import prompts as bench_prompts

    res = measure(lambda: build_model(LLAMA_TINY, "cpu", torch.float32), bench_prompts(4, 24, LLAMA_TINY["vocab_size"]),
                  6, 1, "cpu", VARIANTS, control=True)
    rows = {r["config"]: r for r in res["rows"]}
    assert set(rows) == {"baseline", CONTROL, *(name for name, _, _ in VARIANTS)}
    assert res["decode_steps_per_config"] == 5 and rows[CONTROL]["step_pairs"] == 5
    assert set(rows[CONTROL]) == {"config", "decode_step_ms", "overhead_pct", "overhead_ci95_pct", "step_pairs",
                                  "repeat_overheads_pct", "pairs_pct"}
    assert len(rows[CONTROL]["pairs_pct"]) == 5
    for name, _, target in VARIANTS:
        r = rows[name]
        assert r["canary_host_ms_per_step"] > 0 and r["attributed_overhead_pct"] > 0, r
        assert r["attributed_upper_quartile_pct"] >= r["attributed_overhead_pct"] and r["target_pct"] == target
        assert r["attributed_mean_pct"] > 0, r
        assert r["met_attributed"] is None and r["met"] is r["met_pairs"] and "gpu_busy_pct" not in r
        assert isinstance(r["overhead_vs_control_pct"], float) and r["met_vs_control"] is None
        assert r["overhead_vs_control_ci95_pct"] == [-math.inf, math.inf], r
        assert len(r["pairs_pct"]) == len(r["pairs_vs_control_pct"]) == len(r["attributed_pct"]) == 5, r


def test_benchmark_spin_calibrates_the_pairs() -> None:
    """bench_transformers' spin model: every step of it busy-waits 20 ms inside the timed region, so each of its steps
    is at least that much longer than its work, its pairs are positive, and its row names what the spin alone adds."""
    from bench.bench_transformers import LLAMA_TINY, build_model, measure
    from bench.bench_transformers import prompts as bench_prompts

    res = measure(lambda: build_model(LLAMA_TINY, "cpu", torch.float32), bench_prompts(4, 24, LLAMA_TINY["vocab_size"]),
                  6, 1, "cpu", [], spin_us=20_000)
    rows = {r["config"]: r for r in res["rows"]}
    spun = rows["host spin 20000 us (no canary)"]
    assert set(rows) == {"baseline", spun["config"]} and spun["step_pairs"] == 5, rows
    assert spun["decode_step_ms"] >= 20.0 + rows["baseline"]["decode_step_ms"] / 2, rows
    expected = 100.0 * 20.0 / (spun["decode_step_ms"] - 20.0)
    assert spun["overhead_pct"] > 0 and spun["expected_pct"] == pytest.approx(expected, rel=0.5), spun


def test_spin_reads_its_buffer_while_it_waits() -> None:
    """bench_transformers' spin with a buffer to walk: it still waits its time, and reads the buffer chunk after chunk
    from its start, wrapping around past its end (a buffer of a few chunks, a wait long enough for several passes)."""
    import time

    import numpy as np

    import bench.bench_transformers as bt

    n, seen = 3 * bt.WALK_CHUNK + 5, []

    class Recorded(np.ndarray):
        def __getitem__(self, key: Any) -> Any:
            seen.append(key.start)
            return np.asarray(self)[key]

    t0 = time.perf_counter()
    bt.spin(0.02, np.zeros(n, dtype=np.int64).view(Recorded))
    assert time.perf_counter() - t0 >= 0.02
    want = [k * bt.WALK_CHUNK % n for k in range(5)]  # 0, 1, 2, 3 chunks, then past the end: wrapped
    assert len(seen) >= 8 and seen[:5] == want, seen


def test_round_robin_runs_one_step_of_every_model_per_round() -> None:
    """bench_transformers' RoundRobin: three models' loops take turns, pinned to one core; while all three run, every
    window of three consecutive turns holds each model once and each round starts with another model (the order
    rotates); every model decodes the same number of steps and the same tokens (one of them under a canary)."""
    import contextlib
    import os

    from bench.bench_transformers import LLAMA_TINY, RoundRobin, build_model, installed
    from bench.bench_transformers import prompts as bench_prompts

    names = ("a", "b", "c")
    models = {n: build_model(LLAMA_TINY, "cpu", torch.float32) for n in names}
    with contextlib.ExitStack() as stack:
        handle = stack.enter_context(installed(models["b"], {}))
        rr = RoundRobin("cpu", models, {"a": None, "b": lambda: handle.host_us, "c": None},
                        max(os.sched_getaffinity(0)))
        outs = rr.run(models, bench_prompts(3, 20, LLAMA_TINY["vocab_size"]), 7)
    assert outs["a"] == outs["b"] == outs["c"] and handle.total_violations == 0
    assert len({len(rr.steps[n]) for n in names}) == 1 and len(rr.steps["a"]) >= 7
    assert rr.canary_us["b"] and all(c > 0 for c in rr.canary_us["b"]) and set(rr.canary_us["a"]) == {0.0}
    full = len(rr.turns) - len(rr.turns) % 3 - 3  # the last round: loops leave as their runs stop
    rounds = [rr.turns[i:i + 3] for i in range(0, full, 3)]
    assert all(sorted(r) == sorted(names) for r in rounds), rr.turns
    assert all(x[0] != y[0] for x, y in zip(rounds, rounds[1:], strict=False)), rr.turns
