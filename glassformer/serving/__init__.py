"""Serving many requests at once: continuous batching over a paged KV cache (engine.py)."""

from .engine import Engine, EngineConfig
from .handle import Event, RequestHandle, TokenLogprobs
from .sequence import RequestParams

__all__ = ["Engine", "EngineConfig", "Event", "RequestHandle", "RequestParams", "TokenLogprobs"]
