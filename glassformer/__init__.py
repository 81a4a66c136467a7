"""Glassformer: a glass-box transformer (decoder-only, encoder-only and encoder-decoder)."""

import os
import sys

# OpenMP fixes how long idle threads spin when torch loads it: imported first, Glassformer has
# them sleep at once, so a thread waiting at a barrier gives its core to whatever else runs on
# a busy machine (accel/threads.py; benchmarks/busy_cpu.py measures it). The environment wins.
if "torch" not in sys.modules and "GOMP_SPINCOUNT" not in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .language_model import LanguageModel, load
from .model.config import ModelConfig
from .model.kv_cache import KVCache
from .model.presets import PRESETS, get_preset
from .model.transformer import Transformer

__all__ = ["KVCache", "LanguageModel", "ModelConfig", "PRESETS", "Transformer", "get_preset", "load"]
