"""The decode core every generation loop runs on: generate, batches, streams, chat, beam search
and the training sample.

    logits = prefill(contexts)               every prompt token's keys and values enter the cache
    loop:  tokens = state.pick(logits)       greedy, or one draw per row with the row's generator
           row.accept(token)                 end-of-text, stop string, max_new_tokens, window
           logits = decode_one_token(tokens) one query per row against the cache, last row only

Without the cache (`use_cache=False`), after a row's context slid past the window, or when a
row grows past a LongRoPE model's original context (its keys all turn by the long set from
then on), every live context is run through the model again instead: the baseline the cache
must equal.
Prompts of different lengths share a batch by left padding, with explicit positions.
With `compile`, decode_one_token's compiled twin (compiled.py) takes the one-token steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Sequence

import torch
from torch import Tensor

from ..errors import InputError
from ..model.kv_cache import KVCache
from ..model.layers.positions import switches_to_long
from ..model.sink import SinkKVCache
from ..model.transformer import Transformer
from .batching import left_pad, select_rows
from .compiled import CompiledStep, compiled_room
from .config import Decoding, GenerationConfig, GenerationResult, Piece, StopReason
from .paths import FUSED, Asks, choose_path
from .sampling import SamplingConfig, greedy, process_logits, sample_rows, token_counts
from .stopping import Decoder, TextStream


def prefill(
    model: Transformer,
    ids: Tensor,
    cache: KVCache | None = None,
    positions: Tensor | None = None,
    pad_mask: Tensor | None = None,
) -> Tensor:
    """Run the prompt ids (B, T) through the model (filling `cache`): next-token logits (B, V).
    A sink cache takes the prompt in the pieces its window allows (model/sink.py `room`)."""
    if isinstance(cache, SinkKVCache):
        if pad_mask is not None:
            raise InputError("sink", "the sink policy streams prompts of one length together (no padding)")
        start = 0
        while start < ids.shape[1]:
            end = start + cache.room()
            h = model.forward_hidden(ids[:, start:end], cache)  # (B, ≤ room, d)
            start = end
    else:
        h = model.forward_hidden(ids, cache, positions, pad_mask)  # (B, T, d)
    return model.head(h[:, -1])  # (B, V): only the last row is ever needed


def decode_one_token(
    model: Transformer, token: Tensor, cache: KVCache, positions: Tensor | None = None
) -> Tensor:
    """Feed one token per row (B,) at `positions` (B,) against the cache: logits (B, V).

    One sequence on a model converted by `glassformer.quantize` takes the fused C++ step
    (`glassformer.fast_decode`), which computes the same thing without Python per layer, where
    paths.py's `choose_path` sends it (float32 keys and values at their text positions)."""
    asks = Asks(kv_dtype=cache.kv_dtype, moves_keys=cache.rotates_keys, sequences=token.shape[0],
                own_positions=positions is not None or cache.padded)
    if choose_path(model, asks).name == FUSED:
        return model.fused_step()(token, cache)
    h = model.forward_hidden(token[:, None], cache, None if positions is None else positions[:, None])
    return model.head(h[:, -1])  # (B, V)


