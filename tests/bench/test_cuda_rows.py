"""`bench moe --cuda` and `bench prefill --cuda`: refused without a GPU, saying why; on one, every row runs and
passes the benches' checks (marked `gpu`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from npumoe.bench.cli import bench
from npumoe.bench.gpu.rows import CUDA_GRAPHS, CUDA_NO_GRAPHS, CUDA_PER_EXPERT, WITH_COPIES
from npumoe.engine.backends.cuda.env import cuda_availability

AVAILABLE, REASON = cuda_availability()
QUICK = ["--geometry", "64x8x2x32", "--dtype", "bf16", "--repeats", "1", "--warmup", "0", "--min-seconds", "0",
         "--threads", "2"]


@pytest.mark.skipif(AVAILABLE, reason="this machine has a GPU: the refusal cannot be seen")
@pytest.mark.parametrize("command", ["moe", "prefill"])
def test_without_a_gpu_the_cuda_rows_are_refused_before_anything_is_built(command: str) -> None:
    result = CliRunner().invoke(bench, [command, "--cuda", *QUICK])
    assert result.exit_code == 2
    assert f"the --cuda rows need an NVIDIA GPU that torch can use: {REASON}" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not AVAILABLE, reason=REASON)
@pytest.mark.parametrize("command, extra", [("moe", ["--tokens", "64"]),
                                            ("prefill", ["--layers", "2", "--document-tokens", "128", "--chunk", "64",
                                                         "--calibration-documents", "1"])], ids=["moe", "prefill"])
@pytest.mark.usefixtures("home")
def test_every_cuda_row_runs_and_passes_the_check(command: str, extra: list[str], tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    result = CliRunner().invoke(bench, [command, "--cuda", *QUICK, *extra, "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = {row["impl"]: row for row in json.loads(out.read_text())["results"]}
    expected = {CUDA_GRAPHS, CUDA_NO_GRAPHS, CUDA_PER_EXPERT, "transformers-eager-cuda", "transformers-grouped_mm-cuda",
                *([WITH_COPIES] if command == "moe" else [])}
    assert set(rows) == expected
    assert all(row["status"] == "ok" and row["tokens_per_s"] > 0 for row in rows.values()), rows
    # residency measured on the GPU decides the grouped rows' share; the baseline places every loaded expert there
    assert rows[CUDA_PER_EXPERT]["static_fraction"] > 0
