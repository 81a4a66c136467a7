"""`glassformer.load(source)`: any model Glassformer can read, as a LanguageModel (model + tokenizer).

A source is one of
- a known model name (`glassformer.hub.MODELS`, e.g. smollm2-135m-instruct), pulled on first use;
- a .gguf file (llama.cpp);
- a Hugging Face model folder (config.json with a `model_type`, *.safetensors, tokenizer.json);
- a Glassformer checkpoint folder (config.json with a `model` section) or a training run folder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .accel.quantize import quantize_format, quantize_model
from .errors import InputError
from .formats import checkpoint, hub
from .formats.files import read_json_object
from .generation.fill_mask import MaskFill, fill_mask
from .generation.generate import GenerationConfig, GenerationResult, generate
from .generation.sampling import SamplingConfig
from .interpret.trace import Names, capture, run_with_cache
from .model.transformer import Transformer
from .serving import Engine, EngineConfig, RequestParams

Prompt = str | Sequence[int]


@dataclass
class LanguageModel:
    model: Transformer
    tokenizer: Any  # encode / decode / eos_id / bos_id; ChatTokenizer adds the chat template
    source: str = ""

    @property
    def config(self):
        return self.model.config

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


# A conversion of this many parameters or more takes seconds: `load` announces it.
ANNOUNCED_PARAMETERS = 10_000_000


def load(source: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True,
         quantize: str | None = None, announce: Callable[[str], None] | None = None) -> LanguageModel:
    """Read a model from a known name, a .gguf file, a Hugging Face or a Glassformer folder.

    quantize=None keeps plain nn.Linear layers (trainable; the reference path). Otherwise the
    weights are converted once for fast inference (glassformer.quantize): "none" keeps them
    in float32, "bf16" / "int8" / "int4" store them smaller, and "gguf" keeps a GGUF file's
    Q8_0 / Q4_x, K-quant (Q3_K to Q6_K) and Q5_x blocks as they are (no requantization;
    see formats/gguf.py). The converted model decodes one sequence with the fused C++ step
    (`model.fused_step()`). `announce` is told, in a line, of a conversion long enough to wait
    for (ANNOUNCED_PARAMETERS)."""
    from .formats.gguf import load_gguf  # the loaders import numpy, gguf and safetensors

    fmt = None if quantize is None else quantize_format(quantize)
    keep_blocks = quantize == "gguf"

    text = str(source)
    path = Path(source).expanduser()
    if not path.exists() and text in hub.MODELS:
        model, tokenizer = load_gguf(hub.model_path(text, progress=progress), dtype, keep_blocks)
    elif path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise InputError(path, "not a GGUF file; give a .gguf file or a model folder")
        model, tokenizer = load_gguf(path, dtype, keep_blocks)
    elif path.is_dir():
        if keep_blocks:
            raise InputError(None, "quantize='gguf' applies to GGUF files only")
        model, tokenizer = _load_folder(path, dtype)
    elif path.exists():
        raise InputError(path, "not a regular file or folder (a device or a pipe?)")
    else:
        raise FileNotFoundError(
            f"no model at {text!r}: give a checkpoint folder, a .gguf file, a Hugging Face folder "
            f"or a known name ({', '.join(sorted(hub.MODELS))})"
        )
    if fmt is not None:  # layers kept in GGUF blocks stay; the others get fmt's kernels
        if announce is not None and sum(p.numel() for p in model.parameters()) >= ANNOUNCED_PARAMETERS:
            announce(f"converting the weights of {text} ({quantize}) for the fused decode step")
        quantize_model(model, fmt)
    return LanguageModel(model, tokenizer, text)


def _load_folder(path: Path, dtype: torch.dtype):
    from .formats.chat_tokenizer import ChatTokenizer
    from .formats.huggingface import load_hf

    config_path = path / "config.json"
    meta = read_json_object(config_path) if config_path.exists() else {}
    if "model_type" in meta:
        return load_hf(path, dtype)
    folder = checkpoint.resolve(path)
    model, tokenizer, _ = checkpoint.load_model(folder)
    if (folder / "tokenizer_config.json").is_file():  # written by export or by a loader
        tokenizer = ChatTokenizer.load(folder)
    return model.to(dtype).eval(), tokenizer
