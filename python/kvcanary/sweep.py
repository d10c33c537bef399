"""Sweep: verify every cached prefix chain (TAIL records, fingerprints) from the adapter's vectorized export."""

from __future__ import annotations

import logging

import torch
from kvcanary_schema import Stage

from kvcanary.adapter import PrefixCacheExport
from kvcanary.ops.plan import plan_sweep
from kvcanary.ops.verify import verify
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
    return PrefixCacheExport(export.slots, export.starts[keep], export.lens[keep], export.first_positions[keep],
                             export.prev_slots[keep], None,
                             None if export.expect_end is None else export.expect_end[keep])


class Sweeper:
    """Runs sweeps on the state's TAIL buffers; counts launches, and completions only once results are back."""

    def __init__(self, state: CanaryState, backend: str, unlocked_only: bool = False) -> None:
        self.state = state
        self.backend = backend
        self.unlocked_only = unlocked_only
        self.launched = 0
        self.completed = 0
        self.chains_last = 0

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
            table = export.slots.view(1, -1)
            for g in st.groups:
                verify(g.tail, Stage.SWEEP, st.sweep_plan, st.sweep_status, table, st.sink,
                       fingerprint=g.fingerprint, backend=self.backend)
            chunks += 1
        self.launched += 1
        self.chains_last = n
        return chunks

    @staticmethod
    def empty_export(device: torch.device) -> PrefixCacheExport:
        """An export with no chains (a sweep of it still launches, so the watchdog sees it ran)."""
        z = torch.zeros(0, dtype=torch.int64, device=device)
        return PrefixCacheExport(z, z, z, z, z)
