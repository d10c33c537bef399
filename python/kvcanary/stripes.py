"""WINDOW coverage policy: a cursor per request walking its older prefix slots one stripe per forward."""

from __future__ import annotations

from collections.abc import Hashable

from kvcanary.health import Coverage


class Stripes:
    """A host cursor per request walks ``[0, pass_end)`` in steps of ``stripe_size``, where ``pass_end`` is the count
    of older slots when the pass began; then a new pass starts at 0. So an older slot corrupted at any time is
    verified within 2 * ceil((P - window_links) / stripe_size) forwards of its request (P = prefix length then),
    within ceil(...) when the prefix does not grow; slots of idle cached chains are the sweep's (within
    ``sweep_interval`` forwards).
    """

    def __init__(self, stripe_size: int, window_links: int) -> None:
        """Stripes of ``stripe_size`` older slots; the newest ``window_links`` links are verified every forward."""
        self.stripe_size = stripe_size
        self.window_links = window_links
        self._cursor: dict[Hashable, tuple[int, int]] = {}  # request -> (cursor, pass end)

    def end(self, rid: Hashable, pre: int, coverage: Coverage | None) -> int:
        """End of this forward's stripe of ``rid``'s older slots; advances the cursor and observes ``coverage``
        unless it is None (a capture: nothing runs now)."""
        older = max(0, pre - self.window_links)
        if older == 0:
            if coverage is not None:
                coverage.observe(rid, pre, pre)
            return 0
        cur, pass_end = self._cursor.get(rid, (0, 0))
        if cur >= pass_end or pass_end > older:  # start a pass (also after a rewind of the prefix)
            cur, pass_end = 0, older
        end = min(pass_end, cur + self.stripe_size)
        if coverage is not None:
            self._cursor[rid] = (end, pass_end)
            coverage.observe(rid, pre, min(pre, self.window_links) + min(self.stripe_size, end))
        return end

    def drop(self, rid: Hashable) -> None:
        """Forget a request's cursor."""
        self._cursor.pop(rid, None)
