"""One step of the engine as a value: the scheduler's plan as the rows the executors run.

    plan       (scheduler.py)   which requests, how many tokens each, copies, preemptions
    StepBatch  (here)           flat token ids and positions (N,); per request its RequestRows:
                                its rows, the pool slots its queries see, its adapter, what it
                                inspects, and the path its rows take with the reason (`route`)
    execute    (executors.py)   each path's share of the batch -> its rows' residual streams
    read-out   (read_out.py)    final norm, head and lens over every path's rows at once

The N new tokens of a step (decode rows and prompt chunks alike) are one flat sequence; a
request's rows are first .. first + n - 1 of it. `route` is the one decision of a request's
path: the first executor that does not refuse its rows (executors.py: each declares what it
refuses, and why); the last, the module path, takes every row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Listed
from dataclasses import dataclass
from typing import Protocol

import torch

from ..generation.paths import Path
from ..model.sink import SinkPolicy
from .paged_attention import slots_of
from .rows import RequestRows
from .scheduler import StepPlan
from .sequence import Sequence


@dataclass(frozen=True)
class StepBatch:
    ids: torch.Tensor  # (N,) the step's new tokens
    positions: torch.Tensor  # (N,) their positions: in the text, or in the cache under the sink policy
    requests: tuple[RequestRows, ...]
    copies: tuple[tuple[int, int], ...] = ()  # copy-on-write (source block, copy), before the step
    index: torch.Tensor | None = None  # (N',) rows of the whole step, for a path's share (None: the whole)

    def on(self, path: str) -> StepBatch | None:
        """The share of the requests whose rows take `path`, rows counted from 0; None if none."""
        mine = [r for r in self.requests if r.path.name == path]
        if len(mine) == len(self.requests):
            return self
        if not mine:
            return None
        index = torch.cat([torch.arange(r.first, r.first + r.n) for r in mine])  # (N',)
        firsts = [0]
        for r in mine:
            firsts.append(firsts[-1] + r.n)
        requests = tuple(dataclasses.replace(r, first=first) for r, first in zip(mine, firsts, strict=False))
        rows = index.to(self.ids.device)
        return StepBatch(self.ids[rows], self.positions[rows], requests, (), index)


class Executor(Protocol):
    name: str  # the path it runs: FUSED, GRAPH or MODULES

    def refuses(self, rows: RequestRows) -> str | None:
        """Why it does not run these rows, or None when it does."""

    def takes(self, rows: RequestRows) -> str:
        """Why it runs rows it does not refuse, in words."""


def route(executors: Listed[Executor], rows: RequestRows) -> Path:
    """The path of the first executor that does not refuse the rows, with the reason: why the
    one before it refused them, or, for the first, why it takes them. The engine's last, the
    module path, takes every row."""
    declined = None
    for executor in executors:
        reason = executor.refuses(rows)
        if reason is None:
            return Path(executor.name, declined or executor.takes(rows))
        declined = reason
    raise ValueError(f"no executor takes the rows of {rows.seq.id}: {declined}")


def step_batch(plan: StepPlan, path_of: Callable[[RequestRows], Path], block_size: int,
               sink: SinkPolicy | None, device: torch.device) -> StepBatch:
    """The plan's scheduled tokens as one batch; `path_of(rows)` chooses a request's path."""
    ids, positions, requests = [], [], []
    for seq, n in plan.scheduled:
        context = seq.num_computed + n
        # a chunk past the sink policy's window (model/sink_chunk.py): its queries sit at the
        # cache's last n positions and see the W - 1 latest keys before its own
        past_window = sink is not None and n > 1 and sink.full(seq.num_computed)
        slots = _slots(seq, context, past_window, block_size, sink)  # (L,)
        rows = RequestRows(seq, len(ids), n, slots, past_window)
        requests.append(dataclasses.replace(rows, path=path_of(rows)))
        ids += seq.tokens[seq.num_computed : context]
        first = len(slots) - n if sink is None else sink.position(seq.num_computed, n)
        positions += range(first, first + n)  # text positions, or the cache's
    return StepBatch(torch.tensor(ids, device=device), torch.tensor(positions, device=device),  # (N,) each
                     tuple(requests), tuple(plan.copies))


def _slots(seq: Sequence, context: int, past_window: bool, block_size: int,
           sink: SinkPolicy | None) -> torch.Tensor:
    """The pool slots of what seq's tokens up to `context` attend to, in position order: its
    first `context` tokens, or under the sink policy the kept ones, or for a chunk past its
    window the sinks, the W - 1 latest before it and its own (L,)."""
    if sink is None:
        return slots_of(seq.block_table, context, block_size)
    table = torch.tensor(seq.block_table, dtype=torch.long)
    first = seq.num_computed
    kept = (sink.chunk_slots(first) + [sink.slot(t) for t in range(first, context)]
            if past_window else sink.kept_slots(context))
    kept = torch.tensor(kept, dtype=torch.long)  # (L,)
    return table[kept // block_size] * block_size + kept % block_size
