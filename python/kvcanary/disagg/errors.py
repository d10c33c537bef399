"""Typed errors of the prefill->decode transfer path."""

from __future__ import annotations

from kvcanary.errors import KVCanaryError


class TransferError(KVCanaryError, RuntimeError):
    """A transfer between the prefill and decode roles failed."""


class PeerLostError(TransferError):
    """The peer process died or closed its connection."""


class TransferTimeoutError(TransferError):
    """The peer did not answer within the transfer timeout."""


class TransferProtocolError(TransferError):
    """A message was malformed: bad magic/version, checksum, kind, size, or a layout mismatch."""


class TransferRejectedError(TransferError):
    """The decode side refused one request's transfer (bad length, no capacity); other requests go on."""

    def __init__(self, req_key: int, status: int, reason: str) -> None:
        super().__init__(f"transfer of request {req_key} rejected: {reason} (status {status})")
        self.req_key, self.status, self.reason = req_key, status, reason
