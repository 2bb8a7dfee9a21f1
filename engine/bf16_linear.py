"""The engine's own bf16 matmul for x86-64 CPUs with AVX512-BF16, built from bf16_linear.c at first use.

Why its own: an expert in prefill sees a few to a few dozen rows, so its matmuls are bound by reading
the expert's weights. oneDNN's small-batch kernels read them at 13-18 GB/s on one Zen 4 core, where a
plain in-order stream over a weight packed for it reaches 21-26 GB/s; at hundreds of rows the two are
level (measured with `npumoed bench moe`).

The C source is compiled with the system's C compiler (`$CC`, else `cc`) into the user's cache folder
(`$NPUMOE_CACHE`, else the platform's), under a name that hashes the source, so an edit never loads a
stale build. Where there is no compiler, no x86-64 CPU or no AVX512-BF16, `unavailable()` says why and
the experts use oneDNN instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import platformdirs
import torch

BLOCK = 64  # output columns per packed weight block, as in bf16_linear.c
SOURCE = Path(__file__).with_name("bf16_linear.c")
FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC")


def supports(out_features: int, in_features: int) -> bool:
    """Whether a (out_features, in_features) weight packs into whole blocks of K pairs."""
    return out_features % BLOCK == 0 and in_features % 2 == 0 and min(out_features, in_features) > 0


def pack(w: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16 -> (N/64, K/2, 64, 2): each block of 64 output columns one in-order stream of K pairs."""
    n, k = w.shape
    if w.dtype != torch.bfloat16 or not supports(n, k):
        raise ValueError(f"need a bf16 weight with N % {BLOCK} == 0 and K even, got {w.dtype} {tuple(w.shape)}")
    return w.reshape(n // BLOCK, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(m, K) bf16 rows times a packed (N, K) weight -> (m, N), into `out` when given (rows may be strided)."""
    m, k = x.shape
    n = packed.shape[0] * BLOCK
    if out is None:
        out = x.new_empty(m, n)
    if (x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or k != packed.shape[1] * 2 or out.shape != (m, n)
            or x.stride(1) != 1 or out.stride(1) != 1 or not packed.is_contiguous()):
        raise ValueError(f"bf16 linear: x {x.dtype} {tuple(x.shape)}, weight ({n}, {packed.shape[1] * 2}), out "
                         f"{out.dtype} {tuple(out.shape)}; rows must be unit-stride")
    if m:
        _library().npumoe_linear_bf16(x.data_ptr(), m, x.stride(0), packed.data_ptr(), n, k, out.data_ptr(),
                                      out.stride(0))
    return out


def unavailable() -> str | None:
    """Why this machine cannot run the kernel, or None when it can."""
    try:
        _library()
    except OSError as e:
        return str(e)
    return None


@functools.cache
def _library() -> ctypes.CDLL:
    """The compiled kernel, built once per source and cached; OSError says why there is none here."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise OSError(f"the bf16 kernel is for x86-64 CPUs, this is {platform.machine()}")
    library = ctypes.CDLL(str(_build()))
    if not library.npumoe_cpu_has_avx512bf16():
        raise OSError("this CPU lacks AVX512-BF16")
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.npumoe_linear_bf16.argtypes = [pointer, size, size, pointer, size, size, pointer, size]
    library.npumoe_linear_bf16.restype = None
    return library


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise OSError("no C compiler found (set CC) to build the bf16 kernel")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    folder = Path(os.environ.get("NPUMOE_CACHE") or platformdirs.user_cache_dir("npumoe")) / "kernels"
    target = folder / f"bf16_linear-{digest}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # Build under a private name and rename: processes building at once each finish a whole file.
    fd, partial = tempfile.mkstemp(dir=folder, prefix=".building-", suffix=".so")
    os.close(fd)
    try:
        try:
            result = subprocess.run([compiler, *FLAGS, "-o", partial, str(SOURCE)], capture_output=True,
                                    text=True, timeout=120)
        except subprocess.TimeoutExpired as e:
            raise OSError(f"{compiler} took over {e.timeout:.0f} s to build the bf16 kernel") from e
        if result.returncode != 0:
            raise OSError(f"{compiler} could not build the bf16 kernel: {result.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target
