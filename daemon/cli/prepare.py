"""`npumoed prepare`: from a checkpoint to a ready configuration in one command.

Its stages, each skipped when what it depends on is unchanged since it last ran:

1. plan: calibrate the model on the given documents (or the bundled samples) into the home's plans/,
   the file named by what it depends on (the model's files, the documents' bytes, the options);
2. compile (coreml): convert every group calibration saw load for into Core ML packages, as
   `npumoed compile` does (its build is found by the plan's groups), in the format of `[model] weights`;
3. costs: measure the backend's costs for the plan on this machine into the home's cost cache (with
   Core ML on a Mac: each compiled graph timed on the configured compute units, its ops' placement read);
4. config: the `[model]` section of the config file names the model, backend and plan; the rest of the
   file is kept, the old one backed up (`--print` prints the section instead).

The model is loaded only when a stage needs it. `--backend auto` takes coreml where Core ML can run on a
Neural Engine, else whichever of cpu and torch-static the measured costs expect to be faster.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from npumoe.engine.vocabulary import BACKENDS, COREML, CPU, TORCH_STATIC, WEIGHTS

from ..config import ConfigError, default_config_path
from ..model_choice import DEMO, ModelNotFound, resolve_model
from .app import App, BadConfig, pass_app

if TYPE_CHECKING:
    from npumoe.engine.loading.load import LoadedModel
    from npumoe.engine.plan.expert_plan import ExpertPlan
    from npumoe.engine.plan.residency import MeasuredCosts

    from ..home import Home

AUTO = "auto"
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja")  # what a checkpoint's behaviour rests on


@dataclass
class Stages:
    """The stages' outcomes, for the summary: (stage, what happened, seconds, detail)."""

    console: Console
    rows: list[tuple[str, str, float, str]] = field(default_factory=list)

    @contextmanager
    def stage(self, name: str, description: str, *, spinner: bool = False) -> Iterator[dict[str, str]]:
        """Time a stage; the caller fills `outcome` ("done", "reused", ...) and `detail`. A stage that draws no
        progress bar of its own gets a spinner (rich shows one live display at a time)."""
        outcome = {"outcome": "done", "detail": ""}
        started = time.perf_counter()
        with Progress(SpinnerColumn(), TextColumn(f"{name}: {description}"), TimeElapsedColumn(),
                      console=self.console, transient=True, disable=not spinner) as progress:
            progress.add_task(name, total=None)
            yield outcome
        self.rows.append((name, outcome["outcome"], time.perf_counter() - started, outcome["detail"]))

    def summary(self) -> Table:
        table = Table("stage", "", "seconds", "detail", title="npumoed prepare")
        for name, outcome, seconds, detail in self.rows:
            table.add_row(name, outcome, f"{seconds:.1f}", escape(detail))
        return table


class Model:
    """The checkpoint, loaded the first time a stage needs it."""

    def __init__(self, ref: str, dtype: str, trust_remote_code: bool, allow_download: bool, *,
                 packed: str | None = None, pack: bool = False) -> None:
        self.ref, self.dtype = ref, dtype
        self.trust_remote_code, self.allow_download = trust_remote_code, allow_download
        self.pack, self.packed = pack, packed  # with `pack`, experts are read straight into format `packed`
        self._loaded: LoadedModel | None = None

    def get(self) -> LoadedModel:
        if self._loaded is None:
            from npumoe.engine.loading.load import load_model

            from .engine import quiet_transformers

            quiet_transformers()
            self._loaded = load_model(self.ref, trust_remote_code=self.trust_remote_code,
                                      allow_download=self.allow_download, dtype=self.dtype, pack=self.pack,
                                      format=self.packed)
        return self._loaded

    def signature(self) -> str:
        """What the checkpoint is, cheaply: its files' names, sizes and times for a folder (the plan records the
        model's real key, which the engine checks at load), the key itself for a Hugging Face id."""
        folder = Path(self.ref)
        if folder.is_dir():
            files = sorted(f for pattern in MODEL_FILES for f in folder.glob(pattern))
            return "\n".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
        from npumoe.engine.loading.resolve import model_key

        return model_key(self.ref, trust_remote_code=self.trust_remote_code, allow_download=self.allow_download)


@click.command("prepare")
@click.option("--model", "model_name", required=True,
              help="Model: a checkpoint folder, a .gguf file, a Hugging Face id in the local cache, or \"demo\".")
