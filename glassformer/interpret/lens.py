"""The logit lens and the tuned lens: what each layer's residual stream already predicts.

The logit lens reads the residual stream after each block (`blocks.{i}.resid_post`, and the
embedding's output `embed.out` before any block) through the model's own final norm and head,
as if the blocks after it were skipped. The last residual read this way is the model's output.

The tuned lens first passes each residual but the last through an affine map of its own
(initialised to the identity, so untrained it is the logit lens), trained so that what it
reads out matches the model's final distribution: the mean KL(final ‖ lens) over tokens.
The last residual needs no map: its read-out is the final distribution.

    lens = logit_lens(model, ids, top_k=5)         # lens.ids, lens.probs: (sites, B, T, k)
    tuned = TunedLens.load("lens-dir").check(model.config)
    curve = kl_curve(model, ids, tuned)            # (sites,): mean KL per residual
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn

from ..errors import InputError
from ..formats.files import read_json_object, write_atomic
from ..model.config import ModelConfig
from ..model.encoder_decoder import EncoderDecoder
from ..model.sites import check_residual_layers
from ..model.transformer import Transformer, final_hidden
from .trace import run_with_cache

WEIGHTS, ABOUT = "tuned_lens.safetensors", "tuned_lens.json"


def residual_sites(config: ModelConfig) -> list[str]:
    """The residual streams a lens reads, first to last: the embedding's output, then each
    block's (an encoder-decoder's decoder blocks)."""
    prefix = "decoder." if config.n_encoder_layers else ""
    return ["embed.out"] + [f"{prefix}blocks.{i}.resid_post" for i in range(config.n_layers)]


def lens_sites(config: ModelConfig, layers: tuple[int, ...] | None = None) -> list[str]:
    """The residual sites of `layers` in their order (layer i: the residual after i blocks, 0
    the embedding's output), or all of residual_sites; ValueError naming `lens_layers` for a
    layer the model lacks or one named twice."""
    sites = residual_sites(config)
    if layers is None:
        return sites
    check_residual_layers(config, layers)
    return [sites[layer] for layer in layers]


def read_out(model: Transformer | EncoderDecoder, resid: torch.Tensor) -> torch.Tensor:
    """Logits (…, vocab) of a residual stream (…, d) through the model's final norm and head."""
    stack = model.decoder if isinstance(model, EncoderDecoder) else model
    return model.head(final_hidden(stack.final_norm, resid))


class TunedLens(nn.Module):
    """One affine map (d_model → d_model) per residual but the last, applied before read_out."""

    def __init__(self, d_model: int, n_layers: int) -> None:
        super().__init__()
        self.maps = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(n_layers))
        for linear in self.maps:
            nn.init.eye_(linear.weight)
            nn.init.zeros_(linear.bias)

    @classmethod
    def for_model(cls, config: ModelConfig) -> TunedLens:
        return cls(config.d_model, config.n_layers)

    def forward(self, residuals: list[torch.Tensor]) -> list[torch.Tensor]:
        """The residuals of every site (residual_sites order), each through its map."""
        *inner, last = residuals
        mapped = [linear(r.to(linear.weight.dtype)).to(r.dtype)
                  for linear, r in zip(self.maps, inner, strict=True)]
        return mapped + [last]

    def check(self, config: ModelConfig) -> TunedLens:
        """Refuse a lens trained for another shape of model; return self."""
        d_model, n_layers = self.maps[0].in_features, len(self.maps)
        if d_model != config.d_model:
            raise InputError(None, f"tuned lens: d_model={d_model}, the model has {config.d_model}")
        if n_layers != config.n_layers:
            raise InputError(None, f"tuned lens: n_layers={n_layers}, the model has {config.n_layers}")
        return self

    def save(self, folder: str | Path, about: dict) -> Path:
        """The maps as `tuned_lens.safetensors` and what they were trained on as `tuned_lens.json`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().float().contiguous() for name, t in self.state_dict().items()}
        write_atomic(folder / WEIGHTS, safetensors_bytes(tensors))
        shape = {"d_model": self.maps[0].in_features, "n_layers": len(self.maps)}
        write_atomic(folder / ABOUT, json.dumps({**shape, **about}, indent=1) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> TunedLens:
        folder = Path(folder)
        if not (folder / WEIGHTS).is_file():
            raise FileNotFoundError(f"{folder}: no tuned lens here (expected {WEIGHTS})")
        about = read_json_object(folder / ABOUT)
        for field in ("d_model", "n_layers"):
            if not isinstance(about.get(field), int) or about[field] < 1:
                raise InputError(folder / ABOUT, f"{field} must be a positive integer")
        lens = cls(about["d_model"], about["n_layers"])
        try:
            tensors = load_file(folder / WEIGHTS)
        except SafetensorError as error:
            raise InputError(folder / WEIGHTS, f"corrupt or truncated safetensors file ({error})") from None
        expected = lens.state_dict()
        if set(tensors) != set(expected):
            raise InputError(folder / WEIGHTS, f"tensors {sorted(set(tensors) ^ set(expected))[:3]} "
                             "do not match the lens's maps")
        for name, tensor in tensors.items():
            if tensor.shape != expected[name].shape:
                raise InputError(folder / WEIGHTS, f"{name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(expected[name].shape)}")
        lens.load_state_dict(tensors, strict=True)
        return lens.eval()


@dataclass(frozen=True)
class Lens:
    """The top-k tokens read out of each residual stream at every position."""

    sites: tuple[str, ...]
    ids: torch.Tensor  # (sites, B, T, k) token ids, most probable first
    probs: torch.Tensor  # (sites, B, T, k) their probabilities


def _read(model, residuals: list[torch.Tensor], tuned: TunedLens | None) -> Iterator[torch.Tensor]:
    """Each residual's float32 logits (B, T, vocab) in turn: one vocab-wide tensor at a time."""
    for resid in tuned(residuals) if tuned is not None else residuals:
        yield read_out(model, resid).float()


