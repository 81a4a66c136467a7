"""The HTTP layer: a thin FastAPI app over one Engine, speaking the OpenAI API.

    body ──(size limit, pydantic schema)──> prompt ids + RequestParams ──(admission)──> engine
    engine events ──> one JSON answer, or server-sent events in OpenAI's chunk format

The engine steps on its own thread (started and closed with the app); each request reads its
handle's events from asyncio. A guard task per request cancels it in the engine the moment the
client disconnects or its time is up, so its KV blocks are free on the next step."""

from __future__ import annotations

import asyncio
import hmac
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from ...language_model import LanguageModel
from .. import Engine, EngineConfig, Event, RequestHandle
from . import errors, ui
from .errors import APIError
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .responses import answer
from .tracing import Tracer


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None  # every /v1 route then needs `Authorization: Bearer <key>`
    max_queue: int = 64  # requests waiting beyond the engine's batch; more get 429
    max_tokens: int = 1024  # most tokens one request may ask for
    max_body_bytes: int = 1 << 20  # larger bodies get 413
    request_timeout_s: float = 600.0  # a request still running then is stopped: 504 / an error event

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_tokens", "max_body_bytes"):
            if getattr(self, name) < (0 if name == "max_queue" else 1):
                raise ValueError(f"{name}: too small, got {getattr(self, name)}")


@dataclass
class Admission:
    """What a request's reader shares with its guard: the reader sets `done` when it has read
    the last event; the guard sets `timed_out` before it cancels a request past its time."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    timed_out: bool = False


class Server:
    """The app's state: the engine, the limits and the count of requests admitted."""

    def __init__(self, language_model: LanguageModel, engine: EngineConfig, config: ServerConfig) -> None:
        self.language_model, self.config = language_model, config
        self.engine = Engine(language_model.model, language_model.tokenizer, engine)
        self.metrics = ServerMetrics(self.engine)
        self.tracer = Tracer(language_model.model)
        self.active = 0  # admitted and not yet answered; only touched on the event loop
        self._guards: set[asyncio.Task] = set()

    async def parse(self, request: Request, schema: type[BaseModel]) -> BaseModel:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.config.max_body_bytes:
            raise APIError(413, f"the body is over {self.config.max_body_bytes} bytes", code="body_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.config.max_body_bytes:
                raise APIError(413, f"the body is over {self.config.max_body_bytes} bytes",
                               code="body_too_large")
        try:
            parsed = schema.model_validate_json(bytes(body))
        except ValidationError as error:
            raise errors.from_validation(error) from None
        if parsed.model != self.config.model_name:
            raise APIError(404, f"model: {parsed.model!r} is not served here; use {self.config.model_name!r}",
                           "model", "model_not_found")
        return parsed

    def submit(self, ids: list[int], fields: SamplingFields, asked: int | None,
               request: Request) -> tuple[RequestHandle, Admission]:
        """Admit a request; returns its handle and what its reader shares with its guard."""
        context, cap = self.language_model.config.context_length, self.config.max_tokens
        if len(ids) > context:
            raise APIError(400, f"prompt: {len(ids)} tokens; this model's context holds {context}",
                           "prompt", "context_length_exceeded")
        if asked is not None and asked > cap:
            raise APIError(400, f"max_tokens: at most {cap} on this server, got {asked}", "max_tokens",
                           "invalid_value")
        if self.active >= self.engine.config.max_batch + self.config.max_queue:
            raise APIError(429, "the server is busy; retry shortly", code="queue_full",
                           headers={"Retry-After": "1"})
        limit = asked if asked is not None else max(1, min(cap, context - len(ids)))
        try:
            handle = self.engine.submit(ids, fields.params(limit, self.language_model.tokenizer.eos_id))
        except ValueError as error:
            raise APIError(400, str(error), str(error).split(":")[0], "invalid_value") from None
        admission = Admission()
        self.active += 1
        guard = asyncio.create_task(self._guard(handle, request, admission))
        self._guards.add(guard)
        guard.add_done_callback(self._guards.discard)
        return handle, admission

    async def _guard(self, handle: RequestHandle, request: Request, admission: Admission) -> None:
        """Holds the request's admission until its reader is done; cancels it in the engine as
        soon as the client disconnects or its time is up."""

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        waits = [asyncio.create_task(admission.done.wait()), asyncio.create_task(disconnected())]
        try:
            finished, _ = await asyncio.wait(waits, timeout=self.config.request_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            admission.timed_out = not finished and not handle.finished
        finally:
            for wait in waits:
                wait.cancel()
            if not handle.finished:
                handle.cancel()
            self.active -= 1
            if handle.result is not None and handle.result.stop_reason != "cancelled":
                self.metrics.observe(handle.result)

    @staticmethod
    async def events(handle: RequestHandle, admission: Admission) -> AsyncIterator[Event]:
        try:
            async for event in handle:
                yield event
        finally:
            admission.done.set()

    def stopped(self, event: Event, admission: Admission) -> APIError | None:
        """The error to answer for a request the server stopped before it finished: past its
        time (504), or cancelled by a shutdown or a failed engine (503); else None."""
        if event.stop_reason != "cancelled":
            return None
        if admission.timed_out:
            return APIError(504, f"the request ran past this server's limit of "
                                 f"{self.config.request_timeout_s:g} s", code="timeout")
        return APIError(503, "the request was stopped before it finished (the server is shutting "
                             "down or its engine failed)", code="cancelled")

    def prompt(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        tokenizer = self.language_model.tokenizer
        if isinstance(body, CompletionRequest):
            return tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "messages: this model has no chat template; use /v1/completions",
                           "messages", "no_chat_template")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        try:
            return tokenizer.apply_chat_template(messages)
        except (jinja2.TemplateError, ValueError) as error:
            raise APIError(400, f"messages: {error}", "messages", "invalid_value") from None


def create_app(language_model: LanguageModel, config: ServerConfig,
               engine: EngineConfig | None = None) -> FastAPI:
    server = Server(language_model, engine or EngineConfig(), config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # The engine's thread takes the GIL back after every step's products; while the event
        # loop runs Python, a waiting thread gets it after the switch interval (5 ms by default,
        # a sixth of a decode step): 0.5 ms makes each step wait less (3-4% more tokens/s).
        sys.setswitchinterval(5e-4)
        server.engine.start()
        try:
            yield
        finally:
            server.engine.close()

    app = FastAPI(title="glassformer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    errors.install(app)
    ui.install(app, server.engine)
    app.add_middleware(_CountResponses, metrics=server.metrics)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
            raise APIError(401, "a valid API key is needed: Authorization: Bearer <key>",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict:
        try:
            server.engine.raise_error()
        except Exception:
            raise APIError(503, "the engine stopped after an error", code="engine_error") from None
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "glassformer"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        return await answer(server, request, await server.parse(request, CompletionRequest), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        return await answer(server, request, await server.parse(request, ChatCompletionRequest), chat=True)

    return app


ROUTES = ("/health", "/metrics", "/ui", "/ui/state", "/v1/models", "/v1/completions", "/v1/chat/completions")


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