@click.option("--data", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Calibration document (repeat for more; default: the bundled sample documents).")
@click.option("--backend", type=click.Choice((AUTO, *BACKENDS)), default=AUTO, show_default=True,
              help="Backend to prepare for; auto: coreml on Apple silicon, else the faster measured here.")
@click.option("--print", "print_only", is_flag=True, help="Print the [model] section instead of writing it.")
@click.option("--chunk", type=click.IntRange(min=1), help="Prefill chunk length (default: the config's).")
@click.option("--tiers", "n_tiers", type=click.IntRange(min=1), default=4, show_default=True,
              help="How many capacity tiers.")
@click.option("--group-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Experts per group graph.")
@click.option("--weights", type=click.Choice(WEIGHTS),
              help="The format the model runs in (default: the config's); auto: chosen here at each load.")
@pass_app
def prepare_command(app: App, model_name: str, data: tuple[Path, ...], backend: str, print_only: bool,
                    chunk: int | None, n_tiers: int, group_size: int, weights: str | None) -> None:
    """From a checkpoint to a ready configuration: calibrate, plan, compile, measure, configure."""
    from npumoe.engine.vocabulary import QUANTIZED, WEIGHTS_DTYPE

    from .engine import chosen_weights

    home, configured = app.home, app.config.model
    try:
        ref = resolve_model(model_name)
    except ModelNotFound as e:
        raise click.ClickException(str(e)) from e
    console = Console(stderr=True)
    stages = Stages(console)
    weights = weights or configured.weights
    options = {"chunk_tokens": chunk or configured.plan_chunk_tokens, "n_tiers": n_tiers, "group_size": group_size}
    try:
        runs_in, _ = chosen_weights(ref, weights, trust_remote_code=configured.trust_remote_code,
                                    allow_download=configured.allow_download)
        # the experts read straight into the format they run in, as the engine loads them, unless the backend's
        # graphs are made from their float weights: a quantized file is never held in float
        model = Model(ref, WEIGHTS_DTYPE[runs_in], configured.trust_remote_code, configured.allow_download,
                      packed=runs_in if runs_in in QUANTIZED else None, pack=not _graphs_from_float(backend))
        plan, plan_path = _plan_stage(stages, home.plans, model, data, options)
        units = configured.coreml_compute_units
        chosen = _choose_backend(stages, backend, plan, model, home, units)
        if chosen == COREML:
            _compile_stage(stages, home.compiled, plan, model, weights)
        _costs_stage(stages, chosen, plan, model, home, units, weights)
    except ValueError as e:  # ModelError among them; unusable calibration data or settings
        raise click.ClickException(str(e)) from e
    name = model_name if model_name == DEMO or not Path(model_name).expanduser().is_dir() else ref
    # weights is the one key for the format: a dtype from before it is dropped (None removes a key)
    values = {"name": name, "backend": chosen, "plan": str(plan_path), "weights": weights, "dtype": None}
    _config_stage(stages, app.config_path or default_config_path(), values, print_only)
    console.print(stages.summary())


def _plan_stage(stages: Stages, plans: Path, model: Model, data: Sequence[Path],
                options: dict[str, Any]) -> tuple[ExpertPlan, Path]:
    from npumoe.engine.plan.expert_plan import ExpertPlan, PlanError

    with _documents(data) as documents:
        digest = hashlib.sha256(repr((model.signature(), model.dtype, sorted(options.items()))).encode())
        for document in documents:
            digest.update(hashlib.sha256(document.read_bytes()).digest())
        path = plans / f"{_slug(Path(model.ref).name or model.ref)}-{digest.hexdigest()[:12]}.json"
        if path.is_file():
            try:
                with stages.stage("plan", "reading the plan made before") as outcome:
                    plan = ExpertPlan.load(path)
                    outcome.update(outcome="reused", detail=str(path))
                return plan, path
            except PlanError:
                stages.rows.pop()  # unreadable: calibrate again
        started = time.perf_counter()
        from npumoe.engine.calibration.planner import plan_loaded

        from .engine import chunk_bar, document_texts

        texts = document_texts(documents)
        plan = plan_loaded(model.get(), texts, progress=chunk_bar(stages.console), **options)
        plan.save(path)
    stages.rows.append(("plan", "done", time.perf_counter() - started,
                        f"{len(plan.layers)} layers, tiers {list(plan.tiers)}, {plan.calibration_chunks} chunks "
                        f"of {plan.chunk_tokens} tokens: {path}"))
    return plan, path


@contextmanager
def _documents(data: Sequence[Path]) -> Iterator[Sequence[Path]]:
    """The calibration documents: those given, or the bundled samples written to a temporary folder."""
    if data:
        yield data
        return
    from ..samples import write_samples

    with tempfile.TemporaryDirectory(prefix="npumoed-samples-") as folder:
        yield write_samples(Path(folder))


def _graphs_from_float(backend: str) -> bool:
    """Whether `backend` (or the one auto will choose) makes its group graphs from the experts' float weights."""
    from npumoe.engine.backends.registry import backend_class

    if backend == AUTO:
        from npumoe.engine.backends.coreml.env import coreml_availability

        backend = COREML if coreml_availability()[0] else TORCH_STATIC
    return backend_class(backend).graphs_from_float


def _choose_backend(stages: Stages, backend: str, plan: ExpertPlan, model: Model, home: Home, units: str) -> str:
    if backend != AUTO:
        return backend
    from npumoe.engine.backends.coreml.env import coreml_availability
    from npumoe.engine.backends.registry import backend_class
    from npumoe.engine.plan.residency import decide_residency, expected_seconds

    with stages.stage("backend", "measuring torch-static and the CPU path here", spinner=True) as outcome:
        available, why = coreml_availability()
        if available:
            outcome.update(detail=f"coreml: {why}")
            return COREML
        costs, _ = _costs(TORCH_STATIC, plan, model, home, units)
        seconds = {name: expected_seconds(plan, decide_residency(plan, backend_class(name), costs), costs)
                   for name in (CPU, TORCH_STATIC)}
        chosen = min(seconds, key=lambda name: (seconds[name], name != CPU))  # a tie goes to the exact path
        outcome.update(detail=f"{chosen}: expected MoE seconds per chunk " +
                       ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in seconds.items()) + f" ({why})")
        return chosen


