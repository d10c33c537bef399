"""The installed wheel, outside the checkout, with no compiler on PATH: prebuilt native modules load and catch faults.

Run by `nox -s tests_wheel` in a fresh venv (KVCANARY_WHEEL_TEST=1); the checkout's own suite skips this file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("KVCANARY_WHEEL_TEST") != "1",
                                reason="runs against an installed wheel in `nox -s tests_wheel`")

CUDA_OPS = ("plan_forward", "plan_sweep", "plan_roll", "verify", "write", "fingerprint", "scatter_tokens")
WHEEL_CUDA_ARCHS = ["80-real", "90a-real", "100-real", "100-virtual"]


def test_no_compiler_on_path() -> None:
    for tool in ("c++", "g++", "gcc", "cc", "clang++", "nvcc"):
        assert shutil.which(tool) is None, f"{tool} is reachable: the test would not prove the modules are prebuilt"


def test_imported_from_the_installed_wheel_not_the_checkout() -> None:
    import kvcanary
    import kvcanary_schema

    repo = Path(os.environ["KVCANARY_REPO"]).resolve()
    for mod in (kvcanary, kvcanary_schema):
        path = Path(str(mod.__file__)).resolve()
        assert repo not in path.parents and "site-packages" in path.parts, path
    assert Path.cwd().resolve() != repo and repo not in Path.cwd().resolve().parents


def test_cpu_module_is_the_packaged_prebuilt_one() -> None:
    from kvcanary import _native
    from kvcanary_schema import SCHEMA_VERSION

    loaded = _native.load("cpu")
    assert loaded.origin == "packaged", loaded
    assert Path(loaded.path).parent.name == _native.LIB_DIR and "site-packages" in Path(loaded.path).parts
    assert loaded.module.schema_version() == SCHEMA_VERSION
    cache = Path(os.environ["KVCANARY_CACHE_DIR"])
    assert not cache.exists() or not any(cache.iterdir()), "a JIT build ran"


def test_auto_backend_on_cpu_is_the_native_one() -> None:
    from kvcanary.config import CanaryConfig

    assert CanaryConfig().resolved_backend("cpu") == "cpu"


def test_sources_for_the_jit_fallback_are_packaged() -> None:
    from kvcanary import _native

    root = _native.source_root()
    assert (root / "include" / "kvcanary" / "schema.h").is_file()
    for kind in ("cpu", "cuda"):
        assert _native.sources(kind), kind  # type: ignore[arg-type]
    assert "site-packages" in root.parts and not any(p.is_symlink() for p in root.rglob("*"))


def test_clean_bracket_then_a_detected_corruption() -> None:
    from kvcanary import campaign as C

    clean = C.run_clean(3, 6, backend="cpu", spec=False)
    assert clean.violations == 0 and clean.forwards > 10 and clean.entries_checked > 0, clean
    case = C.CASES_BY_NAME["wrong_prefix_hit"]  # a prefix-cache hit on another prefix: token truth, same forward
    trial = next(t for t in (C.run_trial(case, seed, backend="cpu") for seed in range(6)) if t.fired)
    assert trial.detected and not trial.false_positive and trial.reason_ok and trial.request_ok, trial


def test_demo_runs_from_the_installed_wheel() -> None:
    out = subprocess.run([sys.executable, "-m", "kvcanary", "demo", "--steps", "40", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"] and report["backend"] == "cpu" and report["clean"]["violations"] == 0, report
    assert report["faults"] and all(f["detected"] for f in report["faults"])


def test_wheel_has_the_cuda_module_when_built_with_nvcc() -> None:
    """CI builds with nvcc but has no GPU: check the file, its exported ops and its architectures."""
    from kvcanary import _native

    wheel = Path(os.environ["KVCANARY_WHEEL"])
    names = zipfile.ZipFile(wheel).namelist()
    cuda = f"kvcanary/{_native.LIB_DIR}/kvcanary_cuda.so"
    if os.environ.get("KVCANARY_WHEEL_NVCC") != "1":
        assert cuda not in names
        return
    assert cuda in names
    data = zipfile.ZipFile(wheel).read(cuda)
    for op in CUDA_OPS:
        assert f"__tvm_ffi_{op}".encode() in data, op
    assert _native.build_info()["cuda_architectures"] == WHEEL_CUDA_ARCHS
    cuobjdump = os.environ.get("KVCANARY_CUOBJDUMP")
    if cuobjdump:
        so = _native._package_file(f"{_native.LIB_DIR}/kvcanary_cuda.so")
        elf = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True, check=True).stdout
        ptx = subprocess.run([cuobjdump, "--list-ptx", str(so)], capture_output=True, text=True, check=True).stdout
        for sm in ("sm_80", "sm_90a", "sm_100"):
            assert f".{sm}." in elf, (sm, elf)
        assert "sm_100" in ptx, ptx
