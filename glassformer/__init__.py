"""Glassformer: a glass-box decoder-only transformer."""

from .config import ModelConfig
from .kv_cache import KVCache
from .language_model import LanguageModel, load
from .model import Transformer
from .presets import PRESETS, get_preset

__all__ = ["KVCache", "LanguageModel", "ModelConfig", "PRESETS", "Transformer", "get_preset", "load"]
