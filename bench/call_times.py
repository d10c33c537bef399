"""The probes' timers: a class's methods patched to record each call's host seconds under their names, and calls timed
round-robin."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def time_calls(owner: type, name: str, times: dict[str, list[float]], before: Callable[[], None] | None = None,
               label: str | None = None) -> None:
    """Patch ``owner.name`` to append each call's seconds to ``times[label or name]`` (``before``: run first,
    untimed)."""
    fn: Callable[..., Any] = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        if before is not None:
            before()
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            times.setdefault(label or name, []).append(time.perf_counter() - t)
    setattr(owner, name, wrapper)


def round_robin(calls: dict[str, Callable[[], object]], rounds: int,
                after: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Each call's host seconds over ``rounds`` rounds in which the calls take turns (each sees the same host state);
    ``after(i)``: run after round ``i``, untimed."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for i in range(rounds):
        for name, fn in calls.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
        if after is not None:
            after(i)
    return times
