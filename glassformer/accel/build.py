"""Builds the C++ kernels on first use and caches them; None where they cannot run.

The extension is compiled from every `csrc/*.cpp` (with the header `csrc/glassformer.h`) by
`torch.utils.cpp_extension.load` into `<home>/kernels/<key>`, where `<home>` is
`$GLASSFORMER_HOME`, else `$XDG_CACHE_HOME/glassformer`, else `~/.cache/glassformer`. The key
hashes everything the binary depends on: the sources and header, the compiler and its
version, the flags, the Python and torch versions and the CPU's feature flags, so a change to
any of them builds afresh. A cached build is imported directly (the compiler is only asked
its version). Setting `GLASSFORMER_KERNELS=torch` selects the pure-PyTorch path everywhere.

Two targets: "native" (-march=native: AVX-512 VNNI where the CPU has it) and "avx2" (AVX2 +
FMA + F16C only), so the AVX2 path is built and tested on CPUs that have more. The library
uses the one `decisions.kernel_target` names: "avx2" where PyTorch's dispatch is lowered below
the CPU's AVX-512 (`ATEN_CPU_CAPABILITY=avx2`: the whole process then computes as an AVX2-only
CPU does), the faster of the two where both are compiled, else "native".
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

from ..home import home

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))  # every translation unit of the extension
HEADERS = tuple(sorted(CSRC.glob("*.h")))
TARGETS = {"native": "-march=native", "avx2": "-march=x86-64-v3"}
LDFLAGS = ["-fopenmp"]
# The row tile: the most rows one call of the small-batch kernels (the try_* entry points,
# ops.py's routing) takes, and the rows a batched step is cut into. Compiled into the
# kernels as GLASSFORMER_ROW_TILE; kernels.ROW_TILE is this name for the rest of the library.
ROW_TILE = 8

_loaded: dict[str, ModuleType | str] = {}  # target -> the module, or why there is none


def cflags(target: str) -> list[str]:
    return ["-O3", TARGETS[target], "-mavx2", "-mfma", "-mf16c", "-fopenmp",
            f"-DGLASSFORMER_ROW_TILE={ROW_TILE}"]


def cache_dir() -> Path:
    return home() / "kernels"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


@functools.cache
def _compiler_identity(compiler: str) -> str:
    """The compiler's resolved path and its `--version` output ("" where it is missing)."""
    path = shutil.which(compiler)
    if path is None:
        return ""
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return path
    return f"{os.path.realpath(path)}\n{done.stdout}"


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), which -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def cache_key(target: str = "native") -> str:
    """16 hex digits naming the build of `target` from these sources, by this toolchain."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        data = path.read_bytes()
        digest.update(f"{path.name}\0{len(data)}\0".encode() + data)
    for part in (_compiler_identity(_compiler()), " ".join(cflags(target) + LDFLAGS),
                 f"{sys.implementation.name} {sys.version}", torch.__version__, _cpu_flags()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def _why_unavailable() -> str | None:
    """A reason the C++ kernels cannot be used on this machine, or None."""
    if os.environ.get("GLASSFORMER_KERNELS", "").lower() == "torch":
        return "GLASSFORMER_KERNELS=torch"
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform == "win32":
        return f"no AVX2 kernels for {sys.platform}/{platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "this CPU has no AVX2"
    if _compiler_identity(_compiler()) == "":
        return f"no C++ compiler {_compiler()}"
    return None


def _import(name: str, library: Path) -> ModuleType | None:
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError:  # a partial file from an interrupted build: build again
        return None


def _build(name: str, directory: Path, target: str) -> ModuleType:
    """Compile under an OS lock: the kernel drops it when its holder dies, unlike torch's own
    lock file, which a build killed midway leaves behind for every later one to wait on."""
    import fcntl  # _why_unavailable() has ruled out Windows

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder finishes first
        library = directory / f"{name}.so"
        module = _import(name, library) if library.exists() else None
        if module is not None:
            return module
        (directory / "lock").unlink(missing_ok=True)  # torch's lock: stale, as we hold ours
        return _compile(name, directory, target)


def _compile(name: str, directory: Path, target: str) -> ModuleType:
    from torch.utils import cpp_extension

    print(
        f"glassformer: compiling the CPU kernels once (about a minute) into {directory}",
        file=sys.stderr,
        flush=True,
    )
    # ninja comes from PyPI: make the environment's bin directory visible to the build
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(source) for source in SOURCES],
            extra_cflags=cflags(target),
            extra_ldflags=LDFLAGS,
            build_directory=str(directory),
            verbose=False,
        )
    finally:
        os.environ["PATH"] = path


def _library(target: str) -> tuple[str, Path, Path]:
    """The module name, build folder and library file of `target`'s build."""
    key = cache_key(target)
    name = f"glassformer_kernels_{key}"
    return name, cache_dir() / key, cache_dir() / key / f"{name}.so"


def built(target: str) -> bool:
    """Whether `target`'s build of these sources is compiled and usable (none is started)."""
    return _why_unavailable() is None and _library(target)[2].exists()


def _load(target: str) -> ModuleType | str:
    """The module for `target`, or the reason there is none (also printed)."""
    reason = _why_unavailable()
    if reason is None:
        name, directory, library = _library(target)
        module = _import(name, library) if library.exists() else None
        if module is not None:
            return module
        try:
            return _build(name, directory, target)
        except Exception as error:  # any build or import failure falls back to PyTorch
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            reason = f"could not build them: {type(error).__name__}: {first_line}"
    if not reason.startswith("GLASSFORMER_KERNELS"):
        print(f"glassformer: using PyTorch kernels ({reason})", file=sys.stderr)
    return reason


def extension(target: str) -> ModuleType | None:
    """The compiled kernels for `target` (built on the first call), or None for the PyTorch
    path. Which target the library uses is a measured decision (decisions.kernel_target;
    kernels.extension asks it)."""
    if target not in _loaded:
        _loaded[target] = _load(target)
    found = _loaded[target]
    return None if isinstance(found, str) else found


def why_unavailable(target: str) -> str | None:
    """Why `extension(target)` is None (trying it first), or None when it is not."""
    extension(target)
    found = _loaded[target]
    return found if isinstance(found, str) else None


def reset() -> None:
    """Forgets the loaded modules so the next call decides again (tests, env changes)."""
    _loaded.clear()
