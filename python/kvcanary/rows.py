"""Per slot-table row: the request it holds and the forward it last ran in (request state updated in bulk)."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np


class RequestRows:
    """Which request holds each slot-table row, the host forward the row last ran in and its prefix length then.

    A forward's requests are matched against their rows with one vectorized compare; only a request that is new to its
    row (a new request, or one the engine moved) is claimed one by one. Every per-row state kept elsewhere (the token
    truth's chain values) is reset by the caller for the rows :meth:`claim` returns, so row state always belongs to the
    row's current request.
    """

    def __init__(self, rows: int) -> None:
        """State for ``rows`` slot-table rows, none held."""
        self.owner = np.full(rows, None, dtype=object)
        # the host forward the row last ran in (-1: never), kept when its request leaves (the coverage window counts it)
        self.seen = np.full(rows, -1, dtype=np.int64)
        self.prefix = np.zeros(rows, dtype=np.int64)  # the row's prefix length in that forward
        self._row: dict[Hashable, int] = {}
        self.version = 0  # bumped whenever a row changes hands: an answer derived from `owner` holds while it stands

    def unclaimed(self, rows: np.ndarray, keys: np.ndarray, live: np.ndarray) -> np.ndarray:
        """bool [bs]: the live entries whose row is not held by their request (``rows`` int64, ``keys`` object)."""
        held = np.not_equal(self.owner[rows], keys)
        return live & held  # type: ignore[no-any-return]

    def claim(self, rows: np.ndarray, keys: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Give row ``rows[i]`` to request ``keys[i]`` for each i in ``idx``; returns (bool [len(idx)]: the request
        held no row before this call: new, or evicted by another since; the rows whose state must be reset: each
        claimed row and each row a moved request left)."""
        new = np.fromiter((keys[i] not in self._row for i in idx.tolist()), dtype=bool, count=idx.shape[0])
        reset: list[int] = []
        self.version += 1
        for i in idx.tolist():
            row, key = int(rows[i]), keys[i]
            old = self._row.get(key)
            if old is not None and old != row and self.owner[old] == key:
                self.owner[old] = None
                reset.append(old)
            prev = self.owner[row]
            if prev is not None and prev != key:
                self._row.pop(prev, None)
            self.owner[row] = key
            self._row[key] = row
            reset.append(row)
        return new, reset

    def ran(self, rows: np.ndarray, live: np.ndarray, pre: np.ndarray, step: int) -> None:
        """The live rows ran in forward ``step`` with prefix lengths ``pre``."""
        r = rows[live]
        self.seen[r] = step
        self.prefix[r] = pre[live]

    def drop(self, key: Hashable) -> int | None:
        """Forget ``key``'s row; returns it (None: ``key`` held none)."""
        row = self._row.pop(key, None)
        if row is not None:
            self.owner[row] = None
            self.version += 1
        return row

    def stale(self, step: int, horizon: int) -> list[Hashable]:
        """The requests whose rows have not run within ``horizon`` forwards of ``step``."""
        held = np.not_equal(self.owner, None)  # type: ignore[call-overload]
        return self.owner[held & (self.seen < step - horizon)].tolist()  # type: ignore[no-any-return]

    def live_slots(self, since: int) -> int:
        """Prefix slots of the rows that ran after forward ``since`` (each row's latest prefix)."""
        return int(self.prefix[self.seen > since].sum())
