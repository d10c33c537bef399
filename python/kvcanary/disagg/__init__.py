"""Prefill->decode disaggregation over torch.distributed: the canary records travel with the KV (DESIGN 12)."""

from __future__ import annotations

from .errors import PeerLostError, TransferError, TransferProtocolError, TransferRejectedError, TransferTimeoutError
from .layout import TransferItem, TransferLayout
from .transport import Channel, FaultName, FaultSpec, FaultSwitch

__all__ = ["Channel", "FaultName", "FaultSpec", "FaultSwitch", "PeerLostError", "TransferError", "TransferItem",
           "TransferLayout", "TransferProtocolError", "TransferRejectedError", "TransferTimeoutError"]
