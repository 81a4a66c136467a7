"""Hook sites: named places in the forward pass where a tensor can be read or replaced.

Every module calls `hooks(site, tensor)` at each site. With no hook registered this returns the
tensor at once, so the forward pass costs what it would without the feature. The registry knows
its model's sites: each module registers the sites it has when it is built (`register`, in the
order the forward pass reaches them), so `sites` lists them and a hook at any other name is
refused rather than never called. `glassformer.trace` builds capture, ablation and patching on
top of this registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch

from ..errors import InputError
from .sites import Site, parse_site

# A hook receives the tensor and the site name; returning a tensor replaces it, None keeps it.
HookFn = Callable[[torch.Tensor, str], "torch.Tensor | None"]


class Hooks:
    """The registry shared by all modules of one model."""

    def __init__(self, sites: Mapping[str, Site] | None = None) -> None:
        self._hooks: dict[str, list[HookFn]] = {}
        self.sites: dict[str, Site] = dict(sites or {})  # name -> Site, in forward order

    def register(self, *names: str) -> None:
        """Add sites a module has (a name that is no site fails here, when it is built)."""
        for name in names:
            self.sites[name] = parse_site(name)

    def unhooked(self) -> Hooks:
        """A registry of the same sites with no hooks installed."""
        return Hooks(self.sites)

    def __call__(self, site: str, tensor: torch.Tensor) -> torch.Tensor:
        if not self._hooks:
            return tensor
        for fn in self._hooks.get(site, ()):
            replaced = fn(tensor, site)
            if replaced is not None:
                tensor = replaced
        return tensor

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def wants(self, site: str) -> bool:
        return site in self._hooks

    @contextmanager
    def installed(self, hooks: Mapping[str, HookFn]) -> Iterator[None]:
        """Register `hooks` (site -> fn) for the duration of the block; always removed after.
        InputError naming every site the model lacks (such a hook would never be called)."""
        missing = [site for site in hooks if site not in self.sites]
        if missing:
            raise InputError(None, f"unknown hook site(s) for this model: {', '.join(map(str, missing))} "
                             "(model.hooks.sites lists its sites)")
        added = []
        try:
            for site, fn in hooks.items():
                self._hooks.setdefault(site, []).append(fn)
                added.append((site, fn))
            yield
        finally:
            for site, fn in added:
                self._hooks[site].remove(fn)
                if not self._hooks[site]:
                    del self._hooks[site]
