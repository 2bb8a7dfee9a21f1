"""The `coreml` backend: group graphs converted to Core ML programs for the Neural Engine.

`backend` runs them (registered lazily in `engine.backends`), `convert` builds the packages, `cache` finds
finished builds, `ane` checks a program against what the Neural Engine accepts, `env` imports coremltools
and says whether Core ML can predict here, and `sizing` makes a plan and weights at a real geometry.
"""
