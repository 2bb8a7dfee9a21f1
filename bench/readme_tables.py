"""The documentation's engine-against-transformers tables, rendered from the committed results files.

A table in docs/benchmarks.md (or the README) that a results file backs sits between two markers:

    <!-- rendered from bench/results/a.json bench/results/b.json | geometry=qwen3-30b-a3b dtype=bfloat16 -->
    | ... |
    <!-- end rendered -->

and `python -m npumoe.bench.readme_tables [FILE ...]` rewrites every such table from the files its marker names,
one line per matching case of each file (the filter after `|`: a case's keys and values, `a,b` for either).
A `<!-- rows from FILE | filter -->` marker (closed the same way) renders every row of one file's matching cases
instead: each path, transformers' and the peer's beside the engine's; a `<!-- documents from FILE ... -->` marker
renders `bench document`'s rows, the engine's and llama.cpp's for each document.
Every figure is a field of the file as the benchmark wrote it, rounded: nothing is computed here that the file
does not hold, so a reader can find each number in the file (tests/bench/test_readme_numbers.py checks). The
engine's best path is chosen from the file's rows by paired round-by-round ratios (fair/paired.py), as the
benchmark's own table does. Rerun it after new results.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .fair.paired import best_engine_row

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "docs" / "benchmarks.md", ROOT / "README.md")
MARKED = re.compile(r"(?P<open><!-- (?P<kind>rendered|rows|documents) from (?P<files>[^|>]+?)"
                    r"(?: \| (?P<filter>[^>]*?))? -->\n)(?P<table>.*?)(?P<close><!-- end rendered -->)", re.S)
CASE_KEYS = ("geometry", "layers", "document_tokens", "tokens", "chunk_tokens", "dtype", "threads")
ROWS_HEADER = ("| path | tok/s | × transformers' best | round by round | × the engine's best exact path | load s "
               "| rel. error | what |")
HEADER = ("| results file | machine | case | engine's best exact path | tok/s | × transformers' best | round by round "
          "| × roofline | load s | transformers' best | the run's load |")
DOCUMENTS_HEADER = ("| results file | machine | document | impl | tokens | decode depth | generated | load s "
                    "| prefill tok/s (× llama.cpp) | decode tok/s (× llama.cpp) | seconds (llama.cpp's ÷ the engine's) "
                    "| CPU s | peak RSS GiB |")


def render(text: str, root: Path = ROOT) -> str:
    """`text` with every marked table rendered afresh from the results files its marker names."""
    def table(match: re.Match) -> str:
        files = match["files"].split()
        wanted = dict(item.split("=", 1) for item in (match["filter"] or "").split())
        header, lines_of = {"rendered": (HEADER, engine_lines), "rows": (ROWS_HEADER, every_row),
                            "documents": (DOCUMENTS_HEADER, document_lines)}[match["kind"]]
        lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
        for name in files:
            lines += lines_of(name, json.loads((root / name).read_text()), wanted)
        return match["open"] + "\n".join(lines) + "\n" + match["close"]

    return MARKED.sub(table, text)


def matching_cases(data: dict, wanted: dict[str, str]) -> dict[tuple, list[dict]]:
    """A results file's timed rows by case, the cases that match `wanted`."""
    cases: dict[tuple, list[dict]] = {}
    for row in data["results"]:
        if row["impl"] != "profile" and all(str(row.get(key)) in values.split(",") for key, values in wanted.items()):
            cases.setdefault(tuple((key, row[key]) for key in CASE_KEYS if key in row), []).append(row)
    return cases


