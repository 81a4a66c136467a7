"""A conversation with a chat model that keeps its KV cache from turn to turn.

Each turn renders the whole conversation with the model's chat template, but only the tokens
the cache has not seen are run through the model: the cache is cropped to the longest prefix it
shares with the new rendering (normally everything up to the new user message) and the decode
core (core.py) prefills the rest and streams the reply against the same cache. Sampling works
as in `generate`: penalties count the tokens of the whole rendered conversation, and one
generator, seeded once, draws every turn.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..errors import InputError
from ..model.kv_cache import KVCache
from ..model.sink import SinkKVCache, SinkPolicy
from ..model.transformer import Transformer
from .compiled import check_compilable
from .config import GenerationConfig
from .core import Row, SamplingState, decode_rows, eos_ids, seeded_generators
from .sampling import SamplingConfig


class ChatSession:
    """`reply(text)` streams the assistant's answer as text pieces; `messages` is the history."""

    def __init__(self, model: Transformer, tokenizer, sampling: SamplingConfig | None = None,
                 max_new_tokens: int = 512, system: str | None = None, max_context: int = 2048,
                 seed: int | None = None, kv_dtype: str | None = None,
                 sink: SinkPolicy | None = None, compile: bool = False):
        """`sink`: keep the first S and last W tokens (model/sink.py) and talk past the window;
        a turn that rewrites what the cache has already evicted starts the cache again.
        `compile`: the one-token step compiled over the cache's fixed buffers (compiled.py)."""
        if not getattr(tokenizer, "chat_template", None):
            raise InputError("chat", "this model's tokenizer has no chat template")
        if model.config.n_encoder_layers:
            raise InputError("chat", "a conversation's cache grows turn by turn in a decoder-only "
                             "model; an encoder-decoder answers one source at a time (generate)")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.config = GenerationConfig(max_new_tokens=max_new_tokens, sink=sink,
                                       sampling=sampling or SamplingConfig(temperature=0.0),
                                       kv_dtype=kv_dtype, compile=compile)
        if compile:
            check_compilable(model)
        self.system = system
        self.max_length = min(max_context, model.config.context_length)
        self.generator = seeded_generators(seed, 1, model.embed.tokens.weight.device)[0]
        self.reset()

    def reset(self) -> None:
        """Forget the conversation."""
        self.messages: list[dict[str, str]] = []
        if self.system:
            self.messages.append({"role": "system", "content": self.system})
        self.cache = self._new_cache()
        self.cached_ids: list[int] = []  # the tokens whose keys and values the cache holds
        self.last_prefill = 0  # tokens run through the model before the last reply

    def _new_cache(self) -> KVCache:
        if self.config.sink is not None:
            return SinkKVCache(self.model.config, 1, self.config.sink)
        return KVCache(self.model.config, 1, max_length=self.max_length, kv_dtype=self.config.kv_dtype)

    def reply(self, text: str) -> Iterator[str]:
        """Add a user message and stream the answer. Interrupting the iteration (Ctrl-C) keeps
        the part of the answer produced so far in the conversation."""
        self.messages.append({"role": "user", "content": text})
        ids = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        if self.config.sink is None and len(ids) + 1 > self.max_length:
            self.messages.pop()
            raise InputError("chat", f"the conversation ({len(ids)} tokens) no longer fits the "
                             f"{self.max_length}-token context; start again with /reset")
        shared = _common_prefix(self.cached_ids, ids, limit=len(ids) - 1)  # feed >= 1 token
        sink = isinstance(self.cache, SinkKVCache)
        if sink and shared < self.cache.seen and self.cache.seen > self.cache.max_length:
            self.cache, shared = self._new_cache(), 0  # what differs was evicted: start again
        self.cache.crop(shared)
        self.last_prefill = len(ids) - shared
        eos = eos_ids(self.config, self.tokenizer)
        row = Row(ids, self.config, self.max_length, eos, self.tokenizer)
        state = SamplingState(self.config.sampling, [ids], self.model.config.vocab_size, [self.generator])
        steps = decode_rows(self.model, [row], self.config, state, self.cache)
        try:
            for piece in steps:
                if piece.text:
                    yield piece.text
        finally:  # also on Ctrl-C: keep the partial answer, and note what the cache holds
            steps.close()
            seen = self.cache.seen if sink else self.cache.length
            self.cached_ids = (ids + row.generated)[:seen]
            answer = [t for t in row.generated if t not in eos]
            self.messages.append({"role": "assistant", "content": self.tokenizer.decode(answer)})


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y or n == limit:
            break
        n += 1
    return n
