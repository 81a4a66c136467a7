"""Reading past the trained context window, chosen at load or generation time.

RoPE models need their rotation frequencies rescaled, or attention meets angles it never saw:
linear position interpolation, NTK-aware base scaling or YaRN (the formulas are in
layers/positions.py, `rope_inverse_frequencies`). ALiBi and position-free models need nothing:
a distance bias extrapolates, so only the window grows. Learned and sinusoidal absolute
positions cannot be extended this way.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..model.config import RopeScaling
from ..model.transformer import Transformer

# What extend_context applies; longrope's per-pair factors come with a checkpoint (Phi-3's)
EXTENSIONS: tuple[RopeScaling, ...] = ("none", "linear", "ntk", "yarn", "llama3")


def extend_context(model: Transformer, scaling: RopeScaling, factor: float) -> Transformer:
    """A model sharing `model`'s weights whose window is `factor` times longer."""
    config = model.config
    if factor < 1.0:
        raise InputError("factor", f"must be >= 1, got {factor}")
    if config.position in ("learned", "sinusoidal"):
        raise InputError("position", f"{config.position!r} positions cannot be extended past the window")
    if config.position != "rope" and scaling != "none":
        raise InputError("rope_scaling", f"{config.position!r} models extrapolate; use scaling='none'")
    if config.rope_scaling != "none":
        raise InputError("rope_scaling", f"the model is already extended ({config.rope_scaling!r})")
    if scaling not in EXTENSIONS:
        raise InputError("rope_scaling", f"{scaling!r}'s per-pair factors come with a checkpoint "
                         f"(Phi-3's config.json); choose {', '.join(EXTENSIONS[1:])}")
    extended = config.replace(context_length=int(config.context_length * factor))
    if scaling != "none":
        extended = extended.replace(
            rope_scaling=scaling, rope_factor=factor, rope_original_context=config.context_length
        )
    with torch.device(model.embed.tokens.weight.device):
        new = Transformer(extended)
    new.load_state_dict(model.state_dict(), strict=True, assign=True)  # shares the tensors
    if config.tie_embeddings:
        new.lm_head.weight = new.embed.tokens.weight
    return new.train(model.training)
