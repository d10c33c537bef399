"""hostcopy on CUDA: the export's slots expanded on the device equal the CPU's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvcanary.hostcopy import export_of_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda", 0)  # a resolved device: tensors report their index


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
