"""Builds the C++ kernels on first use and caches them; None where they cannot run.

The extension is compiled from `matvec.cpp` with `torch.utils.cpp_extension.load` into
`$GLASSFORMER_HOME/kernels/<hash>` (default `~/.cache/glassformer/kernels/<hash>`), the hash
covering the source, the flags and the torch version, so an edit or an upgrade rebuilds it.
A cached build is imported directly, without running the compiler. Setting
`GLASSFORMER_KERNELS=torch` selects the pure-PyTorch path everywhere.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).parent / "csrc" / "matvec.cpp"
# #included by SOURCE
INCLUDED = [SOURCE.with_name(name)
            for name in ("quantized.cpp", "decode_step.cpp", "train_ops.cpp")]
# -march=native: the build is for this machine's CPU (AVX-512 VNNI where it has it), so the
# cache key covers the CPU's feature flags as well
CFLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_UNSET = object()
_module: object = _UNSET


def cache_dir() -> Path:
    home = os.environ.get("GLASSFORMER_HOME")
    root = Path(home) if home else Path.home() / ".cache" / "glassformer"
    return root / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), which -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _why_unavailable() -> str | None:
    """A reason the C++ kernels cannot be used on this machine, or None."""
    if os.environ.get("GLASSFORMER_KERNELS", "").lower() == "torch":
        return "GLASSFORMER_KERNELS=torch"
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform == "win32":
        return f"no AVX2 kernels for {sys.platform}/{platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "this CPU has no AVX2"
    return None


def _build(name: str, directory: Path) -> ModuleType:
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
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
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=str(directory),
            verbose=False,
        )
    finally:
        os.environ["PATH"] = path


def _load() -> ModuleType | None:
    reason = _why_unavailable()
    if reason is not None:
        if not reason.startswith("GLASSFORMER_KERNELS"):
            print(f"glassformer: using PyTorch kernels ({reason})", file=sys.stderr)
        return None
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in [SOURCE, *INCLUDED])
        + " ".join(CFLAGS + [torch.__version__, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    name = f"glassformer_kernels_{key}"
    directory = cache_dir() / key
    library = directory / f"{name}.so"
    if library.exists():
        try:
            spec = importlib.util.spec_from_file_location(name, library)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        except ImportError:  # a partial file from an interrupted build: build again
            pass
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        print(f"glassformer: using PyTorch kernels (no C++ compiler {compiler})", file=sys.stderr)
        return None
    try:
        return _build(name, directory)
    except Exception as error:  # any build or import failure falls back to PyTorch
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(
            f"glassformer: could not build the CPU kernels ({type(error).__name__}: "
            f"{first_line}); using the PyTorch path",
            file=sys.stderr,
        )
        return None


def extension() -> ModuleType | None:
    """The compiled kernels module (built on the first call), or None for the PyTorch path."""
    global _module
    if _module is _UNSET:
        _module = _load()
    return _module  # type: ignore[return-value]


def reset() -> None:
    """Forgets the loaded module so the next call decides again (tests, env changes)."""
    global _module
    _module = _UNSET
