"""The executors of a step (step.py `Executor`): `execute(share) -> Executed`, each row's
residual stream after the last block. ModulePath: the model's own blocks over the share's rows
as one sequence, the paged view as each block's cache; it takes every row, and its table
(`CAPABILITIES`) is the engine's. FusedPath: a converted model's fused C++ step
(`FastDecoder.rows`), every layer for every row in one call, a row's numbers those of the fused
step for that token alone, bit for bit; it emits the residuals and what each block adds. Every
path hands what a request inspects to the same hooks (capture.py `Inspection`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.utils.rnn import pad_sequence

from ..accel.capabilities import CapabilityTable, any_value, only
from ..accel.fast_decode import why_not
from ..generation.paths import FUSED, MODULES, fused_source
from ..model.layers.positions import RopeAngles
from ..model.transformer import Transformer
from .adapters import Adapters, ServedAdapter, adapter_rows
from .capture import Inspection
from .config import EngineConfig
from .kv_pool import KVPool
from .paged_attention import PagedView
from .step import Executed, RequestRows, StepBatch, flat_rows

# Prompts up to this many tokens take the fused step; a longer one's prompt rows keep the
# module path, whose attention over a chunk is one product for all its rows, while the fused
# step's goes row by row (int4 SmolLM2 on 2 cores: 1.25x faster at 1,024 tokens, even at
# 2,048, 0.73x at 4,096). A prompt's length is the request's own, so each of its tokens still
# takes one path whatever shares its steps.
FUSED_PROMPT_TOKENS = 2048

# What the engine computes, field by field: it runs the model's embedding, blocks, final norm
# and head; only the RoPE angles (a table over the context) and the flat batch's positions are
# its own, and the masks come from `Transformer.attention_mask`. The module path's table.
CAPABILITIES = CapabilityTable("serving engine", {
    **{name: any_value("the model's own modules compute it") for name in (
        "vocab_size", "context_length", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_ff",
        "norm", "norm_placement", "qk_norm", "parallel_block", "norm_eps", "norm_bias", "activation", "gated",
        "attn_bias", "attn_out_bias", "mlp_bias", "lm_head_bias", "final_norm", "tie_embeddings", "dropout",
        "attention_kernel", "init_std", "n_token_types", "embed_norm", "head", "scale_scores",
        "scale_head_input", "norm_weight_offset", "embed_scale", "attn_softcap", "final_softcap",
        "attn_scale")},
    **{name: any_value("angles from the model's own inverse frequencies and attention factor") for name in (
        "rope_theta", "rope_scaling", "rope_factor", "rope_original_context", "rope_low_freq_factor",
        "rope_high_freq_factor", "rope_local_theta", "rope_beta_fast", "rope_beta_slow", "rope_truncate",
        "rope_attention_factor", "rope_short_factors", "rope_long_factors", "rotary_dim")},
    "position": any_value("RoPE from the table; ALiBi and T5's bias through the model's masks"),
    **{name: any_value("through the model's masks") for name in (
        "sliding_window", "relative_buckets", "relative_max_distance")},
    "causal": only(True, reason="the serving engine runs causal models; an encoder (bidirectional "
                                "attention) does not continue text: glassformer fill-mask"),
    "n_encoder_layers": only(0, reason="the serving engine runs decoder-only models; an "
                                       "encoder-decoder generates one source at a time: "
                                       "glassformer generate"),
    "layer_windows": any_value("each layer narrows the model's masks to its own window "
                               "(Attention.context, called by the paged view)"),
    "pooler": any_value("not part of generating"),
    "decoder_start_id": any_value("an encoder-decoder's field"),
})


def pool_refusal(executor: str, config: EngineConfig) -> str | None:
    """Why an executor that reads float32 keys at their text positions with the fast attention
    refuses every row of an engine so configured, or None."""
    if config.kv_dtype != "fp32":
        return f"{config.kv_dtype} keys and values ({executor} reads float32)"
    if config.sink is not None:
        return f"the sink policy moves keys ({executor} keeps each at its text position)"
    if config.attention != "fast":
        return f"{config.attention} attention asked ({executor} runs the fast one)"
    return None


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
        """cos and sin at `positions` (N,), (N, rotated) each, per kind of layer; every row of a
        request whose text is past LongRoPE's original context (Sequence.rope_long) turns by the
        long set: a whole text by one set, as `generate` and transformers turn it, however its
        prompt is cut into chunks."""
        angles = tuple((cos[positions], sin[positions]) for cos, sin in self.short)
        if self.long is None:
            return angles
        long = torch.tensor([r.seq.rope_long for r in requests for _ in range(r.n)],
                            device=positions.device)[:, None]  # (N, 1)
        return tuple((torch.where(long, lcos[positions], cos), torch.where(long, lsin[positions], sin))
                     for (cos, sin), (lcos, lsin) in zip(angles, self.long, strict=True))


class ModulePath:
    name = MODULES

    def __init__(self, layers: Transformer, model: Transformer, pool: KVPool, config: EngineConfig,
                 rope: RopeTables | None, adapters: Adapters, deterministic: bool = False) -> None:
        """`layers`: the model's modules as the engine runs them (a view with row-invariant or
        adapter-wrapped products); `model`: the model (its masks, for the paged view);
        `deterministic`: each decoding row's attention in a call of its own (PagedView)."""
        self.layers, self.model, self.pool, self.config = layers, model, pool, config
        self.rope, self.adapters, self.deterministic = rope, adapters, deterministic

    def refuses(self, rows: RequestRows) -> None:
        """None: the model's own modules compute every row."""

    def takes(self, rows: RequestRows) -> str:
        return "the model's own modules compute every row"

    def execute(self, batch: StepBatch) -> Executed:
        rotation = None if self.rope is None else self.rope.short[0]  # the sink policy's (one kind)
        view = PagedView(self.pool, batch.requests, self.config.attention == "fast", self.model,
                         self.config.sink, rotation, self.config.query_group, self.deterministic)
        ids, positions = batch.ids[None], batch.positions[None]  # (1, N) each
        rope = None
        if self.rope is not None:  # per kind of layer, (1, 1, N, rotated) each
            rope = tuple((cos[None, None], sin[None, None])
                         for cos, sin in self.rope.rows(batch.positions, batch.requests))
        inspection = Inspection(self.model.config, batch.requests)
        with contextlib.ExitStack() as stack:
            for hooks in (inspection.edits, *inspection.reads):  # edits first
                stack.enter_context(self.layers.hooks.installed(hooks))
            stack.enter_context(self.adapters.rows(batch.requests, ids.device))
            x = self.layers.embed(ids, positions)  # (1, N, d)
            for block in self.layers.blocks:
                x = block(x, None, rope, view)
        return Executed(x[0], inspection.lens)


