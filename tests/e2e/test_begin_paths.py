"""The reference engine's mixed workload (prefix reuse, chunked prefill, speculative rounds, retracts) through a canary
whose begin takes the native begin_decode wherever it can, and through one on the numpy path only: after every forward
both have staged the same truth and hold the same row state, and neither reports anything."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from kvcanary import campaign as C
from kvcanary.engine import ForwardBatch, PoolKind
from kvcanary.engine.canary import EngineCanary
from kvcanary.upload import Upload


def _run(native: bool, spec: bool) -> tuple[list[list[np.ndarray]], int]:
    """Per forward: the staged truth rows and the row state of its pool's manager; and the forwards whose claimed
    batch (new requests, caught-up prefixes) went through begin_decode."""
    engine = C.build_engine((), spec, "cpu")
    snaps: list[list[np.ndarray]] = []

    def snap(canary: EngineCanary, batch: ForwardBatch, kind: PoolKind) -> None:
        up = canary.managers[kind].upload
        snaps.append([canary.managers[kind].state.truth_rows.numpy().copy(), up.chains.h.copy(), up.chains.n.copy(),
                      up.requests.seen.copy(), up.requests.prefix.copy()])
    canary = EngineCanary(engine, C.POLICIES["default"]("cpu"), on_forward=snap)
    claimed = 0
    for m in canary.managers.values():
        if not native:
            m.upload._decodes = False
        continued = m.upload._continued

        def spy(*args: object, continued=continued) -> bool:  # type: ignore[no-untyped-def]
            nonlocal claimed
            got = continued(*args)
            claimed += got
            return got
        m.upload._continued = spy  # type: ignore[method-assign]
    C.mixed_workload(engine, random.Random(7), 14, max_forwards=160)
    canary.flush()
    assert canary.total == 0
    return snaps, claimed


@pytest.mark.parametrize("spec", [False, True])
def test_native_and_numpy_begin_leave_the_same_truth(spec: bool) -> None:
    (native, claimed), (numpy_path, none) = _run(True, spec), _run(False, spec)
    assert claimed > 10 and none == 0
    assert len(native) == len(numpy_path)
    for i, (a, b) in enumerate(zip(native, numpy_path, strict=True)):
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), i


def test_a_new_request_with_a_reused_prefix_stages_its_reuse_end() -> None:
    """A claimed batch through begin_decode: the new request's reuse end is its prefix (the reuse check verifies the
    whole reused prefix on its first forward) and its row caught up to the prefix end first."""
    engine = C.build_engine((), False, "cpu")
    canary = EngineCanary(engine, C.POLICIES["default"]("cpu"))
    up: Upload = canary.target.upload
    seen: list[tuple[int, int]] = []
    begin = up.begin

    def spy(batch, step, capture, shape) -> None:  # type: ignore[no-untyped-def]
        begin(batch, step, capture, shape)
        row = canary.target.state.truth_rows[4, :batch.batch_size]
        seen.extend((int(p), int(r)) for p, r in zip(batch.prefix_lens_host, row.tolist(), strict=True) if r)
    up.begin = spy  # type: ignore[method-assign]
    C.mixed_workload(engine, random.Random(7), 14, max_forwards=160)
    assert seen and all(p == r and p > 0 for p, r in seen)
    assert torch.count_nonzero(canary.target.state.sink.count) == 0
