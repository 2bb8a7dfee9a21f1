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

from npumoe.daemon.cli.weights import quantize_command, size_command
from npumoe.engine.vocabulary import DTYPES, FLOAT32, OVERFLOW_POLICIES, PRUNE, TORCH_STATIC

if TYPE_CHECKING:
    from npumoe.engine.plan import ExpertPlan

# Listed here rather than imported, so that `npumoed --help` does not import torch.
ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "phimoe", "granitemoe", "deepseek_v2", "deepseek_v3",
                 "glm4_moe", "gpt_oss", "qwen3_next", "ernie4_5_moe", "glm4_moe_lite", "deepseek_v4", "lfm2_moe",
                 "nemotron_h")
# Where each family's config.json counts its routed experts.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
STATIC_BACKENDS = (TORCH_STATIC,)  # the static backend that needs no compiled graphs to measure its costs


@click.group("model")
def model_group() -> None:
    """Model utilities."""


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
    _quiet_transformers()
    from transformers import AutoConfig

    from npumoe.engine.tiny import make_tiny

    make_tiny(arch, directory, seed=seed)
    config = AutoConfig.from_pretrained(directory)
    experts = next(getattr(config, key) for key in _EXPERT_COUNT_KEYS if getattr(config, key, None))
    click.echo(f"wrote a tiny {arch} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
               f"{experts} experts, top-{config.num_experts_per_tok}, context "
               f"{config.max_position_embeddings}) to {directory}")


@click.command("calibrate")
@click.option("--model", "model_name", required=True,
              help="Model: a checkpoint folder, a Hugging Face id in the local cache, or \"demo\".")
@click.option("--data", "data", multiple=True, required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Calibration document (text, Markdown, HTML, PDF, DOCX); more may follow it, or repeat --data.")
@click.argument("more_data", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Plan JSON to write.")
@click.option("--chunk", type=click.IntRange(min=1), default=512, show_default=True, help="Prefill chunk length.")
@click.option("--backend", type=click.Choice(STATIC_BACKENDS), default=TORCH_STATIC, show_default=True,
              help="Backend the plan is for (its costs are measured here).")
@click.option("--overflow", type=click.Choice(OVERFLOW_POLICIES), default=PRUNE, show_default=True,
              help="Overflow policy to record in the plan (the engine's own setting decides at run time).")
@click.option("--tiers", "n_tiers", type=click.IntRange(min=1), default=4, show_default=True,
              help="How many capacity tiers.")
@click.option("--group-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Experts per group graph.")
@click.option("--dtype", type=click.Choice(DTYPES), default=FLOAT32, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), help="Torch threads (default: leave as is).")
@click.option("--trust-remote-code", is_flag=True, help="Allow the checkpoint's own Python code.")
@click.option("--allow-download", is_flag=True, help="Download the model from the Hugging Face Hub if needed.")
def calibrate_command(model_name: str, data: tuple[Path, ...], more_data: tuple[Path, ...], out: Path, chunk: int,
                      backend: str, overflow: str, n_tiers: int, group_size: int, dtype: str, threads: int | None,
                      trust_remote_code: bool, allow_download: bool) -> None:
    """Measure expert loads on calibration documents (--data PATH [PATH...]) and write an ExpertPlan."""
    calibrate_documents(model_name, (*data, *more_data), out, chunk_tokens=chunk, backend=backend, overflow=overflow,
                        n_tiers=n_tiers, group_size=group_size, dtype=dtype, threads=threads,
                        trust_remote_code=trust_remote_code, allow_download=allow_download)


def calibrate_documents(model_name: str, documents: Sequence[Path], out: Path, **options: Any) -> None:
    """What `npumoed calibrate` (and the demo's first run) does: extract the documents' text, have the engine's
    `calibrate_plan` (given `options`) write the plan to `out`, with a progress bar and a closing line on stderr."""
    _quiet_transformers()
    from npumoe.engine.planner import calibrate_plan
    from npumoe.jobs.errors import ExtractionError, MissingDependency
    from npumoe.jobs.extract import extract_text

    texts = []
    for path in documents:
        try:
            texts.append((path.name, extract_text(path).text))
        except (ExtractionError, MissingDependency) as e:
            raise click.ClickException(f"{path}: {e}") from e
    stderr = Console(stderr=True)
    try:
        plan = calibrate_plan(_model_ref(model_name), texts, out, progress=_chunk_bar(stderr), **options)
    except ValueError as e:  # ModelError among them
        raise click.ClickException(str(e)) from e
    stderr.print(f"calibrated {len(plan.layers)} MoE layers x {plan.layers[0].num_experts} experts on "
                 f"{plan.calibration_tokens} tokens ({plan.calibration_chunks} chunks of {plan.chunk_tokens}); "
                 f"tiers {list(plan.tiers)}; wrote {escape(str(out))}")


@contextmanager
def _chunk_bar(console: Console) -> Iterator[Callable[[int, int], None]]:
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
@click.option("--json", "as_json", is_flag=True, help="Print the whole plan as JSON.")
def plan_show_command(plan_path: Path, as_json: bool) -> None:
    """Show an ExpertPlan: tiers, groups and residency per layer."""
    from npumoe.engine.plan import ExpertPlan, PlanError

    try:
        plan = ExpertPlan.load(plan_path)
    except PlanError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(plan.to_dict(), indent=2))
        return
    _show(plan, Console())



