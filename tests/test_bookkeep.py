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


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_mirror_holds_the_values_tagged_with_the_counter(backend: str) -> None:
    counter, values = torch.tensor([41, 7]), torch.tensor([3, 9, 5])
    mirror = torch.full((4,), -1, dtype=torch.int64)
    op = bind_bookkeep(counter, counter[:0], counter[:0], backend, values, mirror).frozen()
    op(torch.zeros(1, 1, dtype=torch.int64))
    assert mirror.tolist() == [42, 3, 9, 5] and counter.tolist() == [42, 8]
    values[1] = 0
    op(torch.zeros(1, 1, dtype=torch.int64))
    assert mirror.tolist() == [43, 3, 0, 5]


@pytest.mark.parametrize("bad", ["alone", "length", "no counter", "no values"])
def test_bad_mirrors_raise(bad: str) -> None:
    c, v = torch.zeros(1, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    mirror = torch.zeros(3, dtype=torch.int64)
    args = {"alone": (v, None), "length": (v, mirror[:2]), "no counter": (v, mirror),
            "no values": (v[:0], mirror[:1])}[bad]
    with pytest.raises(CanaryInputError, match="mirror"):
        bind_bookkeep(c[:0] if bad == "no counter" else c, c[:0], c[:0], "cpu", *args)
