"""Runs a step: the scheduler's plan as one StepBatch (step.py) whose every request takes the
path `choose_path` gives it (generation/paths.py), each path's share through its executor
(executors.py), then one read-out of every wanted row (read_out.py).

    batch  = runner.batch(plan)                       ids, positions; per request rows, slots, path
    hidden = executor.execute(batch.on(path))         the fused C++ step; the module path
    logits = step_logits(model, batch, hidden, lens)  final norm, head and lens, once

A converted model (glassformer.quantize) with fast attention and a float32 pool runs a
request's rows, prompt chunks (of prompts up to FUSED_PROMPT_TOKENS) and new tokens alike,
through its fused step; steering, ablation, sites the step does not emit, an adapter not built
for it, other pools and the sink policy keep the module path. Batch invariance: every product
computes each row on its own (row_tiles.py), the head included, so a token's numbers agree
whatever shares its step (on the fused step bit for bit; on the module path within the float32
rounding of its attention kernel). The price is prefill speed for float weights;
`invariant=False` sends all rows to each product at once instead.

With `graph=True` (serve / generate --prompts-file `--compile`) plain decoding rows take the
graph executor (graph_path.py): a compiled step per batch bucket over the pool through
FlexAttention; prompt chunks and rows that inspect, steer or name an adapter stay on the module
path, each with its reason.

On a GPU a norm's or a decoding row's attention call, and the graph's bucket, follow the step's
size, and its kernels split their sums by it; `fixed_batch` (EngineConfig.deterministic on
CUDA) fixes every shape by the request alone: norms in row tiles too, one attention call per
decoding row, the graph at one bucket (docs/guides/serving.md says what it costs).

A request may name a LoRA adapter (RequestParams.adapter): its rows add that adapter's update to
each product it targets, on those rows alone (adapters.py), on either path.
"""

from __future__ import annotations

import torch

from ..accel.capabilities import CapabilityTable, any_value, only
from ..accel.fast_decode import can_build
from ..generation.paths import FUSED, GRAPH, MODULES, Asks, Path, choose_path, module_reason
from ..model.sink import SinkPolicy
from ..model.transformer import Transformer
from .adapters import Adapters, itself
from .executors import FusedPath, ModulePath, RopeTables
from .graph_path import GraphPath
from .kv_pool import KVPool
from .read_out import step_logits
from .row_tiles import row_invariant, tile_norms
from .scheduler import StepPlan
from .sequence import Sequence
from .step import StepBatch, step_batch

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


class ModelRunner:
    def __init__(self, model: Transformer, pool: KVPool, attention: str = "fast",
                 invariant: bool = True, sink: SinkPolicy | None = None,
                 adapters: Adapters | None = None, group: int = 1, graph: bool = False,
                 fixed_batch: int | None = None) -> None:
        """`model` is one the engine accepts (CAPABILITIES, checked by Engine; `sink` checked
        by it too); `adapters`: the LoRA adapters requests may name (adapters.py), applied to
        their rows; `group`: the fast attention's query group (paged_attention.py); `graph`:
        plain decoding rows run compiled (graph_path.py; the pool made with its scratch block);
        `fixed_batch`: the most requests in a step, where every call's shape is to depend on
        the request alone (deterministic on CUDA: norms in row tiles too, one attention call
        per decoding request, the graph always at that batch's bucket), else None."""
        config = model.config
        self.model, self.pool, self.attention, self.sink = model, pool, attention, sink
        self.graph = graph
        self.adapters = adapters
        if fixed_batch is not None and not invariant:
            raise ValueError("fixed shapes need the row-invariant products (invariant=True)")
        # the model's own modules; with invariance, a view whose products run in row tiles
        self.layers = model.with_products(row_invariant) if invariant else model
        if fixed_batch is not None:
            tile_norms(self.layers)
        if adapters is not None:
            wrap = row_invariant if invariant else itself
            if not invariant:  # a view to wrap, so the model itself stays as it is
                self.layers = model.with_products(wrap)
            # built for the fused step too where the pool lets rows take it
            adapters.install(self.layers, wrap, module_reason(self._asks()) is None and can_build(model))
        self.device = model.embed.tokens.weight.device
        rope = RopeTables(model) if config.position == "rope" else None
        self.executors = {FUSED: FusedPath(model, pool, rope, adapters),
                          MODULES: ModulePath(self.layers, model, pool, attention == "fast", sink, rope,
                                              group, adapters, alone=fixed_batch is not None)}
        if graph:
            self.executors[GRAPH] = GraphPath(model, pool, rope, fixed_batch)

    def _asks(self, seq: Sequence | None = None) -> Asks:
        """What seq's rows ask of the step (the pool's, without a request)."""
        if seq is None:
            return Asks(kv_dtype=self.pool.kv_dtype, moves_keys=self.sink is not None, paged=True,
                        attention=self.attention, graph=self.graph)
        params = seq.params
        return Asks(kv_dtype=self.pool.kv_dtype, moves_keys=self.sink is not None, paged=True,
                    attention=self.attention, params=params, graph=self.graph,
                    adapter_fused=params.adapter is None or self.adapters[params.adapter].fused is not None,
                    # a prompt's last token, cut off by the budget, is its query group's as alone
                    prompt=seq.prompt_len if seq.num_computed < seq.prompt_len else 0)

    def route(self, seq: Sequence) -> Path:
        """The path seq's rows take in this step, and why."""
        return choose_path(self.model, self._asks(seq))

    @torch.inference_mode()
    def batch(self, plan: StepPlan) -> StepBatch:
        """The plan as one batch, each request's path chosen (for a step without grad)."""
        return step_batch(plan, self.route, self.pool.block_size, self.sink, self.device)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Runs the batch; returns next-token logits (R, V) for the requests that reach the end
        of their tokens in this step, in batch order."""
        self.pool.reserve(1 + max((b for r in batch.requests for b in r.seq.block_table), default=-1))
        self.pool.copy_blocks(batch.copies)
        hidden, lenses = None, []
        for name, executor in self.executors.items():
            share = batch.on(name)
            if share is None:
                continue
            done = executor.execute(share)
            lenses.append(done.lens)
            if share is batch:
                hidden = done.hidden
            else:
                if hidden is None:
                    hidden = done.hidden.new_empty(len(batch.ids), done.hidden.shape[-1])  # (N, d)
                hidden[share.index.to(hidden.device)] = done.hidden
        return step_logits(self.layers, batch, hidden, lenses)
