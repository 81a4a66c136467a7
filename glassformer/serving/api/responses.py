"""Answers in OpenAI's shapes: one JSON object, or server-sent events (a role delta for chat,
content deltas, a last chunk with `finish_reason`, the usage chunk when asked, `data: [DONE]`).
A request the server stopped (past its time, or at a shutdown) gets an error instead of a
finish_reason: the error response for a whole answer, an `{"error": ...}` event in a stream
(its status line was sent with the first event)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .errors import APIError
from .logprobs import chat_logprobs, completion_logprobs
from .protocol import FINISH, ChatCompletionRequest, CompletionRequest, Usage, new_id, now

if TYPE_CHECKING:
    from .app import Server


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def answer(server: Server, request: Request, body: CompletionRequest | ChatCompletionRequest,
                 chat: bool) -> Response:
    ids = server.prompt(body)
    sites = body.glassformer.trace
    if sites:
        try:
            server.tracer.check(sites)
        except ValueError as error:
            raise APIError(400, f"glassformer.trace: {error}", "glassformer.trace", "invalid_value") from None
    handle, admission = server.submit(ids, body, body.token_limit if chat else body.max_tokens, request)
    head = {"id": new_id("chatcmpl" if chat else "cmpl"), "created": now(), "model": body.model}

    async def extra() -> dict:
        """The trace sites' tensors for this request's tokens, once it has finished."""
        if not sites or handle.result is None:
            return {}
        read = handle.result.prompt_ids + handle.result.generated_ids[:-1]
        return {"glassformer": {"trace": await asyncio.to_thread(server.tracer.run, read, sites)}}

    def usage() -> dict:
        generated = len(handle.result.generated_ids) if handle.result is not None else 0
        return Usage.of(len(ids), generated).model_dump()

    decode = server.language_model.tokenizer.decode
    if not body.stream:
        events = [event async for event in server.events(handle, admission)]
        error = server.stopped(events[-1], admission)
        if error is not None:
            raise error
        text = "".join(event.text for event in events)
        choice = {"index": 0, "logprobs": None, "finish_reason": FINISH[events[-1].stop_reason]}
        if body.logprob_count is not None:
            shape = chat_logprobs if chat else completion_logprobs
            choice["logprobs"] = shape(events, decode)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": usage(), **(await extra())})

    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, role: bool = False, logprobs=None, more=None) -> str:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": {"role": "assistant", **delta} if role else delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice |= {"logprobs": logprobs, "finish_reason": finish}
        return _sse({**head, "object": kind, "choices": [choice], **(more or {})})

    async def stream() -> AsyncIterator[str]:
        offset, error = 0, None
        if chat:
            yield chunk("", None, role=True)
        async for event in server.events(handle, admission):
            if event.logprobs is not None:  # one chunk per token, its text possibly still held back
                logprobs = (chat_logprobs([event], decode) if chat
                            else completion_logprobs([event], decode, offset))
                yield chunk(event.text, None, logprobs=logprobs)
                offset += len(decode([event.token_id]))
            elif event.text:
                yield chunk(event.text, None)
            if event.finished:
                error = server.stopped(event, admission)
                if error is None:
                    yield chunk(None, FINISH[event.stop_reason], more=await extra())
                else:
                    yield _sse(error.payload())
        if error is None and body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({**head, "object": kind, "choices": [], "usage": usage()})
        yield _sse("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
