"""Loads schema/canary.toml and checks it into a typed, render-ready model."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

U64_MASK = (1 << 64) - 1


class SchemaError(ValueError):
    """The schema file is malformed or inconsistent."""


@dataclass(frozen=True)
class Item:
    """A named value with a doc string (enum member, flag, column or constant)."""

    name: str
    value: int
    doc: str


@dataclass(frozen=True)
class Enum:
    """An integer enumeration or a bit-flag set."""

    name: str
    doc: str
    items: tuple[Item, ...]
    is_flag: bool


@dataclass(frozen=True)
class Table:
    """Columns of an int64 table shared by kernels and Python."""

    name: str
    cls: str
    doc: str
    columns: tuple[Item, ...]


@dataclass(frozen=True)
class LaunchTag:
    """One launch tag with the stage, half and group it names."""

    name: str
    value: int
    stage: str
    half: str
    group: str


@dataclass(frozen=True)
class Schema:
    """Everything the templates render."""

    source: str
    version: int
    record_doc: str
    record_fields: tuple[Item, ...]  # value = byte offset
    fail_reasons: Enum
    enums: tuple[Enum, ...]
    flags: tuple[Enum, ...]
    launch_tags: tuple[LaunchTag, ...]
    tables: tuple[Table, ...]
    hash_consts: tuple[Item, ...]  # u64 values
    sentinels: tuple[Item, ...]
    layout: tuple[Item, ...]
    defaults: tuple[Item, ...]


def _req(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise SchemaError(f"{where}: missing key {key!r}")
    return d[key]


def _ident(name: object, where: str) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise SchemaError(f"{where}: {name!r} is not an identifier")
    return name


def _unique(items: tuple[Item, ...], where: str, check_values: bool = True) -> tuple[Item, ...]:
    names = [i.name for i in items]
    if len(set(names)) != len(names):
        raise SchemaError(f"{where}: duplicate names in {names}")
    values = [i.value for i in items]
    if check_values and len(set(values)) != len(values):
        raise SchemaError(f"{where}: duplicate values in {values}")
    return items


def _enum(name: str, body: dict[str, Any], is_flag: bool) -> Enum:
    where = f"{'flags' if is_flag else 'enums'}.{name}"
    items = []
    for raw in _req(body, "values", where):
        value = int(_req(raw, "bit", where)) if is_flag else int(_req(raw, "value", where))
        if is_flag and not 0 <= value < 63:
            raise SchemaError(f"{where}: bit {value} outside [0, 63)")
        items.append(Item(_ident(_req(raw, "name", where), where), 1 << value if is_flag else value,
                          str(_req(raw, "doc", where))))
    return Enum(_ident(name, where), str(_req(body, "doc", where)), _unique(tuple(items), where), is_flag)


def _consts(section: dict[str, Any], where: str, u64: bool) -> tuple[Item, ...]:
    items = []
    for name, raw in section.items():
        if name == "doc":
            continue
        value = int(raw["value"], 0) if isinstance(raw["value"], str) else int(raw["value"])
        if u64 and not 0 <= value <= U64_MASK:
            raise SchemaError(f"{where}.{name}: {value:#x} is not a u64")
        items.append(Item(_ident(name, where), value, str(_req(raw, "doc", f"{where}.{name}"))))
    return _unique(tuple(items), where, check_values=False)


def _camel(snake: str) -> str:
    return "".join(part.capitalize() for part in snake.split("_"))


def _tables(raw: dict[str, Any]) -> tuple[Table, ...]:
    tables = []
    for name, body in raw.items():
        where = f"tables.{name}"
        cols = tuple(Item(_ident(_req(c, "name", where), where), i, str(_req(c, "doc", where)))
                     for i, c in enumerate(_req(body, "columns", where)))
        tables.append(Table(_ident(name, where), _camel(name) + "Col", str(_req(body, "doc", where)),
                            _unique(cols, where)))
    return tuple(tables)


def _launch_tags(raw: list[dict[str, Any]], enums: dict[str, Enum]) -> tuple[LaunchTag, ...]:
    tags = []
    for entry in raw:
        name = _ident(_req(entry, "name", "launch_tag"), "launch_tag")
        parts = name.split("_")
        if len(parts) != 3:
            raise SchemaError(f"launch_tag {name}: expected STAGE_HALF_GROUP")
        for part, enum in zip(parts, ("Stage", "Half", "Group"), strict=True):
            if part not in {i.name for i in enums[enum].items}:
                raise SchemaError(f"launch_tag {name}: {part!r} is not a {enum}")
        tags.append(LaunchTag(name, int(_req(entry, "value", name)), *parts))
    values = sorted(t.value for t in tags)
    combos = {(t.stage, t.half, t.group) for t in tags}
    expected = len(enums["Stage"].items) * len(enums["Half"].items) * len(enums["Group"].items)
    if values != list(range(len(tags))) or len(combos) != expected or len(tags) != expected:
        raise SchemaError("launch_tag: need every Stage x Half x Group once, values 0..N-1")
    return tuple(sorted(tags, key=lambda t: t.value))


def _record(raw: dict[str, Any]) -> tuple[Item, ...]:
    fields = []
    for i, f in enumerate(_req(raw, "fields", "record")):
        if f.get("type") != "int64":
            raise SchemaError(f"record field {f.get('name')}: only int64 fields are supported")
        fields.append(Item(_ident(_req(f, "name", "record"), "record"), 8 * i, str(_req(f, "doc", "record"))))
    return _unique(tuple(fields), "record")


def load(path: Path) -> Schema:
    """Parse and validate the schema file at ``path``."""
    raw = tomllib.loads(path.read_text())
    enums = {n: _enum(n, b, False) for n, b in _req(raw, "enums", "schema").items()}
    reasons = [{"name": r["name"], "bit": r["bit"], "doc": r["doc"]} for r in _req(raw, "fail_reason", "schema")]
    fail = _enum("FailReason", {"doc": "Why a check failed (bit flags).", "values": reasons}, True)
    flags = tuple(_enum(n, b, True) for n, b in _req(raw, "flags", "schema").items())
    schema = Schema(
        source=path.name,
        version=int(_req(raw, "version", "schema")),
        record_doc=str(_req(raw["record"], "doc", "record")),
        record_fields=_record(_req(raw, "record", "schema")),
        fail_reasons=fail,
        enums=tuple(enums.values()),
        flags=flags,
        launch_tags=_launch_tags(_req(raw, "launch_tag", "schema"), enums),
        tables=_tables(_req(raw, "tables", "schema")),
        hash_consts=_consts(_req(raw, "hash", "schema"), "hash", u64=True),
        sentinels=_consts(_req(raw, "sentinels", "schema"), "sentinels", u64=False),
        layout=_consts(_req(raw, "layout", "schema"), "layout", u64=False),
        defaults=_consts(_req(raw, "defaults", "schema"), "defaults", u64=False),
    )
    record_bytes = {i.name: i.value for i in schema.layout}.get("RECORD_BYTES")
    if record_bytes != 8 * len(schema.record_fields):
        raise SchemaError(f"layout.RECORD_BYTES={record_bytes} but the record has "
                          f"{len(schema.record_fields)} int64 fields")
    base = {i.name: i.value for i in schema.hash_consts}.get("CHAIN_BASE", 0)
    if base % 2 == 0:
        raise SchemaError("hash.CHAIN_BASE must be odd (invertible mod 2^64)")
    return schema
