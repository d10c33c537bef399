"""The engine on CUDA: same outputs as on CPU, clean bookkeeping (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_requests
from engine_shadow import ShadowChecker, sequential
from kvcanary.engine import Engine, EngineConfig, ModelConfig
from test_equivalence import check_resident_chains

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("spec", [0, 3])
def test_cuda_matches_cpu(model_cfg: ModelConfig, swa_cfg: ModelConfig, draft_cfg: ModelConfig,
                          spec: int) -> None:
    for model in (model_cfg, swa_cfg):
        reqs = make_requests(4, shared=8, new=12)
        config = EngineConfig(chunk_size=7, page_size=2, spec_num_draft=spec, decode_pad_multiple=4)
        shadow = ShadowChecker(config.num_slots)
        engine = Engine(config, model, draft_cfg if spec else None, device="cuda", hooks=shadow)
        out = engine.generate(reqs)
        assert shadow.violations == []
        assert engine.pool_view().k[0].device.type == "cuda"
        assert engine.cached_chains().slots.device.type == "cuda"
        assert out == sequential(reqs, model)


def test_cuda_resident_chains_match_reference(model_cfg: ModelConfig) -> None:
    """The export's pinned buffers and copies without a sync give the same chains as the slow reference."""
    check_resident_chains(model_cfg, {"chunk_size": 5, "page_size": 4, "num_slots": 1024}, "cuda")
