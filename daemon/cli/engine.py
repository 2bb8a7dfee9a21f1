"""Engine commands: `model make-tiny` (and weights.py's `model quantize`, `model size`), `calibrate` and
`plan show`.

They need no home or config (except "demo", the home's built-in model). Torch loads only inside a
command.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from npumoe.engine.vocabulary import AUTO, BACKENDS, CHUNK_TOKENS, WEIGHTS, WEIGHTS_DTYPE

from .model_list import list_command
from .model_ref import model_ref
from .weights import quantize_command, size_command

if TYPE_CHECKING:
    from npumoe.engine.plan.expert_plan import ExpertPlan
    from npumoe.engine.plan.residency import MeasuredCosts, Residency

# Listed here rather than imported, so that `npumoed --help` does not import torch.
ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "phimoe", "granitemoe", "granitemoeshared",
                 "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_next", "ernie4_5_moe", "glm4_moe_lite",
                 "deepseek_v4", "lfm2_moe", "nemotron_h")
# Where each family's config.json counts its routed experts.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@click.group("model")
def model_group() -> None:
    """Model utilities."""


model_group.add_command(list_command)
model_group.add_command(quantize_command)
model_group.add_command(size_command)


@model_group.command("make-tiny")
@click.argument("arch", type=click.Choice(ARCHITECTURES))
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the random weights.")
def make_tiny_command(arch: str, directory: Path, seed: int) -> None:
    """Write a tiny random-weight ARCH checkpoint (skewed routers, byte tokenizer) to DIRECTORY."""
    if directory.exists() and any(directory.iterdir()):
        raise click.ClickException(f"{directory} exists and is not empty")
    quiet_transformers()
    from transformers import AutoConfig

    from npumoe.engine.synthetic.tiny import make_tiny

    make_tiny(arch, directory, seed=seed)
    config = AutoConfig.from_pretrained(directory)
    experts = next(getattr(config, key) for key in _EXPERT_COUNT_KEYS if getattr(config, key, None))
    click.echo(f"wrote a tiny {arch} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
               f"{experts} experts, top-{config.num_experts_per_tok}, context "
               f"{config.max_position_embeddings}) to {directory}")


@click.command("calibrate")
@click.option("--model", "model_name", required=True,
              help="Model: a checkpoint folder, a .gguf file, a Hugging Face id in the local cache, or \"demo\".")
@click.option("--data", "data", multiple=True, required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Calibration document (text, Markdown, HTML, PDF, DOCX); more may follow it, or repeat --data.")
@click.argument("more_data", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Plan JSON to write.")
@click.option("--chunk", type=click.IntRange(min=1), default=CHUNK_TOKENS, show_default=True,
              help="Prefill chunk length.")
@click.option("--tiers", "n_tiers", type=click.IntRange(min=1), default=4, show_default=True,
              help="How many capacity tiers.")
@click.option("--group-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Experts per group graph.")
@click.option("--weights", type=click.Choice(WEIGHTS), default=AUTO, show_default=True,
              help="The format the model will run in; calibration loads it in its float dtype (int8 and int4: "
                   "bfloat16). auto: as the engine chooses here.")
@click.option("--threads", type=click.IntRange(min=1), help="Torch threads (default: leave as is).")
@click.option("--trust-remote-code", is_flag=True, help="Allow the checkpoint's own Python code.")
@click.option("--allow-download", is_flag=True, help="Download the model from the Hugging Face Hub if needed.")
def calibrate_command(model_name: str, data: tuple[Path, ...], more_data: tuple[Path, ...], out: Path, chunk: int,
                      n_tiers: int, group_size: int, weights: str, threads: int | None,
                      trust_remote_code: bool, allow_download: bool) -> None:
    """Measure expert loads on calibration documents (--data PATH [PATH...]) and write an ExpertPlan.

    The plan serves every backend: where its groups run is decided where it runs (`npumoed plan show --backend`)."""
    calibrate_documents(model_name, (*data, *more_data), out, chunk_tokens=chunk,
                        n_tiers=n_tiers, group_size=group_size, weights=weights, threads=threads,
                        trust_remote_code=trust_remote_code, allow_download=allow_download)


def calibrate_documents(model_name: str, documents: Sequence[Path], out: Path, *, weights: str = AUTO,
                        **options: Any) -> None:
    """What `npumoed calibrate` (and the demo's first run) does: extract the documents' text, have the engine's
    `calibrate_plan` (given `options`, the model in the float dtype of `weights`) write the plan to `out`, with a
    progress bar and a closing line on stderr."""
    quiet_transformers()
    from npumoe.engine.calibration.planner import calibrate_plan

    texts = document_texts(documents)
    stderr = Console(stderr=True)
    ref = model_ref(model_name)
    try:
        dtype, why = float_dtype(ref, weights, trust_remote_code=options.get("trust_remote_code", False),
                                 allow_download=options.get("allow_download", False))
        stderr.print(f"loading the model in {dtype} ({escape(why)})", highlight=False)
        plan = calibrate_plan(ref, texts, out, progress=chunk_bar(stderr), dtype=dtype, **options)
    except ValueError as e:  # ModelError among them
        raise click.ClickException(str(e)) from e
    stderr.print(f"calibrated {len(plan.layers)} MoE layers x {plan.layers[0].num_experts} experts on "
                 f"{plan.calibration_tokens} tokens ({plan.calibration_chunks} chunks of {plan.chunk_tokens}); "
                 f"tiers {list(plan.tiers)}; wrote {escape(str(out))}")


def chosen_weights(ref: str, weights: str, *, trust_remote_code: bool = False,
                   allow_download: bool = False) -> tuple[str, str]:
    """(the format model `ref` runs in with `weights`, what decided it); auto is decided as the engine does at load,
    on this machine."""
    if weights != AUTO:
        return weights, f"weights {weights}"
    from npumoe.engine.loading.auto_weights import choose_model_weights

    _, choice = choose_model_weights(ref, trust_remote_code=trust_remote_code, allow_download=allow_download)
    return choice.weights, f"weights auto -> {choice.reason}"


def float_dtype(ref: str, weights: str, *, trust_remote_code: bool = False,
                allow_download: bool = False) -> tuple[str, str]:
    """(the float dtype model `ref` runs in with `weights`, what decided it)."""
    chosen, why = chosen_weights(ref, weights, trust_remote_code=trust_remote_code, allow_download=allow_download)
    return WEIGHTS_DTYPE[chosen], why


def document_texts(documents: Sequence[Path]) -> list[tuple[str, str]]:
    """(file name, extracted text) of each calibration document; a document that cannot be read is an error."""
    from npumoe.jobs.errors import ExtractionError, MissingDependency
    from npumoe.jobs.extract.isolated import extract_text

    texts = []
    for path in documents:
        try:
            texts.append((path.name, extract_text(path).text))
        except (ExtractionError, MissingDependency) as e:
            raise click.ClickException(f"{path}: {e}") from e
    return texts


@contextmanager
def chunk_bar(console: Console) -> Iterator[Callable[[int, int], None]]:
    """A progress bar of calibration chunks; yields what to call with (done, total) after each chunk."""
    columns = (TextColumn("calibrating"), BarColumn(), MofNCompleteColumn(), TextColumn("chunks"),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("calibrate", total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total)


@click.group("plan")
def plan_group() -> None:
    """Expert plans."""


@plan_group.command("show")
@click.argument("plan_path", metavar="PLAN", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--backend", type=click.Choice(BACKENDS),
              help="Also where its groups run on this backend here, from the costs measured on this machine.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (with --backend, its residency too).")
def plan_show_command(plan_path: Path, backend: str | None, as_json: bool) -> None:
    """Show an ExpertPlan: tiers and groups per layer; with --backend, residency, padding and fp16 scaling."""
    from npumoe.engine.plan.expert_plan import ExpertPlan, PlanError

    try:
        plan = ExpertPlan.load(plan_path)
    except PlanError as e:
        raise click.ClickException(str(e)) from e
    placed = _residency(plan, backend) if backend else None
    if as_json:
        data = plan.to_dict()
        click.echo(json.dumps(data if placed is None else {**data, "residency": _residency_dict(*placed)}, indent=2))
        return
    console = Console()
    _show(plan, console)
    if placed is not None:
        _show_residency(plan, *placed, console)


def _residency(plan: ExpertPlan, backend: str) -> tuple[Residency, MeasuredCosts | None, int]:
    """(residency on `backend` here, the measured costs it came from (None: not measured here yet), the
    backend's capacity multiple), from the home's cost cache; nothing is measured or loaded."""
    import dataclasses

    from npumoe.engine.backends.registry import backend_class
    from npumoe.engine.plan.cost_cache import CostCache
    from npumoe.engine.plan.residency import decide_residency

    from ..home import Home

    traits = backend_class(backend)
    costs = CostCache(Home.current().costs).get(backend, plan) if traits.static else None
    placed = decide_residency(plan, traits, costs)
    if costs is None and traits.static:
        placed = dataclasses.replace(placed, fallback=traits.fallback_reason())
    return placed, costs, traits.capacity_multiple


def _residency_dict(placed: Residency, costs: MeasuredCosts | None, multiple: int) -> dict[str, Any]:
    import dataclasses

    return {**dataclasses.asdict(placed), "costs": costs.to_dict() if costs else None, "capacity_multiple": multiple}


def _show(plan: ExpertPlan, console: Console) -> None:
    console.print(f"[bold]{escape(plan.model)}[/] ({escape(plan.model_key)}) · chunk {plan.chunk_tokens} tokens · "
                  f"up to {plan.group_size} experts per group")
    console.print(f"calibrated on {plan.calibration_tokens} tokens, {plan.calibration_chunks} chunks: "
                  f"{escape(', '.join(plan.sources))}")

    tiers = Table("tier", "capacity", "experts", "groups", title="Tiers")
    for t, capacity in enumerate(plan.tiers):
        groups = [g for layer in plan.layers for g in layer.groups if g.tier == t]
        tiers.add_row(str(t), str(capacity), str(sum(len(g.experts) for g in groups)), str(len(groups)))
    console.print(tiers)

    layers = Table(title="Layers (load: routed tokens per chunk; padding expected from mean loads)")
    layers.add_column("experts module", overflow="fold")
    for header in ("experts per tier", "groups", "hottest/mean load", "padding", "largest value"):
        layers.add_column(header, justify="right")
    for layer in plan.layers:
        mean = layer.load.mean
        per_tier = "/".join(str(layer.expert_tier.count(t)) for t in range(len(plan.tiers)))
        slots = sum(len(g.experts) * plan.tiers[g.tier] for g in layer.groups)
        filled = sum(min(mean[e], plan.tiers[g.tier]) for g in layer.groups for e in g.experts)
        average = sum(mean) / len(mean)
        peaks = layer.magnitudes
        largest = f"{max(*peaks.activation, *peaks.gate, *peaks.output):.3g}" if peaks else "-"
        layers.add_row(layer.name, per_tier, str(len(layer.groups)), f"{max(mean) / average:.1f}x" if average else "-",
                       f"{(slots - filled) / slots:.0%}" if slots else "-", largest)
    console.print(layers)


def _show_residency(plan: ExpertPlan, placed: Residency, costs: MeasuredCosts | None, multiple: int,
                    console: Console) -> None:
    from npumoe.engine.plan.residency import key_group, padding_cost

    console.print(f"[bold]on {placed.backend}[/]: {placed.accelerator_groups} groups on the accelerator, "
                  f"{placed.cpu_groups} on the CPU")
    if costs is not None:
        c = costs.cost
        console.print(f"costs measured: {costs.measured_on}; launch {c.launch_s * 1e6:.1f} µs, graphs "
                      f"{c.static_flops / 1e9:.1f} GFLOP/s; CPU expert call {c.cpu_call_s * 1e6:.1f} µs, CPU "
                      f"{c.cpu_flops / 1e9:.1f} GFLOP/s; {len(costs.groups)} compiled graphs timed on the device")
    elif placed.accelerator_groups:
        console.print("costs not measured on this machine yet (`npumoed prepare`, or the first load measures them): "
                      "every group calibration saw load for is a candidate")
    if placed.fallback:
        console.print(f"[yellow]graphs run through torch here[/]: {placed.fallback}")
    plain, aligned = padding_cost(plan, multiple)
    if multiple > 1:
        console.print(f"capacities aligned to multiples of {multiple}: {aligned} slots per chunk instead of "
                      f"{plain} (+{(aligned - plain) / plain:.0%} padding)")
    reasons: dict[str, int] = {}
    scaled = []
    for i, layer in enumerate(placed.layers):
        for g, p in enumerate(layer):
            where = "accelerator" if p.accelerator else "CPU"
            reasons[f"{where}: {p.reason}"] = reasons.get(f"{where}: {p.reason}", 0) + 1
            if p.scale != 1.0:
                scaled.append(f"{plan.layers[i].name} group {g} (x1/{p.scale:g})")
    console.print("groups by reason: " + ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items())))
    if scaled:
        console.print("fp16 range: scaled in the graph, back on the host: " + "; ".join(scaled))
    if costs is not None and costs.refused:
        refusals = [(key_group(key), why) for key, why in costs.refused.items()]
        console.print("[yellow]graphs the accuracy gate refused[/] (their groups run on the CPU): " + "; ".join(
            f"{plan.layers[i].name} group {g}: {why}" for (i, g), why in sorted(refusals)))


def quiet_transformers() -> None:
    """No weight-loading progress bars from transformers: the commands draw their own."""
    from transformers.utils import logging

    logging.disable_progress_bar()
