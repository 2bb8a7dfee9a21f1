"""From a checkpoint to a loaded model: resolving a name, streaming tensors into the engine's formats, sizes, `auto`
weights.
"""
