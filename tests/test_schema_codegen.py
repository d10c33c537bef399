"""Codegen drift gate, C++/Python constant agreement, and a schema edit flowing to both outputs."""

from __future__ import annotations

import enum
import json
import shutil
import subprocess
import sys
from pathlib import Path

import kvcanary_schema as S
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "schema" / "canary.toml"
GENERATED = ROOT / "generated"


def run_codegen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "codegen", *args], cwd=ROOT, capture_output=True, text=True)


def test_committed_outputs_match_schema() -> None:
    res = run_codegen("--check")
    assert res.returncode == 0, res.stderr


def test_check_fails_after_hand_edit(tmp_path: Path) -> None:
    out = tmp_path / "generated"
    shutil.copytree(GENERATED, out)
    assert run_codegen("--check", "--out", str(out)).returncode == 0
    header = out / "include" / "kvcanary" / "schema.h"
    header.write_text(header.read_text().replace("kSchemaVersion = ", "kSchemaVersion = 1 + "))
    res = run_codegen("--check", "--out", str(out))
    assert res.returncode == 1 and "schema.h" in res.stderr


def test_render_is_deterministic_and_writes_only_changes(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    first = run_codegen("--out", str(out))
    assert first.returncode == 0 and first.stdout.count("wrote") == 2
    snapshot = {p: p.read_text() for p in out.rglob("*") if p.is_file()}
    second = run_codegen("--out", str(out))
    assert second.returncode == 0 and "wrote" not in second.stdout
    assert snapshot == {p: p.read_text() for p in out.rglob("*") if p.is_file()}


def _cxx_enum_lines(py_enum: type[enum.Enum], cxx: str) -> list[str]:
    return [f'  emit("{py_enum.__name__}.{m.name}", (long long)kvcanary::schema::{cxx}::{m.name});'
            for m in py_enum]  # type: ignore[attr-defined]


def _python_view() -> dict[str, int]:
    view: dict[str, int] = {}
    enums = [S.FailReason, S.Stage, S.Half, S.Group, S.FingerprintMode, S.TokenTruth, S.PlanFlag, S.WriteCheck,
             S.LaunchTag, S.ViolationCol, S.CounterCol, S.PlanCol, S.PlanStatusCol, S.FpSourceCol]
    for e in enums:
        for m in e:
            view[f"{e.__name__}.{m.name}"] = int(m)
    for name in dir(S):
        value = getattr(S, name)
        if name.isupper() and isinstance(value, int) and not isinstance(value, enum.Enum):
            view[name] = value
    for name, offset in S.RECORD_FIELDS:
        view[f"offsetof.{name}"] = offset
    for col in S.ViolationCol:
        view[f"offsetof.violation.{col.name.lower()}"] = 8 * int(col)
    return view


def _cxx_program(view: dict[str, int]) -> str:
    lines = ["#include <cstdio>", "#include <cstddef>", '#include "kvcanary/schema.h"',
             "static bool first = true;",
             'static void emit(const char* k, long long v) { std::printf("%s\\"%s\\": %lld", first ? "" : ", ", k, v);'
             " first = false; }",
             'static void emit_u(const char* k, unsigned long long v) { std::printf("%s\\"%s\\": \\"%llu\\"",'
             ' first ? "" : ", ", k, v); first = false; }',
             "int main() {", '  std::printf("{");']
    for key in view:
        if "." in key and not key.startswith("offsetof"):
            cls, member = key.split(".")
            lines.append(f'  emit("{key}", (long long)kvcanary::schema::{cls}::{member});')
        elif key.startswith("offsetof.violation."):
            lines.append(f'  emit("{key}", (long long)offsetof(kvcanary::schema::ViolationRow, {key.split(".")[2]}));')
        elif key.startswith("offsetof."):
            lines.append(f'  emit("{key}", (long long)offsetof(kvcanary::schema::CanaryRecord, {key.split(".")[1]}));')
        elif key == "SCHEMA_VERSION":
            lines.append(f'  emit("{key}", (long long)kvcanary::schema::kSchemaVersion);')
        elif key.startswith("NUM_") and key.endswith("_COLS"):
            table = "".join(p.capitalize() for p in key[4:-5].split("_"))
            lines.append(f'  emit("{key}", (long long)kvcanary::schema::kNum{table}Cols);')
        elif key == "NUM_LAUNCH_TAGS":
            lines.append(f'  emit("{key}", (long long)kvcanary::schema::kNumLaunchTags);')
        elif key == "RECORD_NUM_FIELDS":
            lines.append(f'  emit("{key}", (long long)(sizeof(kvcanary::schema::CanaryRecord) / 8));')
        else:
            lines.append(f'  emit_u("{key}", (unsigned long long)kvcanary::schema::{key});')
    lines += ['  std::printf("}\\n");', "  return 0;", "}"]
    return "\n".join(lines)


def test_cpp_and_python_agree(tmp_path: Path) -> None:
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    view = _python_view()
    src = tmp_path / "dump.cc"
    src.write_text(_cxx_program(view))
    exe = tmp_path / "dump"
    subprocess.run(["g++", "-std=c++17", f"-I{GENERATED / 'include'}", str(src), "-o", str(exe)], check=True)
    cxx = json.loads(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)
    normalized = {k: (int(v) if isinstance(v, str) else v) for k, v in cxx.items()}
    expected = {k: (v & ((1 << 64) - 1) if isinstance(cxx[k], str) else v) for k, v in view.items()}
    assert normalized == expected
    assert len(view) > 100  # every enum member, column, constant and offset is compared


def test_schema_edit_flows_to_both_outputs(tmp_path: Path) -> None:
    schema = tmp_path / "canary.toml"
    extra = '\n[[fail_reason]]\nname = "TEST_EXTRA"\nbit = 40\ndoc = "added by a test"\n'
    schema.write_text(SCHEMA.read_text() + extra)
    out = tmp_path / "gen"
    assert run_codegen("--schema", str(schema), "--out", str(out)).returncode == 0
    py = (out / "python" / "kvcanary_schema" / "__init__.py").read_text()
    header = (out / "include" / "kvcanary" / "schema.h").read_text()
    assert "TEST_EXTRA = 1099511627776" in py and "TEST_EXTRA = 1099511627776," in header
    assert "TEST_EXTRA" not in (GENERATED / "include" / "kvcanary" / "schema.h").read_text()
    ns: dict[str, object] = {}
    exec(compile(py, "gen", "exec"), ns)
    assert int(ns["FailReason"].TEST_EXTRA) == 1 << 40  # type: ignore[attr-defined]
    prog = tmp_path / "p.cc"
    prog.write_text('#include "kvcanary/schema.h"\nstatic_assert((long long)kvcanary::schema::FailReason::TEST_EXTRA'
                    " == (1LL << 40), \"flows\");\nint main() { return 0; }\n")
    subprocess.run(["g++", "-std=c++17", f"-I{out / 'include'}", str(prog), "-o", str(tmp_path / "p")], check=True)


def test_bad_schema_is_rejected(tmp_path: Path) -> None:
    schema = tmp_path / "canary.toml"
    schema.write_text(SCHEMA.read_text().replace('CHAIN_BASE     = { value = "0x9E3779B97F4A7C15"',
                                                 'CHAIN_BASE     = { value = "0x9E3779B97F4A7C14"'))
    res = run_codegen("--schema", str(schema), "--out", str(tmp_path / "g"))
    assert res.returncode != 0 and "odd" in res.stderr
