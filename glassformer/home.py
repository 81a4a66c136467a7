"""Where Glassformer keeps what it downloads and builds: pulled models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """`$GLASSFORMER_HOME`, else `$XDG_CACHE_HOME/glassformer`, else `~/.cache/glassformer`.
    A variable naming something other than a folder is refused, by name."""
    own = os.environ.get("GLASSFORMER_HOME")
    if own:
        return _folder(Path(own).expanduser(), "GLASSFORMER_HOME")
    cache = os.environ.get("XDG_CACHE_HOME")
    if cache:
        return _folder(Path(cache).expanduser(), "XDG_CACHE_HOME") / "glassformer"
    return Path.home() / ".cache" / "glassformer"


def _folder(path: Path, variable: str) -> Path:
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{variable}: {path} is not a folder; point it at a folder (or unset it)")
    return path
