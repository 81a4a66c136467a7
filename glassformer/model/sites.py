"""The hook sites: the one table of every name a module passes to `hooks`, with its tensor's
dimensions, and the one parser of those names.

Modules take their site names from these tables (`names`) and register the ones they have with
the model's registry when they are built (Hooks.register: a model's sites are what its modules
registered, in the order its forward pass reaches them). Everything else that reads a site's
name (glassformer.trace, steering, a request's capture, the fused step's copies) parses it here
once: `parse_site` gives a `Site` (its stack, block, name in the table, dimensions, token and
head axes), `parse_head` a `Head` (blocks.3.attn.head.2), and `model_site` checks a name against
one model's sites. Names within a block (LAYER_SITES, CROSS_SITES) are relative to `blocks.{i}`;
a sublayer's own sites start with its scope ("attn.", "mlp.", "cross.").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import InputError
from .config import ModelConfig

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
RESIDUAL_DIMS = ("batch", "pos", "d_model")  # a residual-width site with a token axis
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


@dataclass(frozen=True)
class Site:
    """One hook site, parsed: decoder.blocks.3.attn.q is Site("decoder", 3, "attn.q")."""

    stack: str  # "encoder" or "decoder" in an encoder-decoder; "" else
    layer: int | None  # its block; None for the embedding's, a stack's and the output's
    name: str  # its name in its table: within the block ("attn.q"), the stack's or the model's

    @property
    def full(self) -> str:
        """The name the modules pass to their hooks: decoder.blocks.3.attn.q."""
        block = "" if self.layer is None else f"blocks.{self.layer}."
        return f"{self.stack}.{block}{self.name}" if self.stack else f"{block}{self.name}"

    def __str__(self) -> str:
        return self.full

    @property
    def dims(self) -> Dims:
        """Its tensor's named dimensions, e.g. ("batch", "head", "pos", "d_head")."""
        return _table(self.stack, self.layer)[self.name]

    @property
    def token_axis(self) -> int | None:
        """Where its tensor keeps its tokens (batch first); None for one without ("query" and
        "key": the attention weights, over pairs of tokens)."""
        return self.dims.index("pos") if "pos" in self.dims else None

    @property
    def head_axis(self) -> int | None:
        """Where its tensor keeps its heads (query or key-value heads); None for one without."""
        return next((i for i, dim in enumerate(self.dims) if dim in HEAD_DIMS), None)


@dataclass(frozen=True)
class Head:
    """One attention head of a decoder-only model, named blocks.{i}.attn.head.{h}: its slice
    (dimension 1) of the site holding the heads' outputs, blocks.{i}.attn.context."""

    site: Site
    index: int

    def __str__(self) -> str:
        return f"blocks.{self.site.layer}.attn.head.{self.index}"


def _table(stack: str, layer: int | None) -> Mapping[str, Dims]:
    """The table a site's name is looked up in, by where it sits."""
    if layer is not None:
        return LAYER_SITES | CROSS_SITES if stack == "decoder" else LAYER_SITES
    return STACK_SITES if stack else EMBED_SITES | OUTPUT_SITES


def parse_site(text: str, field: str | None = None) -> Site:
    """The one parser of site names: `text` as a Site; InputError naming `field` for a name
    that is no site of any model (whether a model has it is its registry's: Hooks.sites)."""
    stack, block, name = "", None, text if isinstance(text, str) else ""
    head, _, rest = name.partition(".")
    if head in ("encoder", "decoder"):
        stack, name = head, rest
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdecimal():
        block, name = int(parts[1]), parts[2]
    site = Site(stack, block, name) if name in _table(stack, block) else None
    if site is None or site.full != text:  # blocks.03.… too: a model's names are written one way
        raise InputError(field, f"unknown hook site {text!r}; glassformer.trace lists the names")
    return site


def parse_head(text: str, field: str | None = "ablate") -> Head:
    """`blocks.{i}.attn.head.{h}` as a Head; InputError naming `field` for anything else."""
    parts = text.split(".") if isinstance(text, str) else []
    head = None
    if (len(parts) == 5 and parts[0] == "blocks" and parts[2:4] == ["attn", "head"]
            and parts[1].isdecimal() and parts[4].isdecimal()):
        head = Head(Site("", int(parts[1]), "attn.context"), int(parts[4]))
    if head is None or str(head) != text:
        raise InputError(field, f"{text!r} is not a head name like blocks.3.attn.head.2")
    return head


def model_site(sites: Mapping[str, Site], text: str | Site, field: str | None = None) -> Site:
    """The site named `text` among a model's `sites` (its Hooks.sites); InputError naming
    `field` for a name that is no site or one this model lacks."""
    site = text if isinstance(text, Site) else parse_site(text, field)
    if site.full not in sites:
        raise InputError(field, f"the model has no site {site.full!r} (glassformer.trace lists "
                         "the names; a model's own are model.hooks.sites)")
    return site


def residual_site(sites: Mapping[str, Site], text: str | Site, field: str | None = "steer") -> Site:
    """The model's site named `text` where it is d_model wide along a token axis (a residual
    stream, a norm's output, a sublayer's output): where a steering vector is added."""
    site = model_site(sites, text, field)
    if site.dims != RESIDUAL_DIMS:
        raise InputError(field, f"{site.full!r} is {site.dims}; a vector is added where the tensor is "
                         "(batch, pos, d_model), e.g. blocks.3.resid_post")
    return site


def model_head(config: ModelConfig, text: str | Head, field: str | None = "ablate") -> Head:
    """The head named `text` (blocks.{i}.attn.head.{h}) of a decoder-only model of `config`;
    InputError naming `field` for a name that is no head of it."""
    head = text if isinstance(text, Head) else parse_head(text, field)
    layer = head.site.layer
    if config.n_encoder_layers or layer >= config.n_layers:
        raise InputError(field, f"the model has no block {layer} (n_layers={config.n_layers})")
    if head.index >= config.n_heads:
        raise InputError(field, f"block {layer} has no head {head.index} (n_heads={config.n_heads})")
    return head


def check_residual_layers(config: ModelConfig, layers: tuple[int, ...]) -> None:
    """InputError naming `lens_layers` unless each of `layers` is one of the model's residual
    streams (0: the embedding's output, i: the stream after i blocks of its decoder), once."""
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= config.n_layers:
            raise InputError("lens_layers",
                             f"layers are 0 (the embedding) to {config.n_layers}, got {layer!r}")
    if len(set(layers)) != len(layers):
        raise InputError("lens_layers", f"each layer once, got {list(layers)}")


# The sites of the model's output, by name (the same in every model)
OUTPUT = names("", OUTPUT_SITES)
