"""Configuration: one TOML file, a default for every key, errors that name the file and the key.

Each section is a frozen dataclass; the loader walks the dataclass fields, so the defaults, the
accepted types and the allowed values live in one place and `config show` prints exactly them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tomllib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import platformdirs

from npumoe.engine.vocabulary import (
    AUTO,
    BACKENDS,
    CHUNK_TOKENS,
    COMPUTE_UNITS,
    CPU,
    DEFAULT_COMPUTE_UNITS,
    DTYPE_WEIGHTS,
    DTYPES,
    MEAN,
    MEASURED,
    OVERFLOW_POLICIES,
    POOLINGS,
    RESIDENCY_POLICIES,
    SPILL,
    SUMMARY_TOKENS,
    WEIGHTS,
    weights_with_dtype,
)
from npumoe.jobs.files import KEEP, ORIGINALS

WINDOW = re.compile(r"^([01]\d|2[0-3]):[0-5]\d-([01]\d|2[0-3]):[0-5]\d$")
QUEUE_URL = re.compile(r"^(postgresql(\+psycopg)?://.*)?$")
# A URL parameter whose name holds one of these carries a secret (libpq: password, sslpassword).
SECRET_WORDS = ("password", "secret", "token")

log = logging.getLogger(__name__)


def choice(default: str, allowed: Sequence[str], note: str = "") -> Any:
    """A key that takes one of `allowed`, `default` when the file leaves it out; `note`: what `config show` says
    beside it."""
    return field(default=default, metadata={"choices": tuple(allowed), **({"note": note} if note else {})})


def positive(default: float) -> Any:
    return field(default=default, metadata={"min": 0})


@dataclass(frozen=True)
class InboxConfig:
    folders: list[str] = field(default_factory=list)  # empty: <home>/inbox
    recursive: bool = True
    stable_seconds: float = positive(2.0)  # size and mtime unchanged this long before a file is queued
    rescan_seconds: float = positive(60.0)  # full rescan backs up the event watcher, which can miss events
    polling: bool = False  # a polling observer, for network shares where events do not arrive
    originals: str = choice(KEEP, ORIGINALS)  # what happens to a document once processed



@dataclass(frozen=True)
class ModelConfig:
    name: str = "demo"  # "demo" (SmolLM2-135M-Instruct made an 8-expert MoE), a local folder, or a Hugging Face id
    backend: str = choice(CPU, BACKENDS)
    plan: str = ""  # an ExpertPlan JSON; empty: exact CPU experts
    coreml_compute_units: str = choice(DEFAULT_COMPUTE_UNITS, COMPUTE_UNITS)
    chunk_tokens: int = positive(CHUNK_TOKENS)  # prefill chunk length; 0: the length measured fastest here (at load)
    overflow: str = choice(SPILL, OVERFLOW_POLICIES)
    # measured: a static backend runs a group on its accelerator where that costs less here; accelerator: every
    # group it can build, whatever the costs say (to run and see the planned path on any machine)
    residency: str = choice(MEASURED, RESIDENCY_POLICIES)
    # What the weights run in, the one key for it: auto (the fastest float dtype measured here that fits memory, else
    # the smallest format that does), fp32, bf16, int8 or int4 (the experts quantized, the rest bf16)
    weights: str = choice(AUTO, WEIGHTS, note="auto | fp32 | bf16 | int8 | int4; auto: chosen at load, "
                                                       "`npumoed doctor` says what and why")
    # Deprecated, from before `weights`: float32 or bfloat16 alone reads as weights fp32 or bf16; "" is unset
    dtype: str = choice("", ("", *DTYPES), note="deprecated: weights decides the dtype")
    summary_tokens: int = positive(SUMMARY_TOKENS)
    section_tokens: int = positive(0)  # longest section summarised on its own; 0: as long as the context allows
    trust_remote_code: bool = False
    allow_download: bool = False  # the only setting that lets the daemon reach the network
    idle_unload_seconds: float = positive(300.0)
    # How search vectors are made from the prefill: mean (over each chunk's tokens), last (token), or prompt
    # (PromptEOL: each chunk prefilled again in a prompt asking for one word; twice the prefill)
    pooling: str = choice(MEAN, POOLINGS)

    @property
    def plan_chunk_tokens(self) -> int:
        """The chunk length a plan is calibrated at: a plan's chunks are fixed, so a measured length (0) takes
        the engine's default."""
        return self.chunk_tokens or CHUNK_TOKENS


@dataclass(frozen=True)
class ExtractConfig:
    timeout_seconds: float = positive(60.0)
    memory_mb: int = positive(1024)
    max_mb: float = positive(100.0)


def matching(default: str, pattern: re.Pattern[str], words: str, *, secret_url: bool = False) -> Any:
    """A string key that must match `pattern`; `words` say how, in the error. `secret_url`: a URL whose password
    `Config.shown` hides."""
    return field(default=default, metadata={"pattern": pattern, "words": words, "secret_url": secret_url})


