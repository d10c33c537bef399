"""torch's current CUDA stream of one device without torch.cuda.current_stream's per-call Python (lazy-init checks,
device lookup, a new Stream object): the hot path records events on it every forward."""

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
    """Work queued on ``stream`` between :meth:`enter` and :meth:`leave`, ordered after what the current stream had
    queued and before what it queues next: ``stream.wait_stream(current)``, then ``current.wait_stream(stream)``, with
    two events kept across calls (each ``wait_stream`` makes a new one) and the current stream from
    :class:`CurrentStream`. Reusing an event is safe: a wait takes the event's state when it is queued."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        """For ``stream`` (of a CUDA device; CUDA initialised)."""
        self.stream = stream
        self._current = CurrentStream(stream.device_index)
        self._entered: torch.cuda.Stream | None = None  # the current stream at enter()
        self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._done = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def enter(self) -> None:
        """``stream`` waits for the work queued on the current stream so far."""
        current = self._entered = self._current.get()
        self._ready.record(current)
        self.stream.wait_event(self._ready)

    def leave(self) -> None:
        """The stream that was current at :meth:`enter` waits for the work queued on ``stream`` so far."""
        if self._entered is not None:
            self._done.record(self.stream)
            self._entered.wait_event(self._done)
            self._entered = None
