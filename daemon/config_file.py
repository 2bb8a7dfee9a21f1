"""Changing one section of a config file in place: the rest of the file, comments included, stays as it was.

The new text is checked by the same loader the daemon uses before it replaces the file; the old file is
kept beside it as `<name>.bak`, and the new one is written to a temporary name and renamed, so a reader
never sees half of it.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import tomlkit

from npumoe.jobs.outputs import write_file

from .config import ConfigError, load_config


def with_section(path: Path, section: str, values: dict[str, Any]) -> tuple[str, str]:
    """(the file's text now, its text with `values` set in `[section]`, a key whose value is None removed); an
    absent file reads as empty."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    try:
        document = tomlkit.parse(old)
    except tomlkit.exceptions.ParseError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    table = document.get(section)
    if table is None:
        table = document[section] = tomlkit.table()
    for key, value in values.items():
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value
    return old, tomlkit.dumps(document)


def section_text(text: str, section: str) -> str:
    """`[section]` of a TOML text, as it would be written on its own."""
    return tomlkit.dumps({section: tomlkit.parse(text)[section]})


def replace_config(path: Path, new: str) -> Path | None:
    """Write `new` to `path` after checking it loads, keeping the file there was as `<name>.bak`; returns the
    backup's path (None when there was no file to back up). The new file keeps the old one's permissions (a file
    that holds the queue server's password stays private), whatever the umask; a new one is private."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o600
    partial = write_file(path.with_name(f".{path.name}.writing"), new.encode("utf-8"), mode=mode)
    try:
        load_config(partial)  # the daemon must be able to read what is written
    except ConfigError:
        partial.unlink()
        raise
    backup = None
    if path.exists():
        backup = path.with_name(f"{path.name}.bak")
        shutil.copy2(path, backup)
    os.replace(partial, path)
    return backup
