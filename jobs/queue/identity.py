"""Which machine a daemon on a shared queue is: an identity kept in its home, made once, never changed.

The queue pins a document to the machine whose inbox holds it, and asks after a worker's process only on
that worker's own machine, so the name must neither repeat nor change. A host name does both: machines cloned
from one image share it, and macOS renames a Mac with the network it joins. The identity is the host name
when the home first ran, for people to read, and random bits, for it to be unique; it is written once,
exclusively, and read back ever after. A home copied whole to another machine carries its identity along:
`Database.hold_identity` then refuses the second daemon while the first one lives.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from ..outputs import fsync_dir, temporary_path

IDENTITY_FILE = "machine-id"
_HOST_CHARS = 40  # enough of the host name to recognise it; the column holds 255


def machine_identity(home: Path) -> str:
    """This home's identity, made and kept in `home` the first time it is asked for."""
    path = home / IDENTITY_FILE
    if (kept := _read(path)) is not None:
        return kept
    made = f"{socket.gethostname()[:_HOST_CHARS]}-{secrets.token_hex(6)}"
    tmp = temporary_path(home, IDENTITY_FILE)
    tmp.write_text(made + "\n")
    try:
        os.link(tmp, path)  # whole or not at all, and only if no other process made one first
    except FileExistsError:
        made = _read(path) or made
    finally:
        tmp.unlink()
    fsync_dir(home)
    return made


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
