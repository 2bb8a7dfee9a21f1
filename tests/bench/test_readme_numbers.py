"""Every figure in the documentation's performance tables comes from a committed results file its section names."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from npumoe.bench import readme_tables

ROOT = Path(__file__).parents[2]
BENCHMARKS, README = ROOT / "docs" / "benchmarks.md", ROOT / "README.md"
RESULTS_FILE = re.compile(r"bench/results/[\w.+-]+\.(?:json|txt)")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", re.I)
# A figure in a cell: a number standing alone, not a part of a name (qwen3-30b-a3b, int8, top-1, a file's date)
FIGURE = re.compile(r"(?<![\w.-])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?![\w-])", re.I)


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of each section of a Markdown text, at any heading level."""
    parts = re.split(r"^(#+ .*)$", text, flags=re.M)
    return [(parts[i], parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


def tables(body: str) -> list[list[list[str]]]:
    """Each Markdown table's body rows (header and separator left out), as lists of cells."""
    found, lines = [], []
    for line in [*body.splitlines(), ""]:
        if line.startswith("|"):
            lines.append(line)
            continue
        if len(lines) > 2:
            found.append([[cell.strip() for cell in row.strip("|").split("|")] for row in lines[2:]])
        lines = []
    return found


def performance_tables(path: Path) -> list[tuple[str, list[str], list[list[str]]]]:
    """(heading, results files named, rows) of each performance table: every table of docs/benchmarks.md, and the
    README's in sections that name a results file."""
    found = []
    for heading, body in sections(path.read_text()):
        named = sorted(set(RESULTS_FILE.findall(body)))
        for rows in tables(body):
            if path == BENCHMARKS or named:
                found.append((heading, named, rows))
    return found


def occurs(figure: str, values: list[float]) -> bool:
    """Whether `figure` as written (commas, a sign, decimals, e-notation, a percentage of a fraction) is some value
    of the file's, rounded as the figure is."""
    text = figure.replace(",", "").lstrip("+")
    value = float(text)
    if "e" in text.lower() and value == 0:  # 0.0e+00: no significant digit to round to, so exactly zero
        return 0.0 in values
    if "e" in text.lower():  # as many significant digits as written
        mantissa = text.lower().split("e")[0]
        digits = len(mantissa.replace("-", "").replace(".", "").lstrip("0")) or 1
        half = 0.5 * 10.0 ** (math.floor(math.log10(abs(value))) - digits + 1)
        return any(abs(v - value) <= half * 1.0001 for v in values)
    step = 10.0 ** -(len(text.split(".")[1]) if "." in text else 0)
    return any(abs(round(candidate / step) * step - value) < step / 1e6
               for v in values for candidate in (v, v * 100))


def file_values(names: list[str]) -> list[float]:
    values = []
    for name in names:
        # A range printed as `1.89-2.64` reads as 1.89 and -2.64, so a figure's magnitude counts too.
        values += [w for v in (float(n.replace(",", "")) for n in NUMBER.findall((ROOT / name).read_text()))
                   if math.isfinite(v) for w in {v, abs(v)}]
    return values


def test_every_number_in_the_readmes_performance_tables_occurs_in_a_committed_results_file():
    checked = 0
    for path in (BENCHMARKS, README):
        for heading, named, rows in performance_tables(path):
            assert named, f"{path.name} {heading}: a table with no results file named in its section"
            values = file_values(named)
            for row in rows:
                for cell in row:
                    for figure in FIGURE.findall(cell):
                        assert occurs(figure, values), (f"{path.name} {heading}: {figure!r} ({cell!r}) is in none "
                                                        f"of {named}")
                        checked += 1
    assert checked > 100
    assert any(named for _, named, _ in performance_tables(README))  # the README's own table is among them


def test_the_rendered_tables_are_what_the_results_files_say_now():
    for path in (BENCHMARKS, README):
        text = path.read_text()
        assert readme_tables.render(text) == text, f"run python -m npumoe.bench.readme_tables: {path.name} is stale"
    assert readme_tables.MARKED.search(BENCHMARKS.read_text())


@pytest.mark.parametrize(("figure", "found"), [("1.52", True), ("1.53", False), ("3,609", True), ("36.1 %", True),
                                               ("4.2e-3", True), ("4.3e-3", False), ("+0.30", False)])
def test_a_figure_occurs_where_the_file_holds_it_rounded_as_written(figure, found):
    assert occurs(NUMBER.findall(figure)[0], [1.5213, 3609.12, 0.3612, 0.0042]) is found
