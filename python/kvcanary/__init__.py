"""kvcanary: KV-cache integrity checking for LLM inference engines."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcanary_schema import SCHEMA_VERSION

if TYPE_CHECKING:
    from kvcanary.config import CanaryConfig
    from kvcanary.manager import CanaryManager, install
    from kvcanary.report import CanaryViolationError

__version__ = "0.1.0"  # the one place of the version (pyproject reads it)
__all__ = ["SCHEMA_VERSION", "CanaryConfig", "CanaryManager", "CanaryViolationError", "__version__", "install"]

# Imported on first use: the runtime pulls in torch and tvm-ffi, which `kvcanary schema` does not need.
_LAZY = {"CanaryConfig": "kvcanary.config", "CanaryManager": "kvcanary.manager", "install": "kvcanary.manager",
         "CanaryViolationError": "kvcanary.report"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvcanary' has no attribute {name!r}")
