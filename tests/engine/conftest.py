"""Shared fixtures of the engine tests."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from kvcanary.engine import ModelConfig, Request, SamplingParams


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The models are tiny: intra-op threads only add overhead (and contention on small boxes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def model_cfg() -> ModelConfig:
    """A tiny float64 model (float64 so batch composition never flips a greedy argmax)."""
    return ModelConfig(dtype=torch.float64)


@pytest.fixture
def swa_cfg() -> ModelConfig:
    """A tiny model whose layer 1 is a sliding-window layer."""
    return ModelConfig(num_layers=3, sliding_layers=(1,), sliding_window=6, dtype=torch.float64)


@pytest.fixture
def draft_cfg() -> ModelConfig:
    """A 1-layer draft model."""
    return ModelConfig(num_layers=1, hidden=32, intermediate=64, num_heads=2, num_kv_heads=1,
                       dtype=torch.float64, seed=7)


def make_requests(n: int = 4, seed: int = 0, prompt_len: int = 20, new: int = 10,
                  shared: int = 0, temperature: float = 0.0) -> list[Request]:
    """n random prompts; the first `shared` tokens are common to all of them."""
    rng = random.Random(seed)
    prefix = [rng.randrange(128) for _ in range(shared)]
    return [Request(f"r{i}", tuple(prefix + [rng.randrange(128) for _ in range(prompt_len + i)]),
                    new, SamplingParams(temperature, seed=i)) for i in range(n)]
