"""Scale-out on Ray Serve: the same FastAPI app, one engine per replica, behind Ray's HTTP
proxy. Each replica loads the model itself (the builder runs on the replica), so replicas may
sit on any machine of the Ray cluster.

    glassformer serve --model M --ray --replicas 2        (a local Ray, or the one RAY_ADDRESS names)
    serve run glassformer.serving.api.ray_serve:build model=M replicas=2     (Ray's own CLI)
"""

from __future__ import annotations

from dataclasses import replace

from .. import EngineConfig
from .app import ServerConfig, create_app


def application(model: str, quantize: str, config: ServerConfig, engine: EngineConfig, replicas: int,
                cpus_per_replica: float = 1.0):
    """A Ray Serve application of `replicas` copies of the server."""
    from ray import serve

    def build_app():
        from ...formats.sources import load

        return create_app(load(model, quantize=quantize), config, engine)

    server = serve.deployment(serve.ingress(build_app)(), name="glassformer", num_replicas=replicas,
                              ray_actor_options={"num_cpus": cpus_per_replica})
    return server.bind()


def build(args: dict[str, str]):
    """The `serve run` target: model=M [quantize=none] [replicas=1] [name=...] [api_key=...]."""
    model = args["model"]
    config = ServerConfig(args.get("name", model), args.get("api_key") or None)
    if "max_tokens" in args:
        config = replace(config, max_tokens=int(args["max_tokens"]))
    return application(model, args.get("quantize", "none"), config, EngineConfig(),
                       int(args.get("replicas", 1)))
