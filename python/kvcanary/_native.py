"""Finds and loads the native tvm-ffi modules: packaged prebuilt, $KVCANARY_NATIVE_DIR, or JIT from packaged sources."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import tvm_ffi
import tvm_ffi.cpp  # module level on purpose: a function-local import shadows tvm_ffi (build guide, pitfall 9)

import kvcanary
from kvcanary.errors import BackendUnavailableError

Kind = Literal["cpu", "cuda"]
Origin = Literal["packaged", "native_dir", "jit"]
MODULE_NAMES: dict[Kind, str] = {"cpu": "kvcanary_cpu", "cuda": "kvcanary_cuda"}
LIB_DIR = "_lib"  # inside the package: the prebuilt modules and build_info.json (a wheel; absent in a checkout)
SRC_DIR = "_src"  # inside the package: csrc/ and include/ (copies in a wheel, links in a checkout)
BUILD_INFO = "build_info.json"
CXX_FLAGS = ["-O3", "-std=c++17"]
CUDA_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
FIX_HINT = ("install a kvcanary wheel built with its native modules (pip install kvcanary), point KVCANARY_NATIVE_DIR "
            "at a folder holding {name}.so (nox -s build), or make {compiler} available for the JIT build")

log = logging.getLogger("kvcanary")


@dataclass(frozen=True)
class Loaded:
    """A loaded backend module and where it came from."""

    module: Any
    origin: Origin
    path: str


def _package_file(rel: str) -> Path | None:
    """``rel`` under the first entry of the package's search path that has it (editable installs have several)."""
    for entry in kvcanary.__path__:
        candidate = Path(entry) / rel
        if candidate.exists():
            return candidate
    return None


def source_root() -> Path:
    """The packaged sources: ``<package>/_src`` with ``csrc/`` and ``include/``."""
    root = _package_file(SRC_DIR)
    if root is None or not (root / "csrc").is_dir():
        raise BackendUnavailableError(f"kvcanary sources are not packaged ({SRC_DIR}/csrc missing beside "
                                      f"{kvcanary.__path__}): reinstall kvcanary from its wheel or sdist")
    return root


def include_dirs() -> list[str]:
    """Include paths of every translation unit: the shared core and the generated schema header."""
    root = source_root()
    return [str(root / "csrc"), str(root / "include")]


def sources(kind: Kind) -> list[str]:
    """The translation units of one module: every .cc under csrc/cpu, or every .cu under csrc/cuda."""
    folder, suffix = ("cpu", ".cc") if kind == "cpu" else ("cuda", ".cu")
    return sorted(str(p) for p in (source_root() / "csrc" / folder).glob(f"*{suffix}"))


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


def jit_dir(kind: Kind) -> Path:
    """Where JIT builds go: $KVCANARY_CACHE_DIR (default ~/.cache/kvcanary), per version and source tree."""
    base = Path(os.environ.get("KVCANARY_CACHE_DIR") or Path.home() / ".cache" / "kvcanary")
    tree = hashlib.sha256(str(source_root().resolve()).encode()).hexdigest()[:12]
    return base / f"jit-{kvcanary.__version__}-{tree}" / MODULE_NAMES[kind]


def device_arch() -> str:
    """The JIT's CUDA arch list: $TVM_FFI_CUDA_ARCH_LIST, else the current GPU's (sm_90 as 9.0a), else 9.0a."""
    import torch

    if os.environ.get("TVM_FFI_CUDA_ARCH_LIST"):
        return os.environ["TVM_FFI_CUDA_ARCH_LIST"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "")
    return "9.0a"


def set_cuda_build_env() -> None:
    """Point tvm-ffi's CUDA JIT at this GPU's architecture and the toolkit root (also for other JIT-built kernels)."""
    os.environ["TVM_FFI_CUDA_ARCH_LIST"] = device_arch()
    os.environ.setdefault("CUDA_HOME", cuda_home())


def build(kind: Kind) -> str:
    """Compile one module by JIT from the packaged sources into jit_dir(kind) and return the .so path (no load)."""
    name = MODULE_NAMES[kind]
    out_dir = jit_dir(kind)
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind == "cuda":
        set_cuda_build_env()
        path: str = tvm_ffi.cpp.build(name, cuda_files=sources(kind), extra_cuda_cflags=CUDA_FLAGS,
                                      extra_include_paths=include_dirs(), build_directory=str(out_dir))
    else:
        path = tvm_ffi.cpp.build(name, cpp_files=sources(kind), extra_cflags=CXX_FLAGS,
                                 extra_include_paths=include_dirs(), build_directory=str(out_dir))
    return path


def build_info() -> dict[str, Any]:
    """What the packaged modules were built with (version, CUDA architectures); empty without packaged modules."""
    path = _package_file(f"{LIB_DIR}/{BUILD_INFO}")
    if path is None:
        return {}
    info: dict[str, Any] = json.loads(path.read_text())
    return info


