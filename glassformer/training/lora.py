"""LoRA (Hu et al., 2021): a frozen model plus trainable low-rank updates of chosen products.

A target names one of a Llama block's projections: q, k, v, o, gate, up, down. Here q, k and v
are row slices of the fused `attn.qkv` product and gate, up of the gated `mlp.up`, so one
LoRALinear may carry several targets, each with its own A and B: the same adapter as PEFT's on
separate q_proj, k_proj, v_proj layers, and saved under their names (formats/peft.py).
`add_lora(model, config)` freezes the model and wraps its targets; `adapter_tensors` and
`load_adapter_tensors` move the A, B pairs in and out; `merge_lora` folds them into the base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..errors import InputError
from ..formats.hub import MODELS
from ..formats.peft import ADAPTER_CONFIG, read_adapter, write_adapter
from ..formats.validate import check_finite
from ..model.config import ModelConfig

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# (layer, target) -> (A (r, in), B (out_t, r))
AdapterTensors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InputError("lora_rank", f"must be an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise InputError("lora_alpha", f"must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise InputError("lora_dropout", f"must be in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise InputError("lora_targets", f"{','.join(self.targets)!r}: give distinct names "
                             f"among {','.join(TARGETS)} (PEFT's q_proj ... down_proj without "
                             "_proj)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Module):
    """A frozen linear layer plus one low-rank update per target slice of its output rows:

        y = x Wᵀ + b
        y[..., s_t:e_t] += (α / r) · dropout_t(x) A_tᵀ B_tᵀ    for each target t

    with A_t (r, d_in) drawn like nn.Linear's weight and B_t (e_t - s_t, r) zero, so training
    starts from the base model. Only A_t and B_t learn; merged, W[s_t:e_t] += (α / r) B_t A_t.
    Without dropout, u = x Âᵀ with Â = [A_1; A_2; …] (every A in one product), then each
    target's rows of y get (α / r) u_t B_tᵀ in place (LowRankUpdate, with its backward written
    out). With dropout, u_t = dropout_t(x) A_tᵀ, then y + (α / r) · u B̂ᵀ with B̂ the B_t set
    block-diagonally at their rows (zero rows between targets), one addmm.
    """

    def __init__(self, base: nn.Linear, slices: dict[str, tuple[int, int]], config: LoRAConfig):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.slices = dict(sorted(slices.items(), key=lambda item: item[1]))  # by row
        self.scale = config.scale
        self.dropout = nn.Dropout(config.dropout)
        d_in, weight = base.in_features, base.weight
        self.lora_A = nn.ParameterDict({
            t: nn.Parameter(torch.empty(config.rank, d_in, dtype=weight.dtype, device=weight.device))
            for t in slices})  # (r, d_in)
        self.lora_B = nn.ParameterDict({
            t: nn.Parameter(torch.zeros(e - s, config.rank, dtype=weight.dtype, device=weight.device))
            for t, (s, e) in slices.items()})  # (e - s, r)
        for a in self.lora_A.values():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # (..., d_out)
        if not (self.dropout.p and self.training):
            a = torch.cat([self.lora_A[t] for t in self.slices])  # (n_t · r, d_in)
            return LowRankUpdate.apply(y, x, a, self.scale, tuple(self.slices.values()),
                                       *(self.lora_B[t] for t in self.slices))
        # a mask of its own per target, as in PEFT
        u = torch.cat([F.linear(self.dropout(x), self.lora_A[t]) for t in self.slices], -1)
        rows = torch.addmm(y.flatten(0, -2), u.flatten(0, -2), self.stacked_B().t(),
                           alpha=self.scale)  # (N, d_out)
        return rows.view(y.shape)

    def stacked_B(self) -> torch.Tensor:
        """B̂ (d_out, n_t · r): B_t at its output rows and its r columns of u, zero elsewhere."""
        gap, blocks, row = self.base.weight.new_zeros, [], 0
        for t, (start, stop) in self.slices.items():
            blocks += [gap(start - row, 0), self.lora_B[t]]  # rows no target holds, then B_t
            row = stop
        return torch.block_diag(*blocks, gap(self.base.out_features - row, 0))

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """The base layer with every update folded into its weight."""
        for t, (start, stop) in self.slices.items():
            self.base.weight[start:stop] += self.scale * (self.lora_B[t] @ self.lora_A[t])
        return self.base


class LowRankUpdate(torch.autograd.Function):
    """y[..., s_t:e_t] += c · u_t B_tᵀ in place, u = x Âᵀ (N, n_t · r), u_t its t-th r
    columns; Â = [A_1; …] (n_t · r, d_in), B_t (e_t - s_t, r). With g = ∂L/∂y (N, d_out) and
    g_t its rows' columns s_t:e_t, the backward is written out so that no product meets the
    zeros between targets and nothing is computed for the frozen base:

        ∂L/∂u_t = c · g_t B_t,   ∂L/∂B_t = c · g_tᵀ u_t,   ∂L/∂Â = (∂L/∂u)ᵀ x,
        ∂L/∂x  = (∂L/∂u) Â  (added by autograd to the base product's g W),   ∂L/∂y = g
    """

    @staticmethod
    def forward(ctx, y, x, a, scale: float, slices: tuple[tuple[int, int], ...], *bs):
        rows, out = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])  # (N, d_in), (N, d_out)
        u = rows @ a.t()  # (N, n_t · r)
        r = a.shape[0] // len(slices)
        for j, ((start, stop), b) in enumerate(zip(slices, bs, strict=True)):
            out[:, start:stop].addmm_(u[:, j * r : (j + 1) * r], b.t(), alpha=scale)
        ctx.mark_dirty(y)
        ctx.save_for_backward(rows, u, a, *bs)
        ctx.scale, ctx.slices, ctx.x_shape = scale, slices, x.shape
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, u, a, *bs = ctx.saved_tensors
        g, r = grad.reshape(-1, grad.shape[-1]), a.shape[0] // len(bs)  # (N, d_out)
        parts = [g[:, start:stop] for start, stop in ctx.slices]  # each (N, e_t - s_t)
        du = torch.cat([part @ b for part, b in zip(parts, bs, strict=True)], 1).mul_(ctx.scale)
        dx = (du @ a).view(ctx.x_shape) if ctx.needs_input_grad[1] else None  # (..., d_in)
        da = du.t() @ rows if ctx.needs_input_grad[2] else None  # (n_t · r, d_in)
        dbs = [(part.t() @ u[:, j * r : (j + 1) * r]).mul_(ctx.scale)  # (e_t - s_t, r)
               if ctx.needs_input_grad[5 + j] else None for j, part in enumerate(parts)]
        return grad, dx, da, None, None, *dbs


def target_slices(config: ModelConfig) -> dict[str, tuple[str, tuple[int, int]]]:
    """target -> (layer path inside a block, its output rows) for this model."""
    q, kv, ff = config.n_heads * config.head_dim, config.kv_heads * config.head_dim, config.ff_dim
    slices = {"q": ("attn.qkv", (0, q)), "k": ("attn.qkv", (q, q + kv)),
              "v": ("attn.qkv", (q + kv, q + 2 * kv)), "o": ("attn.out", (0, config.d_model)),
              "down": ("mlp.down", (0, config.d_model))}
    if config.gated:  # mlp.up holds [W_gate | W_up]
        slices |= {"gate": ("mlp.up", (0, ff)), "up": ("mlp.up", (ff, 2 * ff))}
    else:
        slices["up"] = ("mlp.up", (0, ff))
    return slices


def input_sizes(config: ModelConfig) -> dict[str, int]:
    """Each targeted product's input width (the A matrices' columns), by its path in a block."""
    return {"attn.qkv": config.d_model, "attn.out": config.n_heads * config.head_dim,
            "mlp.up": config.d_model, "mlp.down": config.ff_dim}


def check_targets(model: ModelConfig, config: LoRAConfig) -> None:
    """Refuses targets the model lacks, and a rank above min(in, out) of the smallest targeted
    product (B A would hold no more than that, in factors larger than the weight itself),
    before anything is built or written."""
    if model.n_encoder_layers:
        raise InputError("lora_targets", "LoRA here adapts decoder-only and encoder models, "
                         "not encoder-decoders")
    slices = target_slices(model)
    missing = [t for t in config.targets if t not in slices]
    if missing:
        raise InputError("lora_targets", f"this model has no {missing[0]!r} projection (a "
                         f"feed-forward without a gate); choose among {','.join(slices)}")
    inputs = input_sizes(model)
    sizes = {t: min(inputs[slices[t][0]], slices[t][1][1] - slices[t][1][0]) for t in config.targets}
    smallest = min(sizes, key=sizes.get)
    if config.rank > sizes[smallest]:
        raise InputError("lora_rank", f"{config.rank} is above {sizes[smallest]}, min(in, out) of "
                         f"this model's {smallest} product: a rank of {sizes[smallest]} or less fits")


def add_lora(model: nn.Module, config: LoRAConfig) -> None:
    """Freeze every parameter of `model` and wrap each block's targeted layers in LoRALinear."""
    check_targets(model.config, config)
    slices = target_slices(model.config)
    model.requires_grad_(False)
    for block in model.blocks:
        by_layer: dict[str, dict[str, tuple[int, int]]] = {}
        for t in config.targets:
            path, rows = slices[t]
            by_layer.setdefault(path, {})[t] = rows
        for path, rows in by_layer.items():
            block.set_submodule(path, LoRALinear(block.get_submodule(path), rows, config))


