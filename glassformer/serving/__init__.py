"""Serving many requests at once: continuous batching over a paged KV cache (engine.py)."""

from ..generation.config import RequestParams
from .engine import Engine, EngineConfig
from .handle import Event, RequestHandle, TokenLogprobs

__all__ = ["Engine", "EngineConfig", "Event", "RequestHandle", "RequestParams", "TokenLogprobs"]
