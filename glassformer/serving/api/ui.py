"""`/ui`: a live page of the engine's inside. `/ui/state` is what the page draws, read from the
engine without stopping it (a snapshot that may be one step stale):

    steps     the last steps as a timeline: which requests ran, prefill chunks (> 1 token)
              vs decode rows (1 token), preemptions
    blocks    the KV pool as a map: each block's owners, shared (> 1 owner), cached (free but
              holding a reusable prefix) or free
    requests  each live request: status, prompt and generated tokens, tokens/s
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from .. import Engine

PAGE = Path(__file__).with_name("ui.html")


def state(engine: Engine, n_steps: int = 120) -> dict:
    now = time.perf_counter()
    sequences = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    owners: dict[int, list[str]] = {}
    for seq in sequences:
        for block in list(seq.block_table):
            owners.setdefault(block, []).append(seq.id)
    blocks = []
    for block in list(engine.blocks.blocks):
        users = owners.get(block.id, [])
        kind = ("shared" if block.ref_count > 1 else "used") if block.ref_count else (
            "cached" if block.key is not None else "free")
        blocks.append({"id": block.id, "state": kind, "owners": users})
    blocks += [{"id": i, "state": "free", "owners": []}  # never taken yet
               for i in range(len(blocks), engine.blocks.n_blocks)]
    requests = []
    for seq in sequences:
        generated = len(seq.tokens) - seq.prompt_len
        decoding = now - seq.first_token_time if seq.first_token_time is not None else 0.0
        requests.append({"id": seq.id, "status": seq.status.value, "prompt_tokens": seq.prompt_len,
                         "generated": generated,
                         "tokens_per_second": generated / decoding if decoding else 0.0})
    steps = [{"step": t.step, "seconds": t.seconds, "ago": now - t.start, "preempted": t.preempted,
              "rows": [{"id": rid, "tokens": n, "kind": "prefill" if n > 1 else "decode",
                        "path": path, "reason": reason}
                       for (rid, n), (path, reason) in zip(t.requests, t.paths, strict=True)]}
             for t in list(engine.trace)[-n_steps:]]
    stats = engine.stats
    return {"steps": steps, "blocks": blocks, "requests": requests, "block_size": engine.blocks.block_size,
            "prefix_hit_rate": stats.prefix_hit_tokens / max(stats.prefix_query_tokens, 1),
            "prefix_hit_tokens": stats.prefix_hit_tokens, "preemptions": stats.preemptions,
            "finished": stats.finished}


def install(app: FastAPI, engine: Engine, authorize: Callable[[Request], None]) -> None:
    """The page and its state, each behind `authorize` (the server's API key, if any)."""

    @app.get("/ui", response_class=HTMLResponse)
    async def page(request: Request) -> str:
        authorize(request)
        return PAGE.read_text(encoding="utf-8")

    @app.get("/ui/state")
    async def ui_state(request: Request) -> dict:
        authorize(request)
        return state(engine)