def redacted_url(url: str) -> str:
    """`url` with its password, in the user part or in any parameter that can carry a secret (`password`,
    libpq's `sslpassword`, …), shown as `***`. Paths to key and password files stay: they say where, not what."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:***@{host}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = urlencode([(k, "***" if _names_a_secret(k) else v) for k, v in pairs], safe="*/")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _names_a_secret(key: str) -> bool:
    return any(word in key.lower() for word in SECRET_WORDS)


@dataclass(frozen=True)
class QueueConfig:
    # empty: the SQLite file in the home; postgresql://user@server/db: a queue several machines share
    url: str = matching("", QUEUE_URL, "be empty or a postgresql://… URL", secret_url=True)
    max_attempts: int = positive(3)
    lease_seconds: float = positive(120.0)
    retry_base_seconds: float = positive(30.0)
    retry_max_seconds: float = positive(3600.0)
    # A running job whose progress has not moved this long is stopped and retried (0: never). Longer than
    # the slowest chunk or summary step: a model loading does not count.
    stall_seconds: float = positive(900.0)
    # On a shared queue: folders every machine mounts at the same path. A document anywhere else is pinned to
    # the machine that queued it, since no other machine can read it there (or reads another file by that name).
    shared_folders: list[str] = field(default_factory=list)

    def is_shared(self, path: Path) -> bool:
        """Whether `path` (absolute, its folder resolved) lies in one of the shared folders."""
        return any(path.is_relative_to(Path(folder).expanduser().resolve()) for folder in self.shared_folders)


@dataclass(frozen=True)
class SchedulerConfig:
    run_on_battery: bool = False
    min_battery_percent: int = positive(50)  # below this, wait even when running on battery is allowed
    respect_low_power_mode: bool = True
    respect_thermal_pressure: bool = True
    max_foreground_load: float = positive(0.75)  # fraction of all cores busy with other processes
    # local time; jobs queued with `npumoed batch` run only inside it
    batch_window: str = matching("01:00-06:00", WINDOW, "look like HH:MM-HH:MM")
    batch_requires_ac: bool = True
    poll_seconds: float = positive(5.0)


@dataclass(frozen=True)
class CpuConfig:
    threads: int = positive(0)  # torch threads for the worker; 0: all cores but one
    background_priority: bool = True  # nice 19 + SCHED_IDLE + idle I/O on Linux, background QoS on macOS


@dataclass(frozen=True)
class OutboxConfig:
    folder: str = ""  # empty: <home>/outbox; else a folder (on storage all machines share) for every output


@dataclass(frozen=True)
class Config:
    inbox: InboxConfig = field(default_factory=InboxConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    outbox: OutboxConfig = field(default_factory=OutboxConfig)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def shown(self) -> dict[str, dict[str, Any]]:
        """`as_dict` as it may be printed: the passwords in URLs hidden."""
        shown = self.as_dict()
        for section in dataclasses.fields(self):
            for key in dataclasses.fields(getattr(self, section.name)):
                if key.metadata.get("secret_url"):
                    shown[section.name][key.name] = redacted_url(shown[section.name][key.name])
        return shown

    def notes(self) -> dict[str, dict[str, str]]:
        """What `config show` says beside some keys, by section and key."""
        return {section.name: {f.name: f.metadata["note"] for f in dataclasses.fields(getattr(self, section.name))
                               if "note" in f.metadata}
                for section in dataclasses.fields(self)}


class ConfigError(Exception):
    """An invalid config file; the message names the file and the key."""


def home_dir() -> Path:
    """The one folder that holds all state: NPUMOED_HOME, else the platform's data dir."""
    env = os.environ.get("NPUMOED_HOME")
    return Path(env).expanduser().resolve() if env else Path(platformdirs.user_data_dir("npumoed"))


def default_config_path() -> Path:
    return home_dir() / "config.toml"


def load_config(path: Path | None = None) -> Config:
    """Read `path` (or the home's config.toml when it exists); defaults fill every missing key."""
    explicit = path is not None
    path = path or default_config_path()
    if not path.exists():
        if explicit:
            raise ConfigError(f"{path}: no such file")
        return Config()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    return _build(Config, raw, path, "")


def _build(cls: type, raw: Any, path: Path, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: [{where}] must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            known = ", ".join(fields)
            raise ConfigError(f"{path}: unknown key '{_join(where, key)}' (known: {known})")
    values = {}
    if cls is ModelConfig:
        raw = _legacy_dtype(raw, path)
    for key, value in raw.items():
        name = _join(where, key)
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            values[key] = _build(kind, value, path, name)
        else:
            values[key] = _check(kind, value, fields[key].metadata, path, name)
    return cls(**values)


def _legacy_dtype(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """[model] with a `dtype` from before `weights` decided it folded in: dtype alone pins weights to its float
    format (with a warning to write that instead); beside a weights whose float dtype differs it is an error."""
    dtype, weights = raw.get("dtype", ""), raw.get("weights", AUTO)
    if dtype not in DTYPE_WEIGHTS or weights not in WEIGHTS:
        return raw  # nothing to fold, or a value _check names
    try:
        pinned = weights_with_dtype(weights, dtype)
    except ValueError as e:
        raise ConfigError(f"{path}: [model] {e}; dtype is deprecated: remove it, weights decides") from None
    if weights == AUTO:
        log.warning('%s: [model] dtype is deprecated: weights decides the dtype; dtype = "%s" reads as weights = '
                    '"%s" (write that instead, or remove dtype to let the machine choose)', path, dtype, pinned)
    else:
        log.warning("%s: [model] dtype is deprecated and says nothing weights does not: remove it", path)
    return {**raw, "weights": pinned, "dtype": ""}


def _check(kind: Any, value: Any, meta: Any, path: Path, name: str) -> Any:
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if typing.get_origin(kind) is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: '{name}' must be a list of strings")
        return value
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(f"{path}: '{name}' must be {expected[kind]}, got {value!r}")
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{path}: '{name}' must be one of {', '.join(meta['choices'])}, got {value!r}")
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"{path}: '{name}' must not be negative, got {value!r}")
    if "pattern" in meta and not meta["pattern"].match(value):
        raise ConfigError(f"{path}: '{name}' must {meta['words']}, got {value!r}")
    return value


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
