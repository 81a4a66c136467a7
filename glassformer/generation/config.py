"""What a generation is asked for and what it gives back: the decoding (Decoding: length,
sampling, seed, stops, beams), which `generate` reads as a GenerationConfig (with its cache and
window settings) and the serving engine as a RequestParams (with what only it does: its
log-probabilities, adapters and the sites a request reads or changes, parsed, and checked
against a model by `check`), GenerationResult and the Piece a stream yields per token. Plain
values, validated whole at construction: every field's type, range and finiteness, the error
naming the field."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from ..errors import InputError
from ..model.config import ModelConfig
from ..model.kv_formats import check_kv_dtype, is_scaled
from ..model.sink import SinkPolicy
from ..model.sites import (
    Head,
    Site,
    check_residual_layers,
    model_head,
    model_site,
    parse_head,
    parse_site,
    residual_site,
)
from .sampling import SamplingConfig

# "cancelled" and "error" end engine requests only: cancelled by its caller or a shutdown, or
# failed alone inside a step (the engine and the other requests go on).
StopReason = Literal["eos", "stop_string", "max_new_tokens", "context_full", "cancelled", "error"]

SEEDS = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes: [low, high)


def _integer(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise InputError(name, f"must be {bound}, got {value!r}")


# the most a steer may add to one activation (|α| · max|vector|): a trained model's residual
# stream holds values within thousands, and this much, squared by a norm and summed over any
# d_model, stays far below float32's largest value (3.4e38); beyond it the output is noise
MAX_STEER = 1e6


@dataclass(frozen=True, eq=False)
class Steer:
    """α × a vector (d_model,) added at a hook site to every row of the request that steers;
    |α| · max|vector| at most MAX_STEER."""

    site: Site  # a residual-width site with a token axis, e.g. blocks.3.resid_post (a name is parsed)
    vector: torch.Tensor  # (d_model,)
    alpha: float
    name: str = ""  # what the vector is called (a server's registry name, a file)

    def __post_init__(self) -> None:
        if not isinstance(self.site, Site):
            object.__setattr__(self, "site", parse_site(self.site, "steer"))
        vector = self.vector
        if not isinstance(vector, torch.Tensor) or vector.ndim != 1 or not vector.is_floating_point():
            raise InputError("steer", "vector must be a 1-D float tensor (d_model,)")
        if not bool(torch.isfinite(self.vector).all()):
            raise InputError("steer", f"vector {self.name!r} holds non-finite values")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
            raise InputError("steer", f"alpha must be a finite number, got {alpha!r}")
        peak = abs(alpha) * float(vector.abs().max()) if vector.numel() else 0.0
        if not peak <= MAX_STEER:
            raise InputError("steer", f"alpha {alpha:g} x the largest value of vector {self.name!r} "
                             f"({float(vector.abs().max()):g}) adds {peak:g} to an activation, over "
                             f"{MAX_STEER:g}: its activations would overflow")

    def check(self, config: ModelConfig, sites: Mapping[str, Site]) -> None:
        """InputError naming `steer` unless the model (`sites`: its Hooks.sites) has the site,
        d_model wide along a token axis, and the vector is d_model wide."""
        residual_site(sites, self.site, "steer")
        if self.vector.shape != (config.d_model,):
            raise InputError("steer", f"vector {self.name!r} has width {self.vector.shape[0]}, "
                             f"the model's d_model is {config.d_model}")


def kept_in_step(site: Site) -> bool:
    """Whether the serving engine keeps a site's rows inside its steps (RequestParams.capture):
    a decoder-only model's embedding and block sites with a token axis, not the attention
    weights (query × key), nor the final norm, head and logits (read out after the blocks)."""
    return not site.stack and (site.layer is not None or site.name.startswith("embed.")) \
        and site.token_axis is not None


@dataclass(frozen=True)
class Decoding:
    """How one prompt is continued, in `generate` and in the serving engine alike: what a
    GenerationConfig and a RequestParams share. The default is greedy decoding of up to 64
    tokens."""

    max_new_tokens: int = 64
    sampling: SamplingConfig = SamplingConfig(temperature=0.0)
    seed: int | None = None  # None: a fresh random seed; every row of a batch draws with its own
    stop: tuple[str, ...] = ()  # stop strings, checked on the decoded text (needs a tokenizer)
    eos_ids: tuple[int, ...] | None = None  # None: the tokenizer's eos_id
    beams: int = 1  # > 1: beam search (beam.py)
    length_penalty: float = 1.0  # beam score = sum log p / length^length_penalty

    def __post_init__(self) -> None:
        _integer("max_new_tokens", self.max_new_tokens, 1)
        if not isinstance(self.sampling, SamplingConfig):
            raise InputError("sampling", f"must be a SamplingConfig, got {type(self.sampling).__name__}")
        if self.seed is not None:
            _integer("seed", self.seed, *SEEDS)
        if isinstance(self.stop, str) or not isinstance(self.stop, tuple):
            raise InputError("stop", f"a tuple of strings, got {self.stop!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InputError("stop", f"stop strings must be non-empty strings, got {self.stop!r}")
        if self.eos_ids is not None:
            if not isinstance(self.eos_ids, tuple):
                raise InputError("eos_ids", f"a tuple of token ids or None, got {self.eos_ids!r}")
            for token in self.eos_ids:
                _integer("eos_ids", token, 0)
        _integer("beams", self.beams, 1)
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, int | float) or not math.isfinite(penalty):
            raise InputError("length_penalty", f"must be a finite number, got {penalty!r}")
        if self.beams > 1 and (not self.sampling.greedy or self.sampling.uses_counts):
            raise InputError("beams", "beam search ranks raw log-probabilities; drop sampling and penalties")

    @classmethod
    def from_fields(cls, **fields: Any) -> Decoding:
        """From flat settings (a JSON line, keyword arguments): this type's fields and
        SamplingConfig's side by side; `stop` may be one string."""
        own = {f.name for f in dataclasses.fields(cls)} - {"sampling"}
        sampling = {f.name for f in dataclasses.fields(SamplingConfig)}
        unknown = sorted(set(fields) - own - sampling)
        if unknown:
            raise InputError(unknown[0], f"unknown setting; use {sorted(own | sampling)}")
        if isinstance(fields.get("stop"), str):
            fields["stop"] = (fields["stop"],)
        for name in ("stop", "eos_ids", "ablate", "lens_layers"):
            if isinstance(fields.get(name), list):
                fields[name] = tuple(fields[name])
        fields.setdefault("temperature", 0.0)
        return cls(sampling=SamplingConfig(**{k: v for k, v in fields.items() if k in sampling}),
                   **{k: v for k, v in fields.items() if k in own})


