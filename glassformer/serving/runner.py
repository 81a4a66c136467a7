"""Runs a step: the plan as one StepBatch, each request on the path of the first executor that
does not refuse its rows (step.py `route`), each path's share through its executor, then one
read-out of every wanted row (read_out.py). The runner's view of the model computes each row on
its own (row_tiles.py; `batch_invariant=False`: all rows at once) and adds a request's LoRA
update to its own rows (adapters.py).
"""


from __future__ import annotations

import torch

from ..accel.fast_decode import can_build
from ..generation.paths import FUSED, Path
from ..model.transformer import Transformer
from .adapters import Adapters, itself
from .config import EngineConfig
from .executors import FusedPath, ModulePath, RopeTables
from .graph_path import GraphPath
from .kv_pool import KVPool
from .read_out import step_logits
from .row_tiles import row_invariant, tile_norms
from .scheduler import StepPlan
from .step import RequestRows, StepBatch, route, step_batch


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
