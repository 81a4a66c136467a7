"""The generation loop: prefill the prompt once, then decode one token at a time.

    logits = prefill(prompt)              keys and values of every prompt token enter the cache
    loop:  token = pick(logits[-1])       greedy / sampling (sampling.py) / beam (beam.py)
           logits = decode_one_token(token)   one query against the cache, last row only
           stop on end-of-text, a stop string (stopping.py), max_new_tokens or a full window

Without the cache (`use_cache=False`) every step recomputes the whole prefix instead: the
baseline the cache must equal. Prompts of different lengths share a batch by left padding.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from torch import Tensor

from .kv_cache import KVCache
from .model import Transformer
from .sampling import SamplingConfig, next_token, token_counts
from .stopping import Decoder, TextStream

StopReason = Literal["eos", "stop_string", "max_new_tokens", "context_full"]


@dataclass(frozen=True)
class GenerationConfig:
    """How to continue a prompt. The default is greedy decoding with the KV cache."""

    max_new_tokens: int = 64
    sampling: SamplingConfig = SamplingConfig(temperature=0.0)
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # stop strings, checked on the decoded text (needs a tokenizer)
    eos_ids: tuple[int, ...] | None = None  # None: the tokenizer's eos_id
    use_cache: bool = True
    beams: int = 1  # > 1: beam search (beam.py)
    length_penalty: float = 1.0  # beam score = sum log p / length^length_penalty
    truncate: bool = False  # a prompt longer than the window is cut from the left
    overflow: Literal["stop", "slide"] = "stop"  # at the window's end: stop, or drop old tokens

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens!r}")
        if self.beams < 1:
            raise ValueError(f"beams: must be >= 1, got {self.beams}")
        if self.overflow not in ("stop", "slide"):
            raise ValueError(f"overflow: choose 'stop' or 'slide', got {self.overflow!r}")
        if isinstance(self.stop, str):
            raise ValueError("stop: a tuple of strings, not a single string")


@dataclass
class GenerationResult:
    prompt_ids: list[int]  # what the model saw (after truncation)
    generated_ids: list[int]  # including the end-of-text token when one ended the text
    text: str | None  # the visible text, cut before a stop string; None without a tokenizer
    stop_reason: StopReason
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int  # forward passes after the prefill
    truncated_tokens: int = 0  # prompt tokens dropped from the left
    log_prob: float | None = None  # sum of log-probabilities of generated_ids (beam search)
    stop_string: str | None = field(default=None)

    @property
    def n_generated(self) -> int:
        return len(self.generated_ids)

    @property
    def prefill_tokens_per_second(self) -> float:
        return len(self.prompt_ids) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {
            "n_generated": self.n_generated,
            "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "decode_tokens_per_second": self.decode_tokens_per_second,
        }


@dataclass(frozen=True)
class Piece:
    """One generated token of row `row` and the text it made visible ('' while held back)."""

    row: int
    token_id: int
    text: str


def prefill(
    model: Transformer,
    ids: Tensor,
    cache: KVCache | None = None,
    positions: Tensor | None = None,
    pad_mask: Tensor | None = None,
) -> Tensor:
    """Run the prompt ids (B, T) through the model (filling `cache`): next-token logits (B, V)."""
    h = model.forward_hidden(ids, cache, positions, pad_mask)  # (B, T, d)
    return model.head(h[:, -1])  # (B, V): only the last row is ever needed


def decode_one_token(
    model: Transformer, token: Tensor, cache: KVCache, positions: Tensor | None = None
) -> Tensor:
    """Feed one token per row (B,) at `positions` (B,) against the cache: logits (B, V)."""
    h = model.forward_hidden(token[:, None], cache, None if positions is None else positions[:, None])
    return model.head(h[:, -1])  # (B, V)


def left_pad(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, ...]:
    """ids (B, L) padded on the left, their positions (B, L) and pad_mask (B, L);
    positions and pad_mask are None when every row has the same length."""
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long, device=device)  # (B, L)
    mask = torch.zeros(len(rows), L, dtype=torch.bool, device=device)  # (B, L)
    for b, row in enumerate(rows):
        ids[b, L - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[b, L - len(row) :] = True
    if mask.all():
        return ids, None, None
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, L): 0 at the first real token
    return ids, positions, mask


def select_rows(cache: KVCache, rows: Tensor) -> None:
    """Keep (or repeat) the cache's batch rows `rows` (B',) in that order, in place."""
    for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
        if k is not None:
            cache.keys[i], cache.values[i] = k.index_select(0, rows), v.index_select(0, rows)
    cache.positions = cache.positions.index_select(0, rows.to(cache.positions.device))
    cache.valid = cache.valid.index_select(0, rows.to(cache.valid.device))
    cache.batch_size = len(rows)
    cache.shape = (len(rows), *cache.shape[1:])


def fit_prompt(prompt: Sequence[int], context_length: int, config: GenerationConfig) -> list[int]:
    """The prompt, or its end when it is longer than the window and `truncate` is set: it then
    keeps room for max_new_tokens, but never less than half the window of prompt."""
    prompt = list(prompt)
    if not prompt:
        raise ValueError("prompt: empty; give at least one token")
    if len(prompt) <= context_length:
        return prompt
    if not config.truncate:
        raise ValueError(
            f"prompt: {len(prompt)} tokens exceed the model's context_length={context_length} "
            "(truncate=True / --truncate keeps the end of the prompt)"
        )
    keep = context_length - min(config.max_new_tokens, context_length // 2)
    return prompt[-keep:]


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _eos_ids(config: GenerationConfig, tokenizer: Decoder | None) -> set[int]:
    if config.eos_ids is not None:
        return set(config.eos_ids)
    eos = getattr(tokenizer, "eos_id", None)
    return set() if eos is None else {eos}


def stream_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig = GenerationConfig(),
    tokenizer: Decoder | None = None,
) -> Iterator[Piece]:
    """Generate for every prompt at once, yielding each new token as a Piece; the generator's
    return value is the list of GenerationResult, one per prompt."""
    mc = model.config
    if config.use_cache and not mc.causal:
        raise ValueError("use_cache: a bidirectional model cannot decode incrementally; use_cache=False")
    if config.stop and tokenizer is None:
        raise ValueError("stop: stop strings need a tokenizer to decode the text")
    originals = [list(p) for p in prompts]
    fitted = [fit_prompt(p, mc.context_length, config) for p in originals]
    contexts = [list(p) for p in fitted]  # what the model sees: the prompt, then generated tokens
    generated: list[list[int]] = [[] for _ in prompts]
    reasons: list[StopReason | None] = [None] * len(prompts)
    texts = [None if tokenizer is None else TextStream(tokenizer, config.stop, p[-4:]) for p in fitted]
    eos = _eos_ids(config, tokenizer)
    sampling = config.sampling
    device = model.embed.tokens.weight.device
    generator = torch.Generator(device=device)
    generator.manual_seed(config.seed) if config.seed is not None else generator.seed()
    live = list(range(len(prompts)))  # batch row -> prompt index
    cache: KVCache | None = None
    padded = False  # whether the rows in the cache are left-padded (then positions are explicit)

    def forward_all() -> Tensor:
        """A fresh forward over every live context (the prefill, or a rebuild)."""
        nonlocal cache, padded
        ids, positions, mask = left_pad([contexts[i] for i in live], device)
        padded = mask is not None
        if config.use_cache:
            room = min(mc.context_length, ids.shape[1] + config.max_new_tokens)
            cache = KVCache(mc, len(live), max_length=room)
        return prefill(model, ids, cache, positions, mask)

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            start = _sync(device)
            logits = forward_all()  # (B, V)
            prefill_seconds = (decode_start := _sync(device)) - start
            counts = None
            if sampling.uses_counts:
                ids, _, mask = left_pad(fitted, device)
                counts = token_counts(ids, mc.vocab_size, mask)  # (B, V)
            steps = 0
            while True:
                tokens = next_token(logits, sampling, generator, counts)  # (B,)
                if counts is not None:
                    counts[torch.arange(len(live), device=device), tokens] += 1
                slid = False
                for row, token in enumerate(tokens.tolist()):
                    i = live[row]
                    generated[i].append(token)
                    piece = ""
                    if token in eos:
                        reasons[i] = "eos"
                    elif texts[i] is not None:
                        piece = texts[i].push(token)
                        if texts[i].stop_string is not None:
                            reasons[i] = "stop_string"
                    if reasons[i] is None and len(generated[i]) >= config.max_new_tokens:
                        reasons[i] = "max_new_tokens"
                    if reasons[i] is None and len(contexts[i]) == mc.context_length:
                        if config.overflow == "stop":  # the new token has no position left
                            reasons[i] = "context_full"
                        else:  # slide: keep the newest half window (the new token included)
                            contexts[i] = contexts[i][mc.context_length - mc.context_length // 2 + 1 :]
                            slid = True
                    contexts[i].append(token)
                    if reasons[i] is not None and texts[i] is not None:
                        piece += texts[i].flush()
                    yield Piece(i, token, piece)
                keep = [row for row, i in enumerate(live) if reasons[i] is None]
                if not keep:
                    break
                steps += 1
                if len(keep) < len(live):  # drop finished rows from the batch
                    rows = torch.tensor(keep, device=device)
                    tokens = tokens[rows]
                    counts = None if counts is None else counts[rows]
                    if cache is not None:
                        select_rows(cache, rows)
                    live = [live[row] for row in keep]
                full = cache is not None and cache.length == cache.max_length
                if not config.use_cache or slid or full:
                    logits = forward_all()  # recompute every live context from scratch
                else:
                    positions = None
                    if padded:
                        positions = torch.tensor([len(contexts[i]) - 1 for i in live], device=device)
                    logits = decode_one_token(model, tokens, cache, positions)
            decode_seconds = _sync(device) - decode_start
    finally:
        model.train(was_training)
    return [
        GenerationResult(
            prompt_ids=fitted[i],
            generated_ids=generated[i],
            text=None if texts[i] is None else texts[i].text,
            stop_reason=reasons[i],
            prefill_seconds=prefill_seconds,
            decode_seconds=decode_seconds,
            decode_steps=steps,
            truncated_tokens=len(originals[i]) - len(fitted[i]),
            stop_string=None if texts[i] is None else texts[i].stop_string,
        )
        for i in range(len(prompts))
    ]


class Stream:
    """The Pieces of one prompt's generation as they come; `result` once iteration ends."""

    def __init__(self, steps: Iterator[Piece]) -> None:
        self._steps = steps
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[Piece]:
        results = yield from self._steps
        self.result = results[0]


