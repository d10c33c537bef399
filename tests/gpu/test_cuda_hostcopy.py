"""hostcopy on CUDA: staged rows through pinned memory (the host buffer is not overwritten under a pending copy), and
the export's slots expanded on the device equal the CPU's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvcanary.hostcopy import StagedRows, export_of_blocks

from tests.test_hostcopy import staged_rows_round_trip

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda", 0)  # a resolved device: tensors report their index


def test_staged_rows_round_trip_cuda() -> None:
    staged_rows_round_trip(CUDA)


def test_staged_rows_wait_for_the_pending_copy() -> None:
    """A put queued behind a long kernel, then read on the stream; the next put must not overwrite the host buffer
    before that copy ran, so the first read still sees the first put's values."""
    rows = StagedRows(2, 4, CUDA)
    torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]  # the copy below waits behind it
    first = [v.clone() for v in rows.put(([1, 2, 3, 4], [5, 6, 7, 8]), 4)]
    second = [v.clone() for v in rows.put(([9, 9, 9, 9], [0, 0, 0, 0]), 4)]
    assert [v.tolist() for v in first] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [v.tolist() for v in second] == [[9, 9, 9, 9], [0, 0, 0, 0]]


@pytest.mark.parametrize("page", [1, 16])
def test_export_of_blocks_cuda_equals_cpu(page: int) -> None:
    rng = np.random.default_rng(page)
    blocks = rng.permutation(5000)[:700].astype(np.int64)
    first = rng.integers(0, 100, 700) * page
    parents = np.where(rng.random(700) < 0.3, -1, rng.integers(0, 5000, 700))
    unlocked = rng.random(700) < 0.5
    cpu = export_of_blocks(blocks, first, parents, page, unlocked, torch.device("cpu"))
    gpu = export_of_blocks(blocks, first, parents, page, unlocked, CUDA)
    gpu.validate(CUDA)
    for name in ("slots", "starts", "lens", "first_positions", "prev_slots", "unlocked"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
