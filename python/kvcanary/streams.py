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
