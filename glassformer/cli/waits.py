"""One line on stderr before each wait that may last more than a few seconds, naming it."""

from __future__ import annotations

import sys

from ..serving.engine import EngineConfig


def announce(message: str) -> None:
    """One line on stderr before a wait that may last more than a few seconds, naming it."""
    print(f"glassformer: {message}", file=sys.stderr, flush=True)


def announce_engine(engine: EngineConfig, device: str) -> None:
    """The engine's long waits before its first token: a pool taken whole (off the CPU or for
    the graph executor), and the graph executor's compiled steps."""
    if engine.compile or not device.startswith("cpu"):
        announce(f"taking the KV pool's {engine.kv_memory_mb:g} MiB on {device} at once")
    if engine.compile:
        announce("compiling the engine's decode step (torch.compile), once for each batch size "
                 "as it first comes: the first steps wait for it")


def announce_compile(compile: bool) -> None:
    if compile:
        announce("compiling the one-token step (torch.compile): the first token waits for it")
