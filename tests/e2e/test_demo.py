"""`kvcanary demo`: JSON and text output, exit codes, progress bar."""

from __future__ import annotations

import io
import json

import pytest
from kvcanary.cli import main
from kvcanary.demo import Progress


def test_demo_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--faults", "wrong_prefix_hit,draft_position_off_by_one,record_flip", "--steps", "60",
                 "--seed", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"]
    assert out["clean"]["violations"] == 0 and out["clean"]["forwards"] >= 30
    assert [r["fault"] for r in out["faults"]] == ["wrong_prefix_hit", "draft_position_off_by_one",
                                                  "perturb:record_flip"]
    assert all(r["detected"] and r["tag"] for r in out["faults"])
    assert {p["phase"] for p in out["clean"]["phases"]} == {"serving", "speculative"}


def test_demo_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--faults", "none", "--steps", "40", "--backend", "torch"]) == 0
    text = capsys.readouterr().out
    assert "0 violations over" in text and "RESULT: PASS" in text


def test_demo_rejects_unknown_faults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--faults", "nope", "--steps", "10"]) == 2
    assert "unknown fault" in capsys.readouterr().err


def test_progress_bar() -> None:
    buf = io.StringIO()
    bar = Progress(20, "work", stream=buf)
    for i in range(21):
        bar.update(i)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("work") and "20/20" in lines[-1]
