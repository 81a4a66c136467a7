"""Which path a dense decode step takes, and why: the model's fused C++ step or its modules.

    fused     the fused C++ step (installed by glassformer.quantize: `Transformer.fused_step`):
              every layer in one call, for one sequence whose float32 keys and values sit at
              their text positions
    modules   the model's own modules: the reference, which computes everything (hook sites,
              steering, every cache format, the sink policy, padded rows)

`choose_path` is asked by `decode_one_token`. The serving engine's rows over its paged pool
choose among its executors instead (serving/step.py `route`). `fused_source`: where the fused
step's emitted rows hold a hook site.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.sites import Site, parse_site
from ..model.transformer import Transformer

FUSED, MODULES = "fused", "modules"


@dataclass(frozen=True)
class Path:
    name: str  # FUSED, MODULES (or the serving engine's GRAPH)
    reason: str  # why, in words


@dataclass(frozen=True)
class Asks:
    """What a dense decode step asks, as far as its path goes."""

    kv_dtype: str | None = "fp32"  # its keys' and values' format (None: not chosen yet, float32)
    moves_keys: bool = False  # its cache positions keys itself (the sink policy)
    own_positions: bool = False  # rows at positions of their own (left padding)
    sequences: int = 1  # the sequences of the call (the fused step takes one)


def choose_path(model: Transformer, asks: Asks) -> Path:
    """The path a dense decode step of `model` takes, and why."""
    if asks.kv_dtype not in (None, "fp32"):
        return Path(MODULES, f"{asks.kv_dtype} keys and values (the fused step reads float32)")
    if asks.moves_keys:
        return Path(MODULES, "the sink policy moves keys (the fused step keeps each at its text position)")
    if asks.own_positions or asks.sequences != 1:
        return Path(MODULES, "several sequences or padded rows over a dense cache (the fused step takes one)")
    if not model.has_fused_step:
        return Path(MODULES, "the model has no fused step (glassformer.quantize gives one)")
    if model.fused_step() is None:
        return Path(MODULES, "the fused step declines the model as it is now "
                             "(glassformer.accel.fast_decode.why_not says why)")
    return Path(FUSED, "the fused step computes every row it asks")


def fused_source(site: str | Site) -> tuple[str, int] | None:
    """Where the fused decode step's emitted rows hold a site (FastDecoder.rows): in its
    residuals, 0 the embedding's output (= blocks.0.resid_pre) and i + 1 the stream after block
    i (blocks.{i}.resid_post = blocks.{i+1}.resid_pre); in its writes, 2 i block i's attn.out
    and 2 i + 1 its mlp.out. None for a site it does not emit."""
    site = site if isinstance(site, Site) else parse_site(site)
    layer, name = site.layer, site.name
    if not site.stack and name == "embed.out":
        return "residuals", 0
    if site.stack or layer is None:
        return None
    if name in ("resid_pre", "resid_post"):
        return "residuals", layer + (name == "resid_post")
    if name in ("attn.out", "mlp.out"):
        return "writes", 2 * layer + (name == "mlp.out")
    return None
