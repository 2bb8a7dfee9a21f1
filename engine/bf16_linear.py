"""The engine's own bf16 matmul for x86-64 CPUs with AVX512-BF16, built from bf16_linear.c at first use.

Why its own: an expert in prefill sees a few to a few dozen rows, so its matmuls are bound by reading
the expert's weights. oneDNN's small-batch kernels read them at 13-18 GB/s on one Zen 4 core, where a
plain in-order stream over a weight packed for it reaches 21-26 GB/s; at hundreds of rows the two are
level (measured with `npumoed bench moe`).

The C source is compiled with the system's C compiler (`$CC`, else `cc`) into the user's cache folder
(`$NPUMOE_CACHE`, else the platform's), under a name that hashes the source, so an edit never loads a
stale build. The folder must be this user's and closed to others' writes, and a library is loaded only if
its content matches the hash recorded when it was built. Where there is no compiler, no x86-64 CPU or no
AVX512-BF16, `unavailable()` says why and the experts choose among the other kernels (cpu_kernels).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from .host import cache_root

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
    loaded = _load()
    return loaded if isinstance(loaded, str) else None


def unsupported_cpu() -> str | None:
    """Why this CPU cannot run the kernel whatever the compiler does, or None when it can."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the bf16 kernel is for x86-64 CPUs, this is {platform.machine()}"
    if not torch.cpu._is_avx512_bf16_supported():
        return "this CPU lacks AVX512-BF16"
    return None


def _library() -> ctypes.CDLL:
    loaded = _load()
    if isinstance(loaded, str):
        raise OSError(loaded)
    return loaded


@functools.cache
def _load() -> ctypes.CDLL | str:
    """The compiled kernel, or why there is none here. Tried once per process: a compiler that fails is not
    asked again for every experts module, and one is never asked on a CPU that could not run what it builds
    (an Intel Mac without developer tools would offer to install them)."""
    why = unsupported_cpu()
    if why is not None:
        return why
    try:
        compiler = _compiler()
        folder = cache_root() / "kernels"
        unsafe = _unsafe(folder)
        if unsafe is None:
            return _open(_built(folder, compiler))
        warnings.warn(f"the kernel cache {folder} is not safe to load code from: {unsafe}; the bf16 kernel is "
                      "built in a private temporary folder instead", RuntimeWarning, stacklevel=2)
        with tempfile.TemporaryDirectory(prefix="npumoe-kernel-") as private:
            return _open(_built(Path(private), compiler))  # once loaded, the file may go
    except OSError as e:
        return str(e)


def _compiler() -> list[str]:
    """The C compiler's command: `$CC` (which may carry arguments, as `ccache gcc` does), else the system's."""
    command = shlex.split(os.environ.get("CC", ""))
    if not command:
        found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if not found:
            raise OSError("no C compiler found (set CC) to build the bf16 kernel")
        command = [found]
    return command


def _unsafe(folder: Path) -> str | None:
    """Why `folder` cannot hold libraries this process loads, or None: anyone else who can write there could
    plant code that runs as this user."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = folder.stat()
    if status.st_uid != os.getuid():
        return f"it belongs to user id {status.st_uid}, not this user"
    if status.st_mode & 0o022:
        return f"others can write to it (mode {stat.S_IMODE(status.st_mode):o}; `chmod go-w` it to cache there)"
    return None


def _built(folder: Path, compiler: list[str]) -> Path:
    """The kernel built by `compiler` in `folder`, under a name that hashes the source and the command, so an
    edit never loads a stale build; built now unless a library whose content matches its record is there."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((*compiler, *FLAGS)).encode()).hexdigest()[:16]
    target = folder / f"bf16_linear-{digest}.so"
    if _matches_record(target):
        return target
    # Build under a private name and rename: processes building at once each finish a whole file.
    fd, partial = tempfile.mkstemp(dir=folder, prefix=".building-", suffix=".so")
    os.close(fd)
    try:
        try:
            result = subprocess.run([*compiler, *FLAGS, "-o", partial, str(SOURCE)], capture_output=True,
                                    text=True, timeout=120)
        except subprocess.TimeoutExpired as e:
            raise OSError(f"{shlex.join(compiler)} took over {e.timeout:.0f} s to build the bf16 kernel") from e
        except OSError as e:
            raise OSError(f"{shlex.join(compiler)} could not build the bf16 kernel: {e}") from e
        if result.returncode != 0:
            raise OSError(f"{shlex.join(compiler)} could not build the bf16 kernel: "
                          f"{result.stderr.strip()[-500:]}")
        _record(target).write_text(_sha256(Path(partial)))
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def _open(library_path: Path) -> ctypes.CDLL:
    """Load a built kernel, only if its content is what was recorded when it was built."""
    if not _matches_record(library_path):
        raise OSError(f"{library_path} is not the library built there (its content hash does not match the record)")
    library = ctypes.CDLL(str(library_path))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.npumoe_linear_bf16.argtypes = [pointer, size, size, pointer, size, size, pointer, size]
    library.npumoe_linear_bf16.restype = None
    return library


def _record(library_path: Path) -> Path:
    return library_path.with_name(library_path.name + ".sha256")


def _matches_record(library_path: Path) -> bool:
    try:
        return _record(library_path).read_text().strip() == _sha256(library_path)
    except OSError:  # no library or no record
        return False


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