def lora_layers(model: nn.Module) -> dict[int, list[LoRALinear]]:
    return {i: [m for m in block.modules() if isinstance(m, LoRALinear)]
            for i, block in enumerate(model.blocks)}


def adapter_tensors(model: nn.Module) -> AdapterTensors:
    """Every (layer, target)'s (A, B), detached."""
    return {(i, t): (layer.lora_A[t].detach(), layer.lora_B[t].detach())
            for i, layers in lora_layers(model).items() for layer in layers for t in layer.slices}


@torch.no_grad()
def load_adapter_tensors(model: nn.Module, tensors: AdapterTensors, where: str) -> None:
    """Copy saved (A, B) pairs into a model wrapped by add_lora; every pair must fit."""
    have = {(i, t): layer for i, layers in lora_layers(model).items() for layer in layers
            for t in layer.slices}
    if set(tensors) != set(have):
        odd = sorted(set(tensors) ^ set(have))[0]
        raise InputError(where, f"the adapter's layers do not match the model's "
                         f"(layer {odd[0]}, target {odd[1]})")
    for (i, t), (a, b) in tensors.items():
        layer = have[(i, t)]
        for name, saved, param in (("A", a, layer.lora_A[t]), ("B", b, layer.lora_B[t])):
            if saved.shape != param.shape:
                raise InputError(where, f"layer {i} {t} lora_{name} has shape {tuple(saved.shape)}"
                                 f", the model needs {tuple(param.shape)}: an adapter for another "
                                 "base")
            param.copy_(saved)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base layer and unwrap it; returns the plain model. A merged
    weight that overflows to Inf or NaN is refused, naming it."""
    for i, block in enumerate(model.blocks):
        for path, layer in list(block.named_modules()):
            if isinstance(layer, LoRALinear):
                merged = layer.merged()
                check_finite(merged.weight, f"blocks.{i}.{path}.weight", "lora (merged)")
                block.set_submodule(path, merged)
    return model


def save_adapter(folder: Path, model: nn.Module, config: LoRAConfig, base: str) -> None:
    """The model's adapters as a PEFT adapter folder's two files (in the existing `folder`)."""
    write_adapter(folder, adapter_tensors(model), config.rank, config.alpha, config.dropout,
                  config.targets, base)


def read_lora(folder: str | Path, base: str | None = None) -> tuple[LoRAConfig, AdapterTensors, Path]:
    """The PEFT adapter in `folder` (a run folder: its latest checkpoint): its settings, its
    (A, B) pairs and the folder read. `base`, when given, must be the base the adapter names."""
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() and (folder / "latest" / ADAPTER_CONFIG).is_file():
        folder = (folder / "latest").resolve()
    settings, tensors = read_adapter(folder)
    named = settings["base"]
    if base is not None and named and known_here(named) and not same_model(named, base):
        raise InputError(folder, f"the adapter was trained on {settings['base']}, not {base}")
    config = LoRAConfig(settings["rank"], settings["alpha"], settings["dropout"], settings["targets"])
    return config, tensors, folder


def apply_adapter(model: nn.Module, folder: str | Path, base: str | None = None) -> LoRAConfig:
    """Wrap `model` with the PEFT adapter in `folder` (read_lora)."""
    config, tensors, folder = read_lora(folder, base)
    add_lora(model, config)
    load_adapter_tensors(model, tensors, str(folder))
    return config


def known_here(source: str) -> bool:
    """Whether `source` names a model this machine can find (a hub id elsewhere cannot be
    compared: the shapes are checked instead)."""
    return Path(source).expanduser().exists() or source in MODELS


def same_model(a: str, b: str) -> bool:
    """Whether two sources (a known name, or paths written differently) name one model."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b
