"""`backend = "cuda"` in the config: accepted as a choice, refused at the engine with the reason where torch finds
no GPU, and shown by `npumoed doctor` as available or not, with what it found."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from npumoe.daemon.cli import main
from npumoe.daemon.config import load_config
from npumoe.daemon.home import Home
from npumoe.daemon.model_choice import engine_settings
from npumoe.engine.backends.cuda.env import cuda_availability

AVAILABLE, REASON = cuda_availability()


def test_the_config_takes_the_cuda_backend(configure) -> None:
    config = load_config(configure('[model]\nname = "/models/x"\nbackend = "cuda"\n'))
    assert config.model.backend == "cuda"


@pytest.mark.skipif(AVAILABLE, reason="this machine has a GPU: the refusal cannot be seen")
def test_without_a_gpu_the_engine_refuses_the_configured_cuda_backend_saying_why(configure, home: Path,
                                                                                 tmp_path: Path) -> None:
    config = load_config(configure(f'[model]\nname = "{tmp_path}"\nbackend = "cuda"\n'))
    refusal = f"the cuda backend needs an NVIDIA GPU that torch can use: {REASON}"
    with pytest.raises(ValueError, match=re.escape(refusal)):
        engine_settings(config, Home(home), threads=None)


def test_doctor_says_whether_the_cuda_backend_can_run_here_and_why(home: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUMOE_MODELS", str(tmp_path / "models"))  # no demo model made: doctor loads none
    result = CliRunner().invoke(main, ["doctor", "--json"], catch_exceptions=False)
    check = {c["check"]: c for c in json.loads(result.output)["checks"]}["backend cuda"]
    assert check == {"check": "backend cuda", "status": "ok" if AVAILABLE else "warn", "summary": REASON,
                     "detail": REASON}
