"""The model a command names, as the engine takes it: shared by the engine and weights commands."""

from __future__ import annotations

import click


def model_ref(name: str) -> str:
    """A folder or Hugging Face id for the engine; "demo" is the built-in demo MoE (model_choice.py)."""
    from ..model_choice import ModelNotFound, resolve_model

    try:
        return resolve_model(name)
    except ModelNotFound as e:
        raise click.ClickException(str(e)) from e
