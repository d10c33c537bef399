"""Shared helpers of the runtime tests: build an engine + manager and run bracketed forwards."""

from __future__ import annotations

from typing import Any

from kvcanary.adapter import BatchView
from kvcanary.config import CanaryConfig
from kvcanary.manager import CanaryManager, install
from kvcanary.report import Violation, WindowReport

from .fake_engine import FakeEngine


def setup(n_reqs: int = 3, prompt_len: int = 5, engine: FakeEngine | None = None,
          **cfg: Any) -> tuple[FakeEngine, CanaryManager]:
    """An engine with ``n_reqs`` requests of distinct prompts and an installed manager."""
    eng = engine if engine is not None else FakeEngine()
    cfg.setdefault("stats_interval", 0)
    cfg.setdefault("sweep_interval", 0)
    m = install(eng, CanaryConfig(**cfg))
    for i in range(n_reqs):
        eng.add(f"r{i}", [10 + 7 * i + j for j in range(prompt_len)])
    return eng, m


def bracket(eng: FakeEngine, m: CanaryManager, b: BatchView) -> WindowReport | None:
    """Forward ``b`` inside the canary's bracket."""
    m.begin_forward(b)
    m.pre_forward()
    eng.forward(b)
    m.post_forward()
    return m.end_forward()


def step(eng: FakeEngine, m: CanaryManager, pad_to: int = 0) -> WindowReport | None:
    """One bracketed forward."""
    return bracket(eng, m, eng.batch(pad_to=pad_to))


def run(eng: FakeEngine, m: CanaryManager, n: int, pad_to: int = 0) -> list[WindowReport]:
    """``n`` forwards; the reports collected on the way (plus a final flush)."""
    out = []
    for _ in range(n):
        r = step(eng, m, pad_to)
        if r is not None:
            out.append(r)
    r = m.flush()
    if r is not None:
        out.append(r)
    return out


def violations(reports: list[WindowReport]) -> list[Violation]:
    """All kept rows."""
    return [v for r in reports for v in r.violations]


def total(reports: list[WindowReport]) -> int:
    """Exact violation count."""
    return sum(r.total for r in reports)
