"""The ahead-of-time path: CMake builds csrc/ into a tvm-ffi module that loads and answers."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import tvm_ffi
from kvcanary.ops import hashes
from kvcanary_schema import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ninja") is None, reason="needs cmake + ninja")
def test_cmake_builds_loadable_cpu_module(tmp_path: Path) -> None:
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    f"-DPython_EXECUTABLE={sys.executable}", "-DKVCANARY_CUDA=OFF"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "kvcanary_cpu"], check=True, capture_output=True)
    mod = tvm_ffi.load_module(str(build / "lib" / "kvcanary_cpu.so"))
    assert mod.schema_version() == SCHEMA_VERSION
    x = torch.arange(-5, 5, dtype=torch.int64)
    out = torch.empty_like(x)
    mod.hash_splitmix64(x, out)
    assert torch.equal(out, hashes.splitmix64(x))
