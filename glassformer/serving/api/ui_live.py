"""The live page's view inside requests: for each request opened with `"glassformer": {"ui":
true}`, token by token, the logit lens over its recent positions and the attention weights of
its newest query, from the rows the engine captured in the steps that computed them.

A ui request captures the residual streams (interpret/lens.py residual_sites) and every
layer's queries and keys (serving/capture.py): the engine keeps them for that request's rows
only, so the others stay on their fast path, unchanged. Each event's new rows (Event.captured)
reach the request's watch as its reader takes them:

    lens       each new position's residuals through the model's final norm and head: the
               top-1 token and its probability per layer (lens.top_tokens), the last WINDOW
    attention  the newest query's weights over the context, per layer and head: the layer's
               softmax(q·kᵀ·scale + mask) over the engine's own queries and keys

    GET /ui/requests                        the watched requests, running and recent
    GET /ui/requests/{id}?layer=&head=      one request's lens columns and one head's weights
"""

from __future__ import annotations

import threading
from collections import deque

import torch
from fastapi import FastAPI, Request

from ...formats.sources import Loaded
from ...interpret.lens import residual_sites, top_tokens
from ...model.config import ModelConfig
from ...model.layers.attention_backends import reference_attention
from ...model.sites import Site, parse_site
from ..handle import Event, RequestHandle
from .errors import APIError

WINDOW = 32  # lens columns kept per request: its most recent positions
KEEP = 8  # finished requests still listed


def live_sites(config: ModelConfig) -> tuple[Site, ...]:
    """The sites a ui request captures: its residual streams, then each layer's q and k."""
    return tuple(map(parse_site, residual_sites(config))) + tuple(
        Site("", i, f"attn.{name}") for i in range(config.n_layers) for name in ("q", "k"))


class Watch:
    """One request as the page sees it; `observe` runs on a worker thread per event, `view`
    on the event loop, both under the watch's lock."""

    def __init__(self, handle: RequestHandle, language_model: Loaded, prompt: list[int],
                 params: dict) -> None:
        self.handle, self.model = handle, language_model.model
        self.decode = language_model.tokenizer.decode
        self.tokens = list(prompt)  # what the model has read so far, then each new token
        self.prompt_len, self.params = len(prompt), params
        self.columns: deque[dict] = deque(maxlen=WINDOW)
        self.keys: list[torch.Tensor | None] = [None] * self.model.config.n_layers  # (1, KV, T, d_head)
        self.pattern: torch.Tensor | None = None  # (layers, H, T): the newest query's weights
        self._lock = threading.Lock()

    @property
    def status(self) -> str:
        result = self.handle.result
        return "running" if result is None else result.stop_reason

    def observe(self, event: Event) -> None:
        with self._lock, torch.inference_mode():
            if event.captured is not None:
                end = len(self.tokens)  # the rows are positions end - n .. end - 1
                self._lens(event.captured, end)
                self._attention(event.captured, end)
            if event.token_id is not None:
                self.tokens.append(event.token_id)

    def _lens(self, rows: dict[str, torch.Tensor], end: int) -> None:
        sites = residual_sites(self.model.config)
        n = min(rows[sites[0]].shape[1], WINDOW)
        lens = top_tokens(self.model, [rows[site][:, -n:] for site in sites], top_k=1)
        ids, probs = lens.ids[:, 0, :, 0].T.tolist(), lens.probs[:, 0, :, 0].T.tolist()  # (n, sites)
        for i, position in enumerate(range(end - n, end)):
            self.columns.append({"position": position, "token": self.decode([self.tokens[position]]),
                                 "ids": ids[i], "top": [self.decode([t]) for t in ids[i]],
                                 "probs": probs[i]})

    def _attention(self, rows: dict[str, torch.Tensor], end: int) -> None:
        model, patterns = self.model, []
        for i, block in enumerate(model.blocks):
            new = rows[f"blocks.{i}.attn.k"]  # (1, KV, n, d_head)
            self.keys[i] = new if self.keys[i] is None else torch.cat([self.keys[i], new], dim=2)
            q = rows[f"blocks.{i}.attn.q"][:, :, -1:]  # (1, H, 1, d_head): the newest query
            positions = torch.arange(end, device=q.device)
            mask = model.attention_mask(positions[None, -1:], positions[None])
            keys = self.keys[i]
            patterns.append(reference_attention(q, keys, keys, mask, scale=block.attn.scale)[1][0, :, 0])
        self.pattern = torch.stack(patterns).float()  # (layers, H, T)

    def summary(self) -> dict:
        return {"id": self.handle.request_id, "status": self.status, "prompt_tokens": self.prompt_len,
                "generated": len(self.tokens) - self.prompt_len,
                "prompt": self.decode(self.tokens[: self.prompt_len])[-80:]}

    def view(self, layer: int, head: int) -> dict:
        config = self.model.config
        if not 0 <= layer < config.n_layers:
            raise APIError(400, f"layer: must be in 0..{config.n_layers - 1}, got {layer}", "layer")
        if not 0 <= head < config.n_heads:
            raise APIError(400, f"head: must be in 0..{config.n_heads - 1}, got {head}", "head")
        with self._lock:
            columns = list(self.columns)
            attention = None
            if self.pattern is not None:
                weights = self.pattern[layer, head]  # (T,)
                attention = {"layer": layer, "head": head, "query": len(weights) - 1,
                             "tokens": [self.decode([t]) for t in self.tokens[: len(weights)]],
                             "weights": weights.tolist()}
            generated = self.decode(self.tokens[self.prompt_len :])
        return {**self.summary(), "sites": list(residual_sites(config)), "n_layers": config.n_layers,
                "n_heads": config.n_heads, "columns": columns, "attention": attention, "text": generated,
                "params": self.params, "steer": self.params.get("glassformer", {}).get("steer", [])}


class Live:
    """The watched requests: every running one and the last KEEP finished."""

    def __init__(self, language_model: Loaded) -> None:
        self.language_model = language_model
        self._watches: dict[str, Watch] = {}
        self._lock = threading.Lock()

    def open(self, handle: RequestHandle, prompt: list[int], params: dict) -> Watch:
        watch = Watch(handle, self.language_model, prompt, params)
        with self._lock:
            self._watches[handle.request_id] = watch
            finished = [key for key, w in self._watches.items() if w.status != "running"]
            for key in finished[: max(0, len(finished) - KEEP)]:
                del self._watches[key]
        return watch

    def list(self) -> list[dict]:
        with self._lock:
            watches = list(self._watches.values())
        return [watch.summary() for watch in reversed(watches)]  # newest first

    def get(self, request_id: str) -> Watch:
        with self._lock:
            watch = self._watches.get(request_id)
        if watch is None:
            raise APIError(404, f"request: {request_id!r} is not watched here (open it with "
                                "\"glassformer\": {\"ui\": true})", "request", "not_found")
        return watch


def install(app: FastAPI, live: Live, authorize) -> None:
    """The watched requests' routes, behind `authorize` (the server's API key, if any)."""

    @app.get("/ui/requests")
    async def watched(request: Request) -> dict:
        authorize(request)
        return {"requests": live.list()}

    @app.get("/ui/requests/{request_id}")
    async def watched_one(request: Request, request_id: str, layer: int = 0, head: int = 0) -> dict:
        authorize(request)
        return live.get(request_id).view(layer, head)
