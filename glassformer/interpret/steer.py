"""Steering vectors and head ablation: change what a model computes at one site.

A steering vector is the mean difference of a site's activations between two sets of
prompts (the "positive" and the "negative" side). Each prompt is run alone; its activations
are averaged over all of its tokens (not only the last: the vector is added at every position
of a steered text, so it is measured over every position too), then over the prompts of each
side, so a long prompt weighs as much as a short one:

    v = mean_p⁺ mean_t act(p⁺)[t]  −  mean_p⁻ mean_t act(p⁻)[t]          (d_model,)

Adding α·v at the site moves the residual stream toward the positive side. A file holds the
vector as float32 safetensors with metadata: the site, the model it was built on, its width.

Head ablation zeroes one head's output: its slice of `blocks.{i}.attn.context`
(batch, head, pos, d_head), before the heads are merged by W_O. It is named
`blocks.{i}.attn.head.{h}` (model/sites.py's Head, parsed there with every site name).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from ..errors import InputError
from ..formats.files import write_atomic
from ..generation.config import Steer
from ..model.sites import model_head, residual_site
from ..model.transformer import Transformer
from .trace import intervene, run_with_cache


@dataclass(frozen=True, eq=False)
class SteeringVector:
    vector: torch.Tensor  # (d_model,) float32
    site: str
    model: str  # what it was built on (a name or a path), for the reader

    def save(self, path: str | Path) -> Path:
        metadata = {"site": self.site, "model": self.model, "width": str(self.vector.shape[0])}
        tensors = {"vector": self.vector.detach().float().cpu().contiguous()}
        return write_atomic(path, safetensors_bytes(tensors, metadata))

    @classmethod
    def load(cls, path: str | Path) -> SteeringVector:
        """A file written by `save`; ValueError naming the file for anything else."""
        try:
            tensors = load_file(path)
            with open(path, "rb") as f:
                header_length = int.from_bytes(f.read(8), "little")
                metadata = _metadata(f.read(header_length))
        except (SafetensorError, OSError) as error:
            raise InputError(path, f"not a steering vector file ({error})") from None
        vector = tensors.get("vector")
        if set(tensors) != {"vector"} or vector.ndim != 1:
            raise InputError(path, "a steering vector file holds one 1-D tensor named 'vector'")
        if metadata.get("width") != str(vector.shape[0]) or not metadata.get("site"):
            raise InputError(path, "its metadata must name the site and the vector's width")
        if not bool(torch.isfinite(vector).all()):
            raise InputError(path, "the vector holds non-finite values")
        return cls(vector.float(), metadata["site"], metadata.get("model", ""))

    def steer(self, alpha: float, name: str = "") -> Steer:
        return Steer(self.site, self.vector, alpha, name)


def _metadata(header: bytes) -> dict[str, str]:
    import json

    return json.loads(header).get("__metadata__", {}) or {}


def mean_activation(model: Transformer, prompts: Sequence[Sequence[int]], site: str) -> torch.Tensor:
    """The site's activation averaged over each prompt's tokens, then over the prompts: (d,)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InputError("prompts", "give at least one prompt, each with tokens")
    device = model.embed.tokens.weight.device
    means = []
    for prompt in prompts:
        _, cache = run_with_cache(model, torch.tensor([list(prompt)], device=device), names=[site])
        means.append(cache[site][0].float().mean(dim=0))  # (d,)
    return torch.stack(means).mean(dim=0)


def build_vector(model: Transformer, site: str, positive: Sequence[Sequence[int]],
                 negative: Sequence[Sequence[int]], source: str = "") -> SteeringVector:
    """The mean difference of `site`'s activations, positive minus negative (token id prompts)."""
    residual_site(model.hooks.sites, site, "steer")
    vector = mean_activation(model, positive, site) - mean_activation(model, negative, site)
    return SteeringVector(vector.cpu(), site, source)


@contextmanager
def steered(model: Transformer, steers: Sequence[Steer] = (), ablate: Sequence[str] = ()) -> Iterator[None]:
    """Every row the model computes inside the block is steered and ablated (a whole batch;
    the serving engine does the same for one request's rows: RequestParams.steer / ablate)."""
    for steer in steers:
        steer.check(model.config, model.hooks.sites)
    heads = [model_head(model.config, name) for name in ablate]
    hooks = {}
    for site in {s.site.full for s in steers if s.alpha != 0} | {head.site.full for head in heads}:
        adds = [s for s in steers if s.site.full == site and s.alpha != 0]
        zeros = [head.index for head in heads if head.site.full == site]

        def edit(tensor: torch.Tensor, site: str, adds=adds, zeros=zeros) -> torch.Tensor:
            out = tensor.clone()
            for s in adds:
                out += s.alpha * s.vector.to(out)
            if zeros:
                out[:, zeros] = 0  # (batch, head, pos, d_head): those heads' outputs
            return out

        hooks[site] = edit
    with intervene(model, hooks):
        yield
