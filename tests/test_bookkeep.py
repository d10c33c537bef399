"""bookkeep (docs/ops-contract.md 10): stage counters and a running maximum; torch reference vs the CPU op."""

from __future__ import annotations

import pytest
import torch
from kvcanary.errors import CanaryInputError
from kvcanary.ops.bookkeep import bind_bookkeep

BACKENDS = ["torch", "cpu"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("k", "n"), [(0, 0), (2, 0), (0, 5), (1, 3), (2, 7)])
def test_counters_tick_and_acc_keeps_the_running_max(backend: str, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(k * 10 + n)
    counter = torch.randint(-5, 5, (k,), generator=gen)
    acc, srcs = torch.randint(-9, 9, (n,), generator=gen), torch.randint(-9, 9, (3, n), generator=gen)
    want_counter, want_acc = counter + 3, torch.maximum(acc, srcs.max(0).values) if n else acc.clone()
    for src in srcs:
        op = bind_bookkeep(counter, acc, src.contiguous(), backend).frozen()
        op(torch.zeros(1, 1, dtype=torch.int64))  # the table is not passed on
    assert torch.equal(counter, want_counter) and torch.equal(acc, want_acc)


def test_bad_arguments_raise_before_any_work() -> None:
    c, a = torch.zeros(2, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(CanaryInputError, match="src"):
        bind_bookkeep(c, a, torch.zeros(3, dtype=torch.int64), "cpu")
    with pytest.raises(CanaryInputError, match="counter"):
        bind_bookkeep(c.float(), a, a, "cpu")
    with pytest.raises(CanaryInputError, match="acc"):
        bind_bookkeep(c, a.view(2, 2), a.view(2, 2), "cpu")
    assert int(c.sum()) == 0 and int(a.sum()) == 0
