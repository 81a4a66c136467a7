"""Answers in OpenAI's shapes: one JSON object, or server-sent events (a role delta for chat,
content deltas (with a request's trace sites, each token's new rows under `glassformer`), a
last chunk with `finish_reason`, the usage chunk when asked, `data: [DONE]`).
A request the server stopped (past its time, at a shutdown, or failed in the engine) gets an
error instead of a finish_reason: the error response for a whole answer, an `{"error": ...}`
event in a stream (its status line was sent with the first event). Pure shaping: what to send
when is the server's (server.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from ..handle import Event
from .logprobs import chat_logprobs, completion_logprobs
from .protocol import FINISH

Decode = Callable[[list[int]], str]


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def whole(head: dict, chat: bool, per_choice: list[list[Event]], logprob_count: int | None,
          decode: Decode) -> dict:
    """The answer of a request whose choices finished, from each choice's events (usage added
    by the caller)."""
    answered = []
    for index, events in enumerate(per_choice):
        text = "".join(event.text for event in events)
        choice = {"index": index, "logprobs": None, "finish_reason": FINISH[events[-1].stop_reason]}
        if logprob_count is not None:
            choice["logprobs"] = (chat_logprobs if chat else completion_logprobs)(events, decode)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        answered.append(choice)
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": answered}


class Chunks:
    """The chunks of one stream, each choice's with its `index`; `offsets` count each choice's
    text the logprobs' offsets point into.
    `sites`: the trace sites whose new rows each token's chunk carries.
    A plain text chunk (most of a stream) is its stream's frame around the text as a JSON
    string: the same bytes as `chunk(text, None)`, without building and serialising the object
    per token."""

    def __init__(self, head: dict, chat: bool, decode: Decode, sites: tuple[str, ...] = ()) -> None:
        self.head, self.chat, self.decode, self.sites = head, chat, decode, sites
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.offsets: dict[int, int] = {}
        self.frames: dict[int, tuple[str, str]] = {}  # a choice's chunk before and after its text

    def chunk(self, text: str | None, finish: str | None, role: bool = False, logprobs=None,
              more: dict | None = None, index: int = 0) -> str:
        if self.chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": index, "delta": {"role": "assistant", **delta} if role else delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice |= {"logprobs": logprobs, "finish_reason": finish}
        return sse({**self.head, "object": self.kind, "choices": [choice], **(more or {})})

    def traced(self, event: Event) -> dict:
        """`{"glassformer": {"trace": {site: rows}}}`: the rows of the asked sites the engine
        computed since the previous token (batch dimension dropped), or {} when none."""
        rows = {site: tensor[0].float().tolist() for site, tensor in (event.captured or {}).items()
                if site in self.sites}
        return {"glassformer": {"trace": rows}} if rows else {}

    def token(self, event: Event, index: int = 0) -> str:
        """A token's chunk of choice `index`: its text, and with logprobs or trace sites one
        chunk per token even while its text is still held back."""
        if event.logprobs is None:
            traced = self.traced(event)
            if not traced and event.text:
                before, after = self.frame(index)
                return before + json.dumps(event.text) + after
            return self.chunk(event.text, None, more=traced, index=index)
        offset = self.offsets.get(index, 0)
        logprobs = (chat_logprobs([event], self.decode) if self.chat
                    else completion_logprobs([event], self.decode, offset))
        self.offsets[index] = offset + len(self.decode([event.token_id]))
        return self.chunk(event.text, None, logprobs=logprobs, more=self.traced(event), index=index)

    def frame(self, index: int) -> tuple[str, str]:
        """Choice `index`'s plain text chunk around its text (built once per choice)."""
        if index not in self.frames:
            mark = json.dumps(f"\x00{uuid.uuid4().hex}")  # text no head can hold, as JSON
            before, after = self.chunk(json.loads(mark), None, index=index).split(mark)
            self.frames[index] = before, after
        return self.frames[index]

    def usage(self, usage: dict) -> str:
        return sse({**self.head, "object": self.kind, "choices": [], "usage": usage})