def _compile_stage(stages: Stages, root: Path, plan: ExpertPlan, model: Model, weights: str | None) -> None:
    from .coreml import Source, build, package_weights

    def source() -> Source:
        from npumoe.engine.backends.placement import plan_experts

        experts = plan_experts(plan, model.get().model)
        return Source(plan, [weights for weights, _ in experts].__getitem__, experts[0][1], plan.model_key)

    with stages.stage("compile", "Core ML packages") as outcome:
        formats = package_weights(model.ref, weights, trust_remote_code=model.trust_remote_code)
        folder, manifest, reused = build(root, plan, plan.model_key, source, weights_format=formats)
        total = sum(manifest.package_bytes.values())
        outcome.update(outcome="reused" if reused else "done",
                       detail=f"{len(manifest.groups)} functions in {len(manifest.package_bytes)} packages, "
                              f"{total / 2**20:.1f} MiB: {folder}")


def _costs_stage(stages: Stages, backend: str, plan: ExpertPlan, model: Model, home: Home, units: str,
                 weights: str | None) -> None:
    with stages.stage("costs", f"measuring {backend} here", spinner=True) as outcome:
        if backend == CPU:
            outcome.update(outcome="skipped", detail="cpu runs every expert on the exact path: nothing to measure")
            return
        costs, reused = _costs(backend, plan, model, home, units, weights)
        from npumoe.engine.backends.registry import backend_class
        from npumoe.engine.plan.residency import decide_residency

        placed = decide_residency(plan, backend_class(backend), costs)
        detail = (f"{placed.accelerator_groups} groups on the accelerator, {placed.cpu_groups} on the CPU; "
                  f"{costs.measured_on}")
        if costs.fallback:
            detail += f"; graphs run through torch here ({costs.fallback}): residency is decided again on a Mac"
        outcome.update(outcome="reused" if reused else "done", detail=detail)


def _costs(backend: str, plan: ExpertPlan, model: Model, home: Home, units: str,
           weights: str | None = None) -> tuple[MeasuredCosts, bool]:
    """(the backend's measured costs for the plan here, whether they were cached): measured now when not."""
    from npumoe.engine.plan.cost_cache import CostCache

    cache = CostCache(home.costs)
    costs = cache.get(backend, plan)
    if costs is not None:
        return costs, True
    from npumoe.engine.backends.base import BackendOptions
    from npumoe.engine.backends.placement import measure
    from npumoe.engine.backends.registry import get_backend

    backend_here = get_backend(backend, BackendOptions(compiled_dir=home.compiled, compute_units=units,
                                                       weights=weights))
    costs = measure(plan, backend_here, model.get().model, weights)
    cache.put(backend, plan, costs)
    return costs, False


def _config_stage(stages: Stages, path: Path, values: dict[str, str | None], print_only: bool) -> None:
    from ..config_file import replace_config, section_text, with_section

    with stages.stage("config", str(path)) as outcome:
        try:
            old, new = with_section(path, "model", values)
        except ConfigError as e:
            raise BadConfig(str(e)) from e
        if print_only:
            click.echo(section_text(new, "model"), nl=False)
            outcome.update(outcome="printed", detail="--print: the file is left as it is")
        elif old == new:
            outcome.update(outcome="reused", detail=f"already names {values['backend']} and the plan")
        else:
            try:
                backup = replace_config(path, new)
            except ConfigError as e:
                raise BadConfig(str(e)) from e
            outcome.update(detail=f"[model] written{f', the old file kept as {backup}' if backup else ''}")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"
