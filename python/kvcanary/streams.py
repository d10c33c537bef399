"""The hot path's CUDA streams without torch.cuda's per-call Python (lazy-init checks, device lookups, new Stream
objects): the current stream of a device, and a switch to another stream and back."""

from __future__ import annotations

import torch


class CurrentStream:
    """The current stream of CUDA device ``index`` as a ``torch.cuda.Stream``, rebuilt only when the stream changes."""

    def __init__(self, index: int) -> None:
        """For device ``index`` (CUDA initialised: the caller holds tensors there)."""
        self.index = index
        self._raw: tuple[int, int, int] | None = None
        self._stream: torch.cuda.Stream | None = None

    def get(self) -> torch.cuda.Stream:
        """The stream torch launches on now (as torch.cuda.current_stream(index) returns it)."""
        raw = torch._C._cuda_getCurrentStream(self.index)
        if raw != self._raw or self._stream is None:
            self._raw = raw
            self._stream = torch.cuda.Stream(stream_id=raw[0], device_index=raw[1], device_type=raw[2])  # type: ignore[no-untyped-call]
        return self._stream


Was = tuple[torch.cuda.Stream, int]  # what StreamSwitch.enter found current: the device's stream, the current device


class StreamSwitch:
    """``stream`` made the current stream (and its device the current device) by :meth:`enter`, and what was current
    before made current again by :meth:`leave`: torch's own setters, without ``torch.cuda.stream``'s Python (tens of
    µs per use). It queues nothing on either stream (an event record costs 14-48 µs inside an engine's step,
    bench/results/host_session28): work queued meanwhile is ordered by ``stream`` alone, so whoever switches
    keeps on ``stream`` every device op that must be ordered with that work (``wait_stream`` once where work must
    cross streams). Switches nest: each :meth:`leave` takes what its :meth:`enter` returned."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        """For ``stream`` (of a CUDA device; CUDA initialised)."""
        self.stream = stream
        self._current = CurrentStream(stream.device_index)

    def enter(self) -> Was:
        """Make ``stream`` current; returns what :meth:`leave` restores: the stream current on its device and the
        current device, before."""
        was = self._current.get(), torch._C._cuda_getDevice()
        _set_stream(self.stream)
        return was

    def leave(self, was: Was) -> None:
        """Make current again what :meth:`enter` returned (``was``)."""
        stream, device = was
        _set_stream(stream)
        if device != stream.device_index:
            torch._C._cuda_setDevice(device)


def _set_stream(stream: torch.cuda.Stream) -> None:
    """Make ``stream`` the current stream of its device, and its device the current device (torch.cuda.set_stream's
    own call, without its Python wrappers)."""
    torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)
