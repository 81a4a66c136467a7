"""The server's named steering vectors: registered at start (`serve --steer NAME=PATH`) or
uploaded behind the API key (`POST /v1/steering_vectors`). A request names one
(`"glassformer": {"steer": [{"vector": NAME, "alpha": 4.0}]}`, at the vector's own site unless
it names another) and the engine adds α × vector to that request's rows only."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from ...errors import InputError
from ...generation.config import Steer
from ...interpret.steer import SteeringVector
from ...model.sites import residual_site
from ...model.transformer import Transformer
from ..adapters import NAME
from .protocol import SteerField

MOST = 256  # vectors one server keeps


class SteeringVectors:
    def __init__(self, model: Transformer, vectors: Mapping[str, SteeringVector] | None = None) -> None:
        self.config, self.sites = model.config, model.hooks.sites
        self._vectors: dict[str, SteeringVector] = {}
        self._lock = threading.Lock()
        for name, vector in (vectors or {}).items():
            self.add(name, vector)

    def add(self, name: str, vector: SteeringVector) -> None:
        """Register a vector under a name not taken yet; ValueError naming the field for one this
        model cannot take."""
        if not NAME.fullmatch(name):
            raise InputError("name", f"{name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if not bool(torch.isfinite(vector.vector).all()):
            raise InputError("vector", f"{name!r} holds non-finite values (NaN or Inf)")
        try:  # named by the upload's fields: a vector's site, its numbers
            residual_site(self.sites, vector.site, "steer")
        except InputError as error:
            raise InputError("site", f"{error.detail} (vector {name!r})") from None
        if vector.vector.shape != (self.config.d_model,):
            raise InputError("vector", f"{name!r} has width {vector.vector.shape[0]}, the model's "
                             f"d_model is {self.config.d_model}")
        with self._lock:
            if name in self._vectors:
                raise InputError("name", f"a steering vector named {name!r} is registered already; "
                                 "upload it under another name")
            if len(self._vectors) >= MOST:
                raise InputError("name", f"this server keeps at most {MOST} steering vectors")
            self._vectors[name] = vector

    def steers(self, fields: list[SteerField]) -> tuple[Steer, ...]:
        """The request's steers, each vector looked up by name."""
        with self._lock:
            known = dict(self._vectors)
        steers = []
        for field in fields:
            if field.vector not in known:
                raise InputError("steer", f"no steering vector named {field.vector!r} on this server "
                                 f"(GET /v1/steering_vectors lists {len(known)})")
            vector = known[field.vector]
            steers.append(Steer(field.site or vector.site, vector.vector, field.alpha, field.vector))
        return tuple(steers)

    def listing(self) -> list[dict]:
        with self._lock:
            return [{"object": "steering_vector", "id": name, "site": v.site, "width": v.vector.shape[0],
                     "model": v.model} for name, v in self._vectors.items()]


def uploaded(name: str, site: str, values: list[float]) -> SteeringVector:
    """A vector sent as numbers; ValueError naming `vector` for a non-finite one."""
    vector = torch.tensor(values, dtype=torch.float32)  # (d,)
    if not bool(torch.isfinite(vector).all()):
        raise InputError("vector", f"{name!r}: every value must be finite (also in float32)")
    return SteeringVector(vector, site, "uploaded")