def _show(plan: ExpertPlan, console: Console) -> None:
    c = plan.cost
    console.print(f"[bold]{escape(plan.model)}[/] ({escape(plan.model_key)}) · backend {plan.backend} · "
                  f"chunk {plan.chunk_tokens} tokens · overflow {plan.overflow} · "
                  f"up to {plan.group_size} experts per group")
    console.print(f"calibrated on {plan.calibration_tokens} tokens, {plan.calibration_chunks} chunks: "
                  f"{escape(', '.join(plan.sources))}")
    console.print(f"costs: launch {c.launch_s * 1e6:.1f} µs, graphs {c.static_flops / 1e9:.1f} GFLOP/s; "
                  f"CPU expert call {c.cpu_call_s * 1e6:.1f} µs, CPU {c.cpu_flops / 1e9:.1f} GFLOP/s")

    tiers = Table("tier", "capacity", "experts", "groups", "on accelerator", "on CPU", title="Tiers")
    for t, capacity in enumerate(plan.tiers):
        groups = [g for layer in plan.layers for g in layer.groups if g.tier == t]
        accelerator = sum(g.residency == "accelerator" for g in groups)
        tiers.add_row(str(t), str(capacity), str(sum(len(g.experts) for g in groups)), str(len(groups)),
                      str(accelerator), str(len(groups) - accelerator))
    console.print(tiers)

    layers = Table(title="Layers (load: routed tokens per chunk; padding expected from mean loads)")
    layers.add_column("experts module", overflow="fold")
    for header in ("experts per tier", "groups acc/cpu", "hottest/mean load", "padding"):
        layers.add_column(header, justify="right")
    for layer in plan.layers:
        mean = layer.load.mean
        per_tier = "/".join(str(layer.expert_tier.count(t)) for t in range(len(plan.tiers)))
        accelerator = [g for g in layer.groups if g.residency == "accelerator"]
        slots = sum(len(g.experts) * plan.tiers[g.tier] for g in accelerator)
        filled = sum(min(mean[e], plan.tiers[g.tier]) for g in accelerator for e in g.experts)
        average = sum(mean) / len(mean)
        layers.add_row(layer.name, per_tier, f"{len(accelerator)}/{len(layer.groups) - len(accelerator)}",
                       f"{max(mean) / average:.1f}x" if average else "-",
                       f"{(slots - filled) / slots:.0%}" if slots else "-")
    console.print(layers)


def _model_ref(name: str) -> str:
    """A folder or Hugging Face id for the engine; "demo" is the home's built-in tiny model."""
    from npumoe.daemon.home import Home
    from npumoe.daemon.models import ModelNotFound, resolve_model

    try:
        return resolve_model(name, Home.current().models)
    except ModelNotFound as e:
        raise click.ClickException(str(e)) from e


def _quiet_transformers() -> None:
    """No weight-loading progress bars from transformers: the commands draw their own."""
    from transformers.utils import logging

    logging.disable_progress_bar()