def fit_prompt(prompt: Sequence[int], context_length: int, config: GenerationConfig) -> list[int]:
    """The prompt, or its end when it is longer than the window and `truncate` is set: it then
    keeps room for max_new_tokens, but never less than half the window of prompt."""
    prompt = list(prompt)
    if not prompt:
        raise InputError("prompt", "empty; give at least one token")
    if len(prompt) <= context_length:
        return prompt
    if not config.truncate:
        raise InputError("prompt",
            f"{len(prompt)} tokens exceed the model's context_length={context_length} "
            "(truncate=True / --truncate keeps the end of the prompt)"
        )
    keep = context_length - min(config.max_new_tokens, context_length // 2)
    return prompt[-keep:]


def eos_ids(params: Decoding, tokenizer: Decoder | None) -> set[int]:
    """The tokens that end a text: params.eos_ids, else the tokenizer's end_ids (EOS and any
    end-of-turn token), else its eos_id."""
    if params.eos_ids is not None:
        return set(params.eos_ids)
    if hasattr(tokenizer, "end_ids"):
        return set(tokenizer.end_ids)
    eos = getattr(tokenizer, "eos_id", None)
    return set() if eos is None else {eos}


def clock(device: torch.device) -> float:
    """time.perf_counter() once the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def seeded_generators(seed: int | None, n: int, device: torch.device) -> list[torch.Generator]:
    """One generator per row, each seeded with `seed` (a fresh random seed each when None), so
    a row of a batch draws exactly what its prompt alone would."""
    generators = [torch.Generator(device=device) for _ in range(n)]
    for generator in generators:
        generator.manual_seed(seed) if seed is not None else generator.seed()
    return generators


class SamplingState:
    """What picking the next token needs besides the logits, per row: how often each token
    occurred in the row's context (for penalties) and the row's own random generator."""

    def __init__(self, config: SamplingConfig, contexts: Sequence[Sequence[int]], vocab_size: int,
                 generators: list[torch.Generator]) -> None:
        self.config, self.generators = config, generators
        self.counts = None  # (B, V) when a penalty needs them
        if config.uses_counts:
            ids, _, mask = left_pad(contexts, generators[0].device)
            self.counts = token_counts(ids, vocab_size, mask)  # (B, V)

    def pick(self, logits: Tensor) -> Tensor:
        """The next token of every row (B, V) -> (B,), counted into the row's context."""
        logits = process_logits(logits, self.config, self.counts)
        if self.config.greedy:
            tokens = greedy(logits)  # (B,)
        else:  # each row draws with its own generator, as it would alone
            tokens = sample_rows(logits, self.generators)  # (B,)
        if self.counts is not None:
            self.counts[torch.arange(len(tokens), device=tokens.device), tokens] += 1
        return tokens

    def keep(self, index: Tensor) -> None:
        """Keep only the rows `index` (B',), in that order."""
        self.generators = [self.generators[i] for i in index.tolist()]
        if self.counts is not None:
            self.counts = self.counts[index]


def stop_after(token: int, eos: set[int], text: TextStream | None, n_generated: int,
               max_new_tokens: int) -> tuple[StopReason | None, str]:
    """Why a row stops once `token` is its n_generated-th token (end-of-text, a stop string,
    its budget), or None; and the text the token makes visible (held back text is kept)."""
    if token in eos:
        return "eos", ""
    piece = "" if text is None else text.push(token)
    if text is not None and text.stop_string is not None:
        return "stop_string", piece
    return ("max_new_tokens" if n_generated >= max_new_tokens else None), piece


class Row:
    """One prompt's generation: what the model sees, what was generated, why it stopped, and
    the text released so far."""

    def __init__(self, prompt: Sequence[int], config: GenerationConfig, window: float,
                 eos: set[int], tokenizer: Decoder | None) -> None:
        if config.stop and tokenizer is None:
            raise InputError("stop", "stop strings need a tokenizer to decode the text")
        if config.sink is not None:  # the sink cache streams past any window
            window = math.inf
        self.prompt = fit_prompt(prompt, window, config)
        self.truncated = len(prompt) - len(self.prompt)
        self.context = list(self.prompt)  # the prompt, then generated tokens; slides when asked
        self.generated: list[int] = []
        self.reason: StopReason | None = None
        self.text = None if tokenizer is None else TextStream(tokenizer, config.stop, self.prompt[-4:])
        self.config, self.window, self.eos = config, window, eos
        self.slid = False  # whether the context was just cut (the cache must be rebuilt)

    def accept(self, token: int) -> str:
        """Append a generated token, decide whether to stop; returns the newly visible text."""
        self.generated.append(token)
        self.reason, piece = stop_after(token, self.eos, self.text, len(self.generated),
                                        self.config.max_new_tokens)
        self.slid = False
        if self.reason is None and len(self.context) == self.window:  # no position left for it
            if self.config.overflow == "stop":
                self.reason = "context_full"
            else:  # slide: keep the newest half window (the new token included)
                self.context = self.context[self.window - self.window // 2 + 1 :]
                self.slid = True
        self.context.append(token)
        if self.reason is not None and self.text is not None:
            piece += self.text.flush()
        return piece

    def result(self, prefill_seconds: float, decode_seconds: float, steps: int) -> GenerationResult:
        return GenerationResult(
            prompt_ids=self.prompt,
            generated_ids=self.generated,
            text=None if self.text is None else self.text.text,
            stop_reason=self.reason,
            prefill_seconds=prefill_seconds,
            decode_seconds=decode_seconds,
            decode_steps=steps,
            truncated_tokens=self.truncated,
            stop_string=None if self.text is None else self.text.stop_string,
        )


def decode_rows(
    model: Transformer,
    rows: list[Row],
    config: GenerationConfig,
    state: SamplingState,
    cache: KVCache | None = None,
) -> Generator[Piece, None, tuple[float, float, int]]:
    """Generate for every row until each has stopped, yielding each new token as a Piece; the
    return value is (prefill_seconds, decode_seconds, decode steps).

    A `cache` given for a single row already holds the start of its context (a conversation's
    earlier turns): only the rest is prefilled into it."""
    mc = model.config
    if config.use_cache and not mc.causal:
        raise InputError("use_cache", "a bidirectional model cannot decode incrementally; use_cache=False")
    if cache is not None and (len(rows) != 1 or not config.use_cache):
        raise InputError("cache", "a kept cache continues exactly one row, with use_cache=True")
    device = model.embed.tokens.weight.device
    live = list(range(len(rows)))  # batch row -> index in `rows`
    resume = kept = cache is not None
    padded = False  # whether the rows in the cache are left-padded (then positions are explicit)
    compiled = CompiledStep(model) if config.compile else None

    def forward_all() -> Tensor:
        """Run every live context through the model (the prefill, or a rebuild): logits (B, V)."""
        nonlocal cache, padded, resume
        if resume:  # only what the kept cache has not seen
            resume = False
            seen = cache.seen if isinstance(cache, SinkKVCache) else cache.length
            if switches_to_long(mc, seen, len(rows[0].context)):  # LongRoPE: all again, long
                cache.crop(0)
                seen = 0
            return prefill(model, torch.tensor([rows[0].context[seen:]], device=device), cache)
        ids, positions, mask = left_pad([rows[i].context for i in live], device)  # (B, L)
        padded = mask is not None
        if config.use_cache and config.sink is not None:
            cache = SinkKVCache(mc, len(live), config.sink)
        elif config.use_cache:
            room = min(mc.context_length, ids.shape[1] + config.max_new_tokens)
            if compiled is not None:
                room = compiled_room(room, mc.context_length)
            cache = KVCache(mc, len(live), max_length=room, kv_dtype=config.kv_dtype)
        return prefill(model, ids, cache, positions, mask)

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            start = clock(device)
            logits = forward_all()  # (B, V)
            prefill_seconds = (decode_start := clock(device)) - start
            steps = 0
            while True:
                tokens = state.pick(logits)  # (B,)
                for i, token in zip(live, tokens.tolist(), strict=True):
                    yield Piece(i, token, rows[i].accept(token))
                keep = [b for b, i in enumerate(live) if rows[i].reason is None]
                if not keep:
                    break
                steps += 1
                if len(keep) < len(live):  # drop finished rows from the batch
                    index = torch.tensor(keep, device=device)
                    tokens = tokens[index]
                    state.keep(index)
                    if cache is not None:
                        select_rows(cache, index)
                    live = [live[b] for b in keep]
                full = cache is not None and cache.length == cache.max_length
                crossed = any(switches_to_long(mc, len(rows[i].context) - 1, len(rows[i].context))
                              for i in live)  # LongRoPE: every key by the long set from here
                if crossed and kept:  # the caller's cache holds the text again, every key long
                    cache.crop(0)
                    resume = True
                if not config.use_cache or full or crossed or any(rows[i].slid for i in live):
                    logits = forward_all()  # recompute every live context from scratch
                elif compiled is not None:
                    logits = compiled(tokens, cache)  # positions follow on the device
                else:
                    positions = None
                    if padded:
                        positions = torch.tensor([len(rows[i].context) - 1 for i in live], device=device)
                    logits = decode_one_token(model, tokens, cache, positions)
            decode_seconds = clock(device) - decode_start
    finally:
        model.train(was_training)
    return prefill_seconds, decode_seconds, steps
