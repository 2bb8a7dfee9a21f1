"""Processors the project runs on, simulated by answering torch's and Python's feature probes, and a fake C
compiler: for tests of what the engine decides from the CPU, whichever CPU runs them.

A simulated CPU answers every probe the engine's choices read (the architecture, torch's vector
capability, AVX512-BF16, AMX tiles, oneDNN and its bf16), so no answer comes from the machine at hand.
"""

from __future__ import annotations

import platform
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from npumoe.engine.formats.quantize import error_bound
from npumoe.engine.kernels import choice as mechanism
from npumoe.engine.kernels import float_kernels, host, native


@dataclass(frozen=True)
class Cpu:
    name: str
    arch: str  # platform.machine()
    capability: str  # torch.backends.cpu.get_cpu_capability()
    avx512_bf16: bool
    amx: bool
    avx512_vnni: bool
    onednn: bool  # torch.backends.mkldnn.is_available()
    onednn_bf16: bool
    arm_features: frozenset[str] = frozenset()  # host.arm_features(): asimddp, i8mm, bf16
    kleidiai: bool = False  # torch.backends.kleidiai.is_available()
    avx_vnni: bool = False  # "avx_vnni" in host.cpu_flags(): AVX-VNNI, the VEX form of the byte dot products


ZEN4 = Cpu("AMD Zen 4", "x86_64", "AVX512", avx512_bf16=True, amx=False, avx512_vnni=True, onednn=True,
           onednn_bf16=True)
SAPPHIRE_RAPIDS = Cpu("Intel Xeon with AMX", "x86_64", "AVX512", avx512_bf16=True, amx=True, avx512_vnni=True,
                      onednn=True, onednn_bf16=True, avx_vnni=True)
ICE_LAKE = Cpu("Intel Xeon with AVX-512 VNNI, no BF16 or AMX", "x86_64", "AVX512", avx512_bf16=False, amx=False,
               avx512_vnni=True, onednn=True, onednn_bf16=True)
INTEL_MAC = Cpu("Intel Mac (AVX2)", "x86_64", "AVX2", avx512_bf16=False, amx=False, avx512_vnni=False, onednn=True,
                onednn_bf16=False)
# Its features say no dot product, as an Armv8.0 core's would, and its torch no KleidiAI: the Arm kernels, which a
# simulation cannot run (its compiler and torch are this machine's), are left out; the tests marked arm64 run them
# on an arm64 CPU (emulated by make test-arm64).
APPLE_SILICON = Cpu("Apple silicon", "arm64", "DEFAULT", avx512_bf16=False, amx=False, avx512_vnni=False,
                    onednn=False, onednn_bf16=False)
CPUS = (ZEN4, SAPPHIRE_RAPIDS, ICE_LAKE, INTEL_MAC, APPLE_SILICON)


def within_this_host(cpu: Cpu) -> Cpu:
    """`cpu` with no x86 feature this machine lacks: for a test whose choice really runs the kernels (an accuracy
    probe), where a simulated instruction the processor does not have would kill the process (SIGILL)."""
    capability = torch.backends.cpu.get_cpu_capability()
    avx512 = cpu.capability == "AVX512" and capability == "AVX512"
    return replace(cpu, capability=cpu.capability if avx512 or cpu.capability != "AVX512" else capability,
                   avx512_bf16=avx512 and cpu.avx512_bf16 and torch.cpu._is_avx512_bf16_supported(),
                   amx=avx512 and cpu.amx and torch.cpu._is_amx_tile_supported(),
                   avx512_vnni=avx512 and cpu.avx512_vnni and torch.cpu._is_vnni_supported(),
                   avx_vnni=cpu.avx_vnni and "avx_vnni" in host.cpu_flags())


def simulate(monkeypatch: pytest.MonkeyPatch, cpu: Cpu) -> None:
    """Make every feature probe answer as `cpu` would, in a fresh process's state (nothing built or chosen
    yet, see `fresh_process`), for the test's span."""
    monkeypatch.setattr(platform, "machine", lambda: cpu.arch)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cpu.capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: cpu.avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: cpu.amx)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: cpu.avx512_vnni)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: cpu.onednn)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: cpu.onednn_bf16)
    monkeypatch.delenv(host.MAX_ISA_VARIABLE, raising=False)  # a ceiling put on this machine's CPU, not on `cpu`
    monkeypatch.setattr(host, "arm_features", lambda: cpu.arm_features)
    monkeypatch.setattr(host, "cpu_flags", lambda: frozenset({"avx_vnni"} if cpu.avx_vnni else ()))
    monkeypatch.setattr(torch.backends.kleidiai, "is_available", lambda: cpu.kleidiai)
    fresh_process(monkeypatch)


