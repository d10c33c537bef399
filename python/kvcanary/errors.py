"""Typed exceptions raised by kvcanary (never bare asserts)."""

from __future__ import annotations


class KVCanaryError(Exception):
    """Base class of every kvcanary error."""


class CanaryInputError(KVCanaryError, ValueError):
    """An argument (dtype, device, shape, stride, alignment, range, capacity) is invalid; raised before any launch."""


class BackendUnavailableError(KVCanaryError, RuntimeError):
    """The requested backend (cpu / cuda native module) cannot be built or loaded here."""


class KVCanaryInternalError(KVCanaryError, RuntimeError):
    """An internal invariant was broken (a kvcanary bug, or state mutated behind its back); never raised by design."""
