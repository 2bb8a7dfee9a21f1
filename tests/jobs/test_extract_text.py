"""Text and HTML as people have them: legacy code pages, a damaged UTF-8 byte, a declared charset, a news page
with its navigation, cookie banner and footer around the article."""

from __future__ import annotations

from pathlib import Path

import pytest
from extraction import LIMITS
from support.blocked_imports import block_imports

from npumoe.jobs.errors import MissingDependency
from npumoe.jobs.extract.decode import declared_charset
from npumoe.jobs.extract.formats import extract_bytes
from npumoe.jobs.extract.isolated import ExtractLimits, extract_text

RUSSIAN = (
    "Совет директоров собрался во вторник и утвердил ночной бюджет. Сервер обрабатывает документы, пока все "
    "спят, и утром каждый получает короткое резюме. Батарея ноутбука расходуется бережно."
)
JAPANESE = (
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。何でも薄暗いじめじめした所で"
    "ニャーニャー泣いていた事だけは記憶している。夜の間に文書を読み、朝には要約が届く。"
)
CHINESE = (
    "董事会在星期二开会，批准了夜间预算。服务器在大家睡觉的时候处理文件，早上每个人都会收到一份简短的摘要。"
    "笔记本电脑的电池应当节约使用。"
)


def extracted(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return extract_text(path, LIMITS).text


@pytest.mark.parametrize(
    ("codec", "text", "words"),
    [
        ("cp1251", RUSSIAN, ["Совет директоров", "ночной бюджет", "Батарея ноутбука"]),
        ("shift_jis", JAPANESE, ["吾輩は猫である", "ニャーニャー", "要約が届く"]),
        ("gbk", CHINESE, ["董事会在星期二开会", "批准了夜间预算", "笔记本电脑的电池"]),
    ],
)
def test_a_legacy_code_page_is_detected_and_decoded(tmp_path: Path, codec: str, text: str, words: list[str]) -> None:
    data = text.encode(codec)
    with pytest.raises(UnicodeDecodeError):
        data.decode("utf-8")

    result = extracted(tmp_path, f"{codec}.txt", data)

    for word in words:
        assert word in result
    assert result == text


def test_one_stray_byte_in_a_utf8_file_is_replaced_not_read_as_cp1252(tmp_path: Path) -> None:
    before = "The café served crème brûlée to the naïve guests"
    after = "and the señora paid 12 € at the door."
    data = before.encode() + b" \x92" + after.encode()  # a cp1252 apostrophe pasted into a UTF-8 file

    result = extracted(tmp_path, "menu.txt", data)

    assert result == f"{before} \ufffd{after}"
    assert "Ã" not in result


def test_windows_1252_text_without_utf8_sequences_still_reads_as_windows_1252(tmp_path: Path) -> None:
    text = "Menu of the café: “the porter wrote one line in the log and went back to the quiet of the night”."

    assert extracted(tmp_path, "menu.txt", text.encode("cp1252")) == text


def test_missing_charset_normalizer_is_the_machines_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "russian.txt"
    path.write_bytes(RUSSIAN.encode("cp1251"))
    block_imports(tmp_path / "blocked", monkeypatch, "charset_normalizer")

    with pytest.raises(MissingDependency, match="charset_normalizer"):
        extract_text(path, LIMITS)


NEWS_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Night shift budget approved | The Harbour Gazette</title>
<script>window.dataLayer = [];</script></head>
<body>
<div id="cookie-banner" class="cookie-consent">We use cookies to personalise content and ads.
  <button>Accept all cookies</button> <button>Manage preferences</button></div>
<header><nav class="site-nav"><ul><li><a href="/">Home</a></li><li><a href="/world">World news</a></li>
  <li><a href="/sport">Sport results</a></li><li><a href="/subscribe">Subscribe for 1 € a week</a></li></ul>
</nav></header>
<main><article>
<h1>Harbour board approves the night shift budget</h1>
<p class="byline">By Ada Lindqvist, 7 January 2025</p>
<p>The harbour board met on Tuesday evening and approved a budget that moves the heaviest document work to
the quiet hours between one and six in the morning, when the offices are empty and electricity is cheap.</p>
<p>Under the plan, every report dropped into the shared folder during the day is summarised overnight, and the
summaries wait in each clerk's outbox at breakfast. The treasurer said the laptops would no longer spin their
fans while people were writing letters.</p>
<p>Members asked how the system would behave on battery. The answer was simple: it waits for the charger, and
it says so in plain words when anyone asks why nothing has happened yet.</p>
</article>
<aside class="share"><a href="#">Share on social media</a> <a href="#">Email this story</a></aside>
<section class="related"><h2>Related stories</h2><ul><li><a href="/a">Ferry timetable changes for winter</a></li>
<li><a href="/b">Lighthouse keepers retire after forty years</a></li></ul></section>
</main>
<footer><p>© 2025 The Harbour Gazette. All rights reserved.</p><a href="/privacy">Privacy policy</a>
<a href="/terms">Terms of use</a></footer>
</body></html>
"""


def test_a_news_page_keeps_its_article_and_loses_navigation_banner_and_footer(tmp_path: Path) -> None:
    text = extracted(tmp_path, "news.html", NEWS_PAGE.encode())

    assert text.startswith("Harbour board approves the night shift budget\n\n")
    assert "The harbour board met on Tuesday evening" in text
    assert "every report dropped into the shared folder during the day is summarised overnight" in text
    assert "it waits for the charger" in text
    for boilerplate in (
        *("We use cookies", "Accept all cookies", "World news", "Subscribe", "Share on social media"),
        *("Related stories", "Ferry timetable", "All rights reserved", "Privacy policy", "window.dataLayer"),
    ):
        assert boilerplate not in text


def test_a_page_without_an_article_falls_back_to_all_its_visible_text(tmp_path: Path) -> None:
    page = "<html><body><div>Shopping list</div><ul><li>Bread</li><li>Milk</li></ul></body></html>"

    assert extracted(tmp_path, "list.html", page.encode()) == "Shopping list\n\nBread\n\nMilk"


@pytest.mark.parametrize(
    "head",
    ['<meta charset="windows-1251">', '<meta http-equiv="Content-Type" content="text/html; charset=windows-1251">'],
)
def test_html_is_decoded_by_the_charset_it_declares(tmp_path: Path, head: str) -> None:
    page = f"<html><head>{head}</head><body><p>Привет, мир. Всё готово.</p></body></html>"

    assert extracted(tmp_path, "hello.html", page.encode("cp1251")) == "Привет, мир. Всё готово."


def test_a_declared_latin1_page_is_read_as_windows_1252_as_browsers_do(tmp_path: Path) -> None:
    page = '<html><head><meta charset="ISO-8859-1"></head><body><p>“Quoted” in café.</p></body></html>'

    assert extracted(tmp_path, "quotes.html", page.encode("cp1252")) == "“Quoted” in café."


def test_declared_charset_reads_meta_http_equiv_and_xml_forms() -> None:
    assert declared_charset(b'<meta charset="Shift_JIS">') == "shift_jis"
    assert declared_charset(b"<META HTTP-EQUIV='content-type' CONTENT='text/html;charset=gbk'>") == "gbk"
    assert declared_charset(b'<?xml version="1.0" encoding="koi8-r"?><html>') == "koi8-r"
    assert declared_charset(b'<meta charset="no-such-codec">') is None
    assert declared_charset(b" " * 1024 + b'<meta charset="gbk">') is None  # browsers look no further


def test_missing_trafilatura_is_the_machines_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "news.html"
    path.write_bytes(NEWS_PAGE.encode())
    block_imports(tmp_path / "blocked", monkeypatch, "trafilatura")

    with pytest.raises(MissingDependency, match="trafilatura"):
        extract_text(path, LIMITS)


def test_extracted_text_keeps_newlines_and_tabs_but_no_other_control_characters() -> None:
    prose = "The night clerk reads the harbour ledger. " * 10  # a few control characters among much text
    data = f"A ti\x1b[2Jde\tcame in\x07.\nThe \x9b31mclerk\x01 wrote.\x7f\fNext page. {prose}".encode()
    text = extract_bytes(data, ".txt", ExtractLimits()).text
    assert text == f"A ti[2Jde\tcame in.\nThe 31mclerk wrote.\nNext page. {prose}".strip()
