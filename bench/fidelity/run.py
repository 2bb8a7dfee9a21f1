"""`bench fidelity`'s run: the capacity sweep, the weights formats against the float model (a checkpoint on the
sample documents, or the tiny families), and one real-size layer's quantized experts; each printed as a table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..render import (
    err_console,
    print_fidelity,
    print_layer_errors,
    print_progress,
    print_real_fidelity,
    print_weights_fidelity,
)

if TYPE_CHECKING:
    from npumoe.engine.loading.load import LoadedModel
    from npumoe.engine.synthetic.geometry import Geometry

    from .real_text import RealFidelitySettings

# The tiny families `bench fidelity` compares weights formats on by default.
FIDELITY_FAMILIES = ("qwen3_moe", "olmoe", "mixtral")

HELD_OUT_SAMPLE = "night-shift-log.txt"


@dataclass(frozen=True)
class FidelityRun:
    """What `bench fidelity` was asked: the model (None: a tiny skewed Qwen3-MoE made for the run), the texts, the
    sweep's scales and which parts run."""

    model_name: str | None
    model_path: Path | None
    calibration_texts: list[tuple[str, str]]  # (name, text)
    eval_text: str
    scales: tuple[float, ...]
    chunk_tokens: int
    eval_tokens: int
    tokens_per_document: int
    families: tuple[str, ...]
    layer_geometry: Geometry
    layer_tokens: int
    capacity: bool
    layer: bool
    threads: int
    warmup: int
    repeats: int
    seed: int


@dataclass(frozen=True)
class FidelityResults:
    model_name: str
    model_key: str
    rows: list[dict]  # the sweep's rows, then the weights rows and the layer rows, each with its "section"


def fidelity_texts(calibration_files: Sequence[Path],
                   eval_file: Path | None) -> tuple[list[tuple[str, str]], str]:
    """(calibration texts as (name, text), held-out text): the files given, else the sample documents."""
    from npumoe.daemon.samples import sample_documents

    samples = {doc.filename: "\n\n".join(doc.paragraphs) for doc in sample_documents()}
    calibration = ([(path.name, path.read_text(errors="replace")) for path in calibration_files]
                   or [(name, text) for name, text in samples.items() if name != HELD_OUT_SAMPLE])
    return calibration, eval_file.read_text(errors="replace") if eval_file else samples[HELD_OUT_SAMPLE]


def run_fidelity_benches(run: FidelityRun, machine: dict) -> FidelityResults:
    """Run every part asked for, print its table, return the rows. Raises ModelError or ValueError for a model
    or settings that cannot run."""
    import tempfile

    from npumoe.engine.loading.load import load_model
    from npumoe.engine.synthetic.tiny import make_tiny
    from npumoe.engine.vocabulary import QUANTIZED

    from .capacity import FidelitySettings, run_fidelity_bench
    from .real_text import RealFidelitySettings
    from .weights import DISTRIBUTIONS, layer_errors

    settings = FidelitySettings(threads=run.threads, scales=tuple(sorted(set(run.scales))),
                                chunk_tokens=run.chunk_tokens, eval_tokens=run.eval_tokens, warmup=run.warmup,
                                repeats=run.repeats)
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="npumoed-fidelity-") as scratch:
        loaded = load_model(run.model_path or make_tiny("qwen3_moe", Path(scratch) / "tiny-qwen3_moe", seed=run.seed))
        if run.capacity:
            results = run_fidelity_bench(loaded, run.calibration_texts, run.eval_text, settings,
                                         on_result=print_progress)
        if run.model_path:
            real_settings = RealFidelitySettings(chunk_tokens=run.chunk_tokens,
                                                 tokens_per_document=run.tokens_per_document)
            weights_rows = _real_fidelity(loaded, run.model_name, real_settings)
        else:
            weights_rows = _weights_fidelity(run.families, run.calibration_texts, run.eval_text, run.chunk_tokens,
                                             run.eval_tokens, Path(scratch), run.seed)
    layer_rows = [row for distribution in (DISTRIBUTIONS if run.layer else ())
                  for row in layer_errors(run.layer_geometry, QUANTIZED, distribution, tokens=run.layer_tokens,
                                          seed=run.seed, on_result=lambda row: err_console.print(
                                              f"{row['geometry']} {row['distribution']} {row['format']}: relative "
                                              f"error {row['rel_error']:.2%}", style="dim", highlight=False))]
    if run.capacity:
        print_fidelity(results, f"model {loaded.name}, calibrated on "
                                f"{', '.join(name for name, _ in run.calibration_texts)}, held out: "
                                f"{results[0]['eval_tokens']} tokens, chunk {run.chunk_tokens}, {run.threads} threads")
    if run.model_path:
        print_real_fidelity(weights_rows, f"{loaded.name}: the first {run.tokens_per_document} tokens of each sample "
                                          f"document ({weights_rows[0]['tokens']} in all), fp32, chunk "
                                          f"{run.chunk_tokens}; {run.threads} threads, {machine['cpu']}")
    else:
        print_weights_fidelity(weights_rows, f"held out: {weights_rows[0]['eval_tokens']} tokens; "
                                             f"{run.threads} threads, {machine['cpu']}")
    if layer_rows:
        print_layer_errors(layer_rows)
    results += [{"section": "real-text" if run.model_path else "weights", **row} for row in weights_rows]
    results += [{"section": "layer", **row} for row in layer_rows]
    return FidelityResults(model_name=loaded.name, model_key=loaded.key, rows=results)


