"""Executes a step plan: the scheduled tokens of every request, through the model's own blocks.

The N new tokens of a step (decode rows and prefill chunks alike) form one sequence of N
rows, which the model's embedding, blocks, final norm and head process as they process any
sequence; attention alone looks across rows, per request, over its block table, through the
paged view of the pool that the runner hands each block as its cache (paged_attention.py).
Each weight is read once per panel of rows for all requests together.

Batch invariance: every product computes each row on its own (row_tiles.py): the weight
kernels at any number of rows, in every format, the head included (plain nn.Linear in tiles
padded to exactly ROW_TILE rows: one fixed shape, one code path); the norms and
activations treat every row alike. Attention on this path is the model's PyTorch kernel,
whose rounding may follow the call's batch, threads and buffers (paged_attention.py), so a
token's numbers here agree whatever shares its step within float32 rounding; on the fused
step below, bit for bit. The price is prefill speed for float weights; `invariant=False`
sends all rows to each product at once instead.

A converted model (glassformer.quantize) with fast attention and a float32 pool runs the
step's rows, prompt chunks (of prompts up to FUSED_PROMPT_TOKENS) and new tokens alike,
through its fused C++ step (accel/fast_decode.py `FastDecoder.rows`): one call runs every
layer for every row, each at its own position, attending over its own request's block table
in the pool (a chunk's keys are all written before any of its rows attends, each row to its
own position). A row's numbers are those of the fused step for that token alone, so they do
not depend on what shares the step, how the prompt was cut into chunks, the prefix cache's
hits or (prompts up to that length) a preemption's recomputation. A request that captures
residual sites, attn.out or mlp.out only and/or reads the lens stays on the fused step, which
copies out its rows' residual stream after the embedding and each layer (and what each
layer's attention and feed-forward add to it); the capture and lens hooks the blocks would
call are called on those copies (`_inspect`). Steering, ablation and any other site keep the
module path.

A request may name a LoRA adapter (RequestParams.adapter): its rows add that adapter's update to
each product it targets, on those rows alone (adapters.py), on the module path (the view's
wrapped products) or on the fused step, which takes a row -> adapter index
per call and the adapters' factors as built at load; an adapter the fused step cannot add
(ServedAdapter.fused None) keeps its rows on the module path. Every other row is computed as in
an engine without adapters, on the fused step or not.
"""

from __future__ import annotations

import contextlib

import torch

from ..accel.capabilities import CapabilityTable, any_value, only
from ..accel.fast_decode import FastDecoder, can_build
from ..model.layers.positions import rope_cos_sin
from ..model.sink import SinkPolicy
from ..model.transformer import Transformer
from .adapters import Adapters, itself
from .capture import LensRows, capture_hooks, fused_source
from .interventions import changes, edit_hooks, uses_hooks
from .kv_pool import KVPool
from .paged_attention import PagedView, Part, slots_of
from .row_tiles import row_invariant
from .scheduler import StepPlan
from .sequence import Sequence

Scheduled = list[tuple[Sequence, int]]

# Prompts up to this many tokens take the fused step; a longer one's prompt rows keep the
# module path, whose attention over a chunk is one product for all its rows, while the fused
# step's goes row by row (int4 SmolLM2 on 2 cores: 1.25x faster at 1,024 tokens, even at 2,048,
# 0.73x at 4,096). A prompt's length is the request's own, so each of its tokens still takes
# one path whatever shares its steps.
FUSED_PROMPT_TOKENS = 2048

_MODULES = "the model's own modules compute it"
_ANGLES = "angles from the model's own inverse frequencies and attention factor"