def top_of(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most probable tokens of lens logits (…, vocab): ids and probabilities (…, k)."""
    top = logits.float().softmax(dim=-1).topk(k)
    return top.indices, top.values


def lens_logits(model: Transformer | EncoderDecoder, residuals: list[torch.Tensor],
                tuned: TunedLens | None = None) -> list[torch.Tensor]:
    """Float32 logits (B, T, vocab) read out of each residual (one per residual_sites site)."""
    return list(_read(model, residuals, tuned))


def top_tokens(model: Transformer | EncoderDecoder, residuals: list[torch.Tensor], top_k: int,
               tuned: TunedLens | None = None) -> Lens:
    """The lens over residuals already captured (one per site of residual_sites, in order)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise InputError("top_k", f"must be a positive integer, got {top_k!r}")
    k = min(top_k, model.config.vocab_size)
    with torch.no_grad():
        tops = [top_of(logits, k) for logits in _read(model, residuals, tuned)]
    return Lens(tuple(residual_sites(model.config)), torch.stack([ids for ids, _ in tops]),
                torch.stack([probs for _, probs in tops]))


def _residuals(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if isinstance(model, EncoderDecoder):
        raise InputError("model", "the lens of an encoder-decoder needs its source; use top_tokens "
                         "on residuals captured from model(source, target)")
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise InputError("ids",
                         f"expected a (batch, tokens) tensor with tokens, got shape {tuple(ids.shape)}")
    sites = residual_sites(model.config)
    logits, acts = run_with_cache(model, ids, names=sites)
    return logits, [acts[site] for site in sites]


def logit_lens(model: Transformer, ids: torch.Tensor, top_k: int = 5,
               tuned: TunedLens | None = None) -> Lens:
    """Top-k tokens and probabilities of each residual stream at every position of ids (B, T);
    with `tuned`, through its maps first."""
    if tuned is not None:
        tuned.check(model.config)
    return top_tokens(model, _residuals(model, ids)[1], top_k, tuned)


def _kl(final_log_probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(final ‖ lens), from final log-probabilities and lens logits."""
    lens_log_probs = logits.float().log_softmax(dim=-1)
    kl = F.kl_div(lens_log_probs, final_log_probs, log_target=True, reduction="none")
    return kl.sum(dim=-1).mean()


def kl_curve(model: Transformer, ids: torch.Tensor, tuned: TunedLens | None = None) -> torch.Tensor:
    """Mean KL(final ‖ lens) (nats) per site of residual_sites over ids (B, T): (sites,)."""
    if tuned is not None:
        tuned.check(model.config)
    logits, residuals = _residuals(model, ids)
    final = logits.float().log_softmax(dim=-1)
    with torch.no_grad():
        return torch.stack([_kl(final, lens) for lens in _read(model, residuals, tuned)])


@dataclass(frozen=True)
class LensTraining:
    """How a tuned lens is trained: `steps` Adam steps (the rate decaying linearly from `lr`
    to zero) on `batch` windows of `context` tokens drawn (by `seed`) from the text's tokens."""

    steps: int = 100
    batch: int = 4
    context: int = 128
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        for field in ("steps", "batch", "context"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(field, f"must be a positive integer, got {value!r}")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise InputError("lr", f"must be a positive finite number, got {self.lr!r}")


@contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    """The model's parameters take no gradient inside the block; their flags restored after."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        model.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _windows(tokens: torch.Tensor, settings: LensTraining, context_length: int) -> Callable[[], torch.Tensor]:
    """A function drawing (batch, T) windows of `tokens` at random starts."""
    T = min(settings.context, context_length, len(tokens))
    generator = torch.Generator().manual_seed(settings.seed)
    offsets = torch.arange(T)

    def draw() -> torch.Tensor:
        starts = torch.randint(0, len(tokens) - T + 1, (settings.batch, 1), generator=generator)
        return tokens[starts + offsets]  # (batch, T)

    return draw


def train_tuned_lens(model: Transformer, tokens: torch.Tensor, settings: LensTraining = LensTraining(),
                     progress: Callable[[int, float], None] | None = None) -> TunedLens:
    """A tuned lens for `model` trained on windows of `tokens` (N,) against the model's final
    distribution; `progress(step, loss)` hears each step's KL summed over the maps. A window
    longer than the model's context is refused (a text shorter than a window is one window)."""
    if isinstance(model, EncoderDecoder) or model.training:
        raise InputError("model", "a tuned lens is trained on a decoder or encoder in eval mode")
    if tokens.ndim != 1 or len(tokens) == 0:
        raise InputError("data", "no tokens to train the tuned lens on")
    if settings.context > model.config.context_length:
        raise InputError("context", f"{settings.context} tokens per window is above the model's "
                         f"context length, {model.config.context_length}")
    weight = model.lm_head.weight
    lens = TunedLens.for_model(model.config).to(device=weight.device)
    optimizer = torch.optim.Adam(lens.parameters(), lr=settings.lr)
    draw = _windows(tokens, settings, model.config.context_length)
    with _frozen(model):
        for step in range(1, settings.steps + 1):
            logits, residuals = _residuals(model, draw().to(weight.device))
            final = logits.float().log_softmax(dim=-1)  # (batch, T, vocab)
            optimizer.zero_grad(set_to_none=True)
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * (1 - (step - 1) / settings.steps)
            total = 0.0
            for linear, resid in zip(lens.maps, residuals, strict=False):
                loss = _kl(final, read_out(model, linear(resid.float()).to(weight.dtype)))
                loss.backward()  # one map's graph at a time: a vocab-wide tensor per map
                total += float(loss.detach())
            optimizer.step()
            if progress is not None:
                progress(step, total)
    return lens.eval()



def held_out(tokens: torch.Tensor, context: int, count: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Split tokens (N,) into those to train on and up to `count` windows (n, context) from the
    last tenth (at least one window) to measure on; a text too short for both trains on all."""
    n_held = min(max(len(tokens) // 10, context), count * context)
    if len(tokens) < 2 * context or n_held < context:
        return tokens, tokens[: len(tokens) // context * context].view(-1, context)[:count]
    held = tokens[len(tokens) - n_held:]
    return tokens[: len(tokens) - n_held], held[: n_held // context * context].view(-1, context)
