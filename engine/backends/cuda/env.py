"""Whether the `cuda` backend can run here, and why not: the one place that asks torch about CUDA devices."""

from __future__ import annotations

import torch


def cuda_availability() -> tuple[bool, str]:
    """(whether torch can run graphs on a CUDA device here, what it found or why not)."""
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA device"
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    return True, (f"{torch.cuda.get_device_name(device)}, {free / 2**30:.0f} of {total / 2**30:.0f} GiB free, "
                  f"CUDA {torch.version.cuda}, torch {torch.__version__}")
