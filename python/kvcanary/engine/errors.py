"""Typed exceptions raised by the reference engine."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the reference engine raises."""


class ConfigError(EngineError, ValueError):
    """A configuration value is out of range or inconsistent."""


class PoolExhaustedError(EngineError):
    """The KV pool cannot hold what the scheduler must run, even after eviction and retraction."""


class DoubleFreeError(EngineError):
    """A page was freed that was already free (or was never allocatable)."""


class RequestError(EngineError, ValueError):
    """A request is malformed, unknown, or duplicated."""
