"""The GPU record's bad-input fuzz (tests/gpu/fuzz_bad_inputs.py, run under compute-sanitizer there) run on the CPU
backend: it calls the CPU suite's generators and the GPU tests' helpers, so a change to them that breaks it fails here
and not first on the GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bad_input_fuzz_runs_on_the_cpu_backend() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "tests.gpu.fuzz_bad_inputs", "--device", "cpu", "--n", "8",
                          "--large", "2", "--runtime", "6"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "fuzz done 8 2" in run.stdout
