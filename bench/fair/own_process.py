"""transformers timed as a person would run it: in a Python process of its own, under torch's own OpenMP defaults.

`npumoed` sets OMP_WAIT_POLICY=PASSIVE before torch loads (daemon/cli: wait_passively), so a benchmark run through
it runs transformers under the engine's setting too. Here the same work (workloads.py) is built afresh in a child
process whose environment has none of npumoed's settings (OMP_WAIT_POLICY unset, no NPUMOE_* variables); only the
thread count is the benchmark's, as for every other row. The parent drives it one call at a time over a pipe, so
its calls take their turn in the parent's rounds (timing.interleaved_seconds) and its ratios pair round by round
like any other row's. A call's time is the child's own clock around its run (timing.TimedElsewhere), not the
parent's around the hand-over, whose wake-up latency on a loaded machine would be counted against transformers.
Its output is checked against the parent's reference like any other row's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..paths import TRANSFORMERS_IMPLS
from ..timing import TimedElsewhere

# What npumoed sets in its own environment before torch loads, left out of the child's.
NPUMOED_SETTINGS = ("OMP_WAIT_POLICY",)
SUFFIX = " (own process)"  # how its rows are named: transformers-<impl> (own process)


def person_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`environ` (default: this process's) without npumoed's settings."""
    environ = dict(os.environ if environ is None else environ)
    return {key: value for key, value in environ.items()
            if key not in NPUMOED_SETTINGS and not key.startswith("NPUMOE")}


class OwnProcess:
    """A child process holding the benchmark's model, running transformers' implementations when asked.

    `spec`: what to build (`kind` "prefill": geometry, layers, dtype, context, seed, ids, chunk_tokens; "moe":
    geometry, dtype, seed, inputs: a file of (hidden, top_k_index, top_k_weights)) and `threads`."""

    def __init__(self, spec: dict) -> None:
        self._child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=person_environment(), text=True)
        self.environment = self._ask({"build": spec})["environment"]

    def call(self, impl: str) -> Callable[[], TimedElsewhere]:
        """One run of `impl` in the child, as a call the parent's rounds can time: the child's seconds."""
        return lambda: TimedElsewhere(self._ask({"run": impl})["seconds"])

    def output(self, impl: str) -> tuple[torch.Tensor, ...]:
        """`impl`'s output in the child, for the parent's exactness check."""
        with tempfile.TemporaryDirectory(prefix="npumoed-own-") as folder:
            path = Path(folder) / "output.pt"
            self._ask({"run": impl, "save": str(path)})
            return tuple(torch.load(path))

    def close(self) -> None:
        if self._child.stdin is not None:
            self._child.stdin.close()
        self._child.wait(timeout=60)

    def _ask(self, message: dict) -> dict:
        assert self._child.stdin is not None and self._child.stdout is not None
        self._child.stdin.write(json.dumps(message) + "\n")
        self._child.stdin.flush()
        line = self._child.stdout.readline()
        if not line:
            raise RuntimeError(f"transformers' own process ended (exit status {self._child.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"transformers' own process: {answer['error']}")
        return answer


@contextmanager
def transformers_elsewhere(spec: dict, wanted: bool) -> Iterator[dict]:
    """transformers' implementations in a process of their own building `spec`, as measure_impls' `elsewhere`
    (none unless `wanted`); the process ends with the block."""
    if not wanted:
        yield {}
        return
    process = OwnProcess(spec)
    try:
        yield {f"transformers-{name}{SUFFIX}": (process.call(f"transformers-{name}"),
                                                lambda name=name: process.output(f"transformers-{name}"))
               for name in TRANSFORMERS_IMPLS}
    finally:
        process.close()


def _build(spec: dict) -> tuple[PreTrainedModel, Callable[[], tuple[torch.Tensor, ...]]]:
    """The child's model and its run, from `spec` (OwnProcess)."""
    from npumoe.engine.loading.load import TORCH_DTYPES
    from npumoe.engine.moe.model_experts import moe_experts
    from npumoe.engine.synthetic.geometry import build_layer_model, parse_geometry

    from .workloads import build_model, prefill_parts

    torch.set_num_threads(spec["threads"])
    geometry, dtype = parse_geometry(spec["geometry"]), TORCH_DTYPES[spec["dtype"]]
    if spec["kind"] == "prefill":
        model = build_model(geometry, spec["layers"], dtype, context=spec["context"], seed=spec["seed"])
        ids, chunk = spec["ids"], spec["chunk_tokens"]
        return model, lambda: prefill_parts(model, ids, chunk)
    elif spec["kind"] == "moe":
        model = build_layer_model(geometry, dtype, torch.Generator().manual_seed(spec["seed"]))
        experts = moe_experts(model)[0][1]
        inputs = torch.load(spec["inputs"])
        return model, lambda: (experts(*inputs),)
    raise ValueError(f"unknown kind of work {spec['kind']!r}")


def main() -> None:
    """The child's loop: one JSON request a line on stdin, one JSON answer a line on stdout."""
    built: tuple[PreTrainedModel, Callable[[], tuple[torch.Tensor, ...]]] | None = None
    with torch.inference_mode():
        for line in sys.stdin:
            request = json.loads(line)
            try:
                if "build" in request:
                    built = _build(request["build"])
                    answer: dict = {"environment": {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}}
                else:
                    if built is None:
                        raise ValueError("asked to run before anything was built")
                    model, run = built
                    model.set_experts_implementation(request["run"].removeprefix("transformers-"))
                    start = time.perf_counter()
                    output = run()
                    answer = {"seconds": time.perf_counter() - start}
                    if "save" in request:
                        torch.save(list(output), request["save"])
            except Exception as e:  # the parent reports it as the row's error
                answer = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
