"""The hook sites' one table: every name a module passes to `hooks`, with its tensor's dimensions.

Modules take their site names from these tables (`names`, when they are built: a name not in a
table fails then, not when someone asks for it); glassformer.trace lists a configuration's sites
and their dimensions from them (what each holds is written there), and the engine's capture
parses them (`layer_site`). Names within a block (LAYER_SITES, CROSS_SITES) are relative to
`blocks.{i}`; a sublayer's own sites start with its scope ("attn.", "mlp.", "cross.").
"""

from __future__ import annotations

from collections.abc import Mapping

Dims = tuple[str, ...]

EMBED_SITES: dict[str, Dims] = {
    "embed.tokens": ("batch", "pos", "d_model"),
    "embed.positions": ("batch", "pos", "d_model"),
    "embed.token_types": ("batch", "pos", "d_model"),
    "embed.out": ("batch", "pos", "d_model"),
}
LAYER_SITES: dict[str, Dims] = {
    "resid_pre": ("batch", "pos", "d_model"),
    "norm1": ("batch", "pos", "d_model"),
    "attn.q_norm": ("batch", "head", "pos", "d_head"),
    "attn.k_norm": ("batch", "kv_head", "pos", "d_head"),
    "attn.q": ("batch", "head", "pos", "d_head"),
    "attn.k": ("batch", "kv_head", "pos", "d_head"),
    "attn.v": ("batch", "kv_head", "pos", "d_head"),
    "attn.scores": ("batch", "head", "query", "key"),
    "attn.masked_scores": ("batch", "head", "query", "key"),
    "attn.pattern": ("batch", "head", "query", "key"),
    "attn.context": ("batch", "head", "pos", "d_head"),
    "attn.out": ("batch", "pos", "d_model"),
    "attn_out_norm": ("batch", "pos", "d_model"),
    "resid_mid": ("batch", "pos", "d_model"),
    "norm2": ("batch", "pos", "d_model"),
    "mlp.hidden": ("batch", "pos", "d_ff"),
    "mlp.out": ("batch", "pos", "d_model"),
    "mlp_out_norm": ("batch", "pos", "d_model"),
    "resid_post": ("batch", "pos", "d_model"),
}
OUTPUT_SITES: dict[str, Dims] = {
    "final_norm": ("batch", "pos", "d_model"),
    "head_transform": ("batch", "pos", "d_model"),
    "logits": ("batch", "pos", "vocab"),
}
# A decoder block's cross-attention sublayer (encoder-decoders), between resid_mid's parts
CROSS_SITES: dict[str, Dims] = {
    "resid_self": ("batch", "pos", "d_model"),
    "norm_cross": ("batch", "pos", "d_model"),
    "cross.q": ("batch", "head", "pos", "d_head"),
    "cross.scores": ("batch", "head", "query", "key"),
    "cross.masked_scores": ("batch", "head", "query", "key"),
    "cross.pattern": ("batch", "head", "query", "key"),
    "cross.context": ("batch", "head", "pos", "d_head"),
    "cross.out": ("batch", "pos", "d_model"),
}
# Each stack of an encoder-decoder, prefixed encoder. / decoder.
STACK_SITES: dict[str, Dims] = {"relative_bias": ("batch", "head", "query", "key"), **OUTPUT_SITES}
HEAD_DIMS = ("head", "kv_head")
# An attention sublayer's sites that only the reference kernel forms (the fused ones never do)
WEIGHT_SITES = ("scores", "masked_scores", "pattern")


def names(prefix: str, table: Mapping[str, Dims], scope: str = "") -> dict[str, str]:
    """The full names of `table`'s sites in `scope` ("attn", "mlp", "cross", "embed"; "" the
    undotted ones), keyed by their name within it, below `prefix` ("" for none):
    names("blocks.3", LAYER_SITES, "attn")["q"] == "blocks.3.attn.q"."""
    found = {}
    for name in table:
        head, _, rest = name.rpartition(".")
        if head == scope:
            found[rest] = f"{prefix}.{name}" if prefix else name
    return found


def layer_site(name: str) -> tuple[int, str] | None:
    """(i, the name within block i) for a decoder-only model's block site (blocks.{i}.…) in
    LAYER_SITES; None for any other name."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in LAYER_SITES:
        return int(parts[1]), parts[2]
    return None


# The sites of the model's output, by name (the same in every model)
OUTPUT = names("", OUTPUT_SITES)
