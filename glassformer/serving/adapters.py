"""LoRA adapters served beside the base model, chosen per request (RequestParams.adapter).

Each product a LoRA can target (a block's attn.qkv, attn.out, mlp.up, mlp.down) is wrapped in
the runner's view by AdapterRows: the base product runs over every row, then each adapter
used in the step adds, to its own rows only,

    y[rows_i, s_t:e_t] += (α_i / r_i) · (x[rows_i] A_tᵀ) B_tᵀ      for each target t of adapter i

(training/lora.py's LoRALinear without dropout; α/r folded into B at load). Rows without an
adapter are bitwise an engine's without adapters. Where rows may take the fused step, an
adapter is also built for it at load (`ServedAdapter.fused`), else its rows keep the module path.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Listed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..accel.fast_decode import fused_adapter
from ..errors import InputError
from ..model.config import ModelConfig
from ..model.transformer import Transformer
from ..training.lora import AdapterTensors, LoRAConfig, check_targets, input_sizes, read_lora, target_slices
from .step import RequestRows

PRODUCTS = ("attn.qkv", "attn.out", "mlp.up", "mlp.down")  # the paths LoRA targets, in a block
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a served adapter's (and steering vector's) name


@dataclass(frozen=True)
class Update:
    """One product's low-rank update: `down` (d_in -> n·r, every target's A stacked), then
    per target its output rows and `up` (r -> e - s, its B)."""

    down: nn.Module
    ups: tuple[tuple[int, int, nn.Module], ...]  # (start, stop, up)


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    path: str
    config: LoRAConfig
    key: tuple  # the prefix cache's root for its requests: unique per load (block_manager.py)
    updates: dict[tuple[int, str], Update]  # (layer, product path) -> its update
    fused: object | None  # the adapter as the fused step adds it (fused_adapter), or None


def check_tensors(model: ModelConfig, config: LoRAConfig, tensors: AdapterTensors, where: str) -> None:
    """Every (layer, target) of the model's blocks present, with the shapes this model needs
    and finite values (a NaN would silently spoil every row that uses the adapter)."""
    slices, sizes = target_slices(model), input_sizes(model)
    want = {(i, t) for i in range(model.n_layers) for t in config.targets}
    if set(tensors) != want:
        odd = sorted(set(tensors) ^ want)[0]
        raise InputError(where, f"the adapter's layers do not match the model's (layer {odd[0]}, "
                         f"target {odd[1]}): an adapter for another base")
    for (i, t), (a, b) in tensors.items():
        path, (start, stop) = slices[t]
        needed = {"A": (a, (config.rank, sizes[path])), "B": (b, (stop - start, config.rank))}
        for name, (saved, shape) in needed.items():
            if tuple(saved.shape) != shape:
                raise InputError(where, f"layer {i} {t} lora_{name} has shape {tuple(saved.shape)}, "
                                 f"this model and r={config.rank} need {shape}: an adapter for another "
                                 "base, or another rank")
            if not bool(torch.isfinite(saved).all()):
                raise InputError(where, f"layer {i} {t} lora_{name} holds non-finite values (NaN or Inf)")


def adapter_rows(requests: Listed[RequestRows]) -> dict[str, list[int]]:
    """Adapter name -> the rows of the flat batch whose requests name it, in order of first use."""
    groups: dict[str, list[int]] = {}
    for r in requests:
        if r.seq.params.adapter is not None:
            groups.setdefault(r.seq.params.adapter, []).extend(range(r.first, r.first + r.n))
    return groups


def itself(product: nn.Module) -> nn.Module:
    """The product as it is (the view of an engine without row tiles)."""
    return product


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


class Adapters:
    """The adapters an engine serves, by name, and which rows of the running step use which."""

    def __init__(self, config: ModelConfig, base: str | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        """`base`: the served model's source, checked against an adapter's base name."""
        self.config, self.base, self.dtype, self.device = config, base, dtype, device
        self.wrap: Callable[[nn.Module], nn.Module] = itself  # the view's own (install)
        self.fused_step = False  # whether rows may take the fused step (install)
        self.loaded: dict[str, ServedAdapter] = {}  # name -> adapter
        self._loads = itertools.count()
        self.step: list[tuple[ServedAdapter, torch.Tensor]] = []  # (adapter, its rows (m,)) now

    def read(self, name: str, path: str | Path) -> ServedAdapter:
        """An adapter folder read and checked against the served model (nothing is registered)."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InputError("lora_name", f"{name!r}: a name is 1-64 letters, digits, '_', '.' or '-', "
                             "beginning with a letter or digit")
        try:
            config, tensors, folder = read_lora(path, self.base)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as error:
            raise InputError("lora_path", f"{error}") from None
        check_targets(self.config, config)
        check_tensors(self.config, config, tensors, str(folder))
        slices = target_slices(self.config)
        updates, factors = {}, {}
        for i in range(self.config.n_layers):
            for path in PRODUCTS:
                targets = [t for t in config.targets if slices[t][0] == path]
                if not targets:
                    continue
                a = torch.cat([tensors[(i, t)][0] for t in targets])  # (n·r, d_in)
                a = a.to(self.device, self.dtype)
                ups, scaled = [], []
                for t in targets:
                    b = tensors[(i, t)][1].to(self.device, self.dtype) * config.scale  # (e - s, r)
                    if not bool(torch.isfinite(b).all()):
                        raise InputError(str(folder), f"layer {i} {t} lora_B x lora_alpha/r "
                                         f"({config.scale:g}) overflows {self.dtype}")
                    ups.append((*slices[t][1], self.wrap(_linear(b))))
                    scaled.append((slices[t][1][0], b))
                updates[(i, path)] = Update(self.wrap(_linear(a)), tuple(ups))
                factors[(i, path)] = (a, scaled)
        fused = fused_adapter(self.config.n_layers, factors) if self.fused_step else None
        return ServedAdapter(name, str(folder), config, ("lora", name, next(self._loads)), updates, fused)

    def install(self, view: Transformer, wrap: Callable[[nn.Module], nn.Module],
                fused_step: bool = False) -> None:
        """Wrap each targeted product of the runner's view (a copy: the model is untouched);
        `wrap`, what the view does to each product (row tiles), is done to the updates too."""
        self.wrap, self.fused_step = wrap, fused_step
        for i, block in enumerate(view.blocks):
            for path in PRODUCTS:
                block.set_submodule(path, AdapterRows(block.get_submodule(path), (i, path), self))

    @contextmanager
    def rows(self, requests: Listed[RequestRows], device: torch.device) -> Iterator[None]:
        """For one step: each adapter the requests name adds its update to their rows."""
        self.step = [(self.loaded[name], torch.tensor(rows, device=device))
                     for name, rows in adapter_rows(requests).items()]
        try:
            yield
        finally:
            self.step = []


class AdapterRows(nn.Module):
    """product(x), plus each adapter's update on its own rows (the module docstring)."""

    def __init__(self, product: nn.Module, where: tuple[int, str], adapters: Adapters) -> None:
        super().__init__()
        self.product, self.where, self.adapters = product, where, adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x)  # (..., N)
        if not self.adapters.step:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])  # (M, K), (M, N)
        for adapter, rows in self.adapters.step:
            update = adapter.updates.get(self.where)
            if update is None:
                continue
            h = update.down(flat_x[rows])  # (m, n·r)
            rank = adapter.config.rank
            for j, (start, stop, up) in enumerate(update.ups):
                flat_y[rows, start:stop] += up(h[:, j * rank : (j + 1) * rank])  # (m, stop - start)
        return y
