"""CI has nvcc but no GPU: JIT-compile the CUDA module so that compile errors fail here, and check its exports."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from kvcanary import _native

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"),
                                reason="needs nvcc")

OPS = ("plan_forward", "plan_sweep", "plan_roll", "verify", "write", "fingerprint", "scatter_tokens", "make_sequence",
       "bookkeep")


def test_cuda_module_compiles_and_exports_every_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TVM_FFI_CUDA_ARCH_LIST", os.environ.get("TVM_FFI_CUDA_ARCH_LIST", "9.0a"))
    path = Path(_native.build("cuda"))
    assert path.is_file()
    data = path.read_bytes()
    for op in OPS:
        assert f"__tvm_ffi_{op}".encode() in data, op


def test_every_cpu_op_has_a_cuda_twin() -> None:
    cpu = {Path(p).stem for p in _native.sources("cpu")} - {"hash_ops", "truth"}  # host-side ops: no device twin
    cuda = {Path(p).stem for p in _native.sources("cuda")}
    assert cpu <= cuda, cpu - cuda
