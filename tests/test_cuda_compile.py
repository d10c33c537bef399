"""CI has nvcc but no GPU: JIT-compile the CUDA module so that compile errors fail here, and check its exports."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from kvcanary import _native

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"),
                                reason="needs nvcc")

OPS = ("plan_forward", "plan_sweep", "plan_roll", "verify", "write", "fingerprint", "scatter_tokens", "stage_batch",
       "begin_decode", "make_sequence", "bookkeep", "invalidate", "derive_roll", "slot_rows",
       "stage_slot_rows", "stage_window")


def test_cuda_module_compiles_and_exports_every_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TVM_FFI_CUDA_ARCH_LIST", os.environ.get("TVM_FFI_CUDA_ARCH_LIST", "9.0a"))
    path = Path(_native.build("cuda"))
    assert path.is_file()
    data = path.read_bytes()
    for op in OPS:
        assert f"__tvm_ffi_{op}".encode() in data, op


def test_every_cpu_op_has_a_cuda_twin() -> None:
    cpu = {Path(p).stem for p in _native.sources("cpu")} - {"hash_ops"}  # host-side ops: no device twin
    cuda = {Path(p).stem for p in _native.sources("cuda")}
    assert cpu <= cuda, cpu - cuda


def test_every_kernel_awaits_prior_kernels_first() -> None:
    """launch_kernel's contract (csrc/cuda/cuda_common.cuh): a kernel launched as a programmatic dependent launch may be
    scheduled while the previous kernel of its stream still runs, so each kernel's first statement must be
    ``await_prior_kernels()``, and every launch must go through ``launch_kernel`` (no ``<<<``)."""
    kernels = 0
    for src in _native.sources("cuda"):
        text = Path(src).read_text()
        assert "<<<" not in text, f"{src}: a launch outside launch_kernel"
        for m in re.finditer(r"__global__[^{;]*\{", text):
            kernels += 1
            body = text[m.end():].lstrip()
            while body.startswith("__shared__"):  # declarations touch no memory
                body = body[body.index(";") + 1:].lstrip()
            assert body.startswith("await_prior_kernels();"), f"{src}: {text[m.start():m.end()]!r}"
    assert kernels >= len(OPS) - 2, kernels  # make_sequence launches nothing; begin_decode, stage_batch's kernel