class FusedPath:
    name = FUSED

    def __init__(self, model: Transformer, pool: KVPool, config: EngineConfig, rope: RopeTables | None,
                 adapters: dict[str, ServedAdapter]) -> None:
        """`adapters`: the loaded LoRA adapters by name (Adapters.loaded)."""
        self.model, self.pool, self.rope, self.adapters = model, pool, rope, adapters
        self.refused = pool_refusal("the fused step", config)  # every row's, or None

    def refuses(self, rows: RequestRows) -> str | None:
        params = rows.seq.params
        if self.refused is not None:
            return self.refused
        if rows.prompt > FUSED_PROMPT_TOKENS:
            return f"a prompt over {FUSED_PROMPT_TOKENS} tokens (one attention product per chunk)"
        if params.changes_model:
            return "it steers or ablates (the fused step has no hook sites)"
        unseen = next((site for site in params.capture if fused_source(site) is None), None)
        if unseen is not None:
            return f"it captures {unseen}, a site the fused step does not emit"
        if params.adapter is not None and self.adapters[params.adapter].fused is None:
            return f"its adapter {params.adapter!r} is not built for the fused step"
        if not self.model.has_fused_step:
            return "the model has no fused step (glassformer.quantize gives one)"
        step = self.model.fused_step()
        if step is None:
            return why_not(self.model) or "the fused step declines the model as it is now"
        if not hasattr(step, "rows"):
            return "the installed fused step decodes one dense cache only"
        return None

    def takes(self, rows: RequestRows) -> str:
        params = rows.seq.params
        if params.capture:
            return "it captures only sites the fused step emits (residuals, attn.out, mlp.out)"
        if params.lens is not None:
            return "its lens reads the residuals the fused step emits"
        return "the fused step computes every row it asks"

    def execute(self, batch: StepBatch) -> Executed:
        fused, requests = self.model.fused_step(), batch.requests
        counts = torch.tensor([r.n for r in requests])  # (R,)
        slots = pad_sequence([r.slots for r in requests], batch_first=True)  # (R, S): past a row's own unread
        slots = slots.repeat_interleave(counts, dim=0)  # (B, S): a row's request's
        x = self.model.embed(batch.ids[None], batch.positions[None])[0]  # (B, d)
        # per kind of layer, (B, rotated) each
        angles = None if self.rope is None else self.rope.rows(batch.positions, requests)
        groups = adapter_rows(requests)  # adapter name -> its rows
        adapter_of = torch.full(batch.ids.shape, -1)  # (B,) each row's adapter, its index in groups
        for i, rows in enumerate(groups.values()):
            adapter_of[rows] = i
        inspecting = [r for r in requests if r.seq.params.inspects]  # capture, lens
        emit = residuals = writes = None
        if inspecting:
            emit = flat_rows(inspecting)  # (M,)
            m, n_layers, d = len(emit), len(self.model.blocks), x.shape[1]
            residuals = torch.empty(m, n_layers + 1, d)  # (M, L + 1, d)
            if any(fused_source(site)[0] == "writes" for r in inspecting for site in r.seq.params.capture):
                writes = torch.empty(m, n_layers, 2, d)  # (M, L, 2, d): attn.out, mlp.out
        h = fused.rows(x, batch.positions, slots, angles, self.pool.keys, self.pool.values,
                       adapter_of if groups else None, [self.adapters[name].fused for name in groups],
                       emit, residuals, writes)  # (B, d)
        inspection = Inspection(self.model.config, requests, own_rows=True)  # no hooks if none inspects
        writes = None if writes is None else writes.flatten(1, 2)  # (M, 2 L, d)
        inspection.feed({"residuals": residuals, "writes": writes})
        return Executed(h, inspection.lens)
