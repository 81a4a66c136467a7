"""Which input tokens a prediction depends on: attention rollout and integrated gradients.

Raw attention weights are not explanations: a head's weights say how values were mixed in one
layer, not how much the output depends on a token. Residual connections carry information
around every attention layer, later layers mix already-mixed positions, and the value vectors
(and W_O, the MLPs) can shrink or cancel what was attended to (Jain & Wallace 2019; Serrano &
Smith 2019). Rollout composes the weights through the layers with the residual path;
integrated gradients measures the dependence of the output itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError
from ..model.transformer import Transformer


def attention_rollout(patterns: Sequence[torch.Tensor]) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema, 2020) from each layer's weights (B, H, T, T), in order.

    Per layer Â = ½ (mean over heads of α) + ½ I (the residual path), rows renormalised;
    R = Â_L ⋯ Â_1. Returns R (B, T, T): row q is how position q's final representation is
    made of the input tokens (each row sums to 1).
    """
    if not patterns:
        raise InputError("patterns", "need at least one layer's attention weights")
    rollout = None
    for pattern in patterns:
        B, _, Tq, Tk = pattern.shape
        if Tq != Tk:
            raise InputError("patterns", f"rollout needs square weights (T × T), got {Tq} × {Tk}")
        eye = torch.eye(Tq, dtype=torch.float32, device=pattern.device)  # (T, T)
        mixed = 0.5 * pattern.float().mean(dim=1) + 0.5 * eye  # (B, T, T)
        mixed = mixed / mixed.sum(dim=-1, keepdim=True)
        rollout = mixed if rollout is None else mixed @ rollout
    return rollout


# Where the path from a zero baseline is cut: decades near 0, where a normalised model changes
# fastest (a norm's output jumps as a x grows past √eps, at every depth), then tenths.
PANEL_EDGES = (0.0, *(10.0**-k for k in range(8, 0, -1)), *(k / 10 for k in range(2, 11)))
TENTHS = tuple(k / 10 for k in range(11))  # enough for a baseline of real token embeddings


def quadrature(steps: int, edges: Sequence[float] = PANEL_EDGES) -> tuple[torch.Tensor, torch.Tensor]:
    """Nodes and weights of composite Gauss-Legendre on [0, 1]: `steps` points per panel."""
    x, w = np.polynomial.legendre.leggauss(steps)  # on [-1, 1]
    nodes, weights = [], []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        nodes.append(lo + (x + 1) * (hi - lo) / 2)
        weights.append(w * (hi - lo) / 2)
    return torch.tensor(np.concatenate(nodes)), torch.tensor(np.concatenate(weights))  # (n,)


@dataclass(frozen=True)
class IntegratedGradients:
    """Per-token attributions of one logit; they sum to logit - baseline_logit (completeness)."""

    attributions: torch.Tensor  # (T,) one value per input token
    target: int
    logit: float  # F(x): the target logit on the real embeddings
    baseline_logit: float  # F(x'): on the baseline embeddings

    @property
    def completeness_gap(self) -> float:
        """Σ attributions - (F(x) - F(x')): zero for an exact integral."""
        return float(self.attributions.sum()) - (self.logit - self.baseline_logit)


def integrated_gradients(
    model: Transformer,
    ids: torch.Tensor,
    target: int,
    position: int = -1,
    baseline: torch.Tensor | None = None,
    steps: int = 4,
    batch_size: int = 16,
    edges: Sequence[float] = PANEL_EDGES,
) -> IntegratedGradients:
    """Integrated gradients (Sundararajan et al., 2017) of logits[position, target] with respect
    to the token embeddings E_token[ids] (positions are added as usual).

    IG_t = Σ_d (x - x')_td ∫₀¹ ∂F(x' + a (x - x'))/∂x_td da, with x' the baseline (default
    zeros, (T, d); see `token_baseline`). The integral is composite Gauss-Legendre: the path
    is cut at `edges` and each panel gets `steps` points, evaluated in batches of `batch_size`.
    """
    if model.training:
        raise InputError("integrated_gradients", "call model.eval() first (dropout is random)")
    if steps < 1:
        raise InputError("steps", f"must be at least 1, got {steps}")
    ids = ids.reshape(1, -1)  # (1, T)
    T = ids.shape[1]
    with torch.no_grad():
        x = model.embed.tokens(ids)[0]  # (T, d)
    x_base = torch.zeros_like(x) if baseline is None else baseline.to(x)
    if x_base.shape != x.shape:
        raise InputError("baseline", f"expected shape {tuple(x.shape)}, got {tuple(x_base.shape)}")
    nodes, weights = quadrature(steps, edges)  # (n,) each
    n_nodes = nodes.shape[0]
    alphas = torch.cat([nodes, torch.tensor([0.0, 1.0], dtype=torch.float64)]).float()
    grads, values = [], []
    for chunk in alphas.split(batch_size):
        n = chunk.shape[0]
        a = chunk.to(x)[:, None, None]  # (n, 1, 1)
        path = (x_base + a * (x - x_base)).detach().requires_grad_(True)  # (n, T, d)
        with torch.enable_grad(), model.hooks.installed({"embed.tokens": lambda t, site, path=path: path}):
            h = model.forward_hidden(ids.expand(n, T))  # (n, T, d)
            out = model.head(h[:, position])[:, target]  # (n,)
            (grad,) = torch.autograd.grad(out.sum(), path)
        grads.append(grad.float())
        values.append(out.detach().float())
    grad, value = torch.cat(grads), torch.cat(values)  # (n + 2, T, d), (n + 2,)
    weights = weights.to(device=grad.device, dtype=torch.float32)
    mean_grad = (weights[:, None, None] * grad[:n_nodes]).sum(dim=0)  # (T, d)
    attributions = ((x - x_base).float() * mean_grad).sum(dim=-1)  # (T,)
    return IntegratedGradients(attributions, target, float(value[-1]), float(value[-2]))


def token_baseline(model: Transformer, ids: torch.Tensor, token_id: int, keep: int = 1) -> torch.Tensor:
    """x' (T, d): E_token[token_id] at every position but the first `keep`, which stay as they are.

    Holding the first token matters for Llama-style models: it is the attention sink, and moving
    its embedding switches the whole network between regimes, so the path is not smooth.
    """
    with torch.no_grad():
        x = model.embed.tokens(ids.reshape(-1))  # (T, d)
        row = model.embed.tokens(torch.tensor([token_id], device=ids.device))  # (1, d)
        baseline = row.expand_as(x).clone()
        baseline[:keep] = x[:keep]
    return baseline
