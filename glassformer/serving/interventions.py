"""Steering and head ablation for chosen requests, inside the engine's batched step.

A request adds α × a vector at sites (`RequestParams.steer`) or zeroes heads
(`RequestParams.ablate`, named as model/sites.py's Head). The step runs every request's new
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

from ..model.hooks import HookFn

if TYPE_CHECKING:
    from .rows import RequestRows


def edit_hooks(parts: list[RequestRows]) -> dict[str, HookFn]:
    """Hooks that steer and ablate, for each request's rows of the step, its own rows of the
    sites it named."""
    edits: dict[str, list[tuple[int, int, torch.Tensor | None, int | None]]] = {}
    axes: dict[str, int] = {}  # each edited site's token axis
    for r in parts:
        for steer in r.seq.params.steer:
            if steer.alpha != 0:
                edits.setdefault(steer.site.full, []).append((r.first, r.n, steer.alpha * steer.vector, None))
                axes[steer.site.full] = steer.site.token_axis
        for head in r.seq.params.ablate:
            edits.setdefault(head.site.full, []).append((r.first, r.n, None, head.index))
            axes[head.site.full] = head.site.token_axis

    def edit(tensor: torch.Tensor, site: str) -> torch.Tensor:
        out = tensor.clone()
        axis = axes[site]
        for start, n, add, head in edits[site]:
            rows = out.narrow(axis, start, n)  # a view: the request's rows of the copy
            if add is not None:
                rows += add.to(rows)  # (d,) over (1, n, d)
            else:
                rows[:, head] = 0  # (1, head, n, d_head): that head's output
        return out

    return dict.fromkeys(edits, edit)
