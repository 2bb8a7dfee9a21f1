"""`npumoed search`, `similar` and `reindex`: finding things in what was processed.

`search` embeds the query with the search's own small model (jobs/search/sentence_model.py), here, in
about a second, daemon or not: it never loads the LLM. `reindex` embeds every document's passages with it;
`similar` needs no model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.text import Text

from npumoe.jobs.outputs import read_text
from npumoe.jobs.queue.schema import DONE
from npumoe.jobs.search.index import (
    DocumentHits,
    IndexDamaged,
    Neighbour,
    NotIndexed,
    SearchIndex,
    reindex,
    stale_reason,
)
from npumoe.jobs.search.passages import Passage, passage, query_terms

from ..home import Home, outbox_folder
from .app import App, emit_json, holding_home, pass_app
from .terminal import printable

HIGHLIGHT = "bold yellow"


@click.command()
@click.argument("query")
@click.option("-k", "k", type=click.IntRange(1, 1000), default=10, show_default=True,
              help="How many chunks to return, grouped by document.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@pass_app
def search(app: App, query: str, k: int, as_json: bool) -> None:
    """The passages of processed documents that best match QUERY.

    The query is embedded by the search model exactly as each document's passages are, and each passage is
    scored by that vector's cosine similarity and by how much of the query's words it holds.
    """
    if not query.strip():
        raise click.BadParameter("the query is empty", param_hint="QUERY")
    index = _open(app.home)
    try:
        if not index.models():
            raise click.ClickException("nothing is indexed yet: process some documents (or run `npumoed reindex`)")
        if stale := stale_reason(app.home.database):
            click.echo(f"warning: the search index misses documents ({stale}); `npumoed reindex` rebuilds it", err=True)
        key, vector = _embedded(query)
        results = index.search(key, vector, query, k)
    except (NotIndexed, IndexDamaged) as e:
        raise click.ClickException(str(e)) from e
    finally:
        index.close()
    terms = query_terms(query)
    rows = [_result(hits, terms) for hits in results]
    if as_json:
        emit_json({"query": query, "model_key": key, "results": rows})
        return
    _print_results(rows, terms)


@click.command()
@click.argument("document")
@click.option("-k", "k", type=click.IntRange(1, 1000), default=10, show_default=True,
              help="How many documents to list, the document itself first.")
@click.option("--json", "as_json", is_flag=True, help="Print the documents as JSON.")
@pass_app
def similar(app: App, document: str, k: int, as_json: bool) -> None:
    """The processed documents nearest to DOCUMENT (a file that was processed, or its job id)."""
    index = _open(app.home)
    try:
        neighbours = index.similar(_job_id(app, document), k)
    except (NotIndexed, IndexDamaged) as e:
        raise click.ClickException(str(e)) from e
    finally:
        index.close()
    if as_json:
        emit_json({"document": document, "similar": [_neighbour(n) for n in neighbours]})
        return
    _print_neighbours(neighbours)


@click.command("reindex")
@pass_app
def reindex_command(app: App) -> None:
    """Rebuild the search index from the outbox (its embeddings.npy, offsets.npy and text.txt.gz files).

    Only while the daemon is stopped: it holds the home, and writes the index as it finishes documents.
    """
    app.queue  # noqa: B018 -- opening the queue creates the database when there is none yet
    outbox = outbox_folder(app.config, app.home)
    with holding_home(app.home):
        try:
            done = reindex(app.home.database, outbox)
        except OSError as e:  # a configured outbox folder missing or unreadable (the shared storage not mounted)
            raise click.ClickException(f"cannot read the outbox {outbox}: {e}") from e
    for problem in done.skipped:
        click.echo(f"npumoed: skipped {printable(problem)}", err=True)
    click.echo(f"indexed {done.documents} document(s) from {printable(str(outbox))}")


def _embedded(query: str) -> tuple[str, Any]:
    """(the index's vectors key, the query's vector) by the search model."""
    from npumoe.jobs.search.sentence_model import MODEL_KEY, sentence_model

    return MODEL_KEY, sentence_model().embed([query])[0]


def _open(home: Home) -> SearchIndex:
    try:
        return SearchIndex(home.database)
    except FileNotFoundError as e:
        raise click.ClickException(f"nothing is indexed yet: {e}") from e


def _job_id(app: App, document: str) -> int:
    """A job id as given, or the newest done job of a file's content."""
    from npumoe.jobs.errors import FileRefused

    from ..intake import sha256_of

    path = Path(document).expanduser()
    if re.fullmatch(r"#?\d+", document) and not path.exists():
        return int(document.lstrip("#"))
    try:
        sha256 = sha256_of(path)
    except FileRefused as e:
        raise click.BadParameter(f"{e} (give a processed file or a job id)", param_hint="DOCUMENT") from e
    done = [job.id for job in app.queue.list(DONE) if job.sha256 == sha256]
    if not done:
        raise click.ClickException(f"{path} has not been processed (no done job has its content)")
    return max(done)