def _drain(steps: Iterator[Piece]) -> list[GenerationResult]:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def stream(
    model: Transformer,
    prompt_ids: Sequence[int],
    config: GenerationConfig = GenerationConfig(),
    tokenizer: Decoder | None = None,
) -> Stream:
    """Iterate over the Pieces of one prompt's continuation as each token is generated."""
    if config.beams > 1:
        raise ValueError("beams: beam search settles its output only at the end; it cannot stream")
    return Stream(stream_batch(model, [prompt_ids], config, tokenizer))


def generate_batch(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig = GenerationConfig(),
    tokenizer: Decoder | None = None,
) -> list[GenerationResult]:
    """Continue several prompts in one left-padded batch; each as if generated alone."""
    if config.beams > 1:
        return [generate(model, p, config, tokenizer) for p in prompts]
    return _drain(stream_batch(model, prompts, config, tokenizer))


def generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    config: GenerationConfig = GenerationConfig(),
    tokenizer: Decoder | None = None,
) -> GenerationResult:
    """Continue one prompt: greedy, sampled, or beam search when config.beams > 1."""
    if config.beams > 1:
        from .beam import beam_search  # beam.py builds on this module's prefill and decode

        return beam_search(model, prompt_ids, config, tokenizer)
    return _drain(stream_batch(model, [prompt_ids], config, tokenizer))[0]
