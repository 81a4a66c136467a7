"""Where Glassformer keeps what it downloads and builds: pulled models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """`$GLASSFORMER_HOME`, else `$XDG_CACHE_HOME/glassformer`, else `~/.cache/glassformer`."""
    own = os.environ.get("GLASSFORMER_HOME")
    if own:
        return Path(own).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "glassformer"
