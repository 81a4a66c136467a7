"""The executors of a step: each runs its path's share of a StepBatch (step.py) and returns
the residual streams after the last block, one row per token, `execute(batch) -> Executed`.
What a request inspects (capture, lens, steering, ablation) is handed to the same hooks on
every path (`Inspection`); the read-out (read_out.py) is not an executor's.

ModulePath: the model's own embedding and blocks over the batch's rows as one sequence;
attention alone looks across rows, per request, over its slots, through the paged view of the
pool handed to each block as its cache (paged_attention.py). Each weight is read once per
panel of rows for all requests together; with batch invariance every product computes each
row on its own (row_tiles.py), so a row's numbers do not depend on what shares its step
(attention, the model's PyTorch kernel, within float32 rounding: paged_attention.py). The
hooks the blocks call steer, ablate, capture and keep the lens rows.

FusedPath: a converted model's fused C++ step (accel/fast_decode.py `FastDecoder.rows`): one
call runs every layer for every row, each at its own position, attending over its own
request's slots in the pool (a chunk's keys are all written before any of its rows attends,
each row to its own position). A row's numbers are those of the fused step for that token
alone, bit for bit, whatever shares the step or however its prompt was cut. A request that
captures residual sites, attn.out or mlp.out only and/or reads the lens stays here: the step
copies out its rows' residual stream after the embedding and each layer (and what each
layer's attention and feed-forward add to it), and those copies are handed to the hooks the
blocks would call. A LoRA adapter built for the step (ServedAdapter.fused) is added per row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..generation.paths import fused_source
from ..model.config import ModelConfig
from ..model.hooks import HookFn
from ..model.layers.positions import RopeAngles
from ..model.sink import SinkPolicy
from ..model.transformer import Transformer
from .adapters import Adapters
from .capture import LensRows, capture_hooks
from .interventions import edit_hooks
from .kv_pool import KVPool
from .paged_attention import PagedView, Part
from .step import RequestRows, StepBatch


class RopeTables:
    """RoPE's cos and sin at every position of the context, computed once, per kind of layer
    (Transformer.rope_angles), and under LongRoPE the long set's beside them."""

    def __init__(self, model: Transformer) -> None:
        positions = torch.arange(model.config.context_length, device=model.embed.tokens.weight.device)[None]

        def tables(long: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:  # (context, rotated) each
            return tuple((cos[0, 0], sin[0, 0]) for cos, sin in model.rope_angles(positions, long))

        self.short = tables(False)
        self.long = tables(True) if model.rope_long_inv_freq is not None else None

    def rows(self, positions: torch.Tensor, requests: list[RequestRows]) -> RopeAngles:
        """cos and sin of rows at `positions` (N,), (N, rotated) each, per kind of layer. Under
        LongRoPE the rows of a request whose text is past the original context
        (Sequence.rope_long, set by the engine) turn by the long set: a whole text by one set,
        as `generate` and transformers turn it, however its prompt is cut into chunks."""
        angles = tuple((cos[positions], sin[positions]) for cos, sin in self.short)
        if self.long is None:
            return angles
        long = torch.tensor([r.seq.rope_long for r in requests for _ in range(r.n)],
                            device=positions.device)[:, None]  # (N, 1)
        return tuple((torch.where(long, lcos[positions], cos), torch.where(long, lsin[positions], sin))
                     for (cos, sin), (lcos, lsin) in zip(angles, self.long, strict=True))


@dataclass(frozen=True)
class Executed:
    hidden: torch.Tensor  # (N, d) each row's residual stream after the last block
    lens: LensRows  # the lens requests' kept residual rows, read out with the rest


class Inspection:
    """The hooks of a share's inspecting requests, (request, first row, rows, first position)
    each: edits first, so a site's capture and lens keep what the next module reads."""

    def __init__(self, config: ModelConfig, parts: list[tuple]) -> None:
        self.lens = LensRows(config, parts)
        self.hooks: list[dict[str, HookFn]] = [edit_hooks(parts), capture_hooks(parts),
                                               self.lens.hooks()]

    @classmethod
    def of(cls, config: ModelConfig, batch: StepBatch, rows_of_inspecting: bool = False) -> Inspection:
        """For the batch's requests that inspect; their first rows counted over the batch, or
        over the inspecting requests' rows alone (the fused step's emitted copies)."""
        parts, first = [], 0
        for r in batch.requests:
            if r.inspects:
                parts.append((r.seq, first if rows_of_inspecting else r.first, r.n, r.seq.num_computed))
                first += r.n
        return cls(config, parts)

    def feed(self, emitted: dict[str, torch.Tensor | None]) -> None:
        """Hand each asked site's rows of the fused step's copies (fused_source's name ->
        (M, sites, d)) to the hooks, as the blocks would call them."""
        for hooks in self.hooks[1:]:  # the fused step's requests change nothing
            for site, keep in hooks.items():
                source, index = fused_source(site)
                keep(emitted[source][:, index][None], site)  # (1, M, d): the site's tensor


class ModulePath:
    def __init__(self, layers: Transformer, model: Transformer, pool: KVPool, fast: bool,
                 sink: SinkPolicy | None, rope: RopeTables | None, group: int,
                 adapters: Adapters | None, alone: bool = False) -> None:
        """`layers`: the model's modules as the engine runs them (a view with row-invariant or
        adapter-wrapped products); `model`: the model (its masks, for the paged view);
        `alone`: each decoding row's attention in a call of its own (PagedView)."""
        self.layers, self.model, self.pool, self.fast, self.sink = layers, model, pool, fast, sink
        self.rope, self.group, self.adapters, self.alone = rope, group, adapters, alone

    def execute(self, batch: StepBatch) -> Executed:
        parts = [Part(r.first, r.n, r.slots, r.past_window) for r in batch.requests]
        rotation = None if self.rope is None else self.rope.short[0]  # the sink policy's (one kind)
        view = PagedView(self.pool, parts, self.fast, self.model, self.sink, rotation, self.group, self.alone)
        ids, positions = batch.ids[None], batch.positions[None]  # (1, N) each
        rope = None
        if self.rope is not None:  # per kind of layer, (1, 1, N, rotated) each
            rope = tuple((cos[None, None], sin[None, None])
                         for cos, sin in self.rope.rows(batch.positions, batch.requests))
        adapted: dict[str, list[int]] = {}  # adapter name -> its rows
        for r in batch.requests:
            if r.adapter is not None:
                adapted.setdefault(r.adapter, []).extend(range(r.first, r.first + r.n))
        inspection = Inspection.of(self.model.config, batch)
        with contextlib.ExitStack() as stack:
            for hooks in inspection.hooks:
                stack.enter_context(self.layers.hooks.installed(hooks))
            if adapted:
                stack.enter_context(self.adapters.rows(adapted, ids.device))
            x = self.layers.embed(ids, positions)  # (1, N, d)
            for block in self.layers.blocks:
                x = block(x, None, rope, view)
        return Executed(x[0], inspection.lens)


class FusedPath:
    def __init__(self, model: Transformer, pool: KVPool, rope: RopeTables | None,
                 adapters: Adapters | None) -> None:
        self.model, self.pool, self.rope, self.adapters = model, pool, rope, adapters

    def execute(self, batch: StepBatch) -> Executed:
        fused, requests = self.model.fused_step(), batch.requests
        counts = torch.tensor([r.n for r in requests])  # (R,)
        width = max(len(r.slots) for r in requests)
        slots = torch.zeros(len(requests), width, dtype=torch.long)  # (R, S): slots past a row's own unread
        for i, r in enumerate(requests):
            slots[i, : len(r.slots)] = r.slots
        slots = slots.repeat_interleave(counts, dim=0)  # (B, S): a row's request's
        x = self.model.embed(batch.ids[None], batch.positions[None])[0]  # (B, d)
        # per kind of layer, (B, rotated) each
        angles = None if self.rope is None else self.rope.rows(batch.positions, requests)
        names = list(dict.fromkeys(r.adapter for r in requests if r.adapter is not None))
        adapter_of = torch.tensor([-1 if r.adapter is None else names.index(r.adapter)
                                   for r in requests]).repeat_interleave(counts)  # (B,)
        inspecting = [r for r in requests if r.inspects]  # capture, lens
        emit = residuals = writes = None
        if inspecting:
            emit = torch.cat([torch.arange(r.first, r.first + r.n) for r in inspecting])  # (M,)
            m, n_layers, d = len(emit), len(self.model.blocks), x.shape[1]
            residuals = torch.empty(m, n_layers + 1, d)  # (M, L + 1, d)
            if any(fused_source(site)[0] == "writes" for r in inspecting for site in r.seq.params.capture):
                writes = torch.empty(m, n_layers, 2, d)  # (M, L, 2, d): attn.out, mlp.out
        h = fused.rows(x, batch.positions, slots, angles, self.pool.keys, self.pool.values,
                       adapter_of if names else None, [self.adapters[name].fused for name in names],
                       emit, residuals, writes)  # (B, d)
        inspection = Inspection.of(self.model.config, batch, rows_of_inspecting=True)
        if inspecting:
            both = None if writes is None else writes.flatten(1, 2)  # (M, 2 L, d)
            inspection.feed({"residuals": residuals, "writes": both})
        return Executed(h, inspection.lens)
