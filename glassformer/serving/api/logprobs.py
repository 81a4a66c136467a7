"""Token log-probabilities in OpenAI's two shapes: the completions API's parallel lists and
the chat API's list of {token, logprob, bytes, top_logprobs}."""

from __future__ import annotations

from .. import Event


def completion_logprobs(events: list[Event], decode, offset: int = 0) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset} for the events' tokens; `offset` is
    where the first token's text starts in the completion."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in events:
        if event.logprobs is None:
            continue
        token = decode([event.token_id])
        out["tokens"].append(token)
        out["token_logprobs"].append(event.logprobs.logprob)
        out["top_logprobs"].append({decode([i]): value for i, value in event.logprobs.top})
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def chat_logprobs(events: list[Event], decode) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        token = decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(e.token_id, e.logprobs.logprob),
                         "top_logprobs": [entry(i, value) for i, value in e.logprobs.top]}
                        for e in events if e.logprobs is not None]}