def _result(hits: DocumentHits, terms: list[str]) -> dict[str, Any]:
    doc = hits.document
    text = read_text(Path(doc.output_dir))
    passages = []
    for chunk in hits.chunks:
        shown: Passage | None = None
        if text is not None and chunk.start is not None and chunk.end is not None:
            shown = passage(text, chunk.start, chunk.end, terms)
        passages.append({"chunk": chunk.ordinal, "score": round(chunk.score, 4), "cosine": round(chunk.cosine, 4),
                         "words": round(chunk.words, 4),
                         "phrase": chunk.phrase, "start": shown.start if shown else None,
                         "end": shown.end if shown else None, "text": shown.text if shown else None})
    return {"job_id": doc.job_id, "source": doc.source, "output_dir": doc.output_dir, "summary": doc.summary,
            "score": round(hits.score, 4), "passages": passages}


def _neighbour(n: Neighbour) -> dict[str, Any]:
    return {"job_id": n.document.job_id, "source": n.document.source, "output_dir": n.document.output_dir,
            "summary": n.document.summary, "score": round(n.score, 4)}


def _print_neighbours(neighbours: list[Neighbour]) -> None:
    console = Console()
    for rank, n in enumerate(neighbours, 1):
        line = Text(f"{rank:>2}. {n.score:.3f}  ")
        line.append(printable(n.document.source), style="bold")
        line.append(f"  (#{n.document.job_id})  {printable(n.document.summary)}", style="dim")
        console.print(line)


def _print_results(rows: list[dict[str, Any]], terms: list[str]) -> None:
    console = Console()
    if not rows:
        console.print("no matches")
    words = re.compile(r"(?<![^\W_])(" + "|".join(map(re.escape, terms)) + r")(?![^\W_])", re.IGNORECASE)
    for rank, row in enumerate(rows, 1):
        # Text, not markup: names and passages print as they are. The file name first, whole: the part a person
        # knows the document by; its folder after it, which may be cut.
        source = Path(row["source"])
        heading = Text(f"{rank:>2}. {row['score']:.3f}  ")
        heading.append(printable(source.name), style="bold")
        heading.append(f"  (#{row['job_id']})  ")
        heading.append(printable(str(source.parent)), style="dim")
        console.print(heading, overflow="ellipsis", no_wrap=True)
        for shown in row["passages"]:
            line = Text(f"    {shown['score']:.3f}  ")
            body = Text(printable(shown["text"], lines=True) if shown["text"] is not None
                        else f"(chunk {shown['chunk']}: no text kept)")
            if terms:
                body.highlight_regex(words, HIGHLIGHT)
            console.print(line + body)
        if row["summary"]:
            console.print(Text(f"    summary: {printable(row['summary'], lines=True)}", style="dim"))
