"""Hook sites kept for chosen requests, inside the engine's batched step.

A request names sites (`RequestParams.capture`). The step runs the model's own blocks over
every request's new rows as one sequence (step.py), so each site's tensor holds all of them
along its token axis; the hooks installed for the step keep, for each capturing request, its
own rows, by position. Requests that asked for nothing are computed exactly as without the
hooks (a hook that returns None changes nothing), and a step where no request asks installs
none. The sites with a token axis are captured (glassformer.trace lists them with their
dimensions); the attention weights, the final norm and the logits are not.

The lens (`RequestParams.lens`, top-k, over `lens_layers` or every residual: interpret/lens.py's
lens_sites) keeps the lens requests' residual rows for the length of one step, one copy per site,
and reads them out after the blocks together with every other row the step reads (read_out.py:
the head's weights read once per tile of rows, not once per request and site): each layer's
top-k tokens and probabilities per position, computed from the residuals the step produced for
that request. The last residual's read-out is the model's output: a request reading it at its
last row takes its next-token logits from that same row.

A request that asks only for residual sites (embed.out, blocks.{i}.resid_pre,
blocks.{i}.resid_post), what each block writes into the stream (blocks.{i}.attn.out,
blocks.{i}.mlp.out) and the lens, whose inputs are residuals, runs on the fused decode step,
which copies those out (generation/paths.py `fused_source`); that executor hands each asked
site's rows of those copies to the same hooks (`Inspection`) as the module path's blocks call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..generation.config import kept_in_step
from ..interpret.lens import lens_sites, top_of
from ..model.config import ModelConfig
from ..model.hooks import HookFn
from ..model.sites import Site
from .sequence import Sequence

if TYPE_CHECKING:
    from .rows import RequestRows


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
                    r.seq.captured[site][r.position + i] = row
        return None

    return dict.fromkeys(sites, keep)


def captured(seq: Sequence) -> dict[str, torch.Tensor] | None:
    """Each asked site's rows in position order, stacked on its token axis with a batch of 1:
    the layout glassformer.trace gives the same site for the request's tokens."""
    if not seq.params.capture:
        return None
    return {site.full: _stacked(site, seq.captured[site.full], sorted(seq.captured[site.full]))
            for site in seq.params.capture}


def new_rows(seq: Sequence) -> dict[str, torch.Tensor] | None:
    """The rows computed since the request's previous token, for the event of the token it has
    just accepted: the prompt's with the first token, then the row that predicted the newest
    (captured's layout, over those positions); None for a request that captures nothing."""
    if not seq.params.capture:
        return None
    end = seq.num_tokens - 1  # the newest token's own row is computed in the next step
    first = 0 if len(seq.generated) == 1 else end - 1
    return {site.full: _stacked(site, seq.captured[site.full], range(first, end))
            for site in seq.params.capture}


def _stacked(site: Site, rows: dict[int, torch.Tensor], positions) -> torch.Tensor:
    """The rows at `positions` on the site's token axis, with a batch of 1."""
    return torch.stack([rows[p] for p in positions], dim=site.token_axis - 1)[None]
