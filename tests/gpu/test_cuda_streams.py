"""StreamSwitch on CUDA: between enter() and leave() the side stream is current, after leave() what was current before;
switches nest; a switch queues nothing on either stream."""

from __future__ import annotations

import pytest
import torch
from kvcanary.streams import StreamSwitch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda", 0)
SLEEP_CYCLES = 50_000_000  # torch.cuda._sleep: tens of ms, far longer than the host takes to queue what follows


def test_enter_makes_the_stream_current_and_leave_restores_the_one_before() -> None:
    """Under a non-default current stream, twice: enter() makes the side stream current, leave() the one current
    before; the current device stays the same; with no stream set, the default stream comes back."""
    outer, side = torch.cuda.Stream(CUDA), torch.cuda.Stream(CUDA)  # type: ignore[no-untyped-call]
    switch = StreamSwitch(side)
    with torch.cuda.stream(outer):
        for _ in range(2):
            was = switch.enter()
            inside = torch.cuda.current_stream(CUDA)
            switch.leave(was)
            assert inside == side and torch.cuda.current_stream(CUDA) == outer
            assert torch.cuda.current_device() == CUDA.index
    was = switch.enter()
    switch.leave(was)
    assert torch.cuda.current_stream(CUDA) == torch.cuda.default_stream(CUDA)


def test_switches_nest() -> None:
    """A switch entered while another (or the same) is current restores that one when it leaves."""
    a, b = torch.cuda.Stream(CUDA), torch.cuda.Stream(CUDA)  # type: ignore[no-untyped-call]
    to_a, to_b = StreamSwitch(a), StreamSwitch(b)
    outer = to_a.enter()
    mid = to_b.enter()
    same = to_b.enter()
    assert torch.cuda.current_stream(CUDA) == b
    to_b.leave(same)
    assert torch.cuda.current_stream(CUDA) == b
    to_b.leave(mid)
    assert torch.cuda.current_stream(CUDA) == a
    to_a.leave(outer)
    assert torch.cuda.current_stream(CUDA) == torch.cuda.default_stream(CUDA)


def test_a_switch_queues_nothing() -> None:
    """Work queued on the side stream after enter() does not wait for the long kernel queued before it on the stream
    current then, and that stream does not wait for the side stream after leave(): both finish on their own."""
    side = torch.cuda.Stream(CUDA)  # type: ignore[no-untyped-call]
    switch = StreamSwitch(side)
    current = torch.cuda.current_stream(CUDA)
    x, y = torch.zeros(16, device=CUDA), torch.zeros(16, device=CUDA)  # no allocation below: cudaMalloc may sync
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
    was = switch.enter()
    x.fill_(2)
    switch.leave(was)
    side.synchronize()
    side_done_first = not current.query()  # the side stream finished while the current one still sleeps
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
    was = switch.enter()
    switch.leave(was)
    y.fill_(3)  # on the current stream, after the switch
    current.synchronize()
    current_done_first = not side.query()
    side.synchronize()
    assert side_done_first and current_done_first and x.sum().item() == 32 and y.sum().item() == 48
