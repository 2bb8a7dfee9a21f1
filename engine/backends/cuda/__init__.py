"""The `cuda` backend: the plan's group graphs captured as CUDA graphs on an NVIDIA GPU (backend.py)."""
