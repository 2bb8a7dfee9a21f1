"""The engine's own C kernels, each built from its source beside this module at first use and loaded with ctypes.

A source is compiled with the system's C compiler (`$CC`, else `cc`), this folder on its include path for the
headers beside it, into the user's cache folder (`$NPUMOE_CACHE`, else the platform's), under a name that hashes the
source and the headers it includes, so an edit of either never loads a stale build. The folder must be this user's
and closed to others' writes, and a library is loaded only if its content matches the hash recorded when it was
built. A kernel is built only on a CPU that can run it
(its `unsupported_cpu` says None): an Intel Mac without developer tools would otherwise offer to install them.
Where it cannot be built or run, `unavailable` says why and the engine chooses among its other kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .host import cache_root, isa_ceiling_refuses

FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC")


# How messages name each architecture, and the names platform.machine() gives it.
ARCHITECTURES = {"x86-64": ("x86_64", "amd64"), "arm64": ("arm64", "aarch64")}


def cpu_lacks(what: str, architecture: str, feature: str, has: Callable[[], bool],
              level: str | None = None) -> str | None:
    """Why this CPU cannot run `what`, a kernel for `architecture` CPUs with `feature` (which `has` finds, asked only
    on that architecture), at instruction set `level` of `$NPUMOE_MAX_CPU_ISA` when given; None when it can."""
    if platform.machine().lower() not in ARCHITECTURES[architecture]:
        return f"{what} is for {architecture} CPUs, this is {platform.machine()}"
    if not has():
        return f"this CPU lacks {feature}"
    return None if level is None else isa_ceiling_refuses(level)


def has_avx2() -> bool:
    """Whether torch finds AVX2 and FMA here (its AVX2 level means both; AVX-512 CPUs have both)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def x86_avx512_missing(what: str) -> str | None:
    """Why this CPU cannot run `what`, a kernel for x86-64 CPUs with AVX-512, or None when it can."""
    return cpu_lacks(what, "x86-64", "AVX-512", lambda: torch.backends.cpu.get_cpu_capability() == "AVX512", "avx512")


@dataclass(frozen=True)
class NativeKernel:
    """One C source, `<name>.c` beside this module, the headers beside it that it includes, and the functions it
    exports (all return `restype`)."""

    name: str
    what: str  # how messages name it: "the bf16 kernel"
    functions: Mapping[str, Sequence[type]]  # exported name -> ctypes argument types
    unsupported_cpu: Callable[[], str | None]  # why this CPU cannot run it whatever the compiler does
    restype: type | None = None
    headers: Sequence[str] = ()  # file names, as it #includes them

    @property
    def source(self) -> Path:
        return Path(__file__).with_name(f"{self.name}.c")

    @property
    def sources(self) -> tuple[Path, ...]:
        """Every file its build reads from this folder: the source, then its headers."""
        return (self.source, *(Path(__file__).with_name(header) for header in self.headers))

    def unavailable(self) -> str | None:
        """Why this machine cannot run the kernel, or None when it can."""
        loaded = _load(self)
        return loaded if isinstance(loaded, str) else None

    def library(self) -> ctypes.CDLL:
        """The loaded library; OSError with the reason where there is none."""
        loaded = _load(self)
        if isinstance(loaded, str):
            raise OSError(loaded)
        return loaded


# Each kernel is tried once per process: a compiler that fails is not asked again for every experts module.
_loaded: dict[str, ctypes.CDLL | str] = {}
_loading = threading.Lock()


def _load(kernel: NativeKernel) -> ctypes.CDLL | str:
    """The compiled kernel, or why there is none here."""
    with _loading:
        if kernel.name not in _loaded:
            _loaded[kernel.name] = _try_load(kernel)
        return _loaded[kernel.name]


def _try_load(kernel: NativeKernel) -> ctypes.CDLL | str:
    why = kernel.unsupported_cpu()
    if why is not None:
        return why
    try:
        compiler = _compiler(kernel)
        folder = cache_root() / "kernels"
        unsafe = _unsafe(folder)
        if unsafe is None:
            return _open(kernel, _built(kernel, folder, compiler))
        warnings.warn(f"the kernel cache {folder} is not safe to load code from: {unsafe}; {kernel.what} is "
                      "built in a private temporary folder instead", RuntimeWarning, stacklevel=4)
        with tempfile.TemporaryDirectory(prefix="npumoe-kernel-") as private:
            return _open(kernel, _built(kernel, Path(private), compiler))  # once loaded, the file may go
    except OSError as e:
        return str(e)


def _compiler(kernel: NativeKernel) -> list[str]:
    """The C compiler's command: `$CC` (which may carry arguments, as `ccache gcc` does), else the system's."""
    command = shlex.split(os.environ.get("CC", ""))
    if not command:
        found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if not found:
            raise OSError(f"no C compiler found (set CC) to build {kernel.what}")
        command = [found]
    return command


def _unsafe(folder: Path) -> str | None:
    """Why `folder` cannot hold libraries this process loads, or None: anyone else who can write there could
    plant code that runs as this user, and so could anyone who can write to a folder above it (they would
    rename it away and put their own in its place), unless that folder is sticky (as /tmp is)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = folder.stat()
    if status.st_uid != os.getuid():
        return f"it belongs to user id {status.st_uid}, not this user"
    if status.st_mode & 0o022:
        return f"others can write to it (mode {stat.S_IMODE(status.st_mode):o}; `chmod go-w` it to cache there)"
    for above in folder.resolve().parents:
        status = above.stat()
        if status.st_uid not in (os.getuid(), 0):
            return f"{above} above it belongs to user id {status.st_uid}, neither this user nor root"
        if status.st_mode & 0o022 and not status.st_mode & stat.S_ISVTX:
            return f"others can write to {above} above it (mode {stat.S_IMODE(status.st_mode):o})"
    return None


def _built(kernel: NativeKernel, folder: Path, compiler: list[str]) -> Path:
    """The kernel built by `compiler` in `folder`, under a name that hashes the sources and the command, so an
    edit never loads a stale build; built now unless a library whose content matches its record is there."""
    read = b"".join(source.read_bytes() for source in kernel.sources)
    digest = hashlib.sha256(read + " ".join((*compiler, *FLAGS)).encode()).hexdigest()[:16]
    target = folder / f"{kernel.name}-{digest}.so"
    if _matches_record(target):
        return target
    # Build under a private name and rename: processes building at once each finish a whole file.
    fd, partial = tempfile.mkstemp(dir=folder, prefix=".building-", suffix=".so")
    os.close(fd)
    try:
        try:
            result = subprocess.run([*compiler, *FLAGS, "-I", str(kernel.source.parent), "-o", partial,
                                     str(kernel.source)], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired as e:
            raise OSError(f"{shlex.join(compiler)} took over {e.timeout:.0f} s to build {kernel.what}") from e
        except OSError as e:
            raise OSError(f"{shlex.join(compiler)} could not build {kernel.what}: {e}") from e
        if result.returncode != 0:
            raise OSError(f"{shlex.join(compiler)} could not build {kernel.what}: {result.stderr.strip()[-500:]}")
        _record(target).write_text(_sha256(Path(partial)))
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def _open(kernel: NativeKernel, library_path: Path) -> ctypes.CDLL:
    """Load a built kernel, only if its content is what was recorded when it was built."""
    if not _matches_record(library_path):
        raise OSError(f"{library_path} is not the library built there (its content hash does not match the record)")
    library = ctypes.CDLL(str(library_path))
    for name, argtypes in kernel.functions.items():
        function = getattr(library, name)
        function.argtypes = list(argtypes)
        function.restype = kernel.restype
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
