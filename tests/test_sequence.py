"""make_sequence (docs/ops-contract.md 9): one native call running bound ops in order, the slot table inserted."""

from __future__ import annotations

import pytest
import torch
import tvm_ffi
from kvcanary import _native


def _scatter_args(pool: torch.Tensor, lens: torch.Tensor, row: int, status: torch.Tensor) -> list[object]:
    """scatter_tokens' arguments but ``tokens`` (the sequence's table stands in for it)."""
    rows, starts, counts = (torch.tensor([v]) for v in (row, 0, 3))
    return [tvm_ffi.from_dlpack(t) for t in (pool, lens, rows, starts, counts, status)]


def test_ops_run_in_order_with_the_table_in_its_place() -> None:
    mod = _native.module("cpu")
    pool, lens, status = torch.zeros(3, 5, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), \
        torch.zeros(1, dtype=torch.int64)
    seq = mod.make_sequence([mod.scatter_tokens] * 2,
                            [_scatter_args(pool, lens, row, status) for row in (1, 2)], [5, 5])
    seq(torch.tensor([7, 8, 9]))
    want, want_lens = torch.zeros(3, 5, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    for row in (1, 2):
        mod.scatter_tokens(want, want_lens, torch.tensor([row]), torch.tensor([0]), torch.tensor([3]),
                           torch.tensor([7, 8, 9]), torch.zeros(1, dtype=torch.int64))
    assert torch.equal(pool, want) and torch.equal(lens, want_lens) and int(status[0]) == 0


def test_bad_sequences_and_calls_raise_and_errors_propagate() -> None:
    mod = _native.module("cpu")
    pool, lens, status = torch.zeros(3, 5, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), \
        torch.zeros(1, dtype=torch.int64)
    args = _scatter_args(pool, lens, 1, status)
    with pytest.raises(ValueError, match="table position"):
        mod.make_sequence([mod.scatter_tokens], [args], [7])
    with pytest.raises(ValueError, match="functions"):
        mod.make_sequence([mod.scatter_tokens], [args, args], [5])
    seq = mod.make_sequence([mod.scatter_tokens], [args], [5])
    with pytest.raises(TypeError, match="slot table only"):
        seq(torch.tensor([1]), torch.tensor([2]))
    bad = mod.make_sequence([mod.scatter_tokens, mod.scatter_tokens], [args, args[:5]], [5, 5])  # 2nd: 6 args
    with pytest.raises(TypeError, match="Expected 7 but got 6 arguments"):
        bad(torch.tensor([7, 8, 9]))
    assert int(lens[1]) == 3  # the first op ran
