"""Runs a step: the plan as one StepBatch, each request on the path of the first executor that
does not refuse its rows (step.py `route`), each path's share through its executor, then one
read-out of every wanted row (`step_logits`). The runner's view of the model computes each row
on its own (row_tiles.py; `batch_invariant=False`: all rows at once) and adds a request's LoRA
update to its own rows (adapters.py).
"""

from __future__ import annotations

import torch

from ..accel.fast_decode import can_build
from ..generation.paths import FUSED, Path
from ..interpret.lens import lens_sites, top_of
from ..model.transformer import Transformer
from .adapters import Adapters, itself
from .config import EngineConfig
from .executors import FusedPath, ModulePath, RopeTables
from .graph_path import GraphPath
from .kv_pool import KVPool
from .row_tiles import row_invariant, tile_norms
from .scheduler import StepPlan
from .sequence import Sequence
from .step import RequestRows, StepBatch, route, step_batch

# Rows read out per call: one pass over the head's weights (the kernels' panel of rows), and a
# few MB of logits at a time whatever the number of rows (a long prompt's lens).
LENS_ROWS = 64


class ModelRunner:
    def __init__(self, model: Transformer, pool: KVPool, config: EngineConfig, adapters: Adapters,
                 deterministic: bool = False) -> None:
        """`model` is one the engine accepts (executors.CAPABILITIES and the sink policy,
        checked by Engine); `adapters`: the LoRA adapters requests may name (adapters.py),
        applied to their rows; `pool` made with its scratch block where `config.compile`;
        `deterministic`: config.deterministic where it acts (on CUDA; the engine says)."""
        self.pool, self.config, self.device = pool, config, model.embed.tokens.weight.device
        # the model's own modules; with invariance, a view whose products run in row tiles
        # (without: a view all the same, whose products the adapters wrap, the model untouched)
        wrap = row_invariant if config.batch_invariant else itself
        self.layers = model.with_products(wrap)
        if deterministic:
            tile_norms(self.layers)
        rope = RopeTables(model) if model.config.position == "rope" else None
        first = (GraphPath(model, pool, config, rope, deterministic) if config.compile
                 else FusedPath(model, pool, config, rope, adapters.loaded))
        # adapters are built for the fused step too where rows may take it
        fused = first.name == FUSED and first.refused is None and can_build(model)
        adapters.install(self.layers, wrap, fused)
        self.executors = (first, ModulePath(self.layers, model, pool, config, rope, adapters, deterministic))

    def route(self, rows: RequestRows) -> Path:
        """The path a request's rows take in this step, and why."""
        return route(self.executors, rows)

    @torch.inference_mode()
    def batch(self, plan: StepPlan) -> StepBatch:
        """The plan as one batch, each request's path chosen (for a step without grad)."""
        return step_batch(plan, self.route, self.pool.block_size, self.config.sink, self.device)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Runs the batch; returns next-token logits (R, V) for the requests that reach the end
        of their tokens in this step, in batch order."""
        self.pool.reserve(1 + max((b for r in batch.requests for b in r.seq.block_table), default=-1))
        self.pool.copy_blocks(batch.copies)
        hidden, lens = None, {}
        for executor in self.executors:
            share = batch.on(executor.name)
            if share is None:
                continue
            done = executor.execute(share)
            lens |= done.lens
            if share is batch:
                hidden = done.hidden
            else:
                if hidden is None:
                    hidden = done.hidden.new_empty(len(batch.ids), done.hidden.shape[-1])  # (N, d)
                hidden[share.index.to(hidden.device)] = done.hidden
        return step_logits(self.layers, batch, hidden, lens)


def output_row(rows: RequestRows, sites: list[str], last: str) -> int | None:
    """Which of a lens request's rows (site by site) holds its output: its `last` residual (the
    one the final norm and head read) at its last position, where it reads that one and
    reaches its end in this step; else None."""
    return sites.index(last) * rows.n + rows.n - 1 if rows.ends and last in sites else None


def step_logits(model: Transformer, batch: StepBatch, hidden: torch.Tensor,
                lens: dict[Sequence, dict[str, torch.Tensor]]) -> torch.Tensor:
    """The step's one read-out: next-token logits (R, V) of the batch's requests that reach their
    end, in batch order, from `hidden` (N, d), each row's residual stream after the last block,
    whatever path computed it; `lens`: each lens request's kept residuals by site, (n, d) each,
    whose top-k is kept on it. Read through the final norm and head in calls of at most
    LENS_ROWS rows: the lens rows, then each end's last row unless its lens read that very
    residual (output_row). Through the row-invariant view a row reads the same numbers whatever
    is read beside it."""
    config, last = model.config, lens_sites(model.config)[-1]
    # each lens request's rows, site by site: (rows, first row read, its top-k: ids, probabilities)
    reads, chunks, row_of, total = [], [], {}, 0  # reads; rows read; each end's row among them
    for r in batch.requests:
        if r.seq in lens:
            sites = lens_sites(config, r.seq.params.lens_layers)
            m, k = len(sites) * r.n, min(r.seq.params.lens, config.vocab_size)
            reads.append((r, total, torch.empty(m, k, dtype=torch.long), torch.empty(m, k)))  # (m, k) each
            chunks += [lens[r.seq][site] for site in sites]  # (n, d) each
            if (row := output_row(r, sites, last)) is not None:
                row_of[r.seq] = total + row
            total += m
    for r in batch.requests:
        if r.ends and r.seq not in row_of:  # its own last row, after every lens row
            row_of[r.seq] = total
            chunks.append(hidden[r.rows][-1:])  # (1, d)
            total += 1
    source = [row_of[r.seq] for r in batch.requests if r.ends]  # in batch order
    if not chunks:
        return hidden.new_zeros(0, config.vocab_size)
    rows = torch.cat(chunks)  # (M, d)
    outputs = None
    for c0 in range(0, rows.shape[0], LENS_ROWS):
        logits = model.read_out(rows[c0 : c0 + LENS_ROWS])  # (≤ LENS_ROWS, V)
        for _, first, ids, probs in reads:
            lo, hi = max(first, c0), min(first + ids.shape[0], c0 + logits.shape[0])
            if lo < hi:
                ids[lo - first : hi - first], probs[lo - first : hi - first] = top_of(
                    logits[lo - c0 : hi - c0], ids.shape[1])
        if c0 == 0 and source == list(range(logits.shape[0])):  # the ends' rows alone, in order
            outputs = logits  # (R, V), not copied
            continue
        if outputs is None:
            outputs = logits.new_empty(len(source), logits.shape[-1])  # (R, V)
        for j, row in enumerate(source):
            if c0 <= row < c0 + logits.shape[0]:
                outputs[j] = logits[row - c0]
    for r, _, ids, probs in reads:
        ids, probs = ids.view(-1, r.n, ids.shape[1]), probs.view(-1, r.n, ids.shape[1])  # (sites, n, k)
        for i in range(r.n):  # kept by position (a request recomputed after preemption overwrites its own)
            r.seq.lens[r.seq.num_computed + i] = (ids[:, i], probs[:, i])  # (sites, k) each
    return outputs
