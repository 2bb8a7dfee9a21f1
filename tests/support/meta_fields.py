"""meta.json's fields as docs/outputs.md documents them, and a check of a produced file against it.

Reading the table itself, rather than a copy of it, keeps the documentation and the code from drifting.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OUTPUTS = Path(__file__).resolve().parents[2] / "docs" / "outputs.md"
JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "object": (dict,),
    "null": (type(None),),
}


def documented_fields() -> dict[str, tuple[type, ...]]:
    """Each field of the table after the `meta.json` bullet of docs/outputs.md (nested ones dotted), with the types it
    may hold."""
    lines = OUTPUTS.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("- `meta.json`"))
    table = list(_table_after(lines[start:]))[2:]  # past the header and its rule
    fields: dict[str, tuple[type, ...]] = {}
    for row in table:
        name, kind, _meaning = (cell.strip() for cell in row.strip("|").split("|", 2))
        assert name.startswith("`") and name.endswith("`") and name[1:-1] not in fields, row
        fields[name[1:-1]] = tuple(t for word in kind.split(" or ") for t in JSON_TYPES[word])
    return fields


def assert_documented_once(meta: dict[str, Any]) -> None:
    """`meta` holds exactly the documented fields, each of its documented type, and no key twice at any depth."""
    documented = documented_fields()
    found = dict(_flatten(meta))
    assert sorted(found) == sorted(documented)
    for name, value in found.items():
        assert type(value) in documented[name], f"{name} = {value!r}, documented as {documented[name]}"
    keys = Counter(name.rpartition(".")[2] for name in found)
    assert [key for key, count in keys.items() if count > 1] == []  # no key at two levels


def _table_after(lines: list[str]) -> Iterator[str]:
    rows = (i for i, line in enumerate(lines) if line.startswith("|"))
    first = next(rows)
    for line in lines[first:]:
        if not line.startswith("|"):
            return
        yield line


def _flatten(value: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, item in value.items():
        yield prefix + key, item
        if isinstance(item, dict):
            yield from _flatten(item, f"{prefix}{key}.")
