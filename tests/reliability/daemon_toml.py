"""The config.toml of the daemons these tests start: quick to notice files, tolerant of a shared machine."""

from __future__ import annotations


def daemon_toml(model: str, *, originals: str = "keep", max_attempts: int = 3, background: bool = False,
                queue_url: str = "", outbox: str = "") -> str:
    """A config whose [model] section holds the `model` lines (`name = "…"` and any others); `queue_url` and
    `outbox` for a daemon on a shared queue, writing to a shared outbox.

    The scheduler ignores other processes' load (other test runs share these cores; their load is not what
    the tests are about), and unless `background`, the daemon does not lower its own priority, since at
    SCHED_IDLE on a busy shared machine it could starve.
    """
    return f"""
[inbox]
stable_seconds = 0.3
rescan_seconds = 5
originals = "{originals}"

[model]
{model}

[queue]
url = "{queue_url}"
max_attempts = {max_attempts}
retry_base_seconds = 1

[outbox]
folder = "{outbox}"

[scheduler]
max_foreground_load = 1.0
poll_seconds = 0.3

[cpu]
threads = 1
background_priority = {str(background).lower()}
"""
