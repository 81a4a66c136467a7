"""Glassformer: a glass-box decoder-only transformer."""

from .config import ModelConfig
from .kv_cache import KVCache
from .model import Transformer
from .presets import PRESETS, get_preset

__all__ = ["KVCache", "ModelConfig", "PRESETS", "Transformer", "get_preset"]
