"""The engine's vocabulary: one spelling of each choice, importable without torch, and the backend registry."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from npumoe.daemon.config import ModelConfig
from npumoe.engine import vocabulary
from npumoe.engine.backends.base import BackendOptions
from npumoe.engine.backends.registry import REGISTRY, backend_class, get_backend
from npumoe.engine.loading.load import TORCH_DTYPES


def imported_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    done = subprocess.run([sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
                          capture_output=True, text=True, check=True)
    return set(done.stdout.split())


def test_the_vocabulary_config_and_the_commands_load_without_torch():
    modules = imported_after("import npumoe.engine.vocabulary, npumoe.daemon.config, npumoe.daemon.cli.status_view, "
                             "npumoe.daemon.cli")
    assert "torch" not in modules
    assert "npumoe.engine.api" not in modules  # the package's own names load only when asked for


def test_the_packages_names_still_load_on_first_use():
    import npumoe.engine as package
    from npumoe.engine import Engine, EngineSettings
    from npumoe.engine.api import Engine as defined

    assert Engine is defined and EngineSettings.__module__ == "npumoe.engine.api"
    with pytest.raises(AttributeError, match="has no attribute 'Engin'"):
        getattr(package, "Engin")  # noqa: B009 (the name is wrong on purpose)


def test_config_offers_exactly_the_vocabulary():
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(ModelConfig) if "choices" in f.metadata}
    assert choices == {"backend": vocabulary.BACKENDS, "coreml_compute_units": vocabulary.COMPUTE_UNITS,
                       "overflow": vocabulary.OVERFLOW_POLICIES, "weights": vocabulary.WEIGHTS,
                       "pooling": vocabulary.POOLINGS, "residency": vocabulary.RESIDENCY_POLICIES,
                       "dtype": ("", *vocabulary.DTYPES)}  # the deprecated dtype: "", unset, as when left out


def test_each_dtype_has_one_spelling_and_the_old_short_ones_map_onto_it():
    assert tuple(TORCH_DTYPES) == vocabulary.DTYPES
    assert [vocabulary.dtype_name(s) for s in ("fp32", "bf16", "float32", "bfloat16")] == [
        "float32", "bfloat16", "float32", "bfloat16"]


def test_the_registry_holds_every_backend_the_vocabulary_names():
    assert tuple(REGISTRY) == vocabulary.BACKENDS
    assert all(backend_class(name).name == name for name in vocabulary.BACKENDS)
    with pytest.raises(ValueError, match="unknown backend 'tpu'; choose one of cpu, torch-static, coreml, cuda"):
        get_backend("tpu")


def test_the_coreml_backend_is_imported_only_when_asked_for(tmp_path: Path):
    setup = "from npumoe.engine.api import EngineSettings\nEngineSettings(model='m', backend='torch-static')"
    assert "npumoe.engine.backends.coreml.backend" not in imported_after(setup)
    options = BackendOptions(compiled_dir=tmp_path, compute_units="all")
    backend = get_backend(vocabulary.COREML, options)
    assert (backend.name, backend.cache_root, backend.compute_units) == ("coreml", tmp_path, "all")
    with pytest.raises(ValueError, match="the coreml backend needs compiled_dir"):
        get_backend(vocabulary.COREML)
