"""The hooks of the requests that inspect a step, and what they answer.

The step's rows are one sequence (step.py), so each site's tensor holds every request's rows
along its token axis; a request's hooks touch only its own rows, and a step where none asks
installs none. Edits (steering, head ablation) change that request's rows of a copy, so every
other row keeps its bits; the reads (captured sites, lens rows) see what the next module reads.
On the fused step, which copies out the residuals and what each block adds (generation/paths.py
`fused_source`), the same reads are fed those copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Listed

import torch

from ..generation.paths import fused_source
from ..interpret.lens import lens_sites
from ..model.config import ModelConfig
from ..model.hooks import HookFn
from ..model.sites import Site
from .sequence import Sequence
from .step import RequestRows, recounted


class Inspection:
    """The hooks of a share's inspecting requests, edits first. `own_rows`: their rows counted
    over their own rows alone (the fused step's emitted copies), not over the share's."""

    def __init__(self, config: ModelConfig, requests: Listed[RequestRows], own_rows: bool = False) -> None:
        parts = [r for r in requests if r.seq.params.inspects]
        parts = recounted(parts) if own_rows else parts
        self.lens: dict[Sequence, dict[str, torch.Tensor]] = {}  # lens request -> site -> (n, d)
        self.edits = edit_hooks(parts)
        self.reads: list[dict[str, HookFn]] = [capture_hooks(parts), lens_hooks(config, parts, self.lens)]

    def feed(self, emitted: dict[str, torch.Tensor | None]) -> None:
        """Hand each asked site's rows of the fused step's copies (fused_source's name ->
        (M, sites, d)) to the reads, as the blocks would call them (the fused step's requests
        edit nothing: it refuses them)."""
        for hooks in self.reads:
            for site, keep in hooks.items():
                source, index = fused_source(site)
                keep(emitted[source][:, index][None], site)  # (1, M, d): the site's tensor


def edit_hooks(parts: list[RequestRows]) -> dict[str, HookFn]:
    """Hooks that steer and ablate, for each request's rows of the step, its own rows of the
    sites it named."""
    # site -> (its token axis, first row, rows, vector added or None, head zeroed or None) per edit
    edits: dict[str, list[tuple[int, int, int, torch.Tensor | None, int | None]]] = {}
    for r in parts:
        wanted = [(s.site, s.alpha * s.vector, None) for s in r.seq.params.steer if s.alpha != 0]
        wanted += [(h.site, None, h.index) for h in r.seq.params.ablate]
        for site, add, head in wanted:
            edits.setdefault(site.full, []).append((site.token_axis, r.first, r.n, add, head))

    def edit(tensor: torch.Tensor, site: str) -> torch.Tensor:
        out = tensor.clone()
        for axis, start, n, add, head in edits[site]:
            rows = out.narrow(axis, start, n)  # a view: the request's rows of the copy
            if add is not None:
                rows += add.to(rows)  # (d,) over (1, n, d)
            else:
                rows[:, head] = 0  # (1, head, n, d_head): that head's output
        return out

    return dict.fromkeys(edits, edit)


def capture_hooks(parts: list[RequestRows]) -> dict[str, HookFn]:
    """Hooks that store, for each request's rows of the step that asked for sites, those rows
    of every site it named."""
    sites = {site.full: site for r in parts for site in r.seq.params.capture}

    def keep(tensor: torch.Tensor, site: str) -> None:
        axis = sites[site].token_axis
        for r in parts:
            if site in r.seq.captured:
                rows = tensor.narrow(axis, r.first, r.n)[0].clone()  # one copy of the request's rows
                for i, row in enumerate(rows.unbind(axis - 1)):
                    r.seq.captured[site][r.seq.num_computed + i] = row
        return None

    return dict.fromkeys(sites, keep)


def lens_hooks(config: ModelConfig, parts: list[RequestRows],
               kept: dict[Sequence, dict[str, torch.Tensor]]) -> dict[str, HookFn]:
    """Hooks that keep, for each request's rows of the step that reads the lens, a copy of
    those rows of each residual its lens reads, in `kept` (request -> site -> (n, d))."""
    sites = {r.seq: lens_sites(config, r.seq.params.lens_layers)
             for r in parts if r.seq.params.lens is not None}

    def keep(tensor: torch.Tensor, site: str) -> None:
        for r in parts:
            if site in sites.get(r.seq, ()):
                kept.setdefault(r.seq, {})[site] = tensor[0, r.rows].clone()  # (n, d)

    return dict.fromkeys(set().union(*sites.values()), keep)


def captured(seq: Sequence, positions: range | None = None) -> dict[str, torch.Tensor] | None:
    """Each asked site's rows at `positions` (None: every one kept), stacked on its token axis
    with a batch of 1: the layout glassformer.trace gives the same site for those tokens."""
    if not seq.params.capture:
        return None
    stacked = {}
    for site in seq.params.capture:
        rows = seq.captured[site.full]
        at = sorted(rows) if positions is None else positions
        stacked[site.full] = torch.stack([rows[p] for p in at], dim=site.token_axis - 1)[None]
    return stacked


def new_rows(seq: Sequence) -> dict[str, torch.Tensor] | None:
    """The rows computed since the previous token, for the event of the token just accepted:
    the prompt's with the first token, then the row that predicted the newest."""
    end = seq.num_tokens - 1  # the newest token's own row is computed in the next step
    return captured(seq, range(0 if len(seq.generated) == 1 else end - 1, end))


def lens_of(seq: Sequence) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The request's lens in position order: token ids and probabilities, (sites, T, k) each,
    sites as lens_sites(config, params.lens_layers)."""
    if seq.params.lens is None:
        return None
    rows = [seq.lens[p] for p in sorted(seq.lens)]
    return torch.stack([ids for ids, _ in rows], dim=1), torch.stack([probs for _, probs in rows], dim=1)


def site_elements(config: ModelConfig, site: Site, tokens: int) -> int:
    """How many numbers a site's tensor holds over `tokens` positions (batch 1)."""
    sizes = {"batch": 1, "pos": tokens, "query": tokens, "key": tokens, "head": config.n_heads,
             "kv_head": config.kv_heads, "d_head": config.head_dim, "d_model": config.d_model,
             "d_ff": config.ff_dim, "vocab": config.vocab_size}
    return math.prod(sizes[dim] for dim in site.dims)


def lens_site_count(config: ModelConfig, lens_layers: tuple[int, ...] | None) -> int:
    """How many residual sites a lens over `lens_layers` (None: every one) reads."""
    return config.n_layers + 1 if lens_layers is None else len(lens_layers)
