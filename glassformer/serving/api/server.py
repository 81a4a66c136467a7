"""The server's state and its answer to one request:

    body ──(type, size, time limit, pydantic schema)──> prompt ids + RequestParams ──> engine
    engine events ──> one JSON answer, or server-sent events in OpenAI's chunk format

Each request reads its handle's events from asyncio. A guard task per request cancels it in
the engine the moment the client disconnects or its time is up, so its KV blocks are free on
the next step. A shutdown past its grace ends every running request in OpenAI's error shape
(503, or an error event then `[DONE]`) before the HTTP server would cut it off."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from ...accel.threads import ThreadPolicy
from ...errors import InputError
from ...formats.sources import Loaded
from ...generation.config import GenerationResult, kept_in_step
from ...interpret.lens import Lens, lens_sites
from ...interpret.lens_page import lens_data
from ...interpret.steer import SteeringVector
from ...model.sites import Site, model_site
from .. import Engine, EngineConfig, Event, RequestHandle
from ..errors import CapacityError, EngineStopped
from . import choices, errors, responses
from .errors import APIError
from .metrics import ServerMetrics
from .protocol import FINISH, ChatCompletionRequest, CompletionRequest, SamplingFields, Usage, new_id, now
from .steering import SteeringVectors
from .tracing import Tracer, answer_bytes
from .ui_live import Live, live_sites

LOOPBACK = ("localhost", "127.0.0.1", "::1")
# the request's name for a field the engine's RequestParams (or the steering table) names otherwise
REQUEST_FIELDS = {"max_new_tokens": "max_tokens", "beams": "use_beam_search", "adapter": "model",
                  "capture": "glassformer.trace", "steer": "glassformer.steer",
                  "ablate": "glassformer.ablate", "lens": "glassformer.lens",
                  "lens_layers": "glassformer.lens.layers"}


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None  # /v1 routes, /ui and /ui/state then need `Authorization: Bearer <key>`
    max_queue: int = 64  # requests waiting beyond the engine's batch; more get 429
    max_tokens: int = 1024  # most tokens one request may ask for
    max_body_bytes: int = 1 << 20  # larger bodies get 413
    request_timeout_s: float = 600.0  # a request still running then is stopped: 504 / an error event
    body_timeout_s: float = 10.0  # a body not read whole by then gets 408 and the connection closes
    allowed_hosts: tuple[str, ...] = LOOPBACK  # Host header names answered ("*": any); else 403
    allowed_origins: tuple[str, ...] = ()  # browser origins beyond the allowed hosts' ("*": any)
    metrics_need_key: bool = False  # whether /metrics also needs the API key
    header_timeout_s: float = 10.0  # headers not whole by then get 408 and the connection closes
    max_capture_mb: float = 64.0  # most one request's trace sites and lens may hold; more get 400 (0: none)
    # folders /v1/load_lora_adapter may read adapters from (their real paths); none: loading and
    # unloading adapters at run time is off (403)
    lora_dirs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_tokens", "max_body_bytes"):
            value, low = getattr(self, name), 0 if name == "max_queue" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(name, f"must be an integer >= {low}, got {value!r}")
        for name in ("request_timeout_s", "body_timeout_s", "header_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise InputError(name, f"must be a positive number of seconds, got {value!r}")
        size = self.max_capture_mb
        if isinstance(size, bool) or not isinstance(size, int | float) or not 0 <= size < float("inf"):
            raise InputError("max_capture_mb", f"must be a finite number of MB >= 0, got {size!r}")
        for name in ("allowed_hosts", "allowed_origins", "lora_dirs"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or any(not isinstance(v, str) or not v for v in values):
                raise InputError(name, f"a tuple of non-empty strings, got {values!r}")


@dataclass
class Admission:
    """What a request's reader shares with its guard: the reader sets `done` when it has read
    the last event; the guard sets `timed_out` before it cancels a request past its time."""

    done: asyncio.Event = field(default_factory=asyncio.Event)
    timed_out: bool = False


class Server:
    """The app's state: the engine, the limits and the requests admitted."""

    def __init__(self, language_model: Loaded, engine: EngineConfig, config: ServerConfig,
                 threads: ThreadPolicy | None = None,
                 steering: Mapping[str, SteeringVector] | None = None) -> None:
        self.language_model, self.config = language_model, config
        self.steering = SteeringVectors(language_model.model, steering)
        self.engine = Engine(language_model.model, language_model.tokenizer, engine, threads,
                             language_model.source or None)
        self.metrics = ServerMetrics(self.engine)
        self.tracer = Tracer(language_model.model)
        self.live = Live(language_model)  # the requests opened with the ui flag (ui_live.py)
        self.active: set[RequestHandle] = set()  # admitted and not yet answered (the event loop's)
        self.shutting_down = False
        self.loop: asyncio.AbstractEventLoop | None = None  # set when the app starts
        self._guards: set[asyncio.Task] = set()
        self._token_json: int | None = None  # token_json(), once asked

    def drain(self, grace: float) -> None:
        """A shutdown began (from any thread, a signal handler included): requests still running
        shortly before `grace` seconds have passed are stopped and answered with 503."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, max(0.0, grace - min(1.0, grace / 2)),
                                           self.stop_all)

    def stop_all(self) -> None:
        self.shutting_down = True
        for handle in list(self.active):
            handle.cancel()

    async def parse(self, request: Request, schema: type[BaseModel]) -> BaseModel:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise APIError(415, f"Content-Type: send application/json, got {kind or 'none'!r}",
                           code="unsupported_media_type")
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the body is over {limit} bytes", code="body_too_large")
        try:
            body = await asyncio.wait_for(_read(request, limit), self.config.body_timeout_s)
        except TimeoutError:
            raise APIError(408, f"the body did not arrive within {self.config.body_timeout_s:g} s",
                           code="timeout", headers={"Connection": "close"}) from None
        except ClientDisconnect:  # nobody is left to answer
            raise APIError(400, "the client left before its body ended", code="client_disconnected") from None
        try:
            parsed = schema.model_validate_json(body)
        except ValidationError as error:
            raise errors.from_validation(error) from None
        model = getattr(parsed, "model", self.config.model_name)  # (the adapter routes name none)
        if model != self.config.model_name and model not in self.engine.adapters.loaded:
            names = ", ".join(repr(n) for n in [self.config.model_name, *self.engine.adapters.loaded])
            raise APIError(404, f"model: {model!r} is not served here; use one of {names}",
                           "model", "model_not_found")
        return parsed

    def submit(self, ids: list[int], fields: SamplingFields, asked: int | None, request: Request,
               traced: tuple[Site, ...] = ()) -> tuple[list[RequestHandle], Admission]:
        """Admit a request: one engine request per candidate (choices.py); returns their
        handles and what the reader shares with the guard. `traced`: its trace's sites."""
        context, cap = self.language_model.config.context_length, self.config.max_tokens
        if len(ids) > context:
            raise APIError(400, f"prompt: {len(ids)} tokens; this model's context holds {context}",
                           "prompt", "context_length_exceeded")
        if asked is not None and asked > cap:
            raise APIError(400, f"max_tokens: at most {cap} on this server, got {asked}", "max_tokens",
                           "invalid_value")
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        room = self.engine.config.max_batch + self.config.max_queue - len(self.active)
        if choices.candidates(fields) > room:
            raise APIError(429, "the server is busy; retry shortly", code="queue_full",
                           headers={"Retry-After": "1"})
        limit = asked if asked is not None else max(1, min(cap, context - len(ids)))
        self.check_capture_size(fields, traced, min(len(ids) + limit, context))
        handles: list[RequestHandle] = []
        try:
            params = fields.params(limit, traced)
            if fields.glassformer.ui:
                watched = live_sites(self.language_model.config)
                params = replace(params, capture=tuple(dict.fromkeys(params.capture + watched)))
            if fields.model != self.config.model_name:  # one of the LoRA adapters (parse)
                params = replace(params, adapter=fields.model)
            params = replace(params, steer=self.steering.steers(fields.glassformer.steer))
            for each in choices.plan(fields, params):
                handles.append(self.engine.submit(ids, each))
        except (InputError, EngineStopped) as error:
            for handle in handles:
                handle.cancel()
            if isinstance(error, EngineStopped):
                raise APIError(503, "the engine stopped after an error", code="engine_error") from None
            if isinstance(error, CapacityError):
                param = REQUEST_FIELDS.get(error.field, error.field)  # the request's own name for it
                message = f"{param}: {error.detail}".replace("the engine holds", "the server holds")
                raise APIError(400, message, param, "context_length_exceeded") from None
            raise errors.from_input(error, REQUEST_FIELDS) from None
        admission = Admission()
        self.active.update(handles)
        guard = asyncio.create_task(self._guard(handles, request, admission))
        self._guards.add(guard)
        guard.add_done_callback(self._guards.discard)
        return handles, admission

    def check_capture_size(self, fields: SamplingFields, traced: tuple[Site, ...], tokens: int) -> None:
        """400 for a request whose trace sites and lens would make more than max_capture_mb of
        its answer's JSON (tracing.answer_bytes; at 0, any trace or lens)."""
        asked = fields.glassformer
        lens, layers = (None, None) if asked.lens is None else (asked.lens.top_k, asked.lens.layers)
        size = answer_bytes(self.language_model.config, traced, lens, tokens,
                            None if layers is None else tuple(layers),
                            0 if lens is None else self.token_json(),
                            bool(getattr(fields, "stream", False)))
        most = self.config.max_capture_mb
        if size and not most:
            raise APIError(400, "glassformer: this server keeps no trace or lens (--max-capture-mb 0)",
                           "glassformer", "capture_disabled")
        if size > most * 2**20:
            raise APIError(400, f"glassformer: the trace and lens could take {size / 2**20:.1f} MB of the "
                                f"answer over {tokens} tokens; this server allows {most:g} MB per request "
                                "(--max-capture-mb): ask fewer sites or tokens", "glassformer",
                           "capture_too_large")

    def token_json(self) -> int:
        """The most characters one token's text takes as a JSON string (escaped as ASCII, so at
        least its UTF-8 bytes), the lens answer's token fields; read over the vocabulary once."""
        if self._token_json is None:
            decode = self.language_model.tokenizer.decode
            self._token_json = max(len(json.dumps(decode([i])))
                                   for i in range(self.language_model.config.vocab_size))
        return self._token_json

    async def _guard(self, handles: list[RequestHandle], request: Request, admission: Admission) -> None:
        """Holds the request's admission until its reader is done; cancels every one of its
        engine requests as soon as the client disconnects or its time is up."""

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        waits = [asyncio.create_task(admission.done.wait()), asyncio.create_task(disconnected())]
        try:
            finished, _ = await asyncio.wait(waits, timeout=self.config.request_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            admission.timed_out = not finished and not all(h.finished for h in handles)
        finally:
            for wait in waits:
                wait.cancel()
            for handle in handles:
                if not handle.finished:
                    handle.cancel()
                self.active.discard(handle)
                if handle.result is not None and handle.result.stop_reason not in ("cancelled", "error"):
                    self.metrics.observe(handle.result)

    def stopped(self, event: Event, admission: Admission) -> APIError | None:
        """The error to answer for a request that did not finish on its own: past its time
        (504), stopped by a shutdown (503), or failed in the engine (500); else None."""
        if event.stop_reason == "error":
            return APIError(500, f"the engine failed on this request ({event.error}); other requests "
                                 "are unaffected", code="engine_error")
        if event.stop_reason != "cancelled":
            return None
        if admission.timed_out:
            return APIError(504, f"the request ran past this server's limit of "
                                 f"{self.config.request_timeout_s:g} s", code="timeout")
        if self.shutting_down:
            return APIError(503, "the server shut down before the request finished; send it again "
                                 "once the server is back", code="server_shutdown")
        return APIError(503, "the request was stopped before it finished (its engine failed)",
                        code="cancelled")

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
        except (jinja2.TemplateError, InputError) as error:
            raise APIError(400, f"messages: {error}", "messages", "invalid_value") from None

    async def answer(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                     chat: bool) -> Response:
        """Run one request: its whole answer, or its stream (see responses.py for the shapes)."""
        ids = self.prompt(body)
        try:  # the trace's names parsed, and checked against the model, once
            traced = tuple(model_site(self.language_model.model.hooks.sites, name, "glassformer.trace")
                           for name in body.glassformer.trace)
        except InputError as error:
            raise errors.from_input(error) from None
        if body.model != self.config.model_name and not all(map(kept_in_step, traced)):
            raise APIError(400, "glassformer.trace: with a LoRA adapter, only sites with a token "
                           "axis (kept inside the engine's steps)", "glassformer.trace", "invalid_value")
        sites = [site.full for site in traced]
        handles, admission = self.submit(ids, body, body.token_limit if chat else body.max_tokens,
                                         request, traced)
        handle = handles[0]  # the one a trace, a lens and the live page read (they need n = 1)
        head = {"id": new_id("chatcmpl" if chat else "cmpl"), "created": now(), "model": body.model}
        watch = None
        if body.glassformer.ui:
            shown = body.model_dump(exclude={"prompt", "messages", "model"}, exclude_defaults=True)
            watch = self.live.open(handle, ids, shown)

        async def extra() -> dict:
            """The trace sites' tensors for this request's tokens, once it has finished: those
            the engine kept in its steps, and the rest from a run of the request alone; the
            lens the engine read in its steps."""
            if handle.result is None:
                return {}
            lens = {} if handle.result.lens is None else {
                "lens": self.lens_json(handle.result, body.glassformer.lens.layers)}
            if not sites:
                return {"glassformer": lens} if lens else {}
            kept = {site: t for site, t in (handle.result.captured or {}).items() if site in sites}
            trace = {site: tensor[0].float().tolist() for site, tensor in kept.items()}
            rest = [site for site in sites if site not in kept]
            if rest:
                read = handle.result.prompt_ids + handle.result.generated_ids[:-1]
                trace |= await asyncio.to_thread(self.tracer.run, read, rest)
            return {"glassformer": {"trace": trace, **lens}}

        def usage() -> dict:
            """The prompt once, and every token generated for the request (each candidate's)."""
            generated = sum(len(r.generated_ids) for h in handles if h.result is not None
                            for r in (h.result, *h.result.runners_up))
            return Usage.of(len(ids), generated).model_dump()

        decode = self.language_model.tokenizer.decode
        if not body.stream:
            per_choice: list[list[Event]] = [[] for _ in handles]
            async for index, batch in choices.events(handles, admission.done, watch):
                per_choice[index] += batch
            for events in per_choice:
                error = self.stopped(events[-1], admission)
                if error is not None:
                    raise error
            if body.use_beam_search:
                per_choice = choices.beam_choices(handle.result)
            elif len(per_choice) > body.n:  # best_of: the n likeliest candidates
                per_choice = choices.best(per_choice, body.n)
            whole = responses.whole(head, chat, per_choice, body.logprob_count, decode)
            return JSONResponse(whole | {"usage": usage(), **(await extra())})

        shape = responses.Chunks(head, chat, decode, tuple(sites))

        async def stream() -> AsyncIterator[str]:
            """The events that arrived together go out in one write (one body chunk). A failure
            past the headers ends the stream with an error event (500) and [DONE]."""
            with_usage = body.stream_options is not None and body.stream_options.include_usage
            if chat:
                yield "".join(shape.chunk("", None, role=True, index=i) for i in range(len(handles)))
            try:
                running = len(handles)
                async for index, batch in choices.events(handles, admission.done, watch):
                    out = [shape.token(event, index) for event in batch if event.logprobs is not None
                           or event.text or set(event.captured or ()) & set(sites)]
                    last, error = batch[-1], None
                    if last.finished:
                        running -= 1
                        error = self.stopped(last, admission)
                        if error is None:
                            out.append(shape.chunk(None, FINISH[last.stop_reason], more=await extra(),
                                                   index=index))
                        else:
                            out.append(responses.sse(error.payload()))
                        if error is None and with_usage and not running:
                            out.append(shape.usage(usage()))
                        if error is not None or not running:
                            out.append(responses.sse("[DONE]"))
                    if out:
                        yield "".join(out)
                    if error is not None:
                        return  # (the guard cancels the other choices)
            except Exception:
                errors.log.exception("unexpected error in a stream on %s", request.url.path)
                failed = APIError(500, "internal error; see the server's log", code="internal_error")
                yield responses.sse(failed.payload()) + responses.sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def lens_json(self, result: GenerationResult, layers: list[int] | None) -> dict:
        """The request's lens as `glassformer lens --json` prints one: per residual stream and
        position (the tokens the model read), the top-k tokens and their probabilities."""
        ids, probs = result.lens  # (sites, T, k) each
        read = result.prompt_ids + result.generated_ids[:-1]
        sites = lens_sites(self.language_model.config, None if layers is None else tuple(layers))
        lens = Lens(tuple(sites), ids[:, None], probs[:, None])
        decode = self.language_model.tokenizer.decode
        return lens_data(lens, read, lambda i: decode([i]), tuned=False)


async def _read(request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the body is over {limit} bytes", code="body_too_large")
    return bytes(body)
