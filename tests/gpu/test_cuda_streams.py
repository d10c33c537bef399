"""StreamHandoff on CUDA: between enter() and leave() the side stream is current; work on it runs after what the current
stream queued before enter(), and the current stream's later work runs after what the side stream queued before
leave()."""

from __future__ import annotations

import pytest
import torch
from kvcanary.streams import StreamHandoff

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda", 0)
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: tens of ms, far longer than the host takes to queue what follows


@pytest.mark.parametrize("rounds", [1, 3])
def test_handoff_orders_both_ways(rounds: int) -> None:
    """Each round: the current stream writes behind a long kernel, the side stream reads it and writes behind another,
    the current stream reads that; unordered, either read would see the old value. Rounds reuse the two events."""
    side = torch.cuda.Stream(CUDA)  # type: ignore[no-untyped-call]
    hand = StreamHandoff(side)
    x = torch.zeros(1 << 16, device=CUDA)
    for r in range(1, rounds + 1):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        x.fill_(r)
        hand.enter()
        seen = x.clone()  # on the side stream, after the fill: it waits for it
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        y = seen * 2
        hand.leave()
        back = y.clone()  # on the current stream: after the side stream's work
        y.record_stream(torch.cuda.current_stream(CUDA))
        assert seen.eq(r).all().item() and back.eq(2 * r).all().item()


def test_leave_without_enter_queues_nothing() -> None:
    """leave() with no enter() before it (a bracket that failed before its enter) records and waits on nothing: with
    the side stream busy, its event stays unrecorded and the current stream stays idle."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream(CUDA)  # type: ignore[no-untyped-call]
    hand = StreamHandoff(side)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
    hand.leave()
    recorded, waited = not hand._done.query(), not torch.cuda.current_stream(CUDA).query()
    side.synchronize()
    assert not recorded and not waited


def test_enter_makes_the_stream_current_and_leave_restores_the_one_before() -> None:
    """Under a non-default current stream: enter() makes the side stream current, leave() the one current before; the
    current device stays the same; a failed bracket's leave() (no enter) changes nothing."""
    outer, side = torch.cuda.Stream(CUDA), torch.cuda.Stream(CUDA)  # type: ignore[no-untyped-call]
    hand = StreamHandoff(side)
    with torch.cuda.stream(outer):
        for _ in range(2):
            hand.enter()
            inside = torch.cuda.current_stream(CUDA)
            hand.leave()
            assert inside == side and torch.cuda.current_stream(CUDA) == outer
            assert torch.cuda.current_device() == CUDA.index
        hand.leave()
        assert torch.cuda.current_stream(CUDA) == outer
    assert torch.cuda.current_stream(CUDA) == torch.cuda.default_stream(CUDA)
