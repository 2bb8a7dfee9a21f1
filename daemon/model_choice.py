"""Which model the daemon runs, and holding it: loaded on first use, unloaded after an idle spell.

`[model] name` is "demo" (SmolLM2-135M-Instruct upcycled into an 8-expert top-1 Mixtral-class MoE, made once in the
models cache from the GGUF file setup fetched), a local checkpoint folder, or a Hugging Face id that the engine
looks up in the local HF cache (downloading only when `allow_download` is set).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

from npumoe.engine.vocabulary import AUTO, COREML, FP32
from npumoe.jobs.errors import ModelUnavailable
from npumoe.jobs.outputs import temporary_path

from .config import Config
from .home import Home

if TYPE_CHECKING:
    from npumoe.engine import Engine, EngineSettings

log = logging.getLogger(__name__)

DEMO = "demo"
DEMO_BUILD = "demo-smollm2-135m-moe-8x1-bf16-v2"  # a new name whenever the recipe changes: no old build is reused
# A 135M model summarises a page or two well and loses the thread over its whole 8k context; short sections also keep
# attention, which grows with the section, cheap. Wherever the demo model runs (demo, daemon, search, bench), unless
# `section_tokens` is configured.
DEMO_SECTION_TOKENS = 1536
# At 135M parameters, bf16 compute changes greedy summaries, and differently on each CPU (AMX, AVX512-BF16 and the
# emulated path round differently): on a Zen 4 the expert-committee sample's bf16 summary was under half its
# document's words, its fp32 one held to the document. fp32 costs the demo about a quarter more time. Wherever the
# demo model runs, unless `weights` is configured.
DEMO_WEIGHTS = FP32


class ModelNotFound(ValueError):
    """A model name that is neither "demo", an existing folder or GGUF file, nor shaped like a Hugging Face id."""


def resolve_model(name: str) -> str:
    """The path or Hugging Face id the engine should load for the configured `name`."""
    if name == DEMO:
        return str(demo_model())
    path = Path(name).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return str(path.resolve())
    if name.startswith(("/", ".", "~")) or path.exists():
        raise ModelNotFound(f"model {name} does not exist (or is neither a folder nor a .gguf file)")
    return name


def demo_model_dir() -> Path:
    from npumoe.engine.synthetic.smollm2 import models_cache

    return models_cache() / DEMO_BUILD


def demo_model() -> Path:
    """The demo MoE checkpoint, upcycled on first use (a few minutes) from the GGUF file setup fetched, its router
    built on the sample documents; fetched first if setup did not."""
    target = demo_model_dir()
    if (target / "config.json").is_file():
        return target
    from npumoe.engine.synthetic.smollm2 import fetch_gguf
    from npumoe.engine.synthetic.upcycle import upcycle_gguf

    from .samples import sample_documents

    gguf = fetch_gguf()
    with FileLock(f"{target}.lock"):  # a second process waits for the first one's build
        if not (target / "config.json").is_file():
            log.info("making the demo model (SmolLM2-135M-Instruct upcycled to an MoE) in %s", target)
            tmp = temporary_path(target.parent, DEMO)
            try:
                upcycle_gguf(gguf, tmp, ["\n\n".join(doc.paragraphs) for doc in sample_documents()])
                os.rename(tmp, target)  # all at once: a half-written checkpoint never sits under the real name
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def backend_description(backend: str) -> str:
    """The configured backend as `status` shows it: and where its graphs run, when that is not its device."""
    if backend == COREML:
        from npumoe.engine.backends.coreml.env import coreml_availability

        available, reason = coreml_availability()
        if not available:
            return f"{backend} (graphs through torch: {reason})"
    return backend


def output_settings(config: Config) -> dict[str, Any]:
    """The [model] options that shape what a document's outputs say, as configured, named as the engine's settings
    name them. With the model they make a job's key (daemon/intake.py), so changing one processes a document again;
    the other options (threads, idle_unload_seconds, allow_download, …) change how it runs, not what comes out."""
    m = config.model
    return {"backend": m.backend, "plan": m.plan, "chunk_tokens": m.chunk_tokens, "overflow": m.overflow,
            "weights": m.weights, "summary_tokens": m.summary_tokens, "section_tokens": m.section_tokens,
            "pooling": m.pooling}


def engine_settings(config: Config, home: Home, *, threads: int | None) -> EngineSettings:
    """The engine's settings from the config's [model] section: the output settings with the plan's path and the
    demo's defaults filled in, the model name resolved, and what runs them here."""
    from npumoe.engine import EngineSettings

    m = config.model
    demo = m.name == DEMO
    resolved = {
        "plan": Path(m.plan).expanduser() if m.plan else None,
        "weights": DEMO_WEIGHTS if demo and m.weights == AUTO else m.weights,
        "section_tokens": m.section_tokens or (DEMO_SECTION_TOKENS if demo else 0),
    }
    return EngineSettings(
        **{**output_settings(config), **resolved},
        model=resolve_model(m.name),
        threads=threads,
        trust_remote_code=m.trust_remote_code,
        allow_download=m.allow_download,
        compiled_dir=home.compiled,
        coreml_compute_units=m.coreml_compute_units,
        costs_dir=home.costs,
        residency=m.residency,
        models_dir=home.models,
    )


def load_engine(settings: EngineSettings) -> Engine:
    from npumoe.engine import Engine

    return Engine.load(settings)


@dataclass
class ModelSlot:
    """The daemon's one model. `load` (the pipeline's way in) loads it once; `unload_if_idle` lets it go."""

    config: Config
    home: Home
    threads: int | None = None
    loader: Callable[[EngineSettings], Engine] = load_engine
    clock: Callable[[], float] = time.monotonic
    loads: int = 0

    def __post_init__(self) -> None:
        self._engine: Engine | None = None
        self._settings: EngineSettings | None = None
        self._last_used = self.clock()

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    @property
    def settings(self) -> EngineSettings:
        if self._settings is None:
            self._settings = engine_settings(self.config, self.home, threads=self.threads)
        return self._settings

    def load(self) -> Engine:
        self._last_used = self.clock()
        if self._engine is None:
            started = time.perf_counter()
            try:
                self._engine = self.loader(self.settings)
            except Exception as e:
                self._settings = None  # resolve again next time: the folder may appear, the demo be made
                raise ModelUnavailable(f"{self.config.model.name}: {e}") from e
            self.loads += 1
            log.info(
                "loaded model %s (%s backend) in %.1f s",
                self.settings.model,
                self.settings.backend,
                time.perf_counter() - started,
            )
        return self._engine

    def touch(self) -> None:
        """The model was just used: the idle clock starts again."""
        self._last_used = self.clock()

    def unload_if_idle(self) -> bool:
        idle = self.clock() - self._last_used
        if self._engine is None or idle < self.config.model.idle_unload_seconds:
            return False
        log.info("unloading the model after %.0f s idle", idle)
        self.unload()
        return True

    def unload(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = None
        gc.collect()  # the weights are only freed once the last reference cycle is broken


if __name__ == "__main__":  # `make setup`: fetch the models and build the demo MoE, so tests and the demo find them
    from npumoe.jobs.search.sentence_model import fetch_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"demo model: {demo_model()}")
    print(f"search model: {fetch_model()}")