def fresh_process(monkeypatch: pytest.MonkeyPatch, cache: Path | None = None) -> None:
    """This process as a new one would start, for the test's span: no kernel built or tried, no kernel
    chosen, and (when given) `cache` as the user cache; the process's own state comes back afterwards."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(mechanism, "_chosen", {})
    if cache is not None:
        monkeypatch.setenv("NPUMOE_CACHE", str(cache))


class FakeTimings:
    """Stands in for `float_kernels.time_kernels`: the figures given, and a record of every timing asked; and for
    its probe (`probe`), which finds every kernel exact and records what it was asked."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self.calls: list[tuple[str, ...]] = []
        self.probed: list[tuple[str, ...]] = []

    def __call__(self, kernels, gate_up, down) -> dict[str, float]:
        self.calls.append(tuple(kernels))
        return {kernel: self.seconds[kernel] for kernel in kernels}

    def probe(self, kernels, gate_up, down) -> dict[str, mechanism.Accuracy]:
        self.probed.append(tuple(kernels))
        return {kernel: mechanism.Accuracy(0.0, error_bound(gate_up.dtype)) for kernel in kernels}


def fake_timings(monkeypatch: pytest.MonkeyPatch, cache: Path, fastest: str) -> FakeTimings:
    """Timing that finds `fastest` the fastest kernel (and every kernel within its bound), with no kernel chosen yet
    and `cache` as the user cache, so fake figures reach no other test (the kernel this process built, if any,
    stays loaded)."""
    monkeypatch.setattr(mechanism, "_chosen", {})
    monkeypatch.setenv("NPUMOE_CACHE", str(cache))
    timings = FakeTimings({kernel: 1e-3 * (1 + i) for i, kernel in
                           enumerate([fastest, *(k for k in float_kernels.KERNELS if k != fastest)])})
    monkeypatch.setattr(float_kernels, "time_kernels", timings)
    monkeypatch.setattr(float_kernels, "probe_kernels", timings.probe)  # kernels it may only pretend to run
    return timings


class CountedProjectionTimings:
    """Stands in for the projections' timing loop (`choice.time_in_turns` as projections.py calls it): each
    candidate runs once, so a broken one still fails, then `fastest` comes first; a record of every timing asked
    (its candidates), as FakeTimings keeps."""

    def __init__(self, fastest: str) -> None:
        self.fastest = fastest
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, kernels, count, run) -> dict[str, float]:
        self.calls.append(tuple(kernels))
        for kernel in kernels:
            run(kernel, 0)
        return {kernel: 1e-3 if kernel == self.fastest else 2e-3 for kernel in kernels}


def fake_projection_timings(monkeypatch: pytest.MonkeyPatch, cache: Path, fastest: str) -> CountedProjectionTimings:
    """Projection timing that finds `fastest` the fastest kernel, with no kernel chosen yet and `cache` as the user
    cache, so fake figures reach no other test."""
    from npumoe.engine.attach import projections

    monkeypatch.setattr(mechanism, "_chosen", {})
    monkeypatch.setenv("NPUMOE_CACHE", str(cache))
    timings = CountedProjectionTimings(fastest)
    monkeypatch.setattr(projections, "time_in_turns", timings)
    return timings


_FAKE_CC = """
import pathlib, sys
args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(" ".join(args) + "\\n")
if {fails!r}:
    sys.exit("fake cc: cannot build this")
pathlib.Path(args[args.index("-o") + 1]).write_bytes(b"built by the fake compiler")
"""


class FakeLibrary:
    """What the fake loader hands back: any exported function, which takes the argument types it is given
    and returns 0."""

    def __getattr__(self, name: str) -> object:
        function = type("Function", (), {"__call__": lambda self, *args: 0})()  # every call succeeds
        setattr(self, name, function)
        return function


class FakeBuild:
    """A C compiler (a Python script, run as `CC="python fake_cc.py"`) that logs each run and writes a
    stand-in library, and a loader that records what it was asked to load instead of loading it."""

    def __init__(self, folder: Path, fails: bool) -> None:
        self.log = folder / "cc.log"
        self.script = folder / "fake_cc.py"
        self.script.write_text(_FAKE_CC.format(log=str(self.log), fails=fails))
        self.loaded: list[tuple[Path, bytes]] = []

    @property
    def runs(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def load(self, path: str) -> object:
        self.loaded.append((Path(path), Path(path).read_bytes()))
        return FakeLibrary()


def fake_build(monkeypatch: pytest.MonkeyPatch, folder: Path, *, fails: bool = False) -> FakeBuild:
    build = FakeBuild(folder, fails)
    monkeypatch.setenv("CC", shlex.join([sys.executable, str(build.script)]))
    monkeypatch.setattr(native.ctypes, "CDLL", build.load)
    return build
