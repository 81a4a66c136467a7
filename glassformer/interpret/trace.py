"""Named hook sites: read, ablate or patch any intermediate tensor of the forward pass.

Every site, in the order the forward pass reaches it, with the tensor's dimensions (the names
and dimensions are the table in glassformer/model/sites.py, which the modules name their sites
from; what each holds is written here; a model's own sites are those its modules registered
when built, model.hooks.sites, and each name's Site gives its dimensions: parse_site(name).dims)
(T: tokens in this call; S: keys seen, = cache length + T when decoding with a KVCache):

    embed.tokens               (batch, pos, d_model)            E_token[ids]
    embed.positions            (batch, pos, d_model)            E_pos (learned / sinusoidal only)
    embed.token_types          (batch, pos, d_model)            E_type[token_types] (n_token_types > 0)
    embed.out                  (batch, pos, d_model)            I_emb = E_token[ids] + E_pos (+ E_type, Norm)
    blocks.{i}.resid_pre       (batch, pos, d_model)            residual stream entering block i
    blocks.{i}.norm1           (batch, pos, d_model)            Norm(x) (post-norm: Norm(x + Attn(x)))
    blocks.{i}.attn.q_norm     (batch, head, pos, d_head)       Norm_Q(x W_Q), before RoPE (qk_norm)
    blocks.{i}.attn.k_norm     (batch, kv_head, pos, d_head)    Norm_K(x W_K), before RoPE (qk_norm)
    blocks.{i}.attn.q          (batch, head, pos, d_head)       Q = x W_Q (after RoPE)
    blocks.{i}.attn.k          (batch, kv_head, pos, d_head)    K = x W_K (after RoPE; new rows only)
    blocks.{i}.attn.v          (batch, kv_head, pos, d_head)    V = x W_V (new rows only)
    blocks.{i}.attn.scores     (batch, head, query, key)        A = Q Kᵀ / √d_head      (T × S)
    blocks.{i}.attn.masked_scores (batch, head, query, key)     A + M (-inf where masked)
    blocks.{i}.attn.pattern    (batch, head, query, key)        α = softmax(A + M)
    blocks.{i}.attn.context    (batch, head, pos, d_head)       α V
    blocks.{i}.attn.out        (batch, pos, d_model)            concat(heads) W_O
    blocks.{i}.attn_out_norm   (batch, pos, d_model)            Norm(Attn(x)) (out, sandwich)
    blocks.{i}.resid_mid       (batch, pos, d_model)            x + Attn(...)
    blocks.{i}.norm2           (batch, pos, d_model)            Norm(x) (post-norm: Norm(x + FFN(x)))
    blocks.{i}.mlp.hidden      (batch, pos, d_ff)               σ(x W_up), or σ(x W_gate) ⊙ x W_up
    blocks.{i}.mlp.out         (batch, pos, d_model)            hidden W_down
    blocks.{i}.mlp_out_norm    (batch, pos, d_model)            Norm(FFN(x)) (out, sandwich)
    blocks.{i}.resid_post      (batch, pos, d_model)            residual stream leaving block i
    final_norm                 (batch, pos, d_model)            h = Norm(x) (when the model has one)
    head_transform             (batch, pos, d_model)            Norm(σ(h W_t)) (head = "mlm")
    logits                     (batch, pos, vocab)              h W_headᵀ

An encoder-decoder has the same sites in each stack, prefixed `encoder.` and `decoder.`
(`encoder.blocks.{i}.attn.pattern`, `decoder.final_norm`; the shared embed.* sites fire for
the encoder, then again for the decoder), each stack's T5 bias `{stack}.relative_bias`
(batch, head, query, key), and in every decoder block the cross-attention sublayer between
resid_mid and the self-attention: resid_self, norm_cross and cross.{q, scores, masked_scores,
pattern, context, out}, whose keys are the encoder's tokens (pattern: decoder × encoder).

With grouped-query attention q has n_heads heads and k, v have n_kv_heads. Asking for
scores, masked_scores or pattern switches that layer to the reference attention kernel (the
fused kernels never form the weights); every other site leaves the fast kernel in place.
Hooks are installed by context managers and always removed on exit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from ..errors import InputError
from ..model.hooks import HookFn
from ..model.kv_cache import KVCache
from ..model.sites import parse_site
from ..model.transformer import Transformer

Names = Iterable[str] | Callable[[str], bool] | None


def resolve_names(model: Transformer, names: Names) -> list[str]:
    """Site names from None (all of the model's, model.hooks.sites, in forward order), a
    predicate over them, or an iterable (which the registry checks when they are installed)."""
    if names is None:
        return list(model.hooks.sites)
    if callable(names):
        return [name for name in model.hooks.sites if names(name)]
    return [names] if isinstance(names, str) else list(names)


@contextmanager
def capture(model: Transformer, names: Names = None) -> Iterator[dict[str, torch.Tensor]]:
    """Record the tensors at `names` (detached) into the yielded dict while the block runs."""
    store: dict[str, torch.Tensor] = {}

    def record(tensor: torch.Tensor, site: str) -> None:
        store[site] = tensor.detach()

    with model.hooks.installed({name: record for name in resolve_names(model, names)}):
        yield store


def run_with_cache(
    model: Transformer,
    ids: torch.Tensor,
    names: Names = None,
    cache: KVCache | None = None,
    positions: torch.Tensor | None = None,
    pad_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward pass without gradients: (logits (B, T, vocab), {site: tensor}).

    With a KVCache this is a decode step: q and the attention sites show the new query rows
    against every cached key, e.g. pattern (B, H, 1, S) for one new token.
    """
    with torch.no_grad(), capture(model, names) as store:
        logits = model(ids, cache=cache, positions=positions, pad_mask=pad_mask)
    return logits, store


@contextmanager
def intervene(model: Transformer, hooks: Mapping[str, HookFn]) -> Iterator[None]:
    """Install arbitrary hooks {site: fn(tensor, site) -> tensor | None}; the registry refuses
    a name that is no site of the model."""
    with model.hooks.installed(hooks):
        yield


@contextmanager
def ablate(
    model: Transformer, sites: str | Iterable[str], heads: Sequence[int] | None = None
) -> Iterator[None]:
    """Zero the tensors at `sites`; with `heads`, only those heads (dimension 1) of head sites."""
    sites = [sites] if isinstance(sites, str) else list(sites)
    if heads is not None:
        for site in sites:
            if parse_site(site, "sites").head_axis != 1:
                raise InputError("heads", f"site {site!r} has no head dimension")

    def zero(tensor: torch.Tensor, site: str) -> torch.Tensor:
        if heads is None:
            return torch.zeros_like(tensor)
        out = tensor.clone()
        out[:, list(heads)] = 0
        return out

    with intervene(model, {site: zero for site in sites}):
        yield


@contextmanager
def patch(model: Transformer, values: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Replace each site's tensor by the given one (e.g. captured on another input)."""

    def replace(tensor: torch.Tensor, site: str) -> torch.Tensor:
        value = values[site]
        if value.shape != tensor.shape:
            raise InputError("patch",
                f"{site} has shape {tuple(tensor.shape)}, got {tuple(value.shape)}"
            )
        return value.to(device=tensor.device, dtype=tensor.dtype)

    with intervene(model, {site: replace for site in values}):
        yield