@dataclass(frozen=True)
class RequestParams(Decoding):
    """One request to the serving engine: the decoding and what only the engine does (several
    beams reported, log-probabilities, adapters by name, and looking inside its own rows)."""

    best_beams: int = 1  # the engine: how many of the best beams the result holds (runners_up)
    logprobs: int | None = None  # the engine: each token's log-probability and the n likeliest
    capture: tuple[Site, ...] = ()  # the engine: hook sites kept for this request's rows (names parsed)
    adapter: str | None = None  # the engine: the name of a loaded LoRA adapter (None: the base)
    steer: tuple[Steer, ...] = ()  # the engine: vectors added at sites, this request's rows only
    ablate: tuple[Head, ...] = ()  # the engine: heads zeroed for this request ("blocks.3.attn.head.2")
    lens: int | None = None  # the engine: the logit lens's top-k per residual and position
    lens_layers: tuple[int, ...] | None = None  # the engine: the lens's layers (i: after i blocks); None: all

    def __post_init__(self) -> None:
        super().__post_init__()
        _integer("best_beams", self.best_beams, 1, self.beams + 1)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0)
            if self.beams > 1:
                raise InputError("logprobs", "not with beams (only the winner is reported)")
        if not isinstance(self.capture, tuple) or any(not isinstance(s, str | Site) for s in self.capture):
            raise InputError("capture", f"a tuple of hook site names, got {self.capture!r}")
        object.__setattr__(self, "capture", tuple(
            s if isinstance(s, Site) else parse_site(s, "capture") for s in self.capture))
        if self.capture and self.beams > 1:
            raise InputError("capture", "not with beams (each beam computes other rows)")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise InputError("adapter", f"the name of a loaded LoRA adapter or None, got {self.adapter!r}")
        if not isinstance(self.steer, tuple) or any(not isinstance(s, Steer) for s in self.steer):
            raise InputError("steer", f"a tuple of Steer, got {self.steer!r}")
        if not isinstance(self.ablate, tuple) or any(not isinstance(s, str | Head) for s in self.ablate):
            raise InputError("ablate", f"a tuple of head names (blocks.3.attn.head.2), got {self.ablate!r}")
        object.__setattr__(self, "ablate", tuple(
            s if isinstance(s, Head) else parse_head(s, "ablate") for s in self.ablate))
        if self.lens is not None:
            _integer("lens", self.lens, 1)
        if self.lens_layers is not None:
            if self.lens is None or not isinstance(self.lens_layers, tuple) or not self.lens_layers:
                raise InputError("lens_layers", "a non-empty tuple of layers, with lens; "
                                 f"got {self.lens_layers!r}")
            for layer in self.lens_layers:
                _integer("lens_layers", layer, 0)
        for name in ("steer", "ablate", "lens"):
            if getattr(self, name) not in ((), None) and self.beams > 1:
                raise InputError(name, "not with beams (each beam computes other rows)")

    def check(self, config: ModelConfig, sites: Mapping[str, Site]) -> None:
        """InputError naming the field for what a model of `config` cannot take (`sites`: the
        model's own, Hooks.sites): its captured sites, steers, ablated heads, lens layers and
        number of log-probabilities."""
        for site in self.capture:
            model_site(sites, site, "capture")
            if not kept_in_step(site):
                raise InputError("capture", f"{site.full!r} has no token axis in the engine's steps; it "
                                 "keeps the embedding's and the blocks' sites with one (attention "
                                 "weights, the final norm and the logits are not kept)")
        for steer in self.steer:
            steer.check(config, sites)
            if not kept_in_step(steer.site):
                raise InputError("steer", f"{steer.site.full!r} is read out after the engine's blocks; "
                                 "it steers the embedding's and the blocks' sites")
        for head in self.ablate:
            model_head(config, head)
        if self.lens_layers is not None:
            check_residual_layers(config, self.lens_layers)
        if self.logprobs is not None and self.logprobs > config.vocab_size:
            raise InputError("logprobs", f"at most the vocabulary's {config.vocab_size}, got {self.logprobs}")

    @property
    def changes_model(self) -> bool:
        """Whether the engine computes something else for this request: a steer with α ≠ 0 (one
        with α = 0 is left out entirely) or an ablated head."""
        return bool(self.ablate) or any(s.alpha != 0 for s in self.steer)

    @property
    def inspects(self) -> frozenset[str]:
        """What the request looks at or changes inside the engine's step ("capture", "lens",
        "steer", "ablate"): its rows then need the step's hook sites."""
        asked = {"capture": bool(self.capture), "lens": self.lens is not None,
                 "steer": any(s.alpha != 0 for s in self.steer), "ablate": bool(self.ablate)}
        return frozenset(kind for kind, wanted in asked.items() if wanted)