def _real_fidelity(loaded: LoadedModel, model_name: str | None, settings: RealFidelitySettings) -> list[dict]:
    """Each weights format against the model's float weights on the sample documents; for the demo, whose float
    weights come from its GGUF file, the experts' weights are compared with the file's too."""
    from npumoe.daemon.model_choice import DEMO
    from npumoe.daemon.samples import sample_documents
    from npumoe.engine.synthetic.smollm2 import gguf_path

    from .real_text import gguf_dense_ffn, run_real_fidelity

    dense = gguf_dense_ffn(gguf_path(), loaded.model) if model_name == DEMO and gguf_path().is_file() else None
    texts = ["\n\n".join(doc.paragraphs) for doc in sample_documents()]
    return [{"model": model_name, **row} for row in run_real_fidelity(
        loaded, texts, settings, dense=dense, on_result=lambda row: err_console.print(
            f"{row['variant']}: perplexity {row['perplexity']:.3f}, top-1 {row['top1_agreement']:.1%}",
            style="dim", highlight=False))]


def _weights_fidelity(families: Sequence[str], calibration_texts: Sequence[tuple[str, str]], eval_text: str,
                      chunk_tokens: int, eval_tokens: int, scratch: Path, seed: int) -> list[dict]:
    """bf16, int8 and int4 against fp32 on each tiny family, with its random output layer and with a readout
    fitted to the calibration texts (so that its top-1 means something)."""
    from npumoe.engine.loading.load import load_model
    from npumoe.engine.synthetic.tiny import make_tiny

    from .weights import WeightsFidelitySettings, fit_readout, run_weights_fidelity

    settings = WeightsFidelitySettings(chunk_tokens=chunk_tokens, eval_tokens=eval_tokens)
    rows = []
    for family in families:
        loaded = load_model(make_tiny(family, scratch / f"weights-{family}", seed=seed))
        for head in ("random", "readout"):
            extra = {}
            if head == "readout":
                extra["readout_cross_entropy"] = fit_readout(loaded, [text for _, text in calibration_texts],
                                                             chunk_tokens)
            for row in run_weights_fidelity(loaded, eval_text, settings):
                rows.append({"model": f"tiny {family}", "head": head, **extra, **row})
                err_console.print(f"tiny {family}, {head} output layer, {row['format']}: top-1 vs fp32 "
                                  f"{row['top1_vs_fp32']:.1%}", style="dim", highlight=False)
    return rows
