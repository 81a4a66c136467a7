"""`glassformer.load(source)`: any model Glassformer can read (a known name, a .gguf file, a
Hugging Face or a Glassformer folder: formats/sources.py), as a LanguageModel that generates,
serves many prompts, fills masks, gives logits and traces."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import InputError
from .formats import sources
from .formats.sources import Loaded
from .generation.fill_mask import MaskFill, fill_mask
from .generation.generate import GenerationConfig, GenerationResult, generate
from .generation.sampling import SamplingConfig
from .interpret.trace import Names, capture, run_with_cache
from .serving import Engine, EngineConfig, RequestParams

Prompt = str | Sequence[int]


@dataclass
class LanguageModel(Loaded):
    """A loaded model (formats/sources.py) with what a caller does with it."""

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text, or a sequence of ids checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, Sequence) and not torch.is_tensor(prompt):
            raise TypeError("prompt: give a str or a sequence of token ids, "
                            f"not {type(prompt).__name__}")
        ids = prompt.tolist() if torch.is_tensor(prompt) else list(prompt)
        vocab = self.model.config.vocab_size
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
                raise InputError("prompt", f"token id {i!r} is not in the vocabulary (0 to {vocab - 1})")
        return ids

    def generate(self, prompt: Prompt, max_new_tokens: int = 64, temperature: float = 0.0,
                 **options: Any) -> GenerationResult:
        """Continue a prompt (text or ids). `options` are GenerationConfig fields; sampling
        settings other than temperature go in `sampling=SamplingConfig(...)`."""
        options.setdefault("sampling", SamplingConfig(temperature=temperature))
        config = GenerationConfig(max_new_tokens=max_new_tokens, **options)
        return generate(self.model, self.encode(prompt), config, self.tokenizer)

    def generate_many(self, prompts: Sequence[Prompt], max_new_tokens: int = 64,
                      temperature: float = 0.0, params: Sequence[RequestParams] | None = None,
                      engine: EngineConfig | None = None,
                      on_result: Callable[[int, GenerationResult], None] | None = None,
                      adapters: Mapping[str, str | Path] | None = None,
                      labels: Sequence[str] | None = None, **options: Any) -> list[GenerationResult]:
        """Continue many prompts together through the serving engine (continuous batching over
        a paged KV cache); results in prompt order. `options` are RequestParams and
        SamplingConfig fields for every prompt, or `params` gives one RequestParams each.
        `on_result(index, result)` is called as each request finishes. `adapters`: LoRA
        adapter folders by name, which a request picks with `adapter=name` (None: the base).
        `labels`: what a refusal calls each prompt (a file's line), before its reason."""
        if params is None:
            shared = RequestParams.from_fields(max_new_tokens=max_new_tokens, temperature=temperature,
                                               **options)
            params = [shared] * len(prompts)
        if len(params) != len(prompts):
            raise InputError("params", f"{len(params)} given for {len(prompts)} prompts")
        runner = Engine(self.model, self.tokenizer, engine or EngineConfig(), base=self.source or None)
        for name, path in (adapters or {}).items():
            runner.load_adapter(name, str(path))
        handles = []
        for i, (prompt, request) in enumerate(zip(prompts, params, strict=True)):
            try:
                handles.append(runner.submit(self.encode(prompt), request))
            except InputError as error:
                if labels is None:
                    raise
                raise InputError(None, f"{labels[i]}: {error}", error.code) from None
        index = {h.request_id: i for i, h in enumerate(handles)}
        while runner.has_work():
            runner.step()
            if on_result is not None:
                for finished in [h for h in handles if h.finished and h.request_id in index]:
                    on_result(index.pop(finished.request_id), finished.result)
        return [h.result for h in handles]

    def fill_mask(self, text: str, top_k: int = 5) -> list[MaskFill]:
        """An encoder's `top_k` most likely tokens at each mask token of `text`."""
        return fill_mask(self.model, self.tokenizer, text, top_k)

    def logits(self, prompt: Prompt, target: Prompt | None = None) -> torch.Tensor:
        """Next-token logits at every position of one prompt: (T, vocab). An encoder-decoder
        reads the prompt as its source and gives the decoder's logits at every position of
        `target` behind its start token: (1 + len(target), vocab)."""
        device = self.model.embed.tokens.weight.device
        ids = torch.tensor([self.encode(prompt)], device=device)
        with torch.no_grad():
            if not self.config.n_encoder_layers:
                return self.model(ids)[0]
            decoder_ids = [self.config.decoder_start_id] + ([] if target is None else self.encode(target))
            return self.model(ids, torch.tensor([decoder_ids], device=device))[0]

    def trace(self, prompt: Prompt, names: Names = None, target: Prompt | None = None,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(logits (1, T, vocab), {hook site: tensor}) for one prompt; see glassformer.trace.
        An encoder-decoder reads the prompt as its source and `target` behind its start token."""
        device = self.model.embed.tokens.weight.device
        ids = torch.tensor([self.encode(prompt)], device=device)
        if not self.config.n_encoder_layers:
            return run_with_cache(self.model, ids, names)
        decoder_ids = [self.config.decoder_start_id] + ([] if target is None else self.encode(target))
        with torch.no_grad(), capture(self.model, names) as store:
            logits = self.model(ids, torch.tensor([decoder_ids], device=device))
        return logits, store

    def to(self, device: str | torch.device) -> LanguageModel:
        self.model.to(device)
        return self


def load(source: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True,
         quantize: str | None = None, announce: Callable[[str], None] | None = None) -> LanguageModel:
    """Read a model from a known name, a .gguf file, a Hugging Face or a Glassformer folder
    (formats/sources.py, where `quantize` and `announce` are told)."""
    loaded = sources.load(source, dtype, progress, quantize, announce)
    return LanguageModel(loaded.model, loaded.tokenizer, loaded.source)
