"""The one-token decode step compiled (`GenerationConfig.compile`, `--compile`): fixed buffers,
a slot on the device, the same shapes every step.

    prefill (eager)     the prompt through forward_hidden into a dense KVCache: its per-layer
                        (B, n_kv, S_max, d_head) keys and values are the fixed buffers
    step (compiled)     slot s (1,) on the device; each row's position is its key position at
                        s - 1, plus 1; keys, values and that position written at s (index_copy_);
                        the mask over all S_max slots: written (k_range <= s), not padding,
                        causal by position (the model's own attention_mask); the model's own
                        blocks and attention function; the head
    after the step      s += 1 in place and cache.length += 1, outside the compiled region

No data-dependent shape, no Python number read from a tensor: the step compiles once with
`torch.compile(fullgraph=True)` (a graph break is an error, not a silent fallback) and on CUDA
is recorded as a CUDA graph and replayed (mode="reduce-overhead"). Sampling, stops and the
batch's bookkeeping stay in the decode core (core.py), as for the module path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError
from ..model.kv_cache import AttentionFn, KVCache
from ..model.layers.masking import AttentionMask
from ..model.transformer import Transformer

# Cache lengths are rounded up to a multiple of this (within the window), so that prompts of
# nearby lengths share one compiled shape (and on CUDA one recorded graph).
SLOT_ROUNDING = 256


def compiled_room(needed: int, context_length: int) -> int:
    """The cache length the compiled step decodes in: `needed` slots, rounded up."""
    return min(context_length, -(-needed // SLOT_ROUNDING) * SLOT_ROUNDING)


def check_compilable(model: Transformer) -> None:
    """Raise where the compiled step cannot compute this model's decode as the module path does;
    the request's side is checked by config.refuse_compile."""
    config = model.config
    if config.n_encoder_layers:
        raise InputError("compile", "an encoder-decoder decodes against its encoder's output; "
                         "the compiled step is for decoder-only models")
    if not config.causal:
        raise InputError("compile", "a bidirectional model does not decode token by token")
    if config.attention_kernel == "flash":
        raise InputError("compile", "attention_kernel='flash' skips key tiles by their mask's "
                         "values; use 'sdpa' or 'reference' with the compiled step")
    if model.hooks:
        raise InputError("compile", "hooks are installed on the model (steering, capture, "
                         "tracing): they run Python per site; generate without --compile")
    if model.has_fused_step:
        raise InputError("compile", "compiles the plain PyTorch weights; not with --quantize "
                         "(a fused C++ step)")


class SlotCache:
    """The AttentionCache a compiled step hands the blocks: each layer's new keys and values
    (B, KV, 1, d_head) written at `slot` of the fixed buffers, then the layer's attention over
    all S_max slots (the mask hides those not written yet). Buffers in another plain dtype (a
    kv_dtype of fp32 or bf16) are read back in the queries' dtype, as the dense cache does."""

    rotates_keys = False

    def __init__(self, keys: list[Tensor], values: list[Tensor], slot: Tensor) -> None:
        self.keys, self.values, self.slot = keys, values, slot

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None,
               attention: AttentionFn) -> Tensor:
        keys, values = self.keys[layer], self.values[layer]  # (B, KV, S_max, d_head)
        keys.index_copy_(2, self.slot, k.to(keys.dtype))
        values.index_copy_(2, self.slot, v.to(values.dtype))
        return attention(q, keys.to(q.dtype), values.to(q.dtype), mask)


def static_step(model: Transformer, token: Tensor, slot: Tensor, keys: list[Tensor],
                values: list[Tensor], key_positions: Tensor, key_valid: Tensor) -> Tensor:
    """One token per row (B,) written at `slot` (1,): next-token logits (B, V). key_positions
    and key_valid (B, S_max) are the cache's record of each slot's position and padding."""
    position = key_positions.index_select(1, slot - 1) + 1  # (B, 1): one past the row's last
    key_positions.index_copy_(1, slot, position)
    written = torch.arange(key_positions.shape[1], device=slot.device) <= slot  # (S_max,)
    mask = model.attention_mask(position, key_positions, key_valid & written)
    h = model.run_blocks(token[:, None], position, mask, SlotCache(keys, values, slot))  # (B, 1, d)
    return model.head(h[:, -1])  # (B, V)


# Dynamo keeps compiled graphs on the function's code, one set per backend: a wrapper made once
# per mode lets every generation (and every model of the same shapes) reuse them. Static shapes
# (dynamic=False): a new batch size or cache length is a graph of its own, never a symbolic one.
_STEP = torch.compile(static_step, fullgraph=True, dynamic=False)
_STEP_AS_CUDA_GRAPH = torch.compile(static_step, fullgraph=True, dynamic=False,
                                    mode="reduce-overhead")


class CompiledStep:
    """decode_one_token's compiled twin over one generation's caches: (tokens (B,), cache) ->
    logits (B, V). Positions follow on the device: each row's previous one plus one."""

    def __init__(self, model: Transformer) -> None:
        check_compilable(model)
        self.model = model
        self.slot: Tensor | None = None  # (1,): where the next token is written
        self.length = -1  # the cache length `slot` stands for; -1: none yet

    def __call__(self, token: Tensor, cache: KVCache) -> Tensor:
        if cache.length != self.length:  # a new cache, a rebuilt one, or a conversation's turn
            self.slot = torch.tensor([cache.length], device=token.device)  # (1,)
        buffers = (cache.keys, cache.values, cache.positions, cache.valid)
        if token.device.type == "cuda":  # the buffers stay where the recorded graph reads them
            for tensor in (*cache.keys, *cache.values, cache.positions, cache.valid):
                torch._dynamo.mark_static_address(tensor)
            torch.compiler.cudagraph_mark_step_begin()
            logits = _STEP_AS_CUDA_GRAPH(self.model, token, self.slot, *buffers).clone()
        else:
            logits = _STEP(self.model, token, self.slot, *buffers)
        self.slot.add_(1)
        cache.advance(1)
        self.length = cache.length
        return logits
