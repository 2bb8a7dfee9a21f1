"""The README is a manual a person reads on one sitting, and every page it sends them to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
# Local links: [text](path) or [text](path#anchor), not web addresses nor in-page anchors.
LOCAL_LINK = re.compile(r"\]\((?!https?:|#)([^)#\s]+)(?:#[^)]*)?\)")
MOST_BYTES = 20 * 1024


def test_the_readme_stays_a_manual_of_at_most_20_kb():
    assert len((ROOT / "README.md").read_bytes()) <= MOST_BYTES


def test_every_local_link_of_the_readme_and_the_docs_names_a_file_that_exists():
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    checked = 0
    for page in pages:
        for target in LOCAL_LINK.findall(page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
            checked += 1
    assert checked > 20
