"""Several choices for one HTTP request (`n`, `best_of`, `use_beam_search`): which engine
requests to submit, how their events reach the reader, and which of them are answered.

Each choice (and each best_of candidate) is its own engine request. With a `seed`, candidate
i draws with `derived_seed(seed, i)`: the candidates differ under sampling, and the whole
answer is the same for the same body. A beam search is one engine request as wide as best_of
(or n), whose n best beams are the choices."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from ...errors import InputError
from ...generation.config import SEEDS, GenerationResult
from .. import Event, RequestHandle, RequestParams
from .protocol import SamplingFields
from .ui_live import Watch


def derived_seed(seed: int, index: int) -> int:
    """Candidate `index`'s seed: the request's own for the first, the next ones after it
    (wrapping within what torch.Generator takes)."""
    low, high = SEEDS
    return low + (seed - low + index) % (high - low)


def candidates(fields: SamplingFields) -> int:
    """How many engine requests the body asks for."""
    if fields.use_beam_search:
        return 1
    return getattr(fields, "best_of", None) or fields.n


def plan(fields: SamplingFields, params: RequestParams) -> list[RequestParams]:
    """Each engine request's parameters, from the body's own (`params`)."""
    if fields.use_beam_search:
        width = getattr(fields, "best_of", None) or fields.n
        if width < 2:
            raise InputError("use_beam_search", "needs a width of 2 or more: give n or best_of >= 2")
        return [replace(params, beams=width, best_beams=fields.n)]
    count = candidates(fields)
    if count > fields.n and params.logprobs is None:  # to rank them (not answered)
        params = replace(params, logprobs=0)
    if params.seed is None:
        return [params] * count
    return [replace(params, seed=derived_seed(params.seed, i)) for i in range(count)]


def beam_choices(result: GenerationResult) -> list[list[Event]]:
    """A finished beam search's best beams as choices: each one event with its whole text."""
    return [[Event(f"beam-{rank}", None, beam.text or "", True, beam.stop_reason)]
            for rank, beam in enumerate((result, *result.runners_up))]


def log_prob(events: list[Event]) -> float:
    """A candidate's cumulative log-probability, from its tokens' events (asked with logprobs)."""
    return sum(e.logprobs.logprob for e in events if e.logprobs is not None)


def best(candidates_events: list[list[Event]], n: int) -> list[list[Event]]:
    """The n candidates of highest cumulative log-probability, best first (ties: first asked)."""
    order = sorted(range(len(candidates_events)), key=lambda i: -log_prob(candidates_events[i]))
    return [candidates_events[i] for i in order[:n]]


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, list[Event]]]:
    """Every handle's event batches as they arrive, each with its handle's index, until all
    have finished."""
    queue: asyncio.Queue[tuple[int, list[Event]] | None] = asyncio.Queue()

    async def read(index: int, handle: RequestHandle) -> None:
        try:
            async for batch in handle.batches():
                await queue.put((index, batch))
        finally:
            await queue.put(None)

    readers = [asyncio.create_task(read(i, h)) for i, h in enumerate(handles)]
    try:
        open_ = len(readers)
        while open_:
            item = await queue.get()
            if item is None:
                open_ -= 1
            else:
                yield item
    finally:
        for reader in readers:
            reader.cancel()


async def events(handles: list[RequestHandle], done: asyncio.Event, watch: Watch | None = None
                 ) -> AsyncIterator[tuple[int, list[Event]]]:
    """A request's events, those of one choice that arrived together in one list, with the
    choice's index; each shown to its watch on the live page first, if it has one. `done` is
    set once the reader stops (its guard then cancels what still runs)."""
    try:
        async for index, batch in merged(handles):
            if watch is not None:
                for event in batch:
                    await asyncio.to_thread(watch.observe, event)
            yield index, batch
    finally:
        done.set()
