"""The background service: described once, rendered to a LaunchAgent (macOS) or a systemd --user unit.

The templates live in `launchd/` as data. Installing is a short list of steps (write a file, run a
command), so `--dry-run` can print exactly what a real install would do.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape

from npumoe.jobs.outputs import write_file

from .home import Home

LABEL = "io.npumoed.daemon"
UNIT = "npumoed.service"
TEMPLATES = resources.files("npumoe.launchd")
# The exit status of a daemon that restarting cannot help (its database is damaged or from a newer npumoed):
# EX_CONFIG of sysexits(3). systemd is told not to restart on it; launchd cannot exempt a status, so it
# restarts after every exit but 0, at most once a ThrottleInterval.
EXIT_DO_NOT_RESTART = 78
SERVICE_ENV = "NPUMOED_SERVICE"  # set in the service definitions: the daemon logs to its rotating file only
# Where the person's models and caches are: passed on to the service when set at install time.
PASSED_ON = ("HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "NPUMOE_CACHE")


class ServiceError(RuntimeError):
    """Installing, removing or asking about the service failed; the message says which step."""


@dataclass(frozen=True)
class Service:
    """What runs and how, independent of the service manager."""

    program: tuple[str, ...]  # the absolute interpreter first
    home: Path
    passed_on: tuple[tuple[str, str], ...] = ()  # (name, value) of PASSED_ON variables set at install time
    nice: int = 19
    throttle_seconds: int = 30
    stop_timeout_seconds: int = 30

    @classmethod
    def for_home(cls, home: Home, config_path: Path | None = None) -> Service:
        """`python -m npumoe.daemon [--config FILE] run` with this very interpreter, for this home."""
        program = [sys.executable, "-m", "npumoe.daemon"]
        if config_path is not None:
            program += ["--config", str(config_path.expanduser().resolve())]
        passed_on = tuple((name, os.environ[name]) for name in PASSED_ON if os.environ.get(name))
        return cls(program=(*program, "run"), home=home.root, passed_on=passed_on)

    @property
    def environment(self) -> dict[str, str]:
        # The home is pinned, so the service uses the home that was current at install time.
        return {"NPUMOED_HOME": str(self.home), "PYTHONUNBUFFERED": "1", SERVICE_ENV: "1", **dict(self.passed_on)}

    @property
    def stdout_log(self) -> Path:
        return Home(self.home).logs / "service.out.log"

    @property
    def stderr_log(self) -> Path:
        return Home(self.home).logs / "service.err.log"


# -- steps ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Write:
    path: Path
    text: str


@dataclass(frozen=True)
class Remove:
    path: Path


@dataclass(frozen=True)
class Run:
    argv: tuple[str, ...]
    must_succeed: bool = True  # False: failing is expected (stopping a service that is not running)


Step = Write | Remove | Run
Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


def describe(step: Step) -> str:
    if isinstance(step, Write):
        return f"write {step.path}:\n" + "\n".join(f"    {line}" for line in step.text.splitlines())
    if isinstance(step, Remove):
        return f"remove {step.path}"
    return "run " + shlex.join(step.argv) + ("" if step.must_succeed else "  (may fail: not running)")


def started_by_service() -> bool:
    return os.environ.get(SERVICE_ENV) == "1"


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(argv), 124, "", f"{argv[0]}: no answer within 60 s")


def carry_out(steps: Sequence[Step], run: Runner = run_command) -> None:
    """Do the steps in order; the first command that must succeed and fails stops with its message."""
    for step in steps:
        if isinstance(step, Write):
            step.path.parent.mkdir(parents=True, exist_ok=True)
            write_file(step.path, step.text.encode("utf-8"), mode=0o644)
        elif isinstance(step, Remove):
            step.path.unlink(missing_ok=True)
        else:
            result = run(step.argv)
            if result.returncode != 0 and step.must_succeed:
                said = (result.stderr or result.stdout).strip() or f"exit status {result.returncode}"
                raise ServiceError(f"`{shlex.join(step.argv)}` failed: {said}")


def _template(name: str) -> Template:
    path = TEMPLATES / name
    try:
        return Template(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ServiceError(f"service template {path} cannot be read ({e.strerror}); "
                           "this install of npumoed lacks its launchd/ folder") from e


# -- macOS: launchd ---------------------------------------------------------------------------------

class Launchd:
    name = "launchd"

    def __init__(self, agents: Path | None = None, uid: int | None = None) -> None:
        self.agents = agents or Path.home() / "Library" / "LaunchAgents"
        self.domain = f"gui/{os.getuid() if uid is None else uid}"

    @property
    def path(self) -> Path:
        return self.agents / f"{LABEL}.plist"

    def render(self, service: Service) -> str:
        def string(value: object) -> str:
            return f"<string>{escape(str(value))}</string>"

        return _template(f"{LABEL}.plist").substitute(
            label=escape(LABEL),
            program_arguments="\n".join(f"    {string(arg)}" for arg in service.program),
            environment="\n".join(f"    <key>{escape(k)}</key>\n    {string(v)}"
                                  for k, v in service.environment.items()),
            working_directory=escape(str(service.home)), nice=service.nice,
            throttle_seconds=service.throttle_seconds, stop_timeout_seconds=service.stop_timeout_seconds,
            stdout_log=escape(str(service.stdout_log)), stderr_log=escape(str(service.stderr_log)))

    def install(self, service: Service) -> list[Step]:
        # bootstrap refuses a label that is already loaded, so an older copy is booted out first.
        return [Write(self.path, self.render(service)),
                Run(("launchctl", "bootout", f"{self.domain}/{LABEL}"), must_succeed=False),
                Run(("launchctl", "bootstrap", self.domain, str(self.path)))]

    def uninstall(self) -> list[Step]:
        return [Run(("launchctl", "bootout", f"{self.domain}/{LABEL}"), must_succeed=False), Remove(self.path)]

    def state(self, run: Runner = run_command) -> str:
        if not self.path.exists():
            return "not installed"
        result = run(("launchctl", "print", f"{self.domain}/{LABEL}"))
        if result.returncode != 0:
            return f"installed at {self.path}, not loaded"
        state = re.search(r"^\s*state = (\S+)", result.stdout, re.MULTILINE)
        pid = re.search(r"^\s*pid = (\d+)", result.stdout, re.MULTILINE)
        return f"installed, {state.group(1) if state else 'loaded'}" + (f" (pid {pid.group(1)})" if pid else "")


# -- Linux: systemd --user --------------------------------------------------------------------------

class SystemdUser:
    name = "systemd --user"

    def __init__(self, units: Path | None = None) -> None:
        config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        self.units = units or config / "systemd" / "user"

    @property
    def path(self) -> Path:
        return self.units / UNIT

    def render(self, service: Service) -> str:
        return _template(UNIT).substitute(
            exec_start=" ".join(_systemd_quote(arg, command=True) for arg in service.program),
            environment="\n".join(f"Environment={_systemd_quote(f'{k}={v}')}"
                                  for k, v in service.environment.items()),
            working_directory=_systemd_path(service.home), nice=service.nice,
            throttle_seconds=service.throttle_seconds, stop_timeout_seconds=service.stop_timeout_seconds,
            stdout_log=_systemd_path(service.stdout_log), stderr_log=_systemd_path(service.stderr_log),
            do_not_restart=EXIT_DO_NOT_RESTART)

    def install(self, service: Service) -> list[Step]:
        return [Write(self.path, self.render(service)),
                Run(("systemctl", "--user", "daemon-reload")),
                Run(("systemctl", "--user", "enable", UNIT)),
                Run(("systemctl", "--user", "restart", UNIT))]

    def uninstall(self) -> list[Step]:
        return [Run(("systemctl", "--user", "disable", "--now", UNIT), must_succeed=False),
                Remove(self.path),
                Run(("systemctl", "--user", "daemon-reload"))]

    def state(self, run: Runner = run_command) -> str:
        if not self.path.exists():
            return "not installed"
        result = run(("systemctl", "--user", "is-active", UNIT))
        answer = result.stdout.strip()
        if answer:
            return f"installed, {answer}"
        said = result.stderr.strip() or f"exit status {result.returncode}"
        return f"installed at {self.path}; state unknown: {said}"


def lingering(user: str, linger_dir: Path = Path("/var/lib/systemd/linger")) -> bool:
    """Whether logind keeps `user`'s systemd --user services running after they log out
    (`loginctl enable-linger` makes the file this reads)."""
    return (linger_dir / user).exists()


def _systemd_quote(arg: str, *, command: bool = False) -> str:
    """One quoted word, with systemd's specifiers (%) escaped, and its variables ($) too in a command line."""
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return '"' + (escaped.replace("$", "$$") if command else escaped) + '"'


def _systemd_path(path: Path) -> str:
    if any(c in str(path) for c in "\n\\"):
        raise ServiceError(f"{path}: a path with a newline or backslash cannot go into a systemd unit")
    return str(path).replace("%", "%%")


ServiceManager = Launchd | SystemdUser


def service_manager(platform: str = sys.platform) -> ServiceManager:
    if platform == "darwin":
        return Launchd()
    if platform.startswith("linux"):
        return SystemdUser()
    raise ServiceError(f"no service manager support on {platform}; run `npumoed run` in a terminal instead")
