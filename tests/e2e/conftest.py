"""End-to-end tests: kvcanary hosted in the reference engine (one torch thread: the engine's ops are tiny)."""

from __future__ import annotations

import pytest
import torch
from kvcanary.errors import KVCanaryError


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def backend() -> str:
    """The C++ CPU backend when it builds here, else the torch reference."""
    try:
        from kvcanary import _native
        _native.module("cpu")
        return "cpu"
    except KVCanaryError:
        return "torch"
