"""Trace sites on the serving path: a request names hook sites (`"glassformer": {"trace":
["blocks.3.resid_post", "blocks.3.attn.pattern"]}`) and gets those tensors for its own tokens.

Sites with a token axis are kept by the engine inside the steps that computed the request
(serving/capture.py): the numbers the server produced, in its weight format. The others (the
attention weights, the final norm, the logits) come from a run of the request's tokens (the
prompt and every generated token the model read) through `run_with_cache` alone, once it has
finished, on a twin of the model that shares its weights but has its own hooks (a registry
of the same sites made empty, never a copy of the model's, where the engine's capture hooks
may sit mid-step; no fused step, which a converted model's weights cannot copy), so the
engine's batched steps never see them and it never sees theirs. `answer_bytes` bounds the JSON
a trace and lens add to an answer, before the request is submitted (--max-capture-mb)."""

from __future__ import annotations

import copy
import itertools
import threading

import torch

from ...generation.config import kept_in_step
from ...interpret.trace import run_with_cache
from ...model.config import ModelConfig
from ...model.sites import Site
from ...model.transformer import Transformer
from ..capture import lens_site_count, site_elements


class Tracer:
    def __init__(self, model: Transformer) -> None:
        self.source = model
        self._twin: Transformer | None = None
        self._lock = threading.Lock()  # one trace at a time on the twin's hooks

    def run(self, ids: list[int], names: list[str]) -> dict[str, list]:
        """{site: nested lists} for one sequence of token ids, batch dimension dropped."""
        with self._lock:
            if self._twin is None:
                shared = {id(t): t for t in itertools.chain(self.source.parameters(), self.source.buffers())}
                # a registry of its own, empty: the engine may be mid-step with its capture hooks
                # on the model's, and a copy of those would hand this run's tensors to them
                shared[id(self.source.hooks)] = self.source.hooks.unhooked()
                # no fused step (a converted model's cannot be copied): hooked runs take the
                # module path anyway
                shared.update({id(self.source._step): None, id(self.source._step_builder): None})
                self._twin = copy.deepcopy(self.source, memo=shared)
            device = self.source.embed.tokens.weight.device
            _, cache = run_with_cache(self._twin, torch.tensor([ids], device=device), names)
        return {name: cache[name][0].float().tolist() for name in names}


# The most bytes one number of a trace takes in an answer's JSON: a float32 read as a Python
# float prints in at most 23 characters ("-1.2345678901234567e-38"), then its separator and a
# share of its list's brackets.
FLOAT_JSON = 32
# One lens entry, `{"id": 123, "token": "...", "prob": 0.1234}, `, less its id's digits and its
# token's text: 37 characters with a separator's space, and its position's brackets.
LENS_ENTRY_JSON = 44


def answer_bytes(config: ModelConfig, sites: tuple[Site, ...], lens: int | None, tokens: int,
                 lens_layers: tuple[int, ...] | None = None, token_json: int = 0,
                 streamed: bool = False) -> int:
    """An upper bound on the JSON an answer carries for a request's trace sites and lens over
    `tokens` positions (what the server's --max-capture-mb bounds). `token_json`: the most
    characters one token's text takes as a JSON string (quotes and escapes included);
    `streamed`: the sites the engine keeps go out twice, their rows in each token's chunk
    (with that chunk's wrapping) and the whole in the last."""
    total = 0
    for site in sites:
        copies = 2 if streamed and kept_in_step(site) else 1
        total += FLOAT_JSON * site_elements(config, site, tokens) * copies
        if streamed and kept_in_step(site):
            total += 64 * tokens  # {"glassformer": {"trace": {"<site>": ...}}} in each chunk
    if lens is not None:
        digits = len(str(config.vocab_size))
        entry = LENS_ENTRY_JSON + digits + token_json
        per_site = 64 + tokens * min(lens, config.vocab_size) * entry  # with {"site": ..., "top": ...}
        total += lens_site_count(config, lens_layers) * per_site
        total += tokens * (token_json + digits + 4)  # the tokens read, as text and ids
    return total
