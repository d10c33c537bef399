"""Unit tests of the model, the pools, the allocator and the radix cache."""

from __future__ import annotations

import pytest
import torch
from kvcanary.engine import (
    ConfigError,
    DoubleFreeError,
    ModelConfig,
    RadixCache,
    SlotAllocator,
    SwaMap,
    TinyTransformer,
)


def test_model_weights_are_seeded() -> None:
    a, b = TinyTransformer(ModelConfig(seed=3)), TinyTransformer(ModelConfig(seed=3))
    c = TinyTransformer(ModelConfig(seed=4))
    assert torch.equal(a.weights.layers[0].wq, b.weights.layers[0].wq)
    assert not torch.equal(a.weights.layers[0].wq, c.weights.layers[0].wq)


@pytest.mark.parametrize("kwargs", [
    {"num_heads": 3, "num_kv_heads": 2}, {"head_dim": 15}, {"sliding_layers": (5,)},
    {"sliding_layers": (0,), "sliding_window": 0}, {"dtype": torch.int32}, {"hidden": 0}])
def test_model_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ModelConfig(**kwargs)  # type: ignore[arg-type]


def test_allocator_pages_are_contiguous_and_reserved_skipped() -> None:
    alloc = SlotAllocator(num_slots=32, page_size=4, reserved_slots=1)
    assert alloc.num_pages == 7
    pages = alloc.alloc(2)
    assert pages == [1, 2]
    assert alloc.page_slots(pages).tolist() == list(range(4, 12))
    assert alloc.alloc(6) is None and alloc.num_free_pages == 5
    alloc.free(pages)
    with pytest.raises(DoubleFreeError):
        alloc.free([1])
    with pytest.raises(DoubleFreeError):
        alloc.free([0])


def test_allocator_front_free_is_reused_first() -> None:
    alloc = SlotAllocator(num_slots=16, page_size=1, reserved_slots=2)
    first = alloc.alloc(3)
    assert first == [2, 3, 4]
    alloc.free([3], front=True)
    assert alloc.alloc(1) == [3]


def test_swa_map_assign_release() -> None:
    swa = SwaMap(num_slots=16, num_swa_slots=4, reserved_slots=1, device=torch.device("cpu"))
    assert swa.host[0] == 0 and swa.host[1] == -1
    assert swa.assign([5, 6, 7])
    assert not swa.assign([8])
    assert swa.resident(torch.tensor([5, 8])).tolist() == [True, False]
    swa.release([6])
    assert swa.host[6] == -1 and torch.equal(swa.host, swa.device_map)
    assert swa.assign([8])


def test_radix_match_insert_split() -> None:
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]))[0] == 0
    assert cache.insert([1, 2, 9], torch.tensor([20, 21, 22]))[0] == 2
    m = cache.match([1, 2, 3, 5])
    assert m.slots.tolist() == [10, 11, 12]
    assert cache.match([1, 2, 9, 9]).slots.tolist() == [10, 11, 22]
    assert cache.match([7]).length == 0


def test_radix_page_aligned() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], torch.tensor([4, 5, 6, 7]))
    assert cache.match([1, 2, 3, 9]).slots.tolist() == [4, 5]
    assert cache.match([1, 2, 3]).slots.tolist() == [4, 5]
    with pytest.raises(ConfigError):
        cache.insert([1, 2, 3], torch.tensor([1, 2, 3]))


def test_radix_lru_eviction_respects_locks() -> None:
    evicted: list[list[int]] = []
    cache = RadixCache(on_evict=lambda s: evicted.append(s.tolist()))
    cache.insert([1, 2], torch.tensor([1, 2]))
    cache.insert([3, 4], torch.tensor([3, 4]))
    cache.insert([5, 6], torch.tensor([5, 6]))
    cache.match([1, 2])
    locked = cache.match([3, 4]).node
    cache.lock(locked)
    assert cache.evict(2) == 2 and evicted == [[5, 6]]
    assert cache.evict(10) == 2 and evicted[-1] == [1, 2]
    assert cache.evictable_slots() == 0 and cache.total_slots() == 2
    cache.unlock(locked)
    cache.reset()
    assert cache.total_slots() == 0


def test_radix_export_chains() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3], torch.tensor([10, 11, 12]))
    _, node = cache.insert([1, 2, 4, 5], torch.tensor([10, 11, 30, 31]))
    cache.lock(node)
    ch = cache.export_chains()
    assert ch.num_chains == 3
    by_first = {}
    for i in range(ch.num_chains):
        s, n = int(ch.chain_starts[i]), int(ch.chain_lens[i])
        by_first[tuple(ch.slots[s:s + n].tolist())] = (int(ch.first_positions[i]),
                                                       int(ch.prev_slots[i]), bool(ch.unlocked[i]))
    assert by_first == {(10, 11): (0, -1, False), (12,): (2, 11, True), (30, 31): (2, 11, False)}


def test_radix_export_is_rebuilt_exactly_when_the_tree_changes() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]), "a")
    first = cache.export_chains()
    assert cache.export_chains() is first and cache.export_chains("cpu") is first
    cache.match([1, 2, 3, 4])  # a plain hit changes nothing an export shows
    assert cache.export_chains() is first

    def shown() -> list[tuple[object, ...]]:
        ch = cache.export_chains()
        return sorted((ch.holders[i], tuple(ch.slots[int(ch.chain_starts[i]):][:int(ch.chain_lens[i])].tolist()),
                       int(ch.first_positions[i]), int(ch.prev_slots[i]), bool(ch.unlocked[i]))
                      for i in range(ch.num_chains))
    node = cache.match([1, 2, 9, 9]).node  # splits [1,2,3,4] at 2
    assert shown() == [(("a",), (10, 11), 0, -1, True), (("a",), (12, 13), 2, 11, True)]
    cache.lock(node, "b")
    assert shown() == [(("a",), (12, 13), 2, 11, True), (("a", "b"), (10, 11), 0, -1, False)]
    cache.unlock(node)
    cache.insert([5, 6], torch.tensor([20, 21]), "c")
    assert shown()[-1] == (("c",), (20, 21), 0, -1, True)
    cache.evict(2)
    assert len(shown()) == 2 and cache.export_chains() is cache.export_chains()
