"""vLLM connector tests: skipped where vLLM is absent (the main venv), required by the tests_vllm session."""

from __future__ import annotations

import os

if os.environ.get("KVCANARY_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (tests_vllm: a missing vLLM is an error, never a silent skip)