@dataclass(frozen=True)
class GenerationConfig(Decoding):
    """The decoding as `generate` runs it on one model: with or without the KV cache, and what
    to do with a prompt or a text longer than the window. What only the serving engine does
    (RequestParams' own fields) is no field of it; generate's sites are glassformer.trace's
    and its steering glassformer.interpret.steer.steered's (the whole batch)."""

    use_cache: bool = True
    truncate: bool = False  # a prompt longer than the window is cut from the left
    overflow: Literal["stop", "slide"] = "stop"  # at the window's end: stop, or drop old tokens
    kv_dtype: str | None = None  # how the KV cache stores keys and values (model/kv_formats.py)
    sink: SinkPolicy | None = None  # attention sinks: keep S first and W last keys (model/sink.py)
    compile: bool = False  # the one-token step compiled over fixed buffers (compiled.py)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("use_cache", "truncate", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.kv_dtype is not None:
            check_kv_dtype(self.kv_dtype)
        if self.overflow not in ("stop", "slide"):
            raise InputError("overflow", f"choose 'stop' or 'slide', got {self.overflow!r}")
        if self.sink is not None:
            if not isinstance(self.sink, SinkPolicy):
                raise InputError("sink", f"a SinkPolicy or None, got {type(self.sink).__name__}")
            if not self.use_cache or self.beams > 1:
                raise InputError("sink", "the sink policy lives in the KV cache of one continuation; "
                                 "not with use_cache=False or beams > 1")
            if self.kv_dtype not in (None, "fp32"):
                raise InputError("sink", f"the sink cache keeps float32 keys, not kv_dtype={self.kv_dtype!r}")
        if self.compile:
            refuse_compile(self)


def refuse_compile(config: GenerationConfig) -> None:
    """Raise where the compiled step (fixed buffers, one token per row) cannot compute the
    request; the model's side is checked by compiled.check_compilable."""
    if not config.use_cache:
        raise InputError("compile", "the compiled step decodes against the KV cache; "
                         "not with use_cache=False")
    if config.beams > 1:
        raise InputError("compile", "beam search reorders its rows every step; not with beams > 1")
    if config.sink is not None:
        raise InputError("compile", "the sink cache moves its keys as a ring; not with attention sinks")
    if is_scaled(config.kv_dtype):
        raise InputError("compile", f"the compiled step stores keys in a plain dtype (fp32, bf16); "
                         f"not with kv_dtype={config.kv_dtype!r} and its scales")


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
    # the engine's capture: site -> the tensor the request's rows gave it, positions 0..T-1 of
    # prompt + generated[:-1] along the site's token axis (glassformer.trace's layout, batch 1)
    captured: dict[str, torch.Tensor] | None = None
    # the engine's lens (RequestParams.lens): token ids and probabilities, each (sites, T, k),
    # sites as interpret.lens.lens_sites (RequestParams.lens_layers), positions as `captured`'s
    lens: tuple[torch.Tensor, torch.Tensor] | None = None
    # the engine's beam search with best_beams > 1: the next best beams' results, best first
    runners_up: tuple[GenerationResult, ...] = ()

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
        captured = None if self.captured is None else {
            site: tensor.tolist() for site, tensor in self.captured.items()}
        lens = None if self.lens is None else {"ids": self.lens[0].tolist(), "probs": self.lens[1].tolist()}
        return asdict(self) | {
            "captured": captured,
            "lens": lens,
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
