"""HTML to text: the page's main content by trafilatura, or every visible word when it finds no main content.

A saved news page carries navigation, cookie banners, share buttons and footers the model should not read;
trafilatura keeps the article. A short or unusual page (a note, a report exported as HTML) may have no
article it recognises: then the whole visible text is the document.
"""

from __future__ import annotations

from html.parser import HTMLParser

from .decode import decode_html


def html_text(data: bytes) -> str:
    """The page's text, one paragraph per block, blocks separated by a blank line."""
    page = decode_html(data)
    return main_content(page) or visible_text(page)


def main_content(page: str) -> str:
    """The article trafilatura finds in the page, one block per line it gives; "" when it finds none."""
    import trafilatura

    found = trafilatura.extract(page, include_comments=False, include_tables=True, with_metadata=False)
    return _paragraphs((found or "").split("\n"))


def visible_text(page: str) -> str:
    """All visible text of the page (no scripts or styles); streaming, so nesting depth costs nothing."""
    parser = _VisibleText()
    parser.feed(page)
    parser.close()
    return _paragraphs("".join(parser.parts).split("\n"))


def _paragraphs(lines: list[str]) -> str:
    # HTML collapses whitespace inside a block; blocks become paragraphs separated by one blank line.
    collapsed = (" ".join(line.split()) for line in lines)
    return "\n\n".join(line for line in collapsed if line)


class _VisibleText(HTMLParser):
    """Collects visible text, one line per block element."""

    SKIPPED = frozenset({"script", "style", "template", "noscript"})
    BLOCKS = frozenset(
        {
            *("address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt", "figcaption"),
            *("figure", "footer", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li", "main", "nav"),
            *("ol", "p", "pre", "section", "table", "td", "th", "title", "tr", "ul"),
        }
    )

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.SKIPPED:
            self._skipping += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIPPED:
            self._skipping = max(0, self._skipping - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self.parts.append(data)
