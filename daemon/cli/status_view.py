"""`npumoed status`: what the daemon is doing and why, read from the queue without writing to it.

`snapshot` gathers everything into one JSON-ready dict (that is `--json`); `render_rich` and
`render_text` draw the same dict for a terminal and for pipes and logs. `workers` lists every daemon on the
queue: on a shared queue, one per home on each machine, each with its heartbeat and what it is doing.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from npumoe.engine.vocabulary import PREFILL, REDUCE, SUMMARY
from npumoe.jobs.queue.schema import DEAD, DONE, FAILED, RUNNING
from npumoe.jobs.queue.store import Job, Queue, pid_alive

from .terminal import printable

STALE_SECONDS = 30.0  # a working daemon whose heartbeat is older than this is reported as not responding
RECENT = 5
STEPS = {PREFILL: "chunks", SUMMARY: "sections", REDUCE: "parts"}  # what the engine counts in each phase


def snapshot(queue: Queue, *, now: float | None = None, recent: int = RECENT) -> dict[str, Any]:
    now = time.time() if now is None else now
    daemon = _daemon(queue.daemons.read(), now)
    current = queue.get(daemon["current_job"]) if daemon.get("current_job") else None
    failures = sorted(
        queue.list(DEAD, recent, newest_first=True) + queue.list(FAILED, recent, newest_first=True),
        key=lambda j: j.updated_at,
        reverse=True,
    )[:recent]
    return {
        "daemon": daemon,
        "workers": [_worker(row, queue, now) for row in queue.daemons.all()],
        "queue": queue.counts(),
        "current": _current(current) if current is not None and current.state == RUNNING else None,
        "recent_done": [
            {"id": j.id, "path": j.path, "finished_at": j.finished_at, "output_dir": j.output_dir}
            for j in queue.list(DONE, recent, newest_first=True)
        ],
        "recent_failures": [
            {
                "id": j.id,
                "path": j.path,
                "state": j.state,
                "kind": j.error_kind,
                "reason": j.last_error,
                "at": j.updated_at,
                "retry_at": j.run_after if j.state == FAILED else None,
            }
            for j in failures
        ],
    }


def _worker(row: dict[str, Any], queue: Queue, now: float) -> dict[str, Any]:
    """One daemon's line: its identity, state and heartbeat, and the job it works on."""
    local = row["host"] in (None, queue.host)
    summary = _daemon(row, now, local=local)
    job = queue.get(summary["current_job"]) if summary["current_job"] else None
    return {
        "host": row["host"],
        "home": row["home"],
        **{key: summary[key] for key in ("state", "pid", "started_at", "heartbeat_age_s", "activity", "reason")},
        "done": summary["counters"].get("done", 0),
        "job": {"id": job.id, "path": job.path, "progress": job.progress} if job and job.state == RUNNING else None,
    }


def _daemon(row: dict[str, Any] | None, now: float, *, local: bool = True) -> dict[str, Any]:
    """A daemon's state; only on its own machine can its pid be asked after, elsewhere its heartbeat tells."""
    if row is None:
        return {"state": "never started"}
    state = "running"
    if row["stopped_at"] is not None:
        state = "stopped"
    elif local and (not row["pid"] or not pid_alive(row["pid"])):
        state = "stopped"  # killed without a clean stop; the next start requeues its job
    elif row["activity"] == "working" and now - (row["heartbeat_at"] or 0) > STALE_SECONDS:
        state = "not responding"  # only a running job renews the heartbeat: idle, the daemon writes nothing
    running = state != "stopped"
    return {
        "state": state,
        "pid": row["pid"],
        "started_at": row["started_at"],
        "uptime_s": round(now - row["started_at"], 1) if running and row["started_at"] else None,
        "stopped_at": row["stopped_at"],
        "heartbeat_age_s": round(now - row["heartbeat_at"], 1) if row["heartbeat_at"] else None,
        "activity": row["activity"] if running else "stopped",
        "reason": row["reason"] if running else "",
        "current_job": row["current_job"] if running else None,
        "model": row["model"],
        "backend": row["backend"],
        "power": row["power"],
        "counters": row["counters"] or {},
    }


def _current(job: Job) -> dict[str, Any]:
    detail = job.as_dict()["detail"] or {}
    return {
        "id": job.id,
        "path": job.path,
        "attempt": job.attempts,
        "progress": job.progress,
        "started_at": job.heartbeat_at,
        **detail,
    }


# -- drawing --------------------------------------------------------------------------------------------


def render_text(snap: dict[str, Any]) -> str:
    """Plain lines, for pipes and logs."""
    lines = [_headline(snap["daemon"])]
    if why := _why_waiting(snap):
        lines.append(f"waiting: {why}")
    if awake := _awake(snap["daemon"]):
        lines.append(awake)
    if (current := snap["current"]) is not None:
        lines.append(f"working on #{current['id']} {printable(current['path'])}")
        lines.append(f"  {_progress_words(current)}")
    lines.append("queue: " + ", ".join(f"{n} {state}" for state, n in snap["queue"].items()))
    lines.extend(_worker_lines(snap))
    lines.extend(_recent_lines(snap))
    return "\n".join(lines)


