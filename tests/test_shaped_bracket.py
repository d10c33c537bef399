"""A bracket bound once at a larger batch and run at a batch's shape (docs/ops-contract.md 9, ShapedArg) equals the
same ops called on that batch's exact tensors: the cut keeps the batch and nothing past it (garbage rows and tokens
past the batch would change every output)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from gpu.helpers import ALL_CHECKS, Batch, assert_brackets_equal, clone_group, make_batch, run_bracket
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcanary.ops.plan import bind_plan_forward
from kvcanary.ops.types import Sink
from kvcanary.ops.verify import bind_verify
from kvcanary.ops.write import write_target
from kvcanary.program import _fused
from kvcanary_schema import NUM_PLAN_COLS, NUM_PLAN_STATUS_COLS, FingerprintMode, Stage

BACKENDS = ["torch", "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def _padded(t: torch.Tensor | None, extra: int, gen: torch.Generator, low: int, high: int) -> torch.Tensor | None:
    """``t`` followed by ``extra`` random values in [low, high): what an earlier, larger batch left in a buffer."""
    if t is None:
        return None
    junk = torch.randint(low, high, (extra,), generator=gen).to(t.device)
    return torch.cat([t, junk])


def _bound_bracket(b: Batch, backend: str, extra_rows: int, extra_tokens: int, seed: int) -> dict[str, Any]:
    """run_bracket's five ops bound once on buffers ``extra_rows`` / ``extra_tokens`` past the batch (garbage there),
    run at the batch's (rows, tokens)."""
    dev, gen = b.head.records.device, torch.Generator().manual_seed(seed)
    head, tail = clone_group(b.head), clone_group(b.tail)
    bs, nt = b.rpi.shape[0], b.ids.shape[0]
    slots, rows = b.head.records.shape[0], b.table.shape[0]
    rpi, pre, ext = (_padded(t, extra_rows, gen, 0, h) for t, h in ((b.rpi, rows), (b.pre, 8), (b.ext, 8)))
    ep, en = (_padded(t, extra_rows, gen, 0, 1 << 40) for t in (b.expect_prefix, b.expect_new))
    ids, pos, loc = (_padded(t, extra_tokens, gen, 0, h) for t, h in ((b.ids, 1000), (b.pos, 64), (b.loc, slots)))
    assert rpi is not None and pre is not None and ext is not None and ids is not None and pos is not None \
        and loc is not None
    plan = torch.randint(-9, 99, (bs + extra_rows, NUM_PLAN_COLS), generator=gen).to(dev)
    status = torch.zeros(NUM_PLAN_STATUS_COLS, dtype=torch.int64, device=dev)
    sink = Sink.allocate(4096, dev)
    sink.step.fill_(5)

    def writer(group: Any, stage: Stage, fp: Any) -> Any:
        target = write_target(group, stage, status, b.table, sink, checks=ALL_CHECKS, token_pool=b.pool,
                              fingerprint=fp, backend=backend)
        return target.bind(plan, ids, pos, loc).frozen()
    ops = [bind_plan_forward(plan, status, rpi, pre, ext, b.table, nt + extra_tokens, window=b.window,
                             expect_prefix=ep, expect_new=en, backend=backend).frozen(),
           bind_verify(head, Stage.HEAD, plan, status, b.table, sink, token_pool=b.pool, backend=backend).frozen(),
           writer(head, Stage.HEAD, None),
           bind_verify(tail, Stage.TAIL, plan, status, b.table, sink, token_pool=b.pool, fingerprint=b.fp,
                       backend=backend).frozen(),
           writer(tail, Stage.TAIL, b.fp)]
    for op in _fused(ops, backend):
        op(b.table, bs, nt)
    return {"plan": plan, "status": status, "head": head.records, "tail": tail.records, "sink": sink}


def _case(seed: int, device: str) -> tuple[Batch, int, int]:
    rng = random.Random(seed)
    bs = rng.randint(1, 5)
    b = make_batch(seed, bs=bs, prefix=[rng.randint(0, 40) for _ in range(bs)],
                   ext=[rng.randint(1, 9) for _ in range(bs)], swa=rng.random() < 0.3,
                   window=rng.choice([0, 0, 16]), fp_mode=rng.choice([None, FingerprintMode.PARTIAL]),
                   fp_bytes=64, corrupt=rng.randint(0, 3), pool=rng.random() < 0.3, expect=rng.random() < 0.5,
                   device=device)
    return b, rng.randint(0, 6), rng.randint(0, 40)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(12))
def test_bound_once_run_at_the_batch_shape_equals_the_exact_batch(backend: str, seed: int) -> None:
    b, extra_rows, extra_tokens = _case(seed, "cuda" if backend == "cuda" else "cpu")
    assert_brackets_equal(_bound_bracket(b, backend, extra_rows, extra_tokens, seed), run_bracket(b, backend),
                          f"seed {seed}")


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32))
def test_bound_once_property(seed: int) -> None:
    b, extra_rows, extra_tokens = _case(seed, "cpu")
    assert_brackets_equal(_bound_bracket(b, "cpu", extra_rows, extra_tokens, seed), run_bracket(b, "torch"),
                          f"seed {seed}")
