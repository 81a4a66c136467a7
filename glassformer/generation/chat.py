"""A conversation with a chat model that keeps its KV cache from turn to turn.

Each turn renders the whole conversation with the model's chat template, but only the tokens
the cache has not seen are run through the model: the cache is cropped to the longest prefix it
shares with the new rendering (normally everything up to the new user message) and the rest is
prefilled. The reply then streams one token at a time against the same cache.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..model.kv_cache import KVCache
from ..model.transformer import Transformer
from .generate import decode_one_token, prefill
from .sampling import SamplingConfig, next_token
from .stopping import IncrementalDecoder


class ChatSession:
    """`reply(text)` streams the assistant's answer as text pieces; `messages` is the history."""

    def __init__(self, model: Transformer, tokenizer, sampling: SamplingConfig | None = None,
                 max_new_tokens: int = 512, system: str | None = None, max_context: int = 2048,
                 seed: int | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat: this model's tokenizer has no chat template")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.sampling = sampling or SamplingConfig(temperature=0.0)
        self.max_new_tokens = max_new_tokens
        self.system = system
        self.max_length = min(max_context, model.config.context_length)
        device = model.embed.tokens.weight.device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed) if seed is not None else self.generator.seed()
        self.reset()

    def reset(self) -> None:
        """Forget the conversation."""
        self.messages: list[dict[str, str]] = []
        if self.system:
            self.messages.append({"role": "system", "content": self.system})
        self.cache = KVCache(self.model.config, 1, max_length=self.max_length)
        self.cached_ids: list[int] = []  # the tokens whose keys and values the cache holds
        self.last_prefill = 0  # tokens run through the model before the last reply

    def reply(self, text: str) -> Iterator[str]:
        """Add a user message and stream the answer. Interrupting the iteration (Ctrl-C) keeps
        the part of the answer produced so far in the conversation."""
        self.messages.append({"role": "user", "content": text})
        ids = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        if len(ids) + 1 > self.max_length:
            self.messages.pop()
            raise ValueError(f"chat: the conversation ({len(ids)} tokens) no longer fits the "
                             f"{self.max_length}-token context; start again with /reset")
        shared = _common_prefix(self.cached_ids, ids, limit=len(ids) - 1)  # feed >= 1 token
        self.cache.crop(shared)
        self.cached_ids = self.cached_ids[:shared]
        self.last_prefill = len(ids) - shared
        device = self.model.embed.tokens.weight.device
        reply: list[int] = []
        decoder = IncrementalDecoder(self.tokenizer, ids[-4:])
        try:
            with torch.inference_mode():
                logits = prefill(self.model, torch.tensor([ids[shared:]], device=device), self.cache)
                self.cached_ids += ids[shared:]
                while True:
                    token = next_token(logits, self.sampling, self.generator)  # (1,)
                    token_id = int(token)
                    if token_id == self.tokenizer.eos_id:
                        break
                    reply.append(token_id)
                    if piece := decoder.push(token_id):
                        yield piece
                    if len(reply) >= self.max_new_tokens or self.cache.length + 1 > self.max_length:
                        break
                    logits = decode_one_token(self.model, token, self.cache)
                    self.cached_ids.append(token_id)
            if rest := decoder.flush():
                yield rest
        finally:  # also on Ctrl-C: keep the partial answer, and a cache that matches cached_ids
            if self.cache.length != len(self.cached_ids):
                self.cache.crop(min(self.cache.length, len(self.cached_ids)))
                self.cached_ids = self.cached_ids[: self.cache.length]
            self.messages.append({"role": "assistant", "content": self.tokenizer.decode(reply)})


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y or n == limit:
            break
        n += 1
    return n
