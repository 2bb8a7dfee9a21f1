"""What may reach a terminal of text the person did not write: file names, errors, passages, summaries.

A document or a file name can hold escape sequences (ESC, the C1 CSI) that a terminal obeys: retitle the
window, clear the screen, rewrite what was printed before. Every command prints such text through `printable`.
"""

from __future__ import annotations


def printable(text: str, *, lines: bool = False) -> str:
    """`text` with every character that is not printable (control characters, bidirectional overrides) shown as
    `?`; with `lines`, newlines and tabs are kept (a passage, a summary), else they too are `?` (a name, an error)."""
    keep = "\n\t" if lines else ""
    return "".join(c if c.isprintable() or c in keep else "?" for c in text)
