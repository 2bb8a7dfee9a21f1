"""`bench moe --cuda` and `bench prefill --cuda`: the engine's cuda backend against one launch per expert and
against transformers' own experts, all on one NVIDIA GPU, side by side.

Rows, on the same input and routing as the CPU benches build them:
- `npumoe-cuda`: the engine as it runs on a GPU: tiers and groups, each resident group one captured CUDA graph,
  its residency measured on the GPU (costs and each group's graph), the cold experts and spills on the CPU;
- `npumoe-cuda-no-graphs`: the same groups with their kernels launched one by one (no CUDA graph);
- `npumoe-cuda-per-expert`: the paper's naive baseline: the same tiers, every expert a group of its own, launched
  one by one without graphs;
- `transformers-eager-cuda`, `transformers-grouped_mm-cuda`: transformers' experts implementations with the
  weights and inputs already on the GPU (its best case: no copies); in `bench moe` also
  `transformers-grouped_mm-cuda+copies`, the inputs copied in and the output copied back, as the engine's path
  pays for them.

The engine's paths take host tensors (routing, packing and combine run on the host, the dense parts of a prefill
on the CPU), so in `bench prefill` the transformers rows run the whole model on the GPU while the engine's run only
its resident experts there. Every output is checked as the CPU benches check theirs (paths.gate: against
transformers-eager, here on the GPU, and in bf16 against the same model in fp32 on the GPU), before and after the
timed rounds; ratios are to transformers' best and to the per-expert baseline, round by round.
"""

from __future__ import annotations

import copy
import gc
import statistics
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
from torch import nn
from transformers import PreTrainedModel

from npumoe.engine.attach.runtime import MoeRuntime
from npumoe.engine.backends.cuda.backend import CudaBackend
from npumoe.engine.backends.cuda.env import cuda_availability
from npumoe.engine.backends.placement import place
from npumoe.engine.calibration.calibrate import Calibration
from npumoe.engine.calibration.planner import make_plan
from npumoe.engine.loading.load import TORCH_DTYPES
from npumoe.engine.moe.model_experts import moe_experts
from npumoe.engine.plan.residency import decide_residency
from npumoe.engine.synthetic.geometry import Geometry, build_layer_model, draw_routing, routing_prior
from npumoe.engine.vocabulary import SPILL

from ..fair.paired import add_ratios
from ..fair.workloads import build_model, in_float32, prefill_parts
from ..layer.moe import MoeBenchSettings
from ..paths import Output, Reference, calibration_from_loads, dispatch_fractions, gate, parts, selected
from ..prefill_bench import PrefillBenchSettings, calibrate_on_documents
from ..timing import interleaved_seconds

CUDA_GRAPHS = "npumoe-cuda"
CUDA_NO_GRAPHS = "npumoe-cuda-no-graphs"
CUDA_PER_EXPERT = "npumoe-cuda-per-expert"  # the baseline every row's second ratio is to
TRANSFORMERS_GPU = ("eager", "grouped_mm")
WITH_COPIES = "transformers-grouped_mm-cuda+copies"


def require_cuda() -> torch.device:
    """The GPU the rows run on; ValueError saying why where there is none."""
    available, reason = cuda_availability()
    if not available:
        raise ValueError(f"the --cuda rows need an NVIDIA GPU that torch can use: {reason}")
    return torch.device("cuda", torch.cuda.current_device())


