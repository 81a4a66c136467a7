"""Sizes checked against the machine before anything is allocated: the memory a device offers
(`device_memory`), what a configuration's weights take at the least (`weight_bytes`), and
`check_fits`, which refuses a size larger than the device in one line naming what set it.

A size a user gives (a flag, a key of config.json) reaches an allocation only after one of
these checks, so 10¹² is refused at once instead of stalling or ending in the allocator's
own error."""

from __future__ import annotations

import os

import torch

from ..errors import InputError
from .config import ModelConfig

MIB = 2**20


def device_memory(device: torch.device | str) -> int | None:
    """Bytes a tensor on `device` may take: the free memory of a CUDA device, the physical
    memory of the machine for the CPU (which the pools fill as they are used); None where
    the device does not say."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def check_fits(n_bytes: float, device: torch.device | str, field: str | None, what: str) -> None:
    """Refuse `what` (n_bytes of it) where it is larger than the memory `device` has."""
    memory = device_memory(device)
    if memory is not None and n_bytes > memory:
        device = torch.device(device)
        has = "this machine's memory" if device.type == "cpu" else f"the free memory of {device}"
        raise InputError(field, f"{what} would take {n_bytes / MIB:,.0f} MiB, more than {has} "
                                f"({memory / MIB:,.0f} MiB)")


def weight_bytes(config: ModelConfig, bytes_per_weight: int = 4) -> int:
    """The least memory a model of `config` holds in weights: its token table and, per layer,
    its attention and feed-forward products (norms, biases and heads left out). Plain
    arithmetic: it costs nothing for a configuration that could never be built."""
    d, heads = config.d_model, config.n_heads + config.kv_heads
    attention = 2 * d * heads * config.head_dim  # Q, K, V and the output
    feedforward = (3 if config.gated else 2) * d * config.ff_dim
    layers = config.n_layers * (attention + feedforward)
    encoder = config.n_encoder_layers * (attention + feedforward)
    positions = config.context_length if config.position == "learned" else 0
    tables = (config.vocab_size + config.n_token_types + positions) * d
    return bytes_per_weight * (tables + layers + encoder)


def check_model_fits(config: ModelConfig, device: torch.device | str = "cpu", where: str = "",
                     dtype: torch.dtype = torch.float32) -> None:
    """Refuse a configuration whose weights alone (in `dtype`) are larger than the device's
    memory, naming the size that makes them so (`where`: the file or flags it came from)."""
    memory, size = device_memory(device), weight_bytes(config, dtype.itemsize)
    if memory is None or size <= memory:
        return
    sizes = {name: getattr(config, name) for name in
             ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "n_kv_heads",
              "d_head", "d_ff", "n_encoder_layers", "n_token_types") if getattr(config, name) is not None}
    largest = max(sizes, key=lambda name: sizes[name])
    check_fits(size, device, largest, f"the weights at {sizes[largest]:,}{where}")
