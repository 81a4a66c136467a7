"""The HTTP layer: a thin FastAPI app over one Server (server.py), speaking the OpenAI API.

The engine steps on its own thread, started and closed with the app. Before any route, the
Host header must name an allowed host and a browser's Origin an allowed origin (a page on
another site could otherwise make the user's browser drive a loopback server, and read the
answers through DNS rebinding); with an API key, the /v1 routes and the live page need it."""

from __future__ import annotations

import asyncio
import hmac
import sys
from collections.abc import Mapping
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ...accel.threads import ThreadPolicy
from ...errors import InputError
from ...formats.sources import Loaded
from ...interpret.steer import SteeringVector
from .. import EngineConfig
from . import errors, lora, ui, ui_live
from .errors import APIError
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, SteeringVectorUpload
from .server import Server, ServerConfig
from .steering import uploaded

__all__ = ["ServerConfig", "create_app"]

# The engine's thread takes the GIL back after every step's products; while the event loop runs
# Python, a waiting thread gets it after the switch interval (5 ms by default, a sixth of a
# decode step): 0.5 ms makes each step wait less (3-4% more tokens/s). Restored at shutdown.
SWITCH_INTERVAL_S = 5e-4


def create_app(language_model: Loaded, config: ServerConfig, engine: EngineConfig | None = None,
               threads: ThreadPolicy | None = None,
               steering: Mapping[str, SteeringVector] | None = None) -> FastAPI:
    """`threads`: the process's thread policy, revisited by the engine's loop (none: torch's
    thread count is left alone). `steering`: named vectors requests may steer with."""
    server = Server(language_model, engine or EngineConfig(), config, threads, steering)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        server.loop = asyncio.get_running_loop()
        server.engine.start()
        try:
            yield
        finally:
            server.engine.close()
            sys.setswitchinterval(switch)

    app = FastAPI(title="glassformer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    errors.install(app)

    def authorize(request: Request) -> None:
        """The API key, as `Authorization: Bearer <key>` (or `?key=` on the live page's routes,
        which a browser opens by address)."""
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if request.url.path.startswith("/ui") and "key" in request.query_params:
            given = f"Bearer {request.query_params['key']}"
        if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
            raise APIError(401, "a valid API key is needed: Authorization: Bearer <key>",
                           code="invalid_api_key")

    ui.install(app, server.engine, authorize)
    ui_live.install(app, server.live, authorize)
    lora.install(app, server, authorize)
    app.add_middleware(_CountResponses, metrics=server.metrics)
    app.add_middleware(_AllowedOrigins, config=config)

    @app.get("/health")
    async def health() -> dict:
        try:
            server.engine.raise_error()
        except Exception:
            raise APIError(503, "the engine stopped after an error", code="engine_error") from None
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if config.metrics_need_key:
            authorize(request)
        return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "glassformer"}, *lora.adapter_models(server)]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        return await server.answer(request, await server.parse(request, CompletionRequest), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        return await server.answer(request, await server.parse(request, ChatCompletionRequest), chat=True)

    @app.get("/v1/steering_vectors")
    async def steering_vectors(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": server.steering.listing()}

    @app.post("/v1/steering_vectors")
    async def upload_steering_vector(request: Request) -> dict:
        authorize(request)
        body = await server.parse(request, SteeringVectorUpload)
        try:
            server.steering.add(body.name, uploaded(body.name, body.site, body.vector))
        except InputError as error:
            raise errors.from_input(error) from None
        return {"object": "steering_vector", "id": body.name, "site": body.site, "width": len(body.vector)}

    return app


ROUTES = ("/health", "/metrics", "/ui", "/ui/state", "/ui/requests", "/v1/models", "/v1/completions",
          "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/steering_vectors")


def host_name(value: str) -> str:
    """The host of a Host header (`name`, `name:port`, `[v6]:port`), lower case."""
    return (urlsplit(f"//{value}").hostname or "").lower()


class _AllowedOrigins:
    """ASGI middleware: 403 unless the Host header names an allowed host and an Origin (sent
    by browsers) is an allowed origin or one of an allowed host's."""

    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.hosts = {h.lower() for h in config.allowed_hosts}
        self.origins = {o.lower().rstrip("/") for o in config.allowed_origins}

    def refused(self, headers: dict[bytes, bytes]) -> APIError | None:
        host = host_name(headers.get(b"host", b"").decode("latin-1"))
        if "*" not in self.hosts and host not in self.hosts:
            return APIError(403, f"Host: {host or 'none'!r} is not served here (--allowed-hosts)",
                            code="host_not_allowed")
        origin = headers.get(b"origin")
        if origin is None or "*" in self.origins:
            return None
        origin = origin.decode("latin-1").lower().rstrip("/")
        if origin in self.origins or host_name(urlsplit(origin).netloc) in self.hosts - {"*"}:
            return None
        return APIError(403, f"Origin: {origin!r} may not use this server (--allowed-origins)",
                        code="origin_not_allowed")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            error = self.refused(dict(scope["headers"]))
            if error is not None:
                return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)


class _CountResponses:
    """ASGI middleware: counts answers by route and status (streams are not buffered)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                path = scope["path"]
                self.metrics.record(path if path in ROUTES else "other", message["status"])
            await send(message)

        await self.app(scope, receive, counted)
