"""Writing files so that no reader ever sees half of one, and moving documents between folders.

Everything is first written under a hidden temporary name (`.tmp-…`) in the folder it belongs to,
flushed to disk, then renamed in one step: an output folder appears complete or not at all. A run
killed half-way leaves only `.tmp-…` entries, which `remove_leftovers` deletes at the next start.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import secrets
import shutil
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where it is used: the extraction child imports this module (through
    import numpy as np  # files.py) under a capped address space, which numpy's thread buffers would eat into

TMP_PREFIX = ".tmp-"
NAME_MAX_BYTES = 255  # the longest file name most file systems take (ext4, APFS, NTFS), in bytes
MAX_STEM = 80  # characters, for names people read
_TOKEN = 9  # "-" and 8 hex digits: the sha8 of an output name, or a temporary name's random part
# The longest name made from a stem: the temporary name of the old output folder a rewrite replaces,
# `.tmp-old-<stem>-<sha8>-<hex8>`; capping the stem so that fits keeps every name derived from it legal.
MAX_STEM_BYTES = NAME_MAX_BYTES - len(f"{TMP_PREFIX}old-") - 2 * _TOKEN
# The files of a document's output folder (outbox/<stem>-<sha8>/).
SUMMARY_FILE = "summary.md"  # "# name", a line of facts, then the summary
EMBEDDINGS_FILE = "embeddings.npy"  # float32 (chunks + 1, dim): one row per chunk, then the document vector
META_FILE = "meta.json"  # DocumentMeta (meta.py): how the outputs were made and what making them cost
TEXT_FILE = "text.txt.gz"  # the extracted text the model read, so a search hit can show its passage
OFFSETS_FILE = "offsets.npy"  # int64 (chunks, 2): each chunk's [start, end) character offsets in that text


def output_name(source_name: str, sha256: str) -> str:
    """`<stem>-<sha8>`: a single safe path component, whatever the source was called."""
    return f"{safe_stem(source_name)}-{sha256[:8]}"


def safe_stem(name: str) -> str:
    """The name without its extension, reduced to letters, digits, `.`, `-` and `_`, never hidden or empty.

    Slashes, `..`, newlines and control characters (and bytes of a name that is not UTF-8) all become `_`;
    Unicode letters stay. At most MAX_STEM characters and MAX_STEM_BYTES bytes of UTF-8: 80 CJK characters
    are 240 bytes, too long for a file name once the prefixes and suffixes are added.
    """
    stem = unicodedata.normalize("NFC", name).rsplit("/", 1)[-1]
    stem = stem.rsplit(".", 1)[0] if "." in stem.lstrip(".") else stem
    stem = re.sub(r"[^\w.-]+", "_", stem).strip("._-")
    return truncate_utf8(stem[:MAX_STEM], MAX_STEM_BYTES).rstrip("._-") or "document"


def truncate_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of `text` whose UTF-8 form is at most `max_bytes` (never half a character)."""
    encoded = text.encode("utf-8", "surrogateescape")
    if len(encoded) <= max_bytes:
        return text
    return encoded[:max_bytes].decode("utf-8", "ignore")


def npy_bytes(array: np.ndarray) -> bytes:
    """`array` as the bytes of a .npy file."""
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def compressed_text(text: str) -> bytes:
    """`text` as gzip bytes, the same bytes for the same text (no timestamp inside)."""
    return gzip.compress(text.encode(), mtime=0)


def read_text(folder: Path) -> str | None:
    """The extracted text kept in an output folder; None for outputs written before it was kept."""
    try:
        return gzip.decompress((folder / TEXT_FILE).read_bytes()).decode()
    except FileNotFoundError:
        return None


def temporary_path(folder: Path, label: str) -> Path:
    """A fresh hidden name in `folder`, recognised (and cleaned) as a leftover if its writer dies.

    The label is only a hint for people, cut so that the name stays within NAME_MAX_BYTES.
    """
    label = truncate_utf8(label, NAME_MAX_BYTES - len(TMP_PREFIX) - _TOKEN)
    return folder / f"{TMP_PREFIX}{label}-{secrets.token_hex(4)}"


def write_folder(parent: Path, name: str, files: Mapping[str, bytes]) -> Path:
    """Create `parent/name` holding `files`, all at once; an existing folder of that name is replaced."""
    final = parent / name
    tmp = temporary_path(parent, name)
    tmp.mkdir(mode=0o700)
    try:
        for filename, data in files.items():
            _write_durably(tmp / filename, data)
        _fsync_dir(tmp)
        if final.exists():
            # rename() cannot replace a non-empty folder; between these two renames the name is absent,
            # which a reader sees as "not written yet", never as half written.
            old = temporary_path(parent, f"old-{name}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(parent)
    return final


def write_file(path: Path, data: bytes, *, mode: int = 0o600) -> Path:
    """Write one file under a temporary name and rename it into place."""
    tmp = temporary_path(path.parent, path.name)
    try:
        _write_durably(tmp, data, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def move_file(source: Path, folder: Path, name: str) -> Path:
    """Move `source` into `folder` under `name` (or a free variant of it); returns where it went.

    A rename when both sides share a file system; otherwise a copy under a temporary name, renamed into
    place, then the source removed, so an interrupted move never leaves a partial file under a real name.
    """
    target = _free_name(folder, name)
    try:
        os.rename(source, target)
    except OSError as e:
        if e.errno != getattr(os, "EXDEV", 18):
            raise
        tmp = temporary_path(folder, name)
        try:
            shutil.copy2(source, tmp, follow_symlinks=False)
            os.rename(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        source.unlink()
    return target


def remove_leftovers(folder: Path) -> list[Path]:
    """Delete the `.tmp-…` entries a killed writer left in `folder`; returns what was removed."""
    removed = []
    for entry in folder.glob(f"{TMP_PREFIX}*"):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _free_name(folder: Path, name: str) -> Path:
    target = folder / name
    stem, dot, suffix = name.rpartition(".") if "." in name.lstrip(".") else (name, "", "")
    number = 1
    while os.path.lexists(target):
        number += 1
        target = folder / f"{stem} ({number}){dot}{suffix}"
    return target


def _write_durably(path: Path, data: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # exactly `mode`, whatever the umask
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
