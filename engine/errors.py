"""The errors the engine gives its callers for what they asked of it."""

from __future__ import annotations


class ModelError(ValueError):
    """A model that cannot be found or is not one the engine can run."""
