"""Beam search: keep the W most likely continuations, not just the single most likely token.

Each step extends every running beam by every token, scores a candidate by the sum of its
log-probabilities, and keeps the best W. A candidate that ends in end-of-text (or a stop
string) is set aside as finished with score  sum log p / n_generated^length_penalty
(length_penalty > 0 favours longer texts). Search ends once W are finished, at
max_new_tokens or at the end of the window; the best finished (or running) beam wins.
With W = 1 the kept candidate is always the argmax: exactly greedy decoding. Whether a
candidate ended, and the winner's text, come from the decode core's Row (core.py), as in
every other loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError
from ..model.kv_cache import KVCache
from ..model.transformer import Transformer
from .batching import select_rows
from .config import GenerationConfig, GenerationResult
from .core import Row, clock, decode_one_token, eos_ids, prefill
from .stopping import Decoder


@dataclass(frozen=True)
class Hypothesis:
    ids: tuple[int, ...]  # generated tokens
    log_prob: float  # their summed log-probabilities

    def score(self, length_penalty: float) -> float:
        return self.log_prob / max(len(self.ids), 1) ** length_penalty


class BeamRanking:
    """The ranking both beam searches run (this one, and the engine's over forked sequences):
    `step` keeps the best continuations, sets aside those that ended, and says when the
    search is over; `winner` is then the best finished (or running) hypothesis.
    `room`: how many tokens the window has a position for after the prompt."""

    def __init__(self, width: int, length_penalty: float, max_new_tokens: int, room: int) -> None:
        self.width, self.length_penalty = width, length_penalty
        self.max_new_tokens, self.room = max_new_tokens, room
        self.finished: list[Hypothesis] = []
        self.survivors: list[Hypothesis] = []
        self.window_full = False

    def step(self, logits: torch.Tensor, running: Sequence[Hypothesis],
             ends: Callable[[int, int], bool]) -> list[int] | None:
        """Rank every running hypothesis (n) extended by every token, from their next-token
        logits (n, V); `ends(source, token)` says whether that candidate ended. Returns the
        source of each survivor in `self.survivors` (best first), or None once search is over."""
        W = self.width
        log_probs = logits.float().log_softmax(dim=-1)  # (n, V)
        totals = torch.tensor([h.log_prob for h in running], device=logits.device)[:, None] + log_probs
        best = torch.topk(totals.flatten(), min(2 * W, totals.numel()))  # sorted, best first
        V = log_probs.shape[-1]
        survivors, sources = [], []
        for rank, (total, flat) in enumerate(zip(best.values.tolist(), best.indices.tolist(), strict=True)):
            source, token = divmod(flat, V)
            candidate = Hypothesis(running[source].ids + (token,), total)
            if ends(source, token):
                if rank < W:  # as in Hugging Face: only a top-W candidate may finish
                    self.finished.append(candidate)
            elif len(survivors) < W:
                survivors.append(candidate)
                sources.append(source)
        self.survivors = survivors
        length = len(survivors[0].ids) if survivors else 0
        done = length >= self.max_new_tokens
        self.window_full = not done and length > self.room  # no position left for the next token
        if len(self.finished) >= W or not survivors or done or self.window_full:
            return None
        return sources

    def winner(self) -> Hypothesis:
        return self.best(1)[0]

    def best(self, count: int) -> list[Hypothesis]:
        """The `count` best hypotheses by score, best first: the finished ones, with the
        running ones too while fewer than the width have finished."""
        pool = self.finished
        if len(self.finished) < self.width and self.survivors:
            pool = self.finished + self.survivors
        return sorted(pool, key=lambda h: -h.score(self.length_penalty))[:count]


def beam_search(
    model: Transformer,
    prompt_ids: Sequence[int],
    config: GenerationConfig,
    tokenizer: Decoder | None = None,
) -> GenerationResult:
    if config.overflow != "stop":
        raise InputError("overflow", "beam search stops at the end of the window; it cannot slide")
    mc, W = model.config, config.beams
    eos = eos_ids(config, tokenizer)
    prompt = Row(prompt_ids, config, mc.context_length, eos, tokenizer).prompt  # checks prompt, stop
    device = model.embed.tokens.weight.device

    def replay(ids: tuple[int, ...]) -> Row:
        """A row that accepted `ids`: its stop reason and visible text, as any decode loop's."""
        row = Row(prompt_ids, config, mc.context_length, eos, tokenizer)
        for token in ids:
            if row.reason is not None:
                break
            row.accept(token)
        return row

    def ends(source: int, token: int) -> bool:
        """Whether running[source] followed by `token` ended the text."""
        if token in eos:
            return True
        return bool(config.stop) and replay(running[source].ids + (token,)).reason == "stop_string"

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            start = clock(device)
            cache = None
            if config.use_cache:
                room = min(mc.context_length, len(prompt) + config.max_new_tokens)
                cache = KVCache(mc, 1, max_length=room, kv_dtype=config.kv_dtype)
            logits = prefill(model, torch.tensor([prompt], device=device), cache)  # (1, V)
            prefill_seconds = (decode_start := clock(device)) - start
            running = [Hypothesis((), 0.0)]
            room = mc.context_length - len(prompt)
            ranking = BeamRanking(W, config.length_penalty, config.max_new_tokens, room)
            steps = 0
            while (sources := ranking.step(logits, running, ends)) is not None:
                steps += 1
                running = ranking.survivors
                tokens = torch.tensor([h.ids[-1] for h in running], device=device)  # (W,)
                if cache is not None:
                    select_rows(cache, torch.tensor(sources, device=device))
                    logits = decode_one_token(model, tokens, cache)
                else:
                    ids = torch.tensor([prompt + list(h.ids) for h in running], device=device)
                    logits = prefill(model, ids)
            decode_seconds = clock(device) - decode_start
    finally:
        model.train(was_training)

    winner = ranking.winner()
    result = replay(winner.ids).result(prefill_seconds, decode_seconds, steps)
    result.log_prob = winner.log_prob
    return result
