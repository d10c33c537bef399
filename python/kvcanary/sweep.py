"""Sweeps of the cached prefix chains (TAIL records + fingerprints, HEAD records + seal): full and rolling."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvcanary_schema import Stage

from kvcanary.adapter import PrefixCacheExport
from kvcanary.ops.bound import BoundOp
from kvcanary.ops.plan import bind_plan_roll, derive_roll, plan_sweep
from kvcanary.ops.verify import bind_verify
from kvcanary.report import CachedChain
from kvcanary.state import CanaryState

logger = logging.getLogger("kvcanary")


def filter_export(export: PrefixCacheExport, unlocked_only: bool) -> PrefixCacheExport:
    """The export restricted to unlocked chains (no running request holds them) when asked; eager, may allocate.

    SWA residency needs no filter here: verify translates every slot through the map and skips evicted
    ones (counted SKIPPED), and a chain's first link is skipped when its predecessor is evicted.
    """
    if not unlocked_only or export.unlocked is None:
        return export
    keep = export.unlocked
    holders = None if export.holders is None else [h for h, k in zip(export.holders, keep.tolist(), strict=True) if k]
    return PrefixCacheExport(export.slots, export.starts[keep], export.lens[keep], export.first_positions[keep],
                             export.prev_slots[keep], None,
                             None if export.expect_end is None else export.expect_end[keep], holders)


@dataclass(frozen=True)
class SweepSlice:
    """What one sweep verified, kept until its window is reported: sweep rows name their chain through it."""

    export: PrefixCacheExport
    chain_of_segment: torch.Tensor | None = None  # rolling sweep: segment -> chain; None: segment i is chain i

    def chain(self, segment: int) -> CachedChain | None:
        """The chain of plan segment ``segment`` (a sweep row's BATCH_INDEX), None when out of range."""
        c = segment
        if self.chain_of_segment is not None:
            if not 0 <= segment < self.chain_of_segment.shape[0]:
                return None
            c = int(self.chain_of_segment[segment])
        if not 0 <= c < self.export.num_chains:
            return None
        holders = self.export.holders[c] if self.export.holders is not None else ()
        return CachedChain(c, int(self.export.first_positions[c]), int(self.export.lens[c]), tuple(holders))


class Sweeper:
    """Runs sweeps on the state's TAIL (fingerprint) and HEAD (seal) records; counts launches, and completions only
    once results are back. The rolling sweep walks the table-space slot ids a slice at a time (``width`` ids, at most
    the pool's), so every slot that is cached when the walk passes it is verified once per ``ceil(num_slots /
    width)`` slices, however the cache changes in between."""

    def __init__(self, state: CanaryState, backend: str, unlocked_only: bool = False) -> None:
        self.state = state
        self.backend = backend
        self.unlocked_only = unlocked_only
        self.launched = 0
        self.completed = 0
        self.chains_last = 0
        self.cursor = 0  # rolling sweep: first table slot id of the next slice
        self.slices = 0  # rolling-sweep slices launched
        # rolling sweep: the export chain of each slice entry (a slice past the pool would verify slots twice)
        width = min(state.config.sweep_slice * state.config.sweep_roll_interval, state.pool.num_slots)
        self.chain_out = torch.zeros(width, dtype=torch.int64, device=state.device)
        # the last export rolled over, its slice planner (bound on what derive_roll derived from it) and its slots as
        # the verifies' table
        self._derived: tuple[PrefixCacheExport, Callable[[int], None], torch.Tensor] | None = None
        self._verifies = self._bind_verifies()

    def run(self, export: PrefixCacheExport) -> int:
        """Verify every chain of ``export`` (eager, outside any graph); returns the verify launches per group/half."""
        st = self.state
        export.validate(st.device)
        export = filter_export(export, self.unlocked_only)
        cap, n = st.config.sweep_capacity, export.num_chains
        chunks = 0
        for c0 in range(0, max(n, 1), cap):
            c1 = min(n, c0 + cap)
            plan_sweep(st.sweep_plan, st.sweep_status, export.slots, export.starts[c0:c1], export.lens[c0:c1],
                       export.first_positions[c0:c1], export.prev_slots[c0:c1],
                       expect_end=None if export.expect_end is None else export.expect_end[c0:c1],
                       backend=self.backend)
            self._verify(export.slots.view(1, -1))
            chunks += 1
        self.launched += 1
        self.chains_last = n
        return chunks

    def roll(self, export: PrefixCacheExport) -> SweepSlice | None:
        """Verify the cached slots whose table slot id lies in the next slice (one segment per slot, eager); None
        (nothing launched) when nothing is cached.

        Needs an export whose chains lie back to back in order (``starts`` = exclusive running sum of ``lens``, as
        the reference engine's and the transformers integration's are); slots of other chains are skipped. What the
        slice plan needs of the export (its inverse slot map, running ends) is derived once per export object, so an
        adapter that returns the same object while its cache is unchanged pays one plan launch per forward.
        """
        st = self.state
        m, width = st.pool.num_slots, self.chain_out.shape[0]
        cursor = self.cursor
        self.cursor = (self.cursor + width) % m
        if export.slots.shape[0] == 0 or export.num_chains == 0:
            return None
        if self._derived is None or self._derived[0] is not export:
            self._derived = (export, self._derive(export), export.slots.view(1, -1))
        _, plan, table = self._derived
        plan(cursor)
        self._verify(table)
        self.launched += 1
        self.slices += 1
        return SweepSlice(export, self.chain_out.clone())

    def warm_up(self) -> None:
        """Derive once from a one-slot export, so that a CUDA process loads the derive's kernels now and not inside
        the first forward that rolls (40-44 ms of lazy module loading on an H100). Keeps nothing; the one map entry
        it writes (slot 0 at index 0) is ignored by any later slice whose export does not hold slot 0 there."""
        one = torch.ones(1, dtype=torch.int64, device=self.state.device)
        self._derive(PrefixCacheExport(one - 1, one - 1, one, one - 1, -one, one.to(torch.bool)))

    def _derive(self, export: PrefixCacheExport) -> Callable[[int], None]:
        """Validate a new export, fill the inverse slot map and its running chain ends: its slice planner (takes the
        cursor)."""
        st = self.state
        export.validate(st.device)
        ends = torch.empty_like(export.lens)
        # inv keeps what earlier exports left: plan_roll takes an entry only where this export holds its slot there
        derive_roll(export.slots, export.lens, st.sweep_inv, ends, st.pool.num_slots, backend=self.backend)
        unlocked = export.unlocked.to(torch.int64) if self.unlocked_only and export.unlocked is not None else None
        return bind_plan_roll(st.sweep_plan, st.sweep_status, self.chain_out, export.slots, export.starts, export.lens,
                              ends, export.first_positions, export.prev_slots, st.sweep_inv, st.pool.num_slots,
                              unlocked=unlocked, backend=self.backend)

    def _bind_verifies(self) -> list[BoundOp]:
        """The sweep plan's verifies (TAIL + fingerprint, HEAD + seal per group), checked once: only the export's
        slots (the table, int64 [1, N], validated with the export) change between sweeps."""
        st, table = self.state, torch.zeros(1, 1, dtype=torch.int64, device=self.state.device)
        ops = []
        for g in st.groups:
            ops.append(bind_verify(g.tail, Stage.SWEEP, st.sweep_plan, st.sweep_status, table, st.sink,
                                   fingerprint=g.fingerprint, backend=self.backend).frozen())
            if g.seal is not None:
                ops.append(bind_verify(g.head, Stage.SWEEP, st.sweep_plan, st.sweep_status, table, st.sink,
                                       fingerprint=g.seal, backend=self.backend).frozen())
        return ops

    def _verify(self, table: torch.Tensor) -> None:
        """The sweep plan's verifies over ``table`` (the export's slots, [1, N])."""
        for op in self._verifies:
            op(table)

    @staticmethod
    def empty_export(device: torch.device) -> PrefixCacheExport:
        """An export with no chains (a sweep of it still launches, so the watchdog sees it ran)."""
        z = torch.zeros(0, dtype=torch.int64, device=device)
        return PrefixCacheExport(z, z, z, z, z)

