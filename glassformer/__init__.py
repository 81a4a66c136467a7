"""Glassformer: a glass-box transformer (decoder-only, encoder-only and encoder-decoder)."""

from .language_model import LanguageModel, load
from .model.config import ModelConfig
from .model.kv_cache import KVCache
from .model.presets import PRESETS, get_preset
from .model.transformer import Transformer

__all__ = ["KVCache", "LanguageModel", "ModelConfig", "PRESETS", "Transformer", "get_preset", "load"]
