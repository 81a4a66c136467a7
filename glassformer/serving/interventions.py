"""Steering and head ablation for chosen requests, inside the engine's batched step.

A request adds α × a vector at sites (`RequestParams.steer`) or zeroes heads
(`RequestParams.ablate`, interpret/steer.py names them). The step runs every request's new
rows as one sequence (step.py); the hooks installed for the step copy a site's tensor and
change, in the copy, that request's own rows only, so every other row keeps its exact bits.
A request that changes something (`RequestParams.changes_model`) runs on the module path
(never the fused decode step, whose single C++ call has no sites: generation/paths.py) and stays
out of the prefix cache both ways: its keys and values are its own. A steer with α = 0 is left
out entirely (no hook, no change of path), so it is bit-identical to no steer at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import InputError
from ..generation.config import RequestParams
from ..interpret.steer import check_steer, parse_head
from ..model.config import ModelConfig
from ..model.hooks import HookFn
from .capture import token_axis

if TYPE_CHECKING:
    from .step import RequestRows

def check_edits(config: ModelConfig, params: RequestParams) -> None:
    """ValueError naming `steer` or `ablate` for what this model cannot take."""
    check_steer(config, params.steer)
    for steer in params.steer:
        if token_axis(steer.site) is None:
            raise InputError("steer", f"{steer.site!r} has no token axis")
    for name in params.ablate:
        parse_head(config, name)


def edit_hooks(config: ModelConfig, parts: list[RequestRows]) -> dict[str, HookFn]:
    """Hooks that steer and ablate, for each request's rows of the step, its own rows of the
    sites it named."""
    edits: dict[str, list[tuple[int, int, torch.Tensor | None, int | None]]] = {}
    for r in parts:
        for steer in r.seq.params.steer:
            if steer.alpha != 0:
                edits.setdefault(steer.site, []).append((r.first, r.n, steer.alpha * steer.vector, None))
        for name in r.seq.params.ablate:
            site, head = parse_head(config, name)
            edits.setdefault(site, []).append((r.first, r.n, None, head))

    def edit(tensor: torch.Tensor, site: str) -> torch.Tensor:
        out = tensor.clone()
        axis = token_axis(site)
        for start, n, add, head in edits[site]:
            rows = out.narrow(axis, start, n)  # a view: the request's rows of the copy
            if add is not None:
                rows += add.to(rows)  # (d,) over (1, n, d)
            else:
                rows[:, head] = 0  # (1, head, n, d_head): that head's output
        return out

    return dict.fromkeys(edits, edit)