def every_row(name: str, data: dict, wanted: dict[str, str]) -> list[str]:
    """One table line per row of each matching case: its speed, ratios with their round-by-round range (a peer's
    are unpaired), load time, error and what it is."""
    lines = []
    for rows in matching_cases(data, wanted).values():
        for row in rows:
            if "tokens_per_s" not in row and row.get("status") != "refused":
                continue
            spread = row.get("vs_transformers_best_range")
            engine = row.get("vs_engine_best_range")
            what = (row.get("note") or (f"ran {row['same_work_as']}'s code" if "same_work_as" in row else "")
                    or row.get("quantized") or ("approximate: prunes" if row.get("status") == "approximate" else ""))
            cells = [row["impl"], f"{row['tokens_per_s']:,.0f}" if "tokens_per_s" in row else row["status"],
                     f"{row['vs_transformers_best']:.2f}" if "vs_transformers_best" in row else "",
                     f"{spread[0]:.2f}-{spread[2]:.2f}" if spread else "",
                     f"{row['vs_engine_best']:.2f} ({engine[0]:.2f}-{engine[1]:.2f} unpaired)" if engine else "",
                     f"{row['load_s']:.1f}" if "load_s" in row else "",
                     f"{row['rel_error']:.1e}" if "rel_error" in row else "", what]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def engine_lines(name: str, data: dict, wanted: dict[str, str]) -> list[str]:
    """One table line per case of a `bench moe` or `bench prefill` results file that matches `wanted`."""
    cases = matching_cases(data, wanted)
    machine = data["machine"]
    load = machine.get("load_average")
    run_load = (f"{load['median']:.1f} median, {load['highest']:.1f} highest"
                + (" (above the cores)" if machine.get("overloaded") else "") if load else "not recorded")
    lines = []
    for case, rows in cases.items():
        best = best_engine_row(rows)
        if best is None:
            continue
        transformers = max((r for r in rows if r["impl"].startswith("transformers-") and "tokens_per_s" in r),
                           key=lambda r: r["tokens_per_s"])
        spread = best.get("vs_transformers_best_range")
        cells = [name.removeprefix("bench/results/"), f"{machine['cpu']}, {machine['threads']} threads",
                 ", ".join(f"{key} {value}" for key, value in case if key != "threads"), best["impl"],
                 f"{best['tokens_per_s']:,.0f}", f"{best['vs_transformers_best']:.2f}",
                 f"{spread[0]:.2f}-{spread[2]:.2f}" if spread else "not recorded",
                 f"{best['vs_roofline']:.2f}" if "vs_roofline" in best else "",
                 f"{best['load_s']:.1f}" if "load_s" in best else "not recorded",
                 f"{transformers['impl']}, {transformers['tokens_per_s']:,.0f}", run_load]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def document_lines(name: str, data: dict, wanted: dict[str, str]) -> list[str]:
    """One table line per row of a `bench document` results file: the engine's, then llama.cpp's on the same work,
    with the engine's ratios over it (llama.cpp's seconds over the engine's for the whole document)."""
    machine = data["machine"]
    lines = []
    for row in data["results"]:
        if row["status"] != "ran":
            continue
        ratios = row.get("vs_llama_cpp", {})

        def cell(key: str, spec: str, row: dict = row) -> str:
            return format(row[key], spec) if row.get(key) is not None else ""

        def ratio(key: str, ratios: dict = ratios) -> str:
            return f" ({ratios[key]:.2f}×)" if key in ratios else ""

        cells = [name.removeprefix("bench/results/"), f"{machine['cpu']}, {machine['threads']} threads",
                 row["document"], row["impl"], cell("tokens", ","), cell("decode_depth", ","),
                 cell("generated_tokens", ","), cell("load_s", ".1f"),
                 cell("prefill_tokens_per_s", ",.1f") + ratio("prefill_tokens_per_s"),
                 cell("decode_tokens_per_s", ",.2f") + ratio("decode_tokens_per_s"),
                 cell("seconds", ",.1f") + ratio("seconds"), cell("cpu_seconds", ",.1f"), cell("peak_rss_gib", ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: Sequence[str] = ()) -> None:
    """Rewrite the marked tables of the documents given (default: docs/benchmarks.md and the README)."""
    for path in map(Path, argv) if argv else DOCUMENTS:
        text = path.read_text()
        rendered = render(text)
        if rendered != text:
            path.write_text(rendered)
            print(f"rendered {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
