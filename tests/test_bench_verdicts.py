"""The transformers benchmark's verdict from paired repeats: hand-computed cases (noise must never produce a met)."""

from __future__ import annotations

import pytest

from bench.bench_transformers import _quartiles, _verdict


@pytest.mark.parametrize(("pairs", "target", "met"), [
    ([0.1, 0.3, 0.5, 0.9], 1.0, True),          # every pair within, spread within
    ([-0.2, 0.2, 0.6, 0.8], 1.0, True),
    ([-27.0, -25.3, -18.3, -8.0, -7.3, 11.6], 2.0, None),  # all but one "faster": noise, not a met
    ([-0.5, 0.5, 1.5, 2.5], 1.0, None),         # straddles the target
    ([1.2, 1.5, 2.0, 60.0], 1.0, False),        # every pair above
    ([0.9, 1.5, 2.0, 3.0], 1.0, None),          # one pair within: not every pair above
    ([0.5, 0.8], 1.0, True),                    # fewer than 4: the extremes stand for the quartiles
    ([0.5, 1.8], 1.0, None),
])
def test_verdict(pairs: list[float], target: float, met: bool | None) -> None:
    assert _verdict(sorted(pairs), target) is met


def test_quartiles_of_sorted_pairs() -> None:
    assert _quartiles([1.0, 2.0, 3.0]) == (1.0, 3.0)
    lo, hi = _quartiles([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    assert lo == pytest.approx(2.25) and hi == pytest.approx(6.75)