def run_cuda_moe_bench(geometries: Sequence[Geometry], tokens: Sequence[int], dtypes: Sequence[str],
                       settings: MoeBenchSettings, *, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per (geometry, dtype, tokens, path) of one MoE layer on the GPU."""
    device = require_cuda()
    results: list[dict] = []
    with torch.inference_mode():
        for geometry in geometries:
            for dtype_name in dtypes:
                generator = torch.Generator().manual_seed(settings.seed)
                model = build_layer_model(geometry, TORCH_DTYPES[dtype_name], generator)
                gpu_model = copy.deepcopy(model)  # its experts alone go to the GPU: the rest is on the meta device
                moe_experts(gpu_model)[0][1].to(device)
                prior = routing_prior(geometry, generator, skew=settings.skew)
                for n_tokens in tokens:
                    case = {"geometry": geometry.name, "tokens": n_tokens, "dtype": dtype_name,
                            "threads": settings.threads, "device": torch.cuda.get_device_name(device)}
                    rows = _moe_case(model, gpu_model, geometry, prior, n_tokens, settings, generator, device)
                    _emit(results, case, rows, on_result)
                    _release()  # the case's runtimes and their graphs
                del model, gpu_model
                _release()
    return results


def _moe_case(model: PreTrainedModel, gpu_model: PreTrainedModel, geometry: Geometry, prior: torch.Tensor,
              tokens: int, settings: MoeBenchSettings, generator: torch.Generator, device: torch.device) -> list[dict]:
    """Rows for one chunk length: the plan calibrated on other draws of the routing, then every path."""
    (name, experts), gpu_experts = moe_experts(model)[0], moe_experts(gpu_model)[0][1]
    draws = [draw_routing(prior, tokens, geometry.top_k, generator)[0] for _ in range(settings.calibration_chunks)]
    loads = torch.stack([torch.bincount(index.reshape(-1), minlength=geometry.experts) for index in draws])
    calibration = calibration_from_loads([(name, loads)], chunk_tokens=tokens,
                                         source=f"zipf-routing(skew={settings.skew}, seed={settings.seed})")
    x = torch.randn(tokens, geometry.hidden, generator=generator).to(experts.gate_up_proj.dtype)
    index, weights = draw_routing(prior, tokens, geometry.top_k, generator)
    weights = weights.to(x.dtype)  # transformers' routers hand the experts their weights in the model dtype
    on_gpu = (x.to(device), index.to(device), weights.to(device))

    def with_copies() -> torch.Tensor:
        return gpu_experts(x.to(device), index.to(device), weights.to(device)).cpu()

    def in_fp32() -> torch.Tensor:
        return gpu_experts(on_gpu[0].float(), on_gpu[1], on_gpu[2].float())

    return measure_gpu_rows(model, engine_runtimes(model, calibration, geometry.name), gpu_model,
                            host=partial(experts, x, index, weights), gpu=partial(gpu_experts, *on_gpu),
                            truth=partial(in_float32, gpu_experts, in_fp32),
                            extra={WITH_COPIES: ("grouped_mm", with_copies)}, tokens=tokens, warmup=settings.warmup,
                            repeats=settings.repeats, min_seconds=settings.min_seconds)


def run_cuda_prefill_bench(geometries: Sequence[Geometry], dtypes: Sequence[str], settings: PrefillBenchSettings, *,
                           on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per (geometry, dtype, path) of a whole-document prefill: the engine's experts on the GPU (its dense
    parts on the CPU), transformers' whole model on the GPU."""
    device = require_cuda()
    results: list[dict] = []
    with torch.inference_mode():
        for geometry in geometries:
            for dtype_name in dtypes:
                model = build_model(geometry, settings.layers, TORCH_DTYPES[dtype_name],
                                    context=settings.document_tokens, seed=settings.seed)
                gpu_model = copy.deepcopy(model).to(device)
                generator = torch.Generator().manual_seed(settings.seed)
                vocab = model.config.vocab_size

                def document(generator: torch.Generator = generator, vocab: int = vocab) -> list[int]:
                    return torch.randint(vocab, (settings.document_tokens,), generator=generator).tolist()

                calibration = calibrate_on_documents(model, [document() for _ in range(settings.calibration_documents)],
                                                     settings.chunk_tokens)
                ids = document()
                on_gpu = partial(prefill_parts, gpu_model, ids, settings.chunk_tokens)
                truth = None if model.dtype == torch.float32 else partial(in_float32, gpu_model.base_model, on_gpu)
                rows = measure_gpu_rows(model, engine_runtimes(model, calibration, geometry.name), gpu_model,
                                        host=partial(prefill_parts, model, ids, settings.chunk_tokens), gpu=on_gpu,
                                        truth=truth, tokens=len(ids), warmup=settings.warmup,
                                        repeats=settings.repeats, min_seconds=settings.min_seconds)
                case = {"geometry": geometry.name, "layers": settings.layers, "dtype": dtype_name,
                        "document_tokens": settings.document_tokens, "chunk_tokens": settings.chunk_tokens,
                        "threads": settings.threads, "device": torch.cuda.get_device_name(device)}
                _emit(results, case, rows, on_result)
                del model, gpu_model
                _release()
    return results


def engine_runtimes(model: PreTrainedModel, calibration: Calibration, name: str) -> dict[str, MoeRuntime]:
    """The engine's three GPU paths on `model`, each built and left detached: the grouped plan placed from costs
    measured on the GPU, run as CUDA graphs and without; and one expert per group (every expert calibration saw
    load for on the GPU), without graphs."""
    grouped = make_plan(calibration, model=name, model_key=name)
    per_expert = make_plan(calibration, model=name, model_key=name, group_size=1)
    graphs = CudaBackend()
    residency = place(grouped, graphs, model, cache=None)
    built = {CUDA_GRAPHS: MoeRuntime(model, graphs, grouped, SPILL, residency),
             CUDA_NO_GRAPHS: MoeRuntime(model, CudaBackend(capture=False), grouped, SPILL, residency),
             CUDA_PER_EXPERT: MoeRuntime(model, CudaBackend(capture=False), per_expert, SPILL,
                                         decide_residency(per_expert, CudaBackend))}
    for runtime in built.values():
        runtime.detach()
    return built


def measure_gpu_rows(model: PreTrainedModel, runtimes: Mapping[str, MoeRuntime], gpu_model: nn.Module, *,
                     host: Callable[[], Output], gpu: Callable[[], Output], truth: Callable[[], Output] | None,
                     tokens: int, warmup: int, repeats: int, min_seconds: float,
                     extra: Mapping[str, tuple[str, Callable[[], Output]]] | None = None) -> list[dict]:
    """Each engine runtime on `host()` (the model on the host) and each of transformers' implementations on
    `gpu()` (its copy on the GPU), checked against transformers-eager on the GPU (and `truth`, the same in fp32),
    then timed side by side; `extra`: more of transformers' rows, (implementation, call). Then checked again."""
    gpu_model.set_experts_implementation("eager")
    reference = Reference.of(_on_host(gpu()), _on_host(truth()) if truth is not None else None)
    paths: dict[str, Callable[[], Output]] = {}
    rows: dict[str, dict] = {}
    for impl, runtime in runtimes.items():
        paths[impl] = partial(_engine, model, impl, runtime, host)
        rows[impl] = _checked(impl, paths[impl], reference)
        rows[impl].update(dispatch_fractions(runtime.stats))
    calls = {f"transformers-{name}-cuda": (name, gpu) for name in TRANSFORMERS_GPU} | dict(extra or {})
    for impl, (name, call) in calls.items():
        paths[impl] = partial(_transformers, gpu_model, name, call)
        rows[impl] = _checked(impl, paths[impl], reference)
    last: dict[str, Output] = {}
    timed = {impl: partial(_kept, last, impl, paths[impl]) for impl, row in rows.items() if row["status"] == "ok"}
    for impl, times in interleaved_seconds(timed, warmup=warmup, repeats=repeats, min_seconds=min_seconds).items():
        if isinstance(times, Exception):
            rows[impl] = _broken(impl, times)
            continue
        seconds = statistics.median(times)
        after = gate(impl, _on_host(last.pop(impl)), reference)
        rows[impl].update(seconds=seconds, tokens_per_s=tokens / seconds, round_seconds=times,
                          rel_error_after=after["rel_error"])
        if after["status"] == "refused":
            rows[impl].update(status="refused", error=f"after the timed rounds: {after['error']}")
    gpu_model.set_experts_implementation("eager")
    return add_ratios(list(rows.values()), baseline=CUDA_PER_EXPERT)


def _engine(model: PreTrainedModel, impl: str, runtime: MoeRuntime, run: Callable[[], Output]) -> Output:
    with selected(model, impl, runtime):
        return run()


def _transformers(gpu_model: nn.Module, name: str, run: Callable[[], Output]) -> Output:
    gpu_model.set_experts_implementation(name)
    output = run()
    torch.cuda.synchronize()  # its kernels are queued: the call ends when they are done
    return output


def _checked(impl: str, path: Callable[[], Output], reference: Reference) -> dict:
    try:
        return gate(impl, _on_host(path()), reference)
    except Exception as e:  # a benchmark reports the path that broke and times the others
        return _broken(impl, e)


def _broken(impl: str, error: Exception) -> dict:
    return {"impl": impl, "status": "refused" if impl.startswith("npumoe-") else "skipped",
            "error": f"{type(error).__name__}: {error}"}


def _kept(last: dict[str, Output], impl: str, path: Callable[[], Output]) -> None:
    last[impl] = path()  # copied to the host after the rounds, not inside the timed call


def _on_host(output: Output) -> tuple[torch.Tensor, ...]:
    return tuple(part.cpu() for part in parts(output))


def _emit(results: list[dict], case: dict, rows: list[dict], on_result: Callable[[dict], None] | None) -> None:
    for row in rows:
        results.append({**case, **row})
        if on_result is not None:
            on_result(results[-1])


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()
