"""kvcanary: KV-cache integrity checking for LLM inference engines."""

from kvcanary_schema import SCHEMA_VERSION

__version__ = "0.1.0"
__all__ = ["SCHEMA_VERSION", "__version__"]
