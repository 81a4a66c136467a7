"""What a family's files cannot say, refused by field before anything is written (export)."""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..model.config import ModelConfig


def require(config: ModelConfig, family: str, **expected: Any) -> None:
    """InputError naming the first field of `config` that differs from `expected`."""
    for field, value in expected.items():
        if getattr(config, field) != value:
            raise InputError(field, f"{getattr(config, field)!r} cannot be exported as {family} "
                             f"(needs {value!r})")


def plain_decoder(config: ModelConfig, pre: bool = True) -> None:
    """The pieces no Hugging Face decoder but Gemma's computes, refused (`pre`: norms before
    each sublayer, as every family but OLMo 2 places them)."""
    require(config, "a Hugging Face model", final_norm=True, causal=True, lm_head_bias=False,
            scale_scores=True, scale_head_input=False, norm_weight_offset=0.0, embed_scale=False,
            attn_softcap=None, final_softcap=None, attn_scale=None, layer_windows=None,
            rope_local_theta=None, **({"norm_placement": "pre"} if pre else {}))