class LensRows:
    """The residual rows of the step's requests that read the lens, kept while the blocks run
    (`hooks`: one copy per site of every lens request's rows), then read out with every other
    row of the step (read_out.py: `rows`, `take`, `store`)."""

    def __init__(self, config: ModelConfig, parts: list[RequestRows]) -> None:
        self.parts = [r for r in parts if r.seq.params.lens is not None]
        self.sites = [lens_sites(config, r.seq.params.lens_layers) for r in self.parts]
        self.last = lens_sites(config)[-1]  # the residual the final norm and head read
        self.vocab_size = config.vocab_size
        rows = [torch.arange(r.first, r.first + r.n) for r in self.parts]
        self.index = torch.cat(rows) if rows else None  # (M,) the lens requests' rows in the step
        self.kept: dict[str, torch.Tensor] = {}  # site -> (M, d)
        self.tops: list[tuple[torch.Tensor, torch.Tensor]] = []  # per request: ids, probabilities

    def hooks(self) -> dict[str, HookFn]:
        if not self.parts:
            return {}

        def keep(tensor: torch.Tensor, site: str) -> None:
            self.kept[site] = tensor[0].index_select(0, self.index.to(tensor.device))  # (M, d)

        return dict.fromkeys(set().union(*self.sites), keep)

    def rows(self) -> torch.Tensor | None:
        """Every lens request's kept rows, request by request, site by site: (R, d), R = Σ
        sites × rows; None when no request reads the lens."""
        if not self.parts:
            return None
        chunks, offset = [], 0
        for r, sites in zip(self.parts, self.sites, strict=True):
            n = r.n
            chunks += [self.kept[site][offset : offset + n] for site in sites]  # (n, d) each
            offset += n
            k = min(r.seq.params.lens, self.vocab_size)
            self.tops.append((torch.empty(len(sites) * n, k, dtype=torch.long),
                              torch.empty(len(sites) * n, k)))  # (sites × n, k): ids, probabilities
        self.kept.clear()
        return torch.cat(chunks)

    def output_row(self, seq: Sequence) -> int | None:
        """The row of `rows` that holds seq's output: its last residual at its last position,
        where it reads that one and reaches its end in this step; else None."""
        first = 0
        for r, sites in zip(self.parts, self.sites, strict=True):
            n = r.n
            if r.seq is seq:
                ends = seq.num_computed + n == seq.num_tokens
                return first + sites.index(self.last) * n + n - 1 if ends and self.last in sites else None
            first += len(sites) * n
        return None

    def take(self, logits: torch.Tensor, start: int) -> None:
        """The top-k of the read-out of rows start .. start + len(logits) - 1 of `rows`."""
        first = 0
        for ids, probs in self.tops:  # each request's rows in this call
            lo, hi = max(first, start), min(first + ids.shape[0], start + logits.shape[0])
            if lo < hi:
                ids[lo - first : hi - first], probs[lo - first : hi - first] = top_of(
                    logits[lo - start : hi - start], ids.shape[1])
            first += ids.shape[0]

    def store(self) -> None:
        """Each request's top-k per site of its layers, kept on it by position (a request
        recomputed after preemption overwrites its own)."""
        for r, sites, (ids, probs) in zip(self.parts, self.sites, self.tops, strict=True):
            ids, probs = ids.view(len(sites), r.n, -1), probs.view(len(sites), r.n, -1)  # (sites, n, k)
            for i in range(r.n):
                r.seq.lens[r.position + i] = (ids[:, i], probs[:, i])  # (sites, k) each
        self.tops.clear()


def lens_of(seq: Sequence) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The request's lens in position order: token ids and probabilities, (sites, T, k) each,
    sites as lens_sites(config, params.lens_layers)."""
    if seq.params.lens is None:
        return None
    rows = [seq.lens[p] for p in sorted(seq.lens)]
    return torch.stack([ids for ids, _ in rows], dim=1), torch.stack([probs for _, probs in rows], dim=1)


def _elements(config: ModelConfig, site: Site, tokens: int) -> int:
    """How many numbers a site's tensor holds over `tokens` positions (batch 1)."""
    sizes = {"batch": 1, "pos": tokens, "query": tokens, "key": tokens, "head": config.n_heads,
             "kv_head": config.kv_heads, "d_head": config.head_dim, "d_model": config.d_model,
             "d_ff": config.ff_dim, "vocab": config.vocab_size}
    elements = 1
    for dim in site.dims:
        elements *= sizes[dim]
    return elements


def _lens_sites(config: ModelConfig, lens_layers: tuple[int, ...] | None) -> int:
    return config.n_layers + 1 if lens_layers is None else len(lens_layers)


def capture_bytes(config: ModelConfig, sites: tuple[Site, ...], lens: int | None, tokens: int,
                  lens_layers: tuple[int, ...] | None = None) -> int:
    """An upper bound on what a request's capture and lens hold over `tokens` positions, as
    float32 (token ids as int64): every site's tensor at full length."""
    total = sum(4 * _elements(config, site, tokens) for site in sites)
    if lens is not None:
        total += (4 + 8) * _lens_sites(config, lens_layers) * tokens * min(lens, config.vocab_size)
    return total


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
    `tokens` positions (what the server's --max-capture-mb bounds; it is several times
    capture_bytes). `token_json`: the most characters one token's text takes as a JSON string
    (quotes and escapes included); `streamed`: the sites the engine keeps go out twice, their
    rows in each token's chunk (with that chunk's wrapping) and the whole in the last."""
    total = 0
    for site in sites:
        copies = 2 if streamed and kept_in_step(site) else 1
        total += FLOAT_JSON * _elements(config, site, tokens) * copies
        if streamed and kept_in_step(site):
            total += 64 * tokens  # {"glassformer": {"trace": {"<site>": ...}}} in each chunk
    if lens is not None:
        digits = len(str(config.vocab_size))
        entry = LENS_ENTRY_JSON + digits + token_json
        per_site = 64 + tokens * min(lens, config.vocab_size) * entry  # with {"site": ..., "top": ...}
        total += _lens_sites(config, lens_layers) * per_site
        total += tokens * (token_json + digits + 4)  # the tokens read, as text and ids
    return total
