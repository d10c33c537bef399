"""make_sequence (docs/ops-contract.md 9): one native call running bound ops in order, the slot table inserted, the
shaped arguments cut to the call's batch shape."""

from __future__ import annotations

import pytest
import torch
import tvm_ffi
from kvcanary import _native
from kvcanary_schema import NO_SLOT, RECORD_NUM_FIELDS, RecordField, ShapedArg

ROWS, TOKENS, NUM_TOKENS = int(ShapedArg.BATCH_ROWS), int(ShapedArg.TOKENS), int(ShapedArg.NUM_TOKENS)


def _scatter_args(pool: torch.Tensor, lens: torch.Tensor, row: int, status: torch.Tensor) -> list[object]:
    """scatter_tokens' arguments but ``tokens`` (the sequence's table stands in for it)."""
    rows, starts, counts = (torch.tensor([v]) for v in (row, 0, 3))
    return [tvm_ffi.from_dlpack(t) for t in (pool, lens, rows, starts, counts, status)]


def test_ops_run_in_order_with_the_table_in_its_place() -> None:
    mod = _native.module("cpu")
    pool, lens, status = torch.zeros(3, 5, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), \
        torch.zeros(1, dtype=torch.int64)
    seq = mod.make_sequence([mod.scatter_tokens] * 2,
                            [_scatter_args(pool, lens, row, status) for row in (1, 2)], [5, 5], [[], []])
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
        mod.make_sequence([mod.scatter_tokens], [args], [7], [[]])
    with pytest.raises(ValueError, match="functions"):
        mod.make_sequence([mod.scatter_tokens], [args, args], [5], [[]])
    seq = mod.make_sequence([mod.scatter_tokens], [args], [5], [[]])
    with pytest.raises(TypeError, match="optionally with the batch's rows"):
        seq(torch.tensor([1]), torch.tensor([2]))
    bad = mod.make_sequence([mod.scatter_tokens, mod.scatter_tokens], [args, args[:5]], [5, 5], [[], []])  # 6 args
    with pytest.raises(TypeError, match="Expected 7 but got 6 arguments"):
        bad(torch.tensor([7, 8, 9]))
    assert int(lens[1]) == 3  # the first op ran


def test_shaped_arguments_follow_the_call_shape() -> None:
    """scatter_tokens of three requests, its per-request tensors cut to the call's rows: each call scatters only the
    first ``rows`` requests; a call without a shape runs as bound."""
    mod = _native.module("cpu")
    pool, lens, status = torch.zeros(3, 5, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), \
        torch.zeros(1, dtype=torch.int64)
    per_request = [torch.tensor(v) for v in ([0, 1, 2], [0, 0, 0], [1, 1, 1])]  # rows, starts, counts
    args = [tvm_ffi.from_dlpack(t) for t in (pool, lens, *per_request, status)]
    seq = mod.make_sequence([mod.scatter_tokens], [args], [5], [[2, ROWS, 3, ROWS, 4, ROWS]])
    tokens = torch.tensor([7, 8, 9])
    for rows, want in ((1, [1, 0, 0]), (2, [1, 1, 0]), (1, [1, 1, 0])):  # (1, 0) again: its cached arguments
        seq(tokens, rows, 0)
        assert lens.tolist() == want
    seq(tokens)
    assert lens.tolist() == [1, 1, 1] and pool[:, 0].tolist() == [7, 8, 9] and int(status[0]) == 0
    seq(tokens, 0, 0)  # no request: nothing runs past the checks
    assert lens.tolist() == [1, 1, 1]


def test_an_integer_argument_takes_the_call_tokens() -> None:
    """invalidate's slot list cut to the call's tokens and its reserved count replaced by them."""
    mod = _native.module("cpu")
    records = torch.ones(1, 6, 1, RECORD_NUM_FIELDS, dtype=torch.int64)
    args = [tvm_ffi.from_dlpack(records), tvm_ffi.from_dlpack(torch.tensor([4, 3, 2, 1, 0])), 5]
    seq = mod.make_sequence([mod.invalidate], [args], [-1], [[1, TOKENS, 2, NUM_TOKENS]])
    seq(torch.zeros(1, 1), 0, 2)  # ids 4, 3, both at or past 2 reserved slots
    positions = records[0, :, 0, RecordField.POSITION]
    assert positions.tolist() == [1, 1, 1, NO_SLOT, NO_SLOT, 1]
    seq(torch.zeros(1, 1), 0, 5)  # ids 4..0, 5 reserved: none kept
    assert positions.tolist() == [1, 1, 1, NO_SLOT, NO_SLOT, 1]
    with pytest.raises(ValueError, match="at most 3 rows|at most .* and 5 tokens"):
        seq(torch.zeros(1, 1), 0, 6)


def test_bad_shaped_arguments_and_shapes_raise() -> None:
    mod = _native.module("cpu")
    pool, lens, status = torch.zeros(3, 5, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), \
        torch.zeros(1, dtype=torch.int64)
    args = _scatter_args(pool, lens, 1, status)
    for shaped, err, match in (([2], ValueError, "pairs"), ([9, ROWS], ValueError, "outside"),
                               ([2, 0], ValueError, "no ShapedArg kind"), ([2, NUM_TOKENS], TypeError, "an int"),
                               ([2, int(ShapedArg.PLAN_ROWS)], ValueError, "no row")):
        if match == "no row":
            args = [*args[:2], tvm_ffi.from_dlpack(torch.zeros(0, dtype=torch.int64)), *args[3:]]
        with pytest.raises(err, match=match):
            mod.make_sequence([mod.scatter_tokens], [args], [5], [shaped])
    seq = mod.make_sequence([mod.scatter_tokens], [_scatter_args(pool, lens, 1, status)], [5], [[2, ROWS]])
    for rows, tokens in ((2, 0), (-1, 0), (0, -1)):
        with pytest.raises(ValueError, match="bound for at most 1 rows"):
            seq(torch.tensor([7, 8, 9]), rows, tokens)
    assert int(lens[1]) == 0  # nothing ran
