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
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import Tensor

from ..accel.fast_decode import fast_decoder
from ..model.kv_cache import KVCache
from ..model.transformer import Transformer
from .batching import left_pad, select_rows
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
    stop_string: str | None = None  # the stop string that ended the text

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
    """Feed one token per row (B,) at `positions` (B,) against the cache: logits (B, V).

    One sequence on a model converted by `glassformer.quantize` takes the fused C++ step
    (`glassformer.fast_decode`), which computes the same thing without Python per layer."""
    if token.shape[0] == 1 and positions is None and not cache.padded:
        fused = fast_decoder(model)
        if fused is not None:
            return fused(token, cache)
    h = model.forward_hidden(token[:, None], cache, None if positions is None else positions[:, None])
    return model.head(h[:, -1])  # (B, V)


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


class _Row:
    """One prompt's state: what the model sees, what was generated, why it stopped."""

    def __init__(self, prompt: Sequence[int], config: GenerationConfig, context_length: int,
                 eos: set[int], tokenizer: Decoder | None) -> None:
        self.prompt = fit_prompt(prompt, context_length, config)
        self.truncated = len(prompt) - len(self.prompt)
        self.context = list(self.prompt)  # the prompt, then generated tokens; slides when asked
        self.generated: list[int] = []
        self.reason: StopReason | None = None
        self.text = None if tokenizer is None else TextStream(tokenizer, config.stop, self.prompt[-4:])
        self.config, self.window, self.eos = config, context_length, eos
        self.slid = False  # whether the context was just cut (the cache must be rebuilt)

    def accept(self, token: int) -> str:
        """Append a generated token, decide whether to stop; returns the newly visible text."""
        self.generated.append(token)
        piece = ""
        if token in self.eos:
            self.reason = "eos"
        elif self.text is not None:
            piece = self.text.push(token)
            if self.text.stop_string is not None:
                self.reason = "stop_string"
        if self.reason is None and len(self.generated) >= self.config.max_new_tokens:
            self.reason = "max_new_tokens"
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
    eos = _eos_ids(config, tokenizer)
    rows = [_Row(p, config, mc.context_length, eos, tokenizer) for p in prompts]
    device = model.embed.tokens.weight.device
    generator = torch.Generator(device=device)
    generator.manual_seed(config.seed) if config.seed is not None else generator.seed()
    live = list(range(len(rows)))  # batch row -> prompt index
    cache: KVCache | None = None
    padded = False  # whether the rows in the cache are left-padded (then positions are explicit)

    def forward_all() -> Tensor:
        """A fresh forward over every live context (the prefill, or a rebuild)."""
        nonlocal cache, padded
        ids, positions, mask = left_pad([rows[i].context for i in live], device)
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
            if config.sampling.uses_counts:
                ids, _, mask = left_pad([r.prompt for r in rows], device)
                counts = token_counts(ids, mc.vocab_size, mask)  # (B, V)
            steps = 0
            while True:
                tokens = next_token(logits, config.sampling, generator, counts)  # (B,)
                if counts is not None:
                    counts[torch.arange(len(live), device=device), tokens] += 1
                for i, token in zip(live, tokens.tolist(), strict=True):
                    yield Piece(i, token, rows[i].accept(token))
                keep = [b for b, i in enumerate(live) if rows[i].reason is None]
                if not keep:
                    break
                steps += 1
                if len(keep) < len(live):  # drop finished rows from the batch
                    index = torch.tensor(keep, device=device)
                    tokens = tokens[index]
                    counts = None if counts is None else counts[index]
                    if cache is not None:
                        select_rows(cache, index)
                    live = [live[b] for b in keep]
                full = cache is not None and cache.length == cache.max_length
                if not config.use_cache or full or any(rows[i].slid for i in live):
                    logits = forward_all()  # recompute every live context from scratch
                else:
                    positions = None
                    if padded:
                        positions = torch.tensor([len(rows[i].context) - 1 for i in live], device=device)
                    logits = decode_one_token(model, tokens, cache, positions)
            decode_seconds = _sync(device) - decode_start
    finally:
        model.train(was_training)
    return [row.result(prefill_seconds, decode_seconds, steps) for row in rows]


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
