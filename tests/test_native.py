"""Finding the native modules: packaged prebuilt → $KVCANARY_NATIVE_DIR → JIT; backend="auto"; CUDA arch coverage."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvcanary import _native
from kvcanary.config import CanaryConfig
from kvcanary.errors import BackendUnavailableError
from kvcanary_schema import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Forget loaded modules and the auto choice for one test (and again afterwards)."""
    monkeypatch.delenv("KVCANARY_NATIVE_DIR", raising=False)
    caches = (_native.load, _native.auto_backend)  # the originals: a test may monkeypatch the names
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


@pytest.fixture(scope="module")
def cmake_cpu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        pytest.skip("needs cmake + ninja")
    build = tmp_path_factory.mktemp("cmake")
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    f"-DPython_EXECUTABLE={sys.executable}", "-DKVCANARY_CUDA=OFF"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "kvcanary_cpu"], check=True, capture_output=True)
    return build / "lib"


def _no_jit(kind: str) -> str:
    raise RuntimeError(f"no compiler for {kind} here")


def test_checkout_has_no_packaged_modules_and_finds_its_sources() -> None:
    assert _native._packaged("cpu") is None and _native.build_info() == {}
    assert (_native.source_root() / "include" / "kvcanary" / "schema.h").is_file()
    assert {Path(p).name for p in _native.sources("cpu")} >= {"verify.cc", "write.cc", "plan.cc"}


def test_native_dir_is_used_before_the_jit(fresh_loader: None, cmake_cpu_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCANARY_NATIVE_DIR", str(cmake_cpu_dir))
    monkeypatch.setattr(_native, "build", _no_jit)
    loaded = _native.load("cpu")
    assert loaded.origin == "native_dir" and Path(loaded.path) == cmake_cpu_dir / "kvcanary_cpu.so"
    assert loaded.module.schema_version() == SCHEMA_VERSION


def test_packaged_module_comes_first(fresh_loader: None, cmake_cpu_dir: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A package folder with _lib/ (as a wheel lays it out) wins over $KVCANARY_NATIVE_DIR."""
    pkg = tmp_path / "kvcanary"
    (pkg / _native.LIB_DIR).mkdir(parents=True)
    shutil.copy(cmake_cpu_dir / "kvcanary_cpu.so", pkg / _native.LIB_DIR)
    monkeypatch.setattr(_native.kvcanary, "__path__", [str(pkg), *_native.kvcanary.__path__])
    monkeypatch.setenv("KVCANARY_NATIVE_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setattr(_native, "build", _no_jit)
    loaded = _native.load("cpu")
    assert loaded.origin == "packaged" and Path(loaded.path).parent == pkg / _native.LIB_DIR


def test_broken_candidates_fall_through_to_the_jit(fresh_loader: None, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCANARY_NATIVE_DIR", str(tmp_path))
    (tmp_path / "kvcanary_cpu.so").write_bytes(b"not an ELF file")
    loaded = _native.load("cpu")
    assert loaded.origin == "jit" and loaded.module.schema_version() == SCHEMA_VERSION


def test_nothing_loads_gives_one_typed_error_naming_every_attempt_and_the_fix(
        fresh_loader: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCANARY_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(_native, "build", _no_jit)
    with pytest.raises(BackendUnavailableError) as info:
        _native.load("cpu")
    msg = str(info.value)
    assert f"native_dir {tmp_path / 'kvcanary_cpu.so'}" in msg and "jit: no compiler for cpu here" in msg
    assert "pip install kvcanary" in msg and "KVCANARY_NATIVE_DIR" in msg and "g++" in msg
    assert not _native.available("cpu")


def test_auto_is_the_native_backend_of_the_device(fresh_loader: None) -> None:
    assert _native.load("cpu").module.schema_version() == SCHEMA_VERSION
    assert CanaryConfig().resolved_backend("cpu") == "cpu"


def test_auto_on_cuda_tensors_is_cuda_when_its_module_loads(fresh_loader: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = _native.Loaded(module=object(), origin="packaged", path="x")
    monkeypatch.setattr(_native, "load", lambda kind: loaded if kind == "cuda" else _no_jit(kind))
    assert _native.auto_backend("cuda") == "cuda"


def test_auto_falls_back_to_torch_with_one_warning(fresh_loader: None, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    def fail(kind: str) -> _native.Loaded:
        raise BackendUnavailableError(f"kvcanary {kind} backend unavailable: test")

    monkeypatch.setattr(_native, "load", fail)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        picks = [CanaryConfig().resolved_backend("cpu") for _ in range(3)]
    assert picks == ["torch"] * 3
    warnings = [r.getMessage() for r in caplog.records if "torch reference" in r.getMessage()]
    assert len(warnings) == 1 and "backend unavailable: test" in warnings[0] and "slower" in warnings[0]
    assert _native.auto_backend("meta") == "torch"


@pytest.mark.parametrize(("archs", "capability", "covered"), [
    (["80-real"], (8, 0), True), (["80-real"], (8, 9), True), (["80-real"], (9, 0), False),
    (["80-real"], (7, 5), False), (["90a-real"], (9, 0), True), (["90a-real"], (9, 1), False),
    (["90a-real"], (10, 0), False), (["100-real"], (10, 3), True), (["100-real"], (12, 0), False),
    (["100-virtual"], (12, 0), True), (["100-virtual"], (9, 0), False), (["80"], (12, 1), True),
    (["80-real", "90a-real", "100-real", "100-virtual"], (8, 6), True),
    (["80-real", "90a-real", "100-real", "100-virtual"], (7, 0), False), ([], (9, 0), False),
])
def test_cuda_arch_coverage(archs: list[str], capability: tuple[int, int], covered: bool) -> None:
    assert _native.arch_covers(archs, capability) is covered


def test_jit_builds_go_to_the_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))
    path = _native.jit_dir("cpu")
    assert tmp_path in path.parents and path.name == "kvcanary_cpu"
    assert path.parent.name.startswith(f"jit-{_native.kvcanary.__version__}-")
