"""docs/configuration.md's table against daemon/config.py: every key once, in the code's order, with the code's
default and every value it allows named.

The table is read as written, not copied here, so the documentation and the code cannot drift apart unseen.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from npumoe.daemon.config import Config

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def documented() -> dict[str, tuple[str, str]]:
    """Each row of the table as key -> (default as written, meaning); a key written twice fails here."""
    rows: dict[str, tuple[str, str]] = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `"):
            continue
        key, default, meaning = (cell.strip() for cell in line.strip().strip("|").split("|", 2))
        assert key.startswith("`") and key.endswith("`") and key[1:-1] not in rows, line
        assert default.startswith("`") and default.endswith("`"), line
        rows[key[1:-1]] = (default[1:-1], meaning)
    return rows


def config_keys(config: Config) -> dict[str, tuple[Any, dataclasses.Field]]:
    """Each key of `config` as section.key -> (its value, its field)."""
    return {f"{section.name}.{key.name}": (getattr(getattr(config, section.name), key.name), key)
            for section in dataclasses.fields(config)
            for key in dataclasses.fields(getattr(config, section.name))}


def test_the_table_lists_every_key_of_the_config_once_in_its_order():
    assert list(documented()) == list(config_keys(Config()))


def test_a_key_added_to_the_config_and_not_to_the_table_is_caught():
    @dataclasses.dataclass(frozen=True)
    class GpuConfig:
        device: int = 0

    section = ("gpu", GpuConfig, dataclasses.field(default_factory=GpuConfig))
    wider = dataclasses.make_dataclass("WiderConfig", [section], bases=(Config,), frozen=True)
    missing = set(config_keys(wider())) - set(documented())
    assert missing == {"gpu.device"}


def test_each_documented_default_is_the_configs_own():
    table = documented()
    for name, (default, _field) in config_keys(Config()).items():
        assert tomllib.loads(f"value = {table[name][0]}")["value"] == default, name


def test_each_value_a_key_allows_is_named_in_its_meaning():
    table = documented()
    for name, (_default, key) in config_keys(Config()).items():
        for allowed in key.metadata.get("choices", ()):
            assert not allowed or f"`{allowed}`" in table[name][1], f"{name}: `{allowed}` is not named"
