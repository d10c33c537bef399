"""Loads the compiled tvm-ffi modules: prebuilt by CMake (KVCANARY_NATIVE_DIR) or JIT-built and cached."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Literal

import tvm_ffi
import tvm_ffi.cpp  # module level on purpose: a function-local import shadows tvm_ffi (build guide, pitfall 9)

from kvcanary.errors import BackendUnavailableError

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
INCLUDE_DIRS = [str(CSRC), str(ROOT / "generated" / "include")]
Kind = Literal["cpu", "cuda"]
MODULE_NAMES: dict[Kind, str] = {"cpu": "kvcanary_cpu", "cuda": "kvcanary_cuda"}
CXX_FLAGS = ["-O3", "-std=c++17"]
CUDA_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]


def sources(kind: Kind) -> list[str]:
    """The translation units of one module: every .cc under csrc/cpu, or every .cu under csrc/cuda."""
    folder, suffix = ("cpu", ".cc") if kind == "cpu" else ("cuda", ".cu")
    return sorted(str(p) for p in (CSRC / folder).glob(f"*{suffix}"))


def cuda_home() -> str:
    """The CUDA toolkit root (the nvcc on PATH may be a wrapper outside it: build guide, pitfall 2)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-E", "/dev/null"], capture_output=True, text=True)
        for line in (out.stdout + out.stderr).splitlines():
            if "TOP=" in line:
                return line.split("TOP=", 1)[1].strip().strip('"')
    return "/usr/local/cuda"


def build(kind: Kind) -> str:
    """Compile one module by JIT into build/jit/<name> and return the .so path (no load)."""
    name = MODULE_NAMES[kind]
    out_dir = ROOT / "build" / "jit" / name
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind == "cuda":
        os.environ.setdefault("TVM_FFI_CUDA_ARCH_LIST", "9.0a")
        os.environ.setdefault("CUDA_HOME", cuda_home())
        path: str = tvm_ffi.cpp.build(name, cuda_files=sources(kind), extra_cuda_cflags=CUDA_FLAGS,
                                      extra_include_paths=INCLUDE_DIRS, build_directory=str(out_dir))
    else:
        path = tvm_ffi.cpp.build(name, cpp_files=sources(kind), extra_cflags=CXX_FLAGS,
                                 extra_include_paths=INCLUDE_DIRS, build_directory=str(out_dir))
    return path


@functools.cache
def module(kind: Kind) -> Any:
    """The loaded module of one backend; prebuilt from $KVCANARY_NATIVE_DIR when set, else JIT."""
    prebuilt = os.environ.get("KVCANARY_NATIVE_DIR")
    try:
        if prebuilt:
            return tvm_ffi.load_module(str(Path(prebuilt) / f"{MODULE_NAMES[kind]}.so"))
        return tvm_ffi.load_module(build(kind))
    except Exception as exc:  # the build tool raises many kinds; callers get one typed error
        raise BackendUnavailableError(f"kvcanary {kind} backend unavailable: {exc}") from exc
