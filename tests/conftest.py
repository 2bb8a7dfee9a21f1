"""Fixtures every test area shares: a private home, the `npumoed` command in a subprocess, a tiny model."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.demo_run import DemoRun, process_samples
from support.postgres_server import PostgresServer

from npumoe.engine.synthetic.smollm2 import models_cache
from npumoe.jobs.search.sentence_model import NAME as SEARCH_MODEL_NAME

# The models cache `make setup` filled (the demo model), read before the run points NPUMOE_MODELS elsewhere. xdist's
# workers start after that, with the run's environment: the run passes them the folder (pytest_configure).
SETUP_MODELS_VARIABLE = "NPUMOE_TEST_SETUP_MODELS"
SETUP_MODELS = Path(os.environ.get(SETUP_MODELS_VARIABLE) or models_cache())


def pytest_configure(config: pytest.Config) -> None:
    """Compiled kernels go to a folder of this run's, not the user's cache; set before collection, which
    asks whether the kernel builds, and inherited by every child process. Likewise an empty models cache: no
    test sees the demo model `make setup` made unless it asks for it (`demo_run`); but every test sees the search
    model setup fetched, as indexing a done document embeds its passages with it."""
    os.environ.setdefault(SETUP_MODELS_VARIABLE, str(SETUP_MODELS))  # for the workers
    os.environ["NPUMOE_CACHE"] = tempfile.mkdtemp(prefix="npumoe-test-cache-")
    os.environ["NPUMOE_MODELS"] = tempfile.mkdtemp(prefix="npumoe-test-models-")
    search_model = Path(os.environ["NPUMOE_MODELS"]) / SEARCH_MODEL_NAME
    search_model.symlink_to(SETUP_MODELS / SEARCH_MODEL_NAME, target_is_directory=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test's own timeout mark is a floor, not a ceiling: a run given a longer `--timeout` (make test-arm64's,
    under emulation) gives it to every test."""
    run_timeout = float(config.getoption("timeout", None) or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        if mark is not None and mark.args and float(mark.args[0]) < run_timeout:
            item.add_marker(pytest.mark.timeout(run_timeout))


def pytest_unconfigure(config: pytest.Config) -> None:
    os.environ.pop(SETUP_MODELS_VARIABLE, None)
    for variable in ("NPUMOE_CACHE", "NPUMOE_MODELS"):
        shutil.rmtree(os.environ.pop(variable, ""), ignore_errors=True)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty NPUMOED_HOME, set in this process's environment (and so in every child's)."""
    root = tmp_path / "home"
    monkeypatch.setenv("NPUMOED_HOME", str(root))
    return root


# Starts npumoed with SIGINT at its default, as a terminal's shell does. A child inherits an ignored SIGINT, and in
# some full-suite runs the child of this process had SIGINT and SIGQUIT ignored, the pair that glibc's system()
# ignores process-wide while any thread is inside it (libtorch_cpu links it): a status --watch started then printed
# on for 30 s after its SIGINT.
_AS_FROM_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "os.execv(sys.executable, [sys.executable, '-m', 'npumoe.daemon', *sys.argv[1:]])")


def npumoed_argv(*args: str, terminal: bool = False) -> list[str]:
    """`npumoed ARGS…` with this interpreter (the console script may not be on PATH); with `terminal`, SIGINT at
    its default whatever this process does with it at the moment (Ctrl-C reaches it as it would a person's)."""
    if terminal:
        return [sys.executable, "-c", _AS_FROM_A_TERMINAL, *args]
    return [sys.executable, "-m", "npumoe.daemon", *args]


@pytest.fixture
def npumoed(home: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `npumoed ARGS…` on the test's home to completion: `npumoed("status", "--json")`."""

    def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(npumoed_argv(*args), capture_output=True, text=True, timeout=timeout)

    return run


@dataclass
class Background:
    """An `npumoed` process started by a test; everything it prints goes to `log`."""

    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def start_npumoed(home: Path, tmp_path: Path) -> Iterator[Callable[..., Background]]:
    """Start `npumoed ARGS…` in the background; whatever is still running when the test ends is killed."""
    started: list[Background] = []

    def start(*args: str, terminal: bool = False) -> Background:
        log = tmp_path / f"npumoed-{len(started)}.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(npumoed_argv(*args, terminal=terminal), stdout=sink, stderr=subprocess.STDOUT)
        started.append(Background(process, log))
        return started[-1]

    yield start
    for background in started:
        if background.process.poll() is None:
            os.kill(background.process.pid, signal.SIGKILL)
            background.process.wait(timeout=30)


@pytest.fixture
def configure(home: Path) -> Callable[[str], Path]:
    """Write the home's config.toml: `configure("[model]\\nname = ...")`."""

    def write(toml: str) -> Path:
        home.mkdir(parents=True, exist_ok=True)
        path = home / "config.toml"
        path.write_text(toml)
        return path

    return write


def poll(condition: Callable[[], object], timeout: float = 60.0, interval: float = 0.1) -> bool:
    """Whether `condition()` became true within `timeout` seconds (a bound for waiting, not a timing claim)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())


@pytest.fixture
def wait_for() -> Callable[..., bool]:
    """`wait_for(condition, timeout=60)`: poll until the condition holds; False if it never did."""
    return poll


TEXTS = Path(__file__).parent / "texts"


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: one thread avoids oversubscription stalls."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One real PostgreSQL server for the whole session, started when a test first asks for it; each test
    takes a fresh database of it with `postgres.new_database()`."""
    server = PostgresServer.start_new()
    yield server
    server.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def queue_location(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """Where a test's queue lives, once per dialect: a fresh SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "q.db"
    return request.getfixturevalue("postgres").new_database()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny(arch, seed=0): the folder of a tiny checkpoint, written once per session."""
    from npumoe.engine.synthetic.tiny import make_tiny

    made: dict[tuple[str, int], Path] = {}

    def get(arch: str, seed: int = 0) -> Path:
        if (arch, seed) not in made:
            made[arch, seed] = make_tiny(arch, tmp_path_factory.mktemp(f"{arch}-{seed}") / "model", seed=seed)
        return made[arch, seed]

    return get


@pytest.fixture(scope="session")
def tiny_model(tiny: Callable[..., Path]) -> Path:
    """The demo architecture (tiny random-weight Qwen3-MoE), made once per test session."""
    return tiny("qwen3_moe")


@pytest.fixture(scope="session")
def tiny_gguf(tiny: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_gguf(arch, type_name="Q8_0"): a tiny checkpoint of `arch` written as a GGUF file, every 2-D weight in
    that GGUF type (gguf_writer.py), once per session."""
    import gguf

    from npumoe.engine.synthetic.gguf_writer import write_gguf

    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, type_name: str = "Q8_0") -> Path:
        if (arch, type_name) not in made:
            qtype = gguf.GGMLQuantizationType[type_name]
            out = tmp_path_factory.mktemp(f"{arch}-{type_name}") / f"{arch}-{type_name}.gguf"
            made[arch, type_name] = write_gguf(tiny(arch), out, experts=qtype, weights=qtype)
        return made[arch, type_name]

    return get


@pytest.fixture(scope="session")
def demo_run() -> DemoRun:
    """The demo model's engine and its results on the six samples, made once per session (demo_run.py), from
    the models cache `make setup` filled."""
    return process_samples(SETUP_MODELS)


@pytest.fixture(scope="session")
def harbour() -> str:
    return (TEXTS / "harbour.txt").read_text()


@pytest.fixture(scope="session")
def orchard() -> str:
    return (TEXTS / "orchard.txt").read_text()