# What the engine computes, field by field: it runs the model's embedding, blocks, final norm
# and head; only the RoPE angles (a table over the context) and the flat batch's positions are
# its own, and the masks come from `Transformer.attention_mask`.
CAPABILITIES = CapabilityTable("serving engine", {
    **{name: any_value(_MODULES) for name in (
        "vocab_size", "context_length", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_head",
        "d_ff", "norm", "norm_placement", "qk_norm", "parallel_block", "norm_eps", "norm_bias",
        "activation", "gated",
        "attn_bias", "attn_out_bias", "mlp_bias", "lm_head_bias", "final_norm", "tie_embeddings",
        "dropout", "attention_kernel", "init_std", "n_token_types", "embed_norm", "head",
        "scale_scores", "scale_head_input", "norm_weight_offset", "embed_scale", "attn_softcap",
        "final_softcap", "attn_scale")},
    **{name: any_value(_ANGLES) for name in (
        "rope_theta", "rope_scaling", "rope_factor", "rope_original_context", "rope_low_freq_factor",
        "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow", "rope_truncate",
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


class ModelRunner:
    def __init__(self, model: Transformer, pool: KVPool, attention: str = "fast",
                 invariant: bool = True, sink: SinkPolicy | None = None,
                 adapters: Adapters | None = None, group: int = 1) -> None:
        """`model` is one the engine accepts (CAPABILITIES, checked by Engine; `sink` checked
        by it too); `adapters`: the LoRA adapters requests may name (adapters.py), applied to
        their rows; `group`: the fast attention's query group (paged_attention.py)."""
        config = model.config
        self.model, self.pool, self.fast, self.sink = model, pool, attention == "fast", sink
        self.group = group
        # the model's own modules; with invariance, a view whose products run in row tiles
        self.layers = model.with_products(row_invariant) if invariant else model
        self.adapters = adapters
        if adapters is not None:
            wrap = row_invariant if invariant else itself
            if not invariant:  # a view to wrap, so the model itself stays as it is
                self.layers = model.with_products(wrap)
            adapters.install(self.layers, wrap, self._pool_takes_fused() and can_build(model))
        self.device = model.embed.tokens.weight.device
        self.rope = self.long_rope = None  # computed once: (context, rotated) each
        if config.position == "rope":
            self.rope = self._table(model.rope_inv_freq)
        if model.rope_long_inv_freq is not None:  # LongRoPE's set past the original context
            self.long_rope = self._table(model.rope_long_inv_freq)

    def _table(self, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at every position of the context, (context, rotated) each."""
        positions = torch.arange(self.model.config.context_length, device=self.device)[None]
        cos, sin = rope_cos_sin(inv_freq, positions, self.model.rope_attention_factor)
        dtype = self.model.embed.tokens.weight.dtype
        return cos[0, 0].to(dtype), sin[0, 0].to(dtype)

    def _angles(self, positions: torch.Tensor, long: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of rows at `positions` (N,), (N, rotated) each. Under LongRoPE a row
        whose request's text is past the original context (`long`, per row: Sequence.rope_long,
        set by the engine) turns by the long set: a whole text by one set, as `generate` and
        transformers turn it, however its prompt is cut into chunks."""
        cos, sin = self.rope[0][positions], self.rope[1][positions]
        if self.long_rope is None:
            return cos, sin
        long = torch.tensor(long, device=self.device)[:, None]  # (N, 1)
        return (torch.where(long, self.long_rope[0][positions], cos),
                torch.where(long, self.long_rope[1][positions], sin))

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Runs the plan; returns next-token logits (R, V) for the requests that reach the end
        of their tokens in this step, in plan order."""
        self.pool.reserve(1 + max((b for seq, _ in plan.scheduled for b in seq.block_table), default=-1))
        self.pool.copy_blocks(plan.copies)
        fused = self._fused()
        fast = [fused is not None and self._fused_takes(seq) for seq, _ in plan.scheduled]
        stepped = [part for part, ok in zip(plan.scheduled, fast, strict=True) if ok]
        others = [part for part, ok in zip(plan.scheduled, fast, strict=True) if not ok]
        hidden = {}  # id(request) -> its last row's final hidden state (d,)
        outputs = {}  # id(request) -> its next-token logits (V,), where its lens read them
        if stepped:
            hidden.update(self._run_fused(stepped, fused, outputs))
        if others:
            hidden.update(self._run_blocks(others, outputs))
        ends = [id(seq) for seq, n in plan.scheduled if seq.num_computed + n == seq.num_tokens]
        if not ends:
            return torch.zeros(0, self.model.config.vocab_size, device=self.device)
        todo = [key for key in ends if key not in outputs]
        if todo:
            h = torch.stack([hidden[key] for key in todo])  # (R', d)
            layers = self.layers
            if layers.final_norm is not None:
                h = layers.hooks("final_norm", layers.final_norm(h))
            if len(todo) == len(ends):
                return layers.head(h)  # (R, V)
            outputs |= dict(zip(todo, layers.head(h), strict=True))
        return torch.stack([outputs[key] for key in ends])  # (R, V)

    def _fused(self) -> FastDecoder | None:
        """The model's fused step where it can run the step's rows: fast attention, a float32
        pool, and a step the model accepts now; else None."""
        if not self._pool_takes_fused():
            return None
        step = self.model.fused_step()
        return step if isinstance(step, FastDecoder) else None

    def _pool_takes_fused(self) -> bool:
        """Fast attention over a float32 pool without the sink policy (the fused step keeps
        every key at its text position)."""
        return self.fast and self.pool.kv_dtype == "fp32" and self.sink is None

    def _fused_takes(self, seq: Sequence) -> bool:
        """Whether the fused step computes seq's scheduled rows as it asks: they are a prompt of
        at most FUSED_PROMPT_TOKENS or generated tokens (a longer prompt's last token, cut off
        by the budget, is a query group's as it would be alone), its adapter, if it names one,
        is built for it, and it changes nothing and captures only sites the step emits
        (fused_source; the lens reads residuals only)."""
        params = seq.params
        return ((seq.prompt_len <= FUSED_PROMPT_TOKENS or seq.num_computed >= seq.prompt_len)
                and (params.adapter is None or self.adapters[params.adapter].fused is not None)
                and not changes(params) and all(fused_source(site) is not None for site in params.capture))

    def _run_blocks(self, scheduled: Scheduled, outputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The scheduled tokens through the model's blocks; the last row of each request
        that reaches its end: id(request) -> (d,). `outputs` gets the logits its lens read
        (LensRows.read)."""
        ids, positions, long, parts, ends, capturing = [], [], [], [], {}, []
        adapted: dict[str, list[int]] = {}  # adapter name -> its rows
        for seq, n in scheduled:
            context = seq.num_computed + n
            # a chunk past the sink policy's window (model/sink_chunk.py): its queries sit at
            # the cache's last n positions and see the W - 1 latest keys before its own
            past_window = self.sink is not None and n > 1 and self.sink.full(seq.num_computed)
            slots = self._slots(seq, context, past_window)  # (L,) what its queries see, new ones last
            parts.append(Part(len(ids), n, slots, past_window))
            if uses_hooks(seq.params):  # it captures, reads the lens, steers or ablates
                capturing.append((seq, len(ids), n, seq.num_computed))
            if seq.params.adapter is not None:
                adapted.setdefault(seq.params.adapter, []).extend(range(len(ids), len(ids) + n))
            ids += seq.tokens[seq.num_computed : context]
            first = len(slots) - n if self.sink is None else self.sink.position(seq.num_computed, n)
            positions += range(first, first + n)  # text positions, or the cache's
            long += [seq.rope_long] * n
            if context == seq.num_tokens:
                ends[id(seq)] = len(ids) - 1
        ids_t = torch.tensor(ids, device=self.device)[None]  # (1, N)
        pos_t = torch.tensor(positions, device=self.device)[None]  # (1, N)
        view = PagedView(self.pool, parts, self.fast, self.model, self.sink, self.rope, self.group)
        rope = None
        if self.rope is not None:  # (1, 1, N, rotated) each
            cos, sin = self._angles(pos_t[0], long)
            rope = (cos[None, None], sin[None, None])
        lens, hooks = LensRows(self.model.config, capturing), self.layers.hooks
        # the edits first: a site's capture and lens keep what the next module reads
        with hooks.installed(edit_hooks(self.model.config, capturing)), \
                hooks.installed(capture_hooks(capturing)), hooks.installed(lens.hooks()), \
                self._adapted(adapted):
            x = self.layers.embed(ids_t, pos_t)  # (1, N, d)
            for block in self.layers.blocks:
                x = block(x, None, rope, view)
        outputs |= lens.read(self.layers)  # the row-invariant view: each lens row as if alone
        return {key: x[0, row] for key, row in ends.items()}

    def _slots(self, seq: Sequence, context: int, past_window: bool) -> torch.Tensor:
        """The pool slots of what seq's tokens up to `context` attend to, in position order:
        its first `context` tokens, or under the sink policy the kept ones, or for a chunk past
        its window the sinks, the W - 1 latest before it and its own (L,)."""
        bs = self.pool.block_size
        if self.sink is None:
            return slots_of(seq.block_table, context, bs)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        first = seq.num_computed
        kept = (self.sink.chunk_slots(first) + [self.sink.slot(t) for t in range(first, context)]
                if past_window else self.sink.kept_slots(context))
        kept = torch.tensor(kept, dtype=torch.long)  # (L,)
        return table[kept // bs] * bs + kept % bs

    def _adapted(self, rows: dict[str, list[int]]):
        """The step's adapter rows set on the wrapped products while its blocks run."""
        if not rows:
            return contextlib.nullcontext()
        return self.adapters.rows(rows, self.device)

    def _run_fused(self, scheduled: Scheduled, fused: FastDecoder,
                   outputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The scheduled tokens of each request (a prompt's chunk or one new token) through
        the fused step over the pool, a row each (outputs as _run_blocks')."""
        bs = self.pool.block_size
        seqs = [seq for seq, _ in scheduled]
        starts = [0]  # request i's rows: starts[i] .. starts[i + 1] - 1
        for _, n in scheduled:
            starts.append(starts[-1] + n)
        width = max(len(seq.block_table) for seq in seqs)
        tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table))
                               for seq in seqs])  # (R, blocks)
        slots = (tables[:, :, None] * bs + torch.arange(bs)).reshape(len(seqs), -1)  # (R, S)
        counts = torch.tensor([n for _, n in scheduled])  # (R,)
        slots = slots.repeat_interleave(counts, dim=0)  # (B, S): a row's request's
        positions = torch.tensor([t for seq, n in scheduled
                                  for t in range(seq.num_computed, seq.num_computed + n)])  # (B,)
        ids = torch.tensor([t for seq, n in scheduled
                            for t in seq.tokens[seq.num_computed : seq.num_computed + n]])  # (B,)
        x = self.model.embed(ids[None], positions[None])[0]  # (B, d)
        cos = sin = None
        if self.rope is not None:
            cos, sin = self._angles(positions, [seq.rope_long for seq, n in scheduled for _ in range(n)])
        names = list(dict.fromkeys(seq.params.adapter for seq in seqs if seq.params.adapter is not None))
        adapter_of = torch.tensor([-1 if seq.params.adapter is None else names.index(seq.params.adapter)
                                   for seq in seqs]).repeat_interleave(counts)  # (B,)
        adapters = [self.adapters[name].fused for name in names]
        inspecting = [i for i, seq in enumerate(seqs) if uses_hooks(seq.params)]  # capture, lens
        emit = residuals = writes = None
        if inspecting:
            emit = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in inspecting])  # (M,)
            m, n_layers, d = len(emit), len(self.model.blocks), x.shape[1]
            residuals = torch.empty(m, n_layers + 1, d)  # (M, L + 1, d)
            if any(fused_source(site)[0] == "writes" for i in inspecting for site in seqs[i].params.capture):
                writes = torch.empty(m, n_layers, 2, d)  # (M, L, 2, d): attn.out, mlp.out
        h = fused.rows(x, positions, slots, cos, sin, self.pool.keys, self.pool.values,
                       adapter_of if names else None, adapters, emit, residuals, writes)  # (B, d)
        if inspecting:  # request seqs[i]'s rows of the copies, in order, from its first's
            parts, first = [], 0
            for i in inspecting:
                n = scheduled[i][1]
                parts.append((seqs[i], first, n, seqs[i].num_computed))
                first += n
            emitted = {"residuals": residuals, "writes": None if writes is None else writes.flatten(1, 2)}
            outputs |= self._inspect(parts, emitted)
        return {id(seq): h[starts[i + 1] - 1] for i, (seq, n) in enumerate(scheduled)
                if seq.num_computed + n == seq.num_tokens}

    def _inspect(self, parts: list[tuple[Sequence, int, int, int]],
                 emitted: dict[str, torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """The capture and lens of the fused step's inspecting rows: each asked site's rows of
        what the step emitted (fused_source's name -> (M, sites, d)), rows i .. i + n - 1 of
        parts' (request, i, n, position), handed to the hooks the module path installs, then
        the lens read out as _run_blocks reads it (its logits returned)."""
        lens = LensRows(self.model.config, parts)
        for hooks in (capture_hooks(parts), lens.hooks()):
            for site, keep in hooks.items():
                source, index = fused_source(site)
                keep(emitted[source][:, index][None], site)  # (1, M, d): the site's tensor
        return lens.read(self.layers)
