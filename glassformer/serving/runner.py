"""Executes a step plan: the scheduled tokens of every request, flattened into one batch.

The N new tokens of a step (decode rows and prefill chunks alike) form one (N, d) batch: the
norms, projections and feed-forward see rows, never requests, and attention alone looks
across rows, per request, over its block table (paged_attention.py). Each weight is read
once per row tile for all requests together.

Batch invariance: every row-wise stage runs on tiles of at most ROW_TILE rows, the size the
fast weight kernels take in one call (accel/quantized_linear.py); those kernels compute each
row on its own, and the elementwise ops of a tile treat every row alike. So a token's
numbers do not depend on which tokens share its step. Layers without such kernels (plain
nn.Linear) get tiles padded to exactly ROW_TILE rows: one fixed shape, one code path.
The price is prefill speed (about half that of one large product per layer, measured on a
2-core Zen 4); `invariant=False` sends all rows to each layer at once instead.

Decode steps of a converted model (glassformer.quantize) with fast attention and a float32
pool take the fused C++ step instead (accel/fast_decode.py `FastDecoder.rows`): one call runs
every layer for every row, attending over each row's own block table in the pool, with no
gather and no Python per layer. Each row's numbers are those of `generate`'s fused step for
that sequence alone, so they too are independent of what shares the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..accel.fast_decode import FastDecoder
from ..accel.quantized_linear import QuantizedLinear
from ..model.layers.positions import apply_rope, rope_cos_sin
from ..model.transformer import Transformer
from .kv_pool import KVPool
from .paged_attention import AttentionPlan, Part, paged_attention, slots_of
from .scheduler import StepPlan

ROW_TILE = 8


class ModelRunner:
    def __init__(self, model: Transformer, pool: KVPool, attention: str = "fast",
                 invariant: bool = True) -> None:
        config = model.config
        if not config.causal:
            raise ValueError("model: the engine decodes causal models only")
        self.model, self.pool, self.fast, self.invariant = model, pool, attention == "fast", invariant
        self.device, self.dtype = model.embed.tokens.weight.device, model.embed.tokens.weight.dtype
        linears = [m for m in model.modules() if isinstance(m, (nn.Linear, QuantizedLinear))]
        self.pad = not all(isinstance(m, QuantizedLinear) for m in linears)
        self.rope = None
        if config.position == "rope":  # computed once: (context, d_head) each
            positions = torch.arange(config.context_length, device=self.device)[None]
            cos, sin = rope_cos_sin(model.rope_inv_freq, positions, model.rope_attention_factor)
            dtype = model.embed.tokens.weight.dtype
            self.rope = (cos[0, 0].to(dtype), sin[0, 0].to(dtype))

    def _rows(self, fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        """fn applied to row tiles of xs (N, ·), results concatenated: (N, ·)."""
        n, outs = xs[0].shape[0], []
        if not self.invariant:
            return fn(*xs)
        for i in range(0, n, ROW_TILE):
            tiles = [x[i : i + ROW_TILE] for x in xs]
            m = tiles[0].shape[0]
            if self.pad and m < ROW_TILE:
                tiles = [torch.cat([t, t.new_zeros(ROW_TILE - m, *t.shape[1:])]) for t in tiles]
            outs.append(fn(*tiles)[:m])
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def parts(self, plan: StepPlan) -> list[Part]:
        parts, start = [], 0
        for seq, n in plan.scheduled:
            context = seq.num_computed + n
            slots = slots_of(seq.block_table, context, self.pool.block_size).to(self.device)
            parts.append(Part(start, n, slots))
            start += n
        return parts

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """Runs the plan; returns next-token logits (R, V) for the requests that reach the end
        of their tokens in this step, in plan order."""
        self.pool.copy_blocks(plan.copies)
        fused = self._fused(plan)
        if fused is not None:
            return self._run_fused(plan, fused)
        model, config = self.model, self.model.config
        ids, positions, last_rows = [], [], []
        for seq, n in plan.scheduled:
            ids += seq.tokens[seq.num_computed : seq.num_computed + n]
            positions += range(seq.num_computed, seq.num_computed + n)
            if seq.num_computed + n == seq.num_tokens:
                last_rows.append(len(ids) - 1)
        ids_t = torch.tensor(ids, device=self.device)  # (N,)
        pos_t = torch.tensor(positions, device=self.device)  # (N,)
        parts = self.parts(plan)
        new_slots = torch.cat([p.slots[p.context - p.n :] for p in parts])  # (N,)
        attention = AttentionPlan(parts, self.fast, config.sliding_window,
                                  getattr(model, "alibi_slopes", None), self.dtype, self.device)
        rope = None if self.rope is None else (self.rope[0][pos_t][:, None], self.rope[1][pos_t][:, None])
        x = self._rows(lambda i, p: model.embed(i[None], p[None])[0], ids_t, pos_t)  # (N, d)
        for layer, block in enumerate(model.blocks):
            x = self._block(block, layer, x, new_slots, attention, rope)
        h = x[torch.tensor(last_rows, dtype=torch.long, device=self.device)]  # (R, d)
        if not last_rows:
            return h.new_zeros(0, config.vocab_size)
        if model.final_norm is not None:
            return self._rows(lambda t: model.head(model.final_norm(t)), h)  # (R, V)
        return self._rows(model.head, h)

    def _fused(self, plan: StepPlan) -> FastDecoder | None:
        """The model's fused step where it can run this plan: decode rows only (one token
        each), fast attention, a float32 pool; else None."""
        if not self.fast or self.pool.kv_dtype != "fp32" or any(n != 1 for _, n in plan.scheduled):
            return None
        step = self.model.fused_step()
        return step if isinstance(step, FastDecoder) else None

    def _run_fused(self, plan: StepPlan, fused: FastDecoder) -> torch.Tensor:
        model, bs = self.model, self.pool.block_size
        seqs = [seq for seq, _ in plan.scheduled]
        width = max(len(seq.block_table) for seq in seqs)
        tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table))
                               for seq in seqs])  # (B, blocks)
        slots = (tables[:, :, None] * bs + torch.arange(bs)).reshape(len(seqs), -1)  # (B, S)
        positions = torch.tensor([seq.num_computed for seq in seqs])  # (B,)
        ids = torch.tensor([seq.tokens[seq.num_computed] for seq in seqs])  # (B,)
        x = model.embed(ids[None], positions[None])[0]  # (B, d)
        cos = sin = None
        if self.rope is not None:
            cos, sin = self.rope[0][positions], self.rope[1][positions]  # (B, d_head) each
        h = fused.rows(x, positions, slots, cos, sin, self.pool.keys, self.pool.values)  # (B, d)
        last = [i for i, seq in enumerate(seqs) if seq.num_computed + 1 == seq.num_tokens]
        h = h[last]  # (R, d)
        if model.final_norm is not None:
            return self._rows(lambda t: model.head(model.final_norm(t)), h)  # (R, V)
        return self._rows(model.head, h)

    def _block(self, block, layer, x, slots, attention, rope) -> torch.Tensor:
        attn = block.attn
        N = x.shape[0]
        inner = block.norm1 if block.pre_norm else nn.Identity()
        qkv = self._rows(lambda t: attn.qkv(inner(t)), x)  # (N, (H + 2 KV) d_head)
        q, k, v = qkv.split(attn.split, dim=-1)
        q = q.view(N, attn.n_heads, attn.d_head)  # (N, H, d_head)
        k = k.view(N, attn.n_kv_heads, attn.d_head)  # (N, KV, d_head)
        v = v.view(N, attn.n_kv_heads, attn.d_head)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        self.pool.write(layer, slots, k, v)
        context = paged_attention(q, self.pool, layer, attention).reshape(N, -1)  # (N, H d_head)
        if block.pre_norm:
            def rest(x, c):
                x = x + attn.out(c)
                return x + block.mlp(block.norm2(x))
        else:
            def rest(x, c):
                x = block.norm1(x + attn.out(c))
                return block.norm2(x + block.mlp(x))
        return self._rows(rest, x, context)
