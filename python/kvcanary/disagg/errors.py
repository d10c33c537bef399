"""Typed errors of the prefill->decode transfer path."""

from __future__ import annotations

from kvcanary.errors import KVCanaryError


class TransferError(KVCanaryError, RuntimeError):
    """A transfer between the prefill and decode roles failed.

    The message is one line: ``"<role>: <step>: <cause>"``. ``detail`` keeps what the transport said (gloo/NCCL
    text, source paths) for the log; it never goes into the message.
    """

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class PeerLostError(TransferError):
    """The peer process died, closed its connection, or gave up and said so (ABORT)."""


class TransferTimeoutError(TransferError):
    """The peer did not answer within the transfer timeout."""


class TransferProtocolError(TransferError):
    """A message was malformed: bad magic/version, checksum, kind, size, or a layout mismatch."""


class TransferRejectedError(TransferError):
    """The decode side refused one request's transfer (bad length, no capacity); other requests go on."""

    def __init__(self, req_key: int, status: int, reason: str) -> None:
        super().__init__(f"prefill: the OFFER of request {req_key}: decode rejected it ({reason}, status {status})")
        self.req_key, self.status, self.reason = req_key, status, reason
