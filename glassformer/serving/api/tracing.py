"""Trace sites on the serving path: a request names hook sites (`"glassformer": {"trace":
["blocks.3.resid_post", "blocks.3.attn.pattern"]}`) and gets those tensors for its own tokens.

Sites with a token axis are kept by the engine inside the steps that computed the request
(serving/capture.py): the numbers the server produced, in its weight format. The others (the
attention weights, the final norm, the logits) come from a run of the request's tokens (the
prompt and every generated token the model read) through `run_with_cache` alone, once it has
finished, on a twin of the model that shares its weights but has its own hooks (a registry
of the same sites made empty, never a copy of the model's, where the engine's capture hooks
may sit mid-step; no fused step, which a converted model's weights cannot copy), so the
engine's batched steps never see them and it never sees theirs."""

from __future__ import annotations

import copy
import itertools
import threading

import torch

from ...interpret.trace import run_with_cache
from ...model.transformer import Transformer


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
