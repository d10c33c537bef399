"""The hot path's CUDA streams without torch.cuda's per-call Python (lazy-init checks, device lookups, new Stream
objects): the current stream of a device, and a handoff to another stream and back."""

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


class StreamHandoff:
    """Work queued on ``stream`` between :meth:`enter` and :meth:`leave`, with ``stream`` current meanwhile, ordered
    after what the current stream had queued and before what it queues next: ``stream.wait_stream(current)`` and
    ``torch.cuda.stream(stream)``, then ``current.wait_stream(stream)``, with two events kept across calls (each
    ``wait_stream`` makes a new one), the current stream from :class:`CurrentStream` and the stream switched by
    torch's own setter (``torch.cuda.stream`` costs tens of µs of Python per use). Reusing an event is safe: a wait
    takes the event's state when it is queued."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        """For ``stream`` (of a CUDA device; CUDA initialised)."""
        self.stream = stream
        self._current = CurrentStream(stream.device_index)
        self._entered: torch.cuda.Stream | None = None  # the current stream at enter()
        self._device = 0  # the current device at enter() (setting a stream makes its device current)
        self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._done = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def enter(self) -> None:
        """``stream`` waits for the work queued on the current stream so far, then becomes the current stream."""
        current = self._current.get()
        self._ready.record(current)
        self.stream.wait_event(self._ready)
        self._device = torch._C._cuda_getDevice()
        _set_stream(self.stream)
        self._entered = current

    def leave(self) -> None:
        """The stream that was current at :meth:`enter` is current again and waits for the work queued on ``stream``
        so far; the device current at :meth:`enter` is current again. Nothing without an :meth:`enter` before it."""
        entered, self._entered = self._entered, None
        if entered is None:
            return
        self._done.record(self.stream)
        _set_stream(entered)
        if self._device != entered.device_index:
            torch._C._cuda_setDevice(self._device)
        entered.wait_event(self._done)


def _set_stream(stream: torch.cuda.Stream) -> None:
    """Make ``stream`` the current stream of its device, and its device the current device (torch.cuda.set_stream's
    own call, without its Python wrappers)."""
    torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)
