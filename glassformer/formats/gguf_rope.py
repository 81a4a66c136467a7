"""RoPE scaling in GGUF files, both ways, under the keys and tensor names llama.cpp uses.

- linear: `<arch>.rope.scaling.type` linear and `.factor`.
- yarn: type yarn, `.factor`, `.original_context_length` (by default the file's context
  length, as llama.cpp takes it), `.yarn_beta_fast` and `.yarn_beta_slow` (by default 32 and
  1), and `.yarn_attn_factor` where the attention factor is stated (Hugging Face's
  attention_factor, as llama.cpp's converter writes it). llama.cpp always rounds the band's
  edges to whole dimensions, so rope_truncate=False cannot be written; DeepSeek's
  `.yarn_log_multiplier` and an extrapolation mix other than 1 (`.yarn_ext_factor`) are
  refused when read.
- longrope (Phi-3): the tensors rope_factors_short and rope_factors_long (one factor per
  turning pair), `.original_context_length` and `.attn_factor`, the factor cos and sin are
  scaled by (llama.cpp's converter writes the derived one; so does export). Files from that
  converter name no type: the factor tensors say it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
from gguf.quants import dequantize

from ..errors import InputError
from ..model.config import ModelConfig
from ..model.layers.positions import rope_inverse_frequencies
from .gguf_file import GGUFFile

# LongRoPE's factor tensors -> the ModelConfig field each one gives
FACTOR_TENSORS = {"rope_factors_short.weight": "rope_short_factors",
                  "rope_factors_long.weight": "rope_long_factors"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's bands: what llama.cpp divides each θ_i by
ROPE_TENSORS = (*FACTOR_TENSORS, ROPE_FREQS)  # the tensors read into the config, not the model
# rope_freqs.weight against the divisors of the fields read from it: the converter computes in
# float32 (up to 20 units in the last place apart from exact arithmetic, measured at factor 64)
DIVISOR_TOLERANCE = 1e-5
LLAMA3_FIELDS = ("rope_factor", "rope_original_context", "rope_low_freq_factor", "rope_high_freq_factor")


def read_factors(file: GGUFFile) -> dict[str, tuple[float, ...]]:
    """The values of the RoPE tensors (ROPE_TENSORS) a file holds (none: empty)."""
    return {name: tuple(float(x) for x in dequantize(file.raw(name), file.tensors[name].qtype).reshape(-1))
            for name in ROPE_TENSORS if name in file.tensors}


def rope_scaling_fields(arch: str, meta: dict[str, Any], context_length: int,
                        factors: dict[str, tuple[float, ...]], theta: float,
                        rotated: int, bands: bool = False) -> dict[str, Any]:
    """The ModelConfig's RoPE scaling fields of an `arch` file's metadata and RoPE tensors
    (`theta` and `rotated`: its base and turning dimensions, which rope_freqs.weight needs;
    `bands`: whether llama.cpp reads Llama 3.1's bands from that tensor in `arch` files)."""
    if ROPE_FREQS in factors:
        if not bands:
            raise InputError(None, f"unexpected GGUF tensor {ROPE_FREQS} in a {arch} file "
                             "(llama.cpp does not read it there)")
        if meta.get(f"{arch}.rope.scaling.type", "none") != "none" or len(factors) > 1:
            raise InputError(None, f"GGUF tensor {ROPE_FREQS} with another RoPE scaling "
                             f"({meta.get(f'{arch}.rope.scaling.type') or sorted(factors)})")
        return llama3_fields(factors[ROPE_FREQS], theta, rotated)

    def number(key: str, default: float | None = None) -> float:
        value = meta.get(f"{arch}.rope.scaling.{key}", default)
        if value is None:
            raise InputError(None, f"GGUF metadata lacks {arch}.rope.scaling.{key}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e30:
            raise InputError(None, f"GGUF metadata {arch}.rope.scaling.{key} = {value!r}: "
                             "expected a positive number")
        return float(value)

    scaling = meta.get(f"{arch}.rope.scaling.type", "longrope" if factors else "none")
    if scaling not in ("none", "linear", "yarn", "longrope"):
        raise InputError(None, f"unsupported GGUF RoPE scaling {scaling!r}")
    if (scaling == "longrope") != bool(factors):
        raise InputError(None, f"GGUF RoPE scaling {scaling!r} with {sorted(factors) or 'no'} "
                         "factor tensors (longrope needs rope_factors_short and rope_factors_long)")
    if scaling != "longrope" and number("attn_factor", 1.0) != 1.0:
        raise InputError(None, f"unsupported GGUF {arch}.rope.scaling.attn_factor with {scaling!r}")
    if scaling == "none":
        return {}
    fields: dict[str, Any] = {"rope_scaling": scaling}
    if scaling in ("linear", "yarn"):
        fields["rope_factor"] = number("factor")
    if scaling == "yarn":
        if meta.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0) != 0.0:
            raise InputError(None, f"unsupported GGUF {arch}.rope.scaling.yarn_log_multiplier")
        if meta.get(f"{arch}.rope.scaling.yarn_ext_factor", 1.0) not in (1.0, -1.0):  # -1: llama.cpp's 1
            raise InputError(None, f"unsupported GGUF {arch}.rope.scaling.yarn_ext_factor")
        fields |= {"rope_original_context": int(number("original_context_length", context_length)),
                   "rope_beta_fast": number("yarn_beta_fast", 32.0),
                   "rope_beta_slow": number("yarn_beta_slow", 1.0)}
        if f"{arch}.rope.scaling.yarn_attn_factor" in meta:
            fields["rope_attention_factor"] = number("yarn_attn_factor")
    if scaling == "longrope":
        original = int(number("original_context_length"))
        fields |= {"rope_original_context": original,
                   "rope_factor": number("factor", max(context_length / original, 1.0)),
                   "rope_attention_factor": number("attn_factor", 1.0),
                   **{field: factors[name] for name, field in FACTOR_TENSORS.items()}}
    return fields


def rope_scaling_metadata(arch: str, config: ModelConfig) -> dict[str, Any]:
    """The `<arch>.rope.scaling.*` values of `config` (floats: float32 where written)."""
    if config.rope_scaling in ("none", "llama3"):  # llama3: rope_freqs.weight alone says it
        return {}
    key = f"{arch}.rope.scaling."
    meta = {key + "type": config.rope_scaling, key + "factor": config.rope_factor}
    if config.rope_scaling in ("yarn", "longrope"):
        meta[key + "original_context_length"] = config.original_context
    if config.rope_scaling == "yarn":
        meta |= {key + "yarn_beta_fast": config.rope_beta_fast,
                 key + "yarn_beta_slow": config.rope_beta_slow}
        if config.rope_attention_factor is not None:
            meta[key + "yarn_attn_factor"] = config.rope_attention_factor
    if config.rope_scaling == "longrope":
        meta[key + "attn_factor"] = attention_factor(config)
    return meta


def factor_tensors(config: ModelConfig) -> dict[str, np.ndarray]:
    """The RoPE tensors of `config`, float32 (rotated/2,) each: LongRoPE's factors, Llama 3.1's
    divisors; none for the others."""
    if config.rope_scaling == "llama3":
        return {ROPE_FREQS: llama3_divisors(config.rope_theta, config.rotated_dim, config.rope_factor,
                                            config.original_context, config.rope_low_freq_factor,
                                            config.rope_high_freq_factor)}
    if config.rope_scaling != "longrope":
        return {}
    return {name: np.array(getattr(config, field), dtype=np.float32)
            for name, field in FACTOR_TENSORS.items()}


def attention_factor(config: ModelConfig) -> float:
    """The factor cos and sin are scaled by, stated or derived (layers/positions.py)."""
    return rope_inverse_frequencies(config)[1]


def llama3_divisors(theta: float, rotated: int, factor: float, original: float, low: float,
                    high: float) -> np.ndarray:
    """What llama.cpp divides each θ_i by under Llama 3.1's bands (layers/positions.py), as its
    converter writes rope_freqs.weight: 1 for a pair turning more than `high` times over the
    original context C, the factor s for one turning less than `low` times, and 1/((1 - t)/s + t)
    between, with t = (C/λ_i - low) / (high - low). Float32 (rotated/2,)."""
    turns = original * _base_frequencies(theta, rotated) / (2 * math.pi)  # C / λ_i, (rotated/2,)
    mix = np.clip((turns - low) / (high - low), 0.0, 1.0)  # 0: interpolated, 1: kept
    return (1.0 / ((1.0 - mix) / factor + mix)).astype(np.float32)


def llama3_fields(divisors: tuple[float, ...], theta: float, rotated: int) -> dict[str, Any]:
    """Llama 3.1's fields whose `llama3_divisors` are `divisors` (rope_freqs.weight), or
    InputError naming the tensor. A divisor is 1 (kept), the factor (the largest), or in the
    smooth band, where 1/divisor = (1 - t)/s + t and t is linear in 1/λ_i: two such pairs give
    the ratios C/low and C/high. With fewer, low 1 and high 4, the original context implied by
    the band's edges; all ones: no scaling."""
    file = np.asarray(divisors, dtype=np.float64)  # (n,)
    if len(file) != rotated // 2 or not np.all(np.isfinite(file)) or file.min() < 1.0:
        values = f" from {file.min():g} to {file.max():g}" if len(file) else ""
        raise InputError(None, f"GGUF tensor {ROPE_FREQS}: expected {rotated // 2} divisors of at "
                         f"least 1, got {len(file)}{values}")
    if file.max() == 1.0:
        return {}  # no pair is slowed: the angles of no scaling
    for factor, original, low, high in _llama3_candidates(file, theta, rotated):
        if factor > 1 and original >= 1 and 0 < low < high:
            ours = llama3_divisors(theta, rotated, factor, original, low, high)
            if np.allclose(ours, file, rtol=DIVISOR_TOLERANCE, atol=0.0):
                return {"rope_scaling": "llama3", "rope_factor": factor, "rope_original_context": original,
                        "rope_low_freq_factor": low, "rope_high_freq_factor": high}
    raise InputError(None, f"GGUF tensor {ROPE_FREQS} is not Llama 3.1's bands for RoPE base {theta:g} "
                     f"on {rotated} dimensions (no original context and band factors reproduce it)")


def _llama3_candidates(file: np.ndarray, theta: float, rotated: int):
    """(s, C, low, high) to try against the divisors `file`, the canonical low 1 and high 4
    first. Where the largest divisor is one pair's alone, that pair may lie in the band too
    (no pair slowed by the whole factor): with low 1 and high 4 it gives s."""
    x = _base_frequencies(theta, rotated) / (2 * math.pi)  # 1/λ_i, decreasing
    top = file.max()
    factor = float(str(np.float32(top)))  # the shortest decimal that is the float32
    smooth = (file > 1.0) & (file < top)
    mix = (1.0 / file[smooth] - 1.0 / top) / (1.0 - 1.0 / top)  # t of each smooth pair
    kept = x[file == 1.0]
    lowest = 4.0 / kept.min() if len(kept) else 1.0  # C: kept pairs turn 4 times or more over it
    if smooth.sum() >= 2:  # t = a/λ + b with a = C/(high - low), b = -low/(high - low)
        a, b = np.polyfit(x[smooth], mix, 1)
        if a > 0 and b < 0:
            over_low, over_high = -a / b, a / (1.0 - b)  # C/low, C/high
            original = max(1, round(over_low))
            yield factor, original, 1.0, 4.0
            yield factor, original, _nice(original / over_low), _nice(original / over_high)
            yield factor, original, original / over_low, original / over_high
    elif smooth.sum() == 1:  # C/λ = 1 + 3t
        yield factor, round((1.0 + 3.0 * mix[0]) / x[smooth][0]), 1.0, 4.0
    else:  # slowed pairs turn at most once over C
        yield factor, _context_between(lowest, 1.0 / x[file == top].max()), 1.0, 4.0
    if (file == top).sum() == 1 and file[-1] == top and smooth.sum() <= 1:  # the last pair in the band
        inverse, top_x = 3.0 / file + 1.0, x[-1]  # C·x_i (1 - u) = 3/r_i + 1 - 4u, u = 1/s
        if smooth.sum() == 1:
            (one,) = np.flatnonzero(smooth)
            u = (inverse[one] / x[one] - inverse[-1] / top_x) / (4.0 / x[one] - 4.0 / top_x)
            original = round((inverse[-1] - 4.0 * u) / ((1.0 - u) * top_x))
        else:
            original = _context_between(max(lowest, 1.0 / top_x), 4.0 / top_x)
            t = (original * top_x - 1.0) / 3.0
            u = (1.0 / top - t) / (1.0 - t) if t < 1.0 else 0.0
        if 0 < u < 1:
            yield _nice(1.0 / u), original, 1.0, 4.0


def _context_between(lowest: float, highest: float) -> int:
    """An original context in [lowest, highest]: a power of two where one lies there."""
    power = 2 ** max(0, math.ceil(math.log2(lowest)))
    return power if power <= highest else math.ceil(lowest)


def _nice(x: float) -> float:
    """x to six significant digits (a band factor read back from float32 divisors)."""
    return float(f"{x:.6g}")


def _base_frequencies(theta: float, rotated: int) -> np.ndarray:
    """θ_i as the model computes them without scaling (layers/positions.py), float64 (rotated/2,)."""
    unscaled = SimpleNamespace(rotated_dim=rotated, rope_theta=theta, rope_factor=1.0, rope_scaling="none")
    return rope_inverse_frequencies(unscaled)[0].double().numpy()
