"""Render the schema into generated/: python -m codegen [--check] [--schema F] [--out DIR]."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jinja2

from codegen.model import Schema, load

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "templates"
REGENERATE = "python -m codegen  (or: nox -s generate)"
OUTPUTS = {
    "python/kvcanary_schema/__init__.py": "schema_py.j2",
    "include/kvcanary/schema.h": "schema_h.j2",
}


def render(schema: Schema, schema_rel: str) -> dict[str, str]:
    """Render every output file (path relative to the output dir -> text), deterministically."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             autoescape=False)
    env.filters["pyrepr"] = repr
    marker = f"GENERATED from {schema_rel} by codegen/ -- do not edit. Regenerate: {REGENERATE}"
    return {rel: env.get_template(tpl).render(s=schema, marker=marker) for rel, tpl in OUTPUTS.items()}


def main(argv: list[str] | None = None) -> int:
    """Write changed outputs, or with --check report drift and exit 1."""
    parser = argparse.ArgumentParser(prog="python -m codegen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if a committed file differs from a fresh render")
    parser.add_argument("--schema", type=Path, default=ROOT / "schema" / "canary.toml")
    parser.add_argument("--out", type=Path, default=ROOT / "generated")
    args = parser.parse_args(argv)
    schema_path: Path = args.schema.resolve()
    rel = schema_path.relative_to(ROOT).as_posix() if schema_path.is_relative_to(ROOT) else schema_path.name
    drift = []
    for name, text in render(load(schema_path), rel).items():
        path = args.out / name
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        drift.append(name)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"codegen: wrote {path}")
    if args.check and drift:
        print(f"codegen --check: out of date: {', '.join(drift)}. Run: {REGENERATE}", file=sys.stderr)
        return 1
    if args.check:
        print("codegen --check: generated files are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