def arch_covers(archs: list[str], capability: tuple[int, int]) -> bool:
    """Whether CMake CUDA architectures (e.g. ``80-real``, ``90a-real``, ``100-virtual``) run on ``capability``:
    SASS of sm_Xy runs on sm_Xz for z >= y (an ``a`` arch only on its own chip); PTX of compute_Xy on any chip
    >= Xy, through the driver's JIT."""
    major, minor = capability
    for arch in archs:
        code, _, kind = arch.partition("-")
        exact = code.endswith("a") or code.endswith("f")
        number = int(code.rstrip("af"))
        a_major, a_minor = divmod(number, 10)
        if kind in ("", "virtual") and (major, minor) >= (a_major, a_minor) and not exact:
            return True  # PTX (CMake's plain "80" embeds both SASS and PTX)
        if kind in ("", "real") and major == a_major and (minor == a_minor if exact else minor >= a_minor):
            return True
    return False


def _packaged(kind: Kind) -> Path | None:
    """The packaged prebuilt module, if the wheel has one that can run here."""
    path = _package_file(f"{LIB_DIR}/{MODULE_NAMES[kind]}.so")
    if path is None or kind == "cpu":
        return path
    import torch

    if torch.cuda.is_available() and not arch_covers(list(build_info().get("cuda_architectures", [])),
                                                    torch.cuda.get_device_capability()):
        log.warning("kvcanary: the packaged CUDA module has no code for this GPU (sm_%d%d; built for %s): "
                    "JIT-building from the packaged sources", *torch.cuda.get_device_capability(),
                    build_info().get("cuda_architectures"))
        return None
    return path


def _candidates(kind: Kind) -> list[tuple[Origin, Path]]:
    out: list[tuple[Origin, Path]] = []
    packaged = _packaged(kind)
    if packaged is not None:
        out.append(("packaged", packaged))
    native_dir = os.environ.get("KVCANARY_NATIVE_DIR")
    if native_dir:
        out.append(("native_dir", Path(native_dir) / f"{MODULE_NAMES[kind]}.so"))
    return out


@functools.cache
def load(kind: Kind) -> Loaded:
    """Load one backend, trying in order: the packaged prebuilt module, $KVCANARY_NATIVE_DIR, a JIT build from the
    packaged sources. Raises BackendUnavailableError naming every attempt and how to fix it."""
    tried: list[str] = []
    for origin, path in _candidates(kind):
        try:
            return Loaded(tvm_ffi.load_module(str(path)), origin, str(path))
        except Exception as exc:  # tvm-ffi raises several kinds; each attempt is reported below
            tried.append(f"{origin} {path}: {exc}")
    try:
        path_str = build(kind)
        return Loaded(tvm_ffi.load_module(path_str), "jit", path_str)
    except Exception as exc:  # the build tool raises many kinds; callers get one typed error
        tried.append(f"jit: {exc}")
    hint = FIX_HINT.format(name=MODULE_NAMES[kind], compiler="a C++ compiler (g++)" if kind == "cpu" else
                           "the CUDA toolkit (nvcc, CUDA_HOME)")
    raise BackendUnavailableError(f"kvcanary {kind} backend unavailable; tried: {'; '.join(tried)}. Fix: {hint}")


def module(kind: Kind) -> Any:
    """The loaded module of one backend (see load for the order)."""
    return load(kind).module


def available(kind: Kind) -> bool:
    """Whether the backend loads here (loading it, JIT-building if nothing prebuilt is found)."""
    try:
        load(kind)
    except BackendUnavailableError:
        return False
    return True


@functools.cache
def auto_backend(device_type: str) -> str:
    """``backend="auto"``: the native backend of ``device_type`` when it loads (cuda on GPUs, the C++ backend on
    CPU), else the torch reference, with one warning saying so and what it costs."""
    kind: Kind | None = "cuda" if device_type == "cuda" else "cpu" if device_type == "cpu" else None
    if kind is None:
        reason = f"kvcanary has no native backend for {device_type!r} tensors"
    else:
        try:
            load(kind)
            return kind
        except BackendUnavailableError as exc:
            reason = str(exc)
    log.warning("kvcanary: falling back to the torch reference backend (%s). It is correct but 100-1000x slower than "
                "the native ops: hundreds of allocations and tens of host syncs per forward.", reason)
    return "torch"


def resolve(backend: str, device_type: str) -> str:
    """The backend to run for ``backend`` (auto/torch/cpu/cuda) on ``device_type`` tensors, with a native one loaded
    (JIT-built on first use) now: call it before anything is timed or bounded."""
    if backend == "auto":
        return auto_backend(device_type)
    if backend == "cpu" or backend == "cuda":
        load(backend)
    return backend
