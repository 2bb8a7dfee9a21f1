"""The Core ML environment: importing coremltools quietly, and whether Core ML can predict here.

coremltools converts and saves packages on any platform, but predicts only on macOS, where its
native `libcoremlpython` exists. Multifunction packages need macOS 15 (Core ML's iOS 18 spec).
"""

from __future__ import annotations

import logging
import platform
import sys
from functools import cache
from importlib.metadata import version
from types import ModuleType

MIN_MACOS = (15, 0)


@cache
def import_coremltools() -> ModuleType:
    """coremltools, imported once without its import-time warnings.

    Off macOS it warns that its native proxies are missing, and it warns about every torch newer
    than the one it was tested with; `coreml_availability` reports the first plainly and the tests
    check that conversion works with this torch.
    """
    log = logging.getLogger("coremltools")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import coremltools
    finally:
        log.setLevel(level)
    return coremltools


def coremltools_version() -> str:
    """The installed coremltools' version, without importing it (which takes seconds): builds are kept per version."""
    return version("coremltools")


def macos_version() -> tuple[int, ...]:
    """(major, minor, ...) on macOS; () elsewhere."""
    release = platform.mac_ver()[0]
    return tuple(int(part) for part in release.split(".")) if release else ()


def coreml_availability() -> tuple[bool, str]:
    """(whether the `coreml` backend can run groups on the Neural Engine here, why or why not)."""
    if sys.platform != "darwin":
        return False, f"Core ML prediction needs macOS; this is {platform.system()} (conversion still works)"
    version = macos_version()
    if version < MIN_MACOS:
        return False, (f"multifunction Core ML packages need macOS {'.'.join(map(str, MIN_MACOS))} or newer; "
                       f"this is macOS {'.'.join(map(str, version))}")
    ct = import_coremltools()
    from coremltools.models.compute_device import MLComputeDevice, MLNeuralEngineComputeDevice
    from coremltools.models.model import _MLModelProxy  # None when the native bindings failed to load

    if _MLModelProxy is None:
        return False, f"coremltools {ct.__version__} could not load its Core ML bindings for this Python"
    devices = MLComputeDevice.get_all_compute_devices()
    engines = [d for d in devices if isinstance(d, MLNeuralEngineComputeDevice)]
    can_predict = f"Core ML {ct.__version__} can predict on macOS {platform.mac_ver()[0]}"
    if not engines:
        return False, f"{can_predict}, but this Mac has no Neural Engine"
    return True, f"{can_predict}; Neural Engine with {engines[0].total_core_count} cores"
