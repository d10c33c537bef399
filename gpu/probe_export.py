"""Probe: the reference engine's resident_chains export timed alone (device idle before each call, median of 30) at
every tenth forward of a 32-request run: before the eighth session (per-node tensors and per-tail slices, one pageable
copy each), now (radix part kept while the tree is unchanged; tails: one pinned buffer, one copy, two gathers), and now
with the radix part rebuilt as after a tree change. Usage: PYTHONPATH=...:tests/engine:tests python3
gpu/probe_export.py [cuda|cpu]."""

import statistics
import sys
import time
from collections.abc import Callable

import torch
from conftest import make_requests
from kvcanary.engine import Engine, EngineConfig, ForwardBatch, ModelConfig, NullHooks, PoolKind
from kvcanary.engine.radix import CachedChains, RadixCache


def before_export(cache: RadixCache, device: torch.device) -> CachedChains:
    """RadixCache.export_chains as of c8ac0ec."""
    nodes = list(cache.nodes())
    lens = torch.tensor([n.value.numel() for n in nodes], dtype=torch.int64)
    prev = [int(n.parent.value[-1]) if n.parent is not None and n.parent is not cache.root else -1 for n in nodes]
    slots = torch.cat([n.value for n in nodes]) if nodes else torch.empty(0, dtype=torch.int64)
    host = (slots, torch.cumsum(lens, 0) - lens, lens,
            torch.tensor([n.start for n in nodes], dtype=torch.int64), torch.tensor(prev, dtype=torch.int64),
            torch.tensor([n.lock_ref == 0 for n in nodes], dtype=torch.bool))
    return CachedChains(*(t.to(device) for t in host), tuple(n.holders for n in nodes))


def before_resident(e: Engine) -> CachedChains:
    """Engine.resident_chains as of c8ac0ec."""
    base = before_export(e.radix, e.device)
    tails = [s for s in e.scheduler.running if s.row >= 0 and s.kv_len > s.cached_len]
    table, dev = e.req_to_token.table, base.slots.device
    slots = [table[s.row, s.cached_len:s.kv_len].to(torch.int64) for s in tails]
    none = torch.full((1,), -1, dtype=torch.int64, device=table.device)
    prev = [table[s.row, s.cached_len - 1:s.cached_len].to(torch.int64) if s.cached_len else none for s in tails]
    lens = torch.tensor([s.kv_len - s.cached_len for s in tails], dtype=torch.int64)
    starts = base.slots.numel() + torch.cumsum(lens, 0) - lens
    return CachedChains(
        torch.cat([base.slots, *[t.to(dev) for t in slots]]), torch.cat([base.chain_starts, starts.to(dev)]),
        torch.cat([base.chain_lens, lens.to(dev)]),
        torch.cat([base.first_positions, torch.tensor([s.cached_len for s in tails], device=dev)]),
        torch.cat([base.prev_slots, *[t.to(dev) for t in prev]]),
        torch.cat([base.unlocked, torch.zeros(len(tails), dtype=torch.bool, device=dev)]),
        base.holders + tuple((s.rid,) for s in tails))


class Timer(NullHooks):
    """At every tenth forward: each variant's median over 30 calls."""

    def __init__(self, engine: Engine) -> None:
        self.e, self.n, self.res = engine, 0, {}

    def _rebuilt(self) -> CachedChains:
        self.e.radix.version += 1  # what an export costs right after the tree changed
        return self.e.resident_chains()

    def after_forward(self, batch: ForwardBatch, pool_kind: PoolKind) -> None:
        self.n += 1
        if self.n % 10:
            return
        variants: dict[str, Callable[[], CachedChains]] = {
            "before": lambda: before_resident(self.e), "now": self.e.resident_chains, "now_rebuilt": self._rebuilt}
        for name, fn in variants.items():
            ts = []
            for _ in range(30):
                if self.e.device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            self.res.setdefault(name, []).append(statistics.median(ts))


def main() -> None:
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    engine = Engine(EngineConfig(chunk_size=64, max_running=32, num_slots=8192), ModelConfig(), device=dev)
    timer = Timer(engine)
    engine.hooks = timer
    engine.generate(make_requests(32, shared=64, new=40, prompt_len=100))
    print({k: round(statistics.median(v) * 1e6, 1) for k, v in timer.res.items()}, "us (median of the per-forward "
          f"medians); {timer.n} forwards, {dev}")


if __name__ == "__main__":
    main()