def render_rich(snap: dict[str, Any]) -> RenderableType:
    """The same facts for a terminal: colour, and a progress bar for the running document."""
    daemon = snap["daemon"]
    colour = {"running": "green", "not responding": "yellow"}.get(daemon["state"], "red")
    parts: list[RenderableType] = [Text.assemble(("● ", colour), _headline(daemon))]
    if why := _why_waiting(snap):
        parts.append(Text.assemble(("waiting: ", "yellow"), why))
    if awake := _awake(snap["daemon"]):
        parts.append(Text(awake))
    if (current := snap["current"]) is not None:
        parts.append(Text(f"working on #{current['id']} {printable(current['path'])}", style="bold"))
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            ProgressBar(total=1.0, completed=current["progress"], width=30),
            _progress_words(current),
        )
        parts.append(bar)
    queue = Table.grid(padding=(0, 2))
    styles = {RUNNING: "cyan", DONE: "green", FAILED: "yellow", DEAD: "red"}
    queue.add_row(
        *(Text(f"{n} {state}", style=styles.get(state, "") if n else "dim") for state, n in snap["queue"].items())
    )
    parts.append(Text("queue", style="bold"))
    parts.append(queue)
    if workers := _worker_lines(snap):
        parts.append(Text("\n".join(workers)))
    if recent := _recent_lines(snap):
        parts.append(Text("\n".join(recent)))
    return Group(*parts)


def _headline(daemon: dict[str, Any]) -> str:
    state = daemon["state"]
    if state == "never started":
        return "npumoed has not run in this home yet"
    words = [f"npumoed {state}"]
    if state != "stopped":
        words.append(f"pid {daemon['pid']}")
        if daemon["uptime_s"] is not None:
            words.append(f"up {_duration(daemon['uptime_s'])}")
        words.append(daemon["activity"] or "")
    elif daemon["stopped_at"]:
        words.append(f"since {_clock(daemon['stopped_at'])}")
    loaded = " (loaded)" if daemon["counters"].get("model_loaded") else ""
    words.append(f"model {daemon['model']}{loaded} on {daemon['backend']}")
    return " · ".join(w for w in words if w)


def _why_waiting(snap: dict[str, Any]) -> str:
    daemon = snap["daemon"]
    if daemon["state"] == "never started" or not daemon["reason"]:
        return ""
    return printable(daemon["reason"])  # it can quote a folder's name


def _awake(daemon: dict[str, Any]) -> str:
    holding = (daemon.get("power") or {}).get("awake") if daemon["state"] == "running" else None
    return f"keeping the computer awake: {holding}" if holding else ""


def _progress_words(current: dict[str, Any]) -> str:
    phase = current.get("phase") or "starting"
    words = [f"{current['progress']:.0%}", phase]
    if current.get("steps"):
        words[-1] += f" {current['step']}/{current['steps']} {STEPS.get(phase, 'steps')}"
    if current.get("tokens_total"):
        words.append(f"{current['tokens_done']:,}/{current['tokens_total']:,} tokens")
    if current.get("tokens_per_s"):
        words.append(f"{current['tokens_per_s']:,.0f} tok/s")
    if current.get("eta_s") is not None:
        words.append(f"ETA {_duration(current['eta_s'])}")
    return " · ".join(words)


def _worker_lines(snap: dict[str, Any]) -> list[str]:
    """Every worker on the queue, when there is more than this home's own daemon to show."""
    workers = snap.get("workers", [])
    if len(workers) < 2:
        return []
    lines = ["workers:"]
    for w in workers:
        words = [f"{w['host']} {printable(w['home'] or '')}", f"pid {w['pid']}", w["state"]]
        if w["state"] != "stopped":
            words.append(w["activity"] or "")
            if w["heartbeat_age_s"] is not None:
                words.append(f"heartbeat {_duration(w['heartbeat_age_s'])} ago")
        if w["job"]:
            words.append(f"#{w['job']['id']} {printable(Path(w['job']['path']).name)} {w['job']['progress']:.0%}")
        words.append(f"{w['done']} done")
        lines.append("  " + " · ".join(word for word in words if word))
    return lines


def _recent_lines(snap: dict[str, Any]) -> list[str]:
    lines = []
    if snap["recent_done"]:
        lines.append("recently done:")
        lines.extend(
            f"  #{j['id']} {printable(Path(j['path']).name)} → {printable(j['output_dir'])} "
            f"({_clock(j['finished_at'])})"
            for j in snap["recent_done"]
        )
    if snap["recent_failures"]:
        lines.append("recent failures:")
        for j in snap["recent_failures"]:
            retry = f", retry at {_clock(j['retry_at'])}" if j["retry_at"] else ""
            lines.append(
                f"  #{j['id']} {printable(Path(j['path']).name)}: {j['state']} ({j['kind']}{retry}): "
                f"{printable(j['reason'] or '')}"
            )
    if rejected := snap["daemon"].get("counters", {}).get("rejected"):
        lines.append(f"{rejected} file(s) in the inbox could not be queued; see failed/*.error.txt")
    return lines


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _clock(timestamp: float | None) -> str:
    return datetime.fromtimestamp(timestamp).strftime("%H:%M:%S") if timestamp else "?"
