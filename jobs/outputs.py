"""Writing files so that no reader ever sees half of one.

Everything is first written under a hidden temporary name (`.tmp-…`) in the folder it belongs to,
flushed to disk, then renamed in one step: an output folder appears complete or not at all. A run
killed half-way leaves only `.tmp-…` entries, which `remove_leftovers` clears at the next start: it deletes
them all, except that an output folder set aside while being replaced (`.tmp-…-<hex8>.old`) is put back
when its replacement never took its place. In an outbox other homes share, a home's temporary names carry its
mark (`.tmp-<mark>-…`), and its start sweeps those only: the others' may be in flight. Output folders are named
for the document, the model and its settings together (`output_name`), so no other job's outputs ever replace them.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import logging
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

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
DISPLACED_SUFFIX = ".old"  # after a temporary name: an output folder set aside while its replacement moves in
NAME_MAX_BYTES = 255  # the longest file name most file systems take (ext4, APFS, NTFS), in bytes
MAX_STEM = 80  # characters, for names people read
_KEY_HEX = 16  # 64 bits of the job's keys in an output name: no two jobs' outputs share a folder
_TMP_TOKEN = 9  # "-" and 8 hex digits: a temporary name's random part
MARK_HEX = 8  # a home's mark on its temporary names in an outbox other homes share (`.tmp-<mark>-…`)
# The longest name made from a stem: the old output folder a rewrite sets aside,
# `.tmp-<mark>-<stem>-<key16>-<hex8>.old`; capping the stem so that fits keeps every name derived from it legal.
MAX_STEM_BYTES = (NAME_MAX_BYTES - len(TMP_PREFIX) - (MARK_HEX + 1) - (1 + _KEY_HEX) - _TMP_TOKEN
                  - len(DISPLACED_SUFFIX))
# The files of a document's output folder (outbox/<stem>-<key16>/).
SUMMARY_FILE = "summary.md"  # the document's name, what made the summary, the summary: see summary_file.py
EMBEDDINGS_FILE = "embeddings.npy"  # float32 (chunks + 1, dim): one row per chunk, then the document vector
META_FILE = "meta.json"  # DocumentMeta (meta.py): how the outputs were made and what making them cost
TEXT_FILE = "text.txt.gz"  # the extracted text the model read, so a search hit can show its passage
OFFSETS_FILE = "offsets.npy"  # int64 (chunks, 2): each chunk's [start, end) character offsets in that text


def output_name(source_name: str, sha256: str, model_key: str, settings_key: str) -> str:
    """`<stem>-<key16>`: a single safe path component, whatever the source was called; key16 is 64 bits of
    the hash of the job's keys (the content, the model, its settings), so one document made with other
    settings, or another document, never gets the same folder."""
    return f"{safe_stem(source_name)}-{output_key(sha256, model_key, settings_key)}"


def output_key(sha256: str, model_key: str, settings_key: str) -> str:
    """The part of an output folder's name that the job's keys decide, whatever its document is called now."""
    return hashlib.sha256("\0".join((sha256, model_key, settings_key)).encode()).hexdigest()[:_KEY_HEX]


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


def readable(text: str) -> str:
    """`text` as valid Unicode: the bytes of a name that is not UTF-8 (surrogate escapes) shown as \\xNN."""
    return os.fsencode(text).decode("utf-8", "backslashreplace")


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


def temporary_path(folder: Path, label: str, mark: str = "") -> Path:
    """A fresh hidden name in `folder`, recognised (and cleaned) as a leftover if its writer dies.

    The label is only a hint for people, cut so that the name stays within NAME_MAX_BYTES. `mark`: the writing
    home's (`home_mark`), in a folder other homes share, so that a start sweeps its own leftovers only.
    """
    prefix = _temporary_prefix(mark)
    label = truncate_utf8(label, NAME_MAX_BYTES - len(prefix) - _TMP_TOKEN)
    return folder / f"{prefix}{label}-{secrets.token_hex(4)}"


def home_mark(identity: str) -> str:
    """The mark of a home's temporary names, made from its machine identity (queue/identity.py)."""
    return hashlib.sha256(identity.encode()).hexdigest()[:MARK_HEX]


def _temporary_prefix(mark: str) -> str:
    return f"{TMP_PREFIX}{mark}-" if mark else TMP_PREFIX


def displaced_path(folder: Path, name: str, mark: str = "") -> Path:
    """Where the folder `name` is set aside while its replacement moves in: a temporary name that says which
    name it held, so that a start after a crash can put it back (`remove_leftovers`)."""
    if len(name.encode("utf-8", "surrogateescape")) > MAX_STEM_BYTES + 1 + _KEY_HEX:
        raise ValueError(f"a folder name of at most {MAX_STEM_BYTES + 1 + _KEY_HEX} bytes can be replaced safely")
    return folder / f"{temporary_path(folder, name, mark).name}{DISPLACED_SUFFIX}"


def write_folder(parent: Path, name: str, files: Mapping[str, bytes], *, mark: str = "") -> Path:
    """Create `parent/name` holding `files`, all at once; an existing folder of that name is replaced. `mark`: see
    temporary_path."""
    final = parent / name
    tmp = temporary_path(parent, name, mark)
    tmp.mkdir(mode=0o700)
    try:
        for filename, data in files.items():
            _write_durably(tmp / filename, data)
        fsync_dir(tmp)
        if final.exists():
            # rename() cannot replace a non-empty folder; between these two renames the name is absent,
            # which a reader sees as "not written yet", never as half written. Killed in between, the old
            # folder is put back at the next start; failing in between, at once.
            old = displaced_path(parent, name, mark)
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except BaseException:
                os.rename(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)  # what is left of it goes at the next start
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)
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
    fsync_dir(path.parent)
    return path


def remove_leftovers(folder: Path, mark: str = "") -> list[Path]:
    """Delete the `.tmp-…` entries a killed writer left in `folder` (with a `mark`, only those of the home it marks:
    see temporary_path); returns what was removed. An output folder set aside while being replaced is put back if
    nothing took its name, and removed if its replacement did."""
    removed = []
    prefix = _temporary_prefix(mark)
    for entry in folder.glob(f"{glob.escape(prefix)}*"):
        held = _displaced_from(entry, prefix)
        if held is not None and not os.path.lexists(folder / held):
            os.rename(entry, folder / held)
            fsync_dir(folder)
            log.warning("put back %s: the run replacing it was killed before the new one took its place",
                        folder / held)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        else:
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _displaced_from(entry: Path, prefix: str) -> str | None:
    """The name the folder set aside as `entry` (named `prefix…`) held (see displaced_path); None if it is no such
    folder."""
    if not entry.name.endswith(DISPLACED_SUFFIX) or entry.is_symlink() or not entry.is_dir():
        return None
    name, dash, token = entry.name[len(prefix):-len(DISPLACED_SUFFIX)].rpartition("-")
    return name if dash and name and len(token) == _TMP_TOKEN - 1 and re.fullmatch("[0-9a-f]+", token) else None


def _write_durably(path: Path, data: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # exactly `mode`, whatever the umask
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(folder: Path) -> None:
    """Make the entries of `folder` (a file created, renamed or removed there) survive a power cut."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
