"""What `Engine.submit` checks before queueing a request, and what the engine answers from a
finished or failed one."""

from __future__ import annotations

from collections.abc import Sequence as Ids

from ..errors import InputError
from ..generation.config import GenerationResult, RequestParams
from ..model.sink import SinkPolicy
from ..model.transformer import Transformer
from .block_manager import BlockManager
from .capture import captured, lens_of
from .errors import CapacityError
from .sequence import Sequence


def check_request(model: Transformer, prompt: Ids[int], params: RequestParams, window: float,
                  sink: SinkPolicy | None, blocks: BlockManager, decodes: bool) -> list[int]:
    """The prompt as a list, once the request is one the engine can run: InputError naming the
    field otherwise (CapacityError where the whole pool could not hold it). `window`: how many
    tokens a request may reach (Engine.window); `decodes`: whether the engine has a tokenizer.
    What the request asks of the model is its params' own check."""
    if not isinstance(params, RequestParams):
        raise InputError("params", f"a RequestParams, got {type(params).__name__}")
    mc = model.config
    prompt = list(prompt)
    if not prompt:
        raise InputError("prompt", "empty; give at least one token")
    if len(prompt) > window:
        raise InputError("prompt", f"{len(prompt)} tokens exceed context_length={mc.context_length}")
    if sink is not None and params.beams > 1:
        raise InputError("beams", "not with the sink policy (beams would share a ring of slots)")
    if params.stop and not decodes:
        raise InputError("stop", "stop strings need a tokenizer to decode the text")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < mc.vocab_size for t in prompt):
        raise InputError("prompt", f"token ids must be integers in 0..{mc.vocab_size - 1}")
    params.check(mc, model.hooks.sites)
    slots = sink.capacity if sink else mc.context_length
    longest = min(len(prompt) + params.max_new_tokens, slots)
    needed = blocks.blocks_for(longest) * params.beams  # every beam may need its own
    if needed > blocks.n_blocks:
        size, beams = blocks.block_size, f"{params.beams} beams x " if params.beams > 1 else ""
        new = longest - len(prompt)
        cut = f" of max_new_tokens {params.max_new_tokens}, cut at the window" \
            if new < params.max_new_tokens else ""
        prompt_fits = blocks.blocks_for(len(prompt) + 1) * params.beams <= blocks.n_blocks
        field = "beams" if params.beams > 1 else "max_new_tokens" if prompt_fits else "prompt"
        raise CapacityError(field, f"the request needs {needed * size} tokens of cache ({beams}"
                            f"{len(prompt)} prompt + {new} new{cut}, in blocks of "
                            f"{size}); the engine holds {blocks.n_blocks * size}")
    return prompt


def too_large(members: list[Sequence], blocks: BlockManager) -> CapacityError:
    """Why a request (its sequences) that could not start on an empty pool is refused."""
    longest, size = max(seq.num_tokens for seq in members), blocks.block_size
    return CapacityError("beams" if len(members) > 1 else "prompt",
                         f"{len(members)} sequence(s) of up to {longest} tokens need more KV cache than "
                         f"the engine's {blocks.n_blocks * size} tokens (blocks of {size})")


def result_of(seq: Sequence) -> GenerationResult:
    """A finished (or stopped) request's result."""
    first = seq.first_token_time or seq.finish_time
    return GenerationResult(
        prompt_ids=seq.tokens[: seq.prompt_len],
        generated_ids=seq.generated,
        text=None if seq.text is None else seq.text.text,
        stop_reason=seq.stop_reason,
        prefill_seconds=first - seq.arrival,  # the time to first token, queueing included
        decode_seconds=seq.finish_time - first,
        decode_steps=max(len(seq.generated) - 1, 0),
        stop_string=None if seq.text is None else seq.text.stop_string,
        captured=captured(seq),
        lens=lens_of(seq),
    )
