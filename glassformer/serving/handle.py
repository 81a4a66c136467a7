"""A submitted request as its caller sees it: a stream of events, readable from a thread or from
asyncio, that can be cancelled. The engine thread pushes; any thread may read. An asyncio
reader is woken through its loop once per step for all its requests (`Wakeups`: one callback
per loop, not one per token, each of which would take the GIL from the stepping thread), and
takes every event queued by then at once."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import torch

from ..generation.config import StopReason


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability the model gave a generated token (its raw distribution, before any
    sampling setting), and the `top` most likely tokens at that step as (id, logprob)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Event:
    """One generated token and the text it made visible ('' while held back). The last event
    of a request has `finished` set (a cancelled request's last event may carry no token)."""

    request_id: str
    token_id: int | None
    text: str
    finished: bool = False
    stop_reason: StopReason | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them (RequestParams.logprobs)
    error: str | None = None  # why the request failed (stop_reason "error"); others go on
    # capture: each asked site's rows computed since the previous event (serving/capture.py
    # new_rows): the prompt's with the first token, then one row per token
    captured: dict[str, torch.Tensor] | None = None


class Wakeups:
    """The asyncio readers to wake once a step's events are pushed (RequestHandle.push)."""

    def __init__(self) -> None:
        self._events: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}

    def add(self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> None:
        self._events.setdefault(loop, []).append(wake)

    def send(self) -> None:
        """One callback per loop, setting each of its readers' events in push order."""
        events, self._events = self._events, {}
        for loop, wakes in events.items():
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is left to read
                loop.call_soon_threadsafe(_set_all, wakes)


def _set_all(wakes: list[asyncio.Event]) -> None:
    for wake in wakes:
        wake.set()


class RequestHandle:
    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._events: deque[Event] = deque()
        self._lock = threading.Condition()
        self.finished = False
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self.result = None  # the GenerationResult, once finished

    def cancel(self) -> None:
        """Ask the engine to stop this request; its last event arrives with stop_reason
        'cancelled' (unless it finished first)."""
        self._cancel(self.request_id)

    def push(self, event: Event, wakeups: Wakeups, result=None) -> None:
        """Called by the engine: an asyncio reader is woken by `wakeups.send()`."""
        with self._lock:
            self._events.append(event)
            if event.finished:
                self.finished, self.result = True, result
            self._lock.notify_all()
            waker = self._waker
        if waker is not None:
            wakeups.add(*waker)

    def get(self, timeout: float | None = None) -> Event:
        """The next event, waiting for it; raises TimeoutError after `timeout` seconds."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._events, timeout):
                raise TimeoutError(f"{self.request_id}: no event within {timeout} s")
            return self._events.popleft()

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.get()
            yield event
            if event.finished:
                return

    def wait(self, timeout: float | None = None):
        """Block until the request finishes; returns its GenerationResult."""
        with self._lock:
            if not self._lock.wait_for(lambda: self.finished, timeout):
                raise TimeoutError(f"{self.request_id}: not finished within {timeout} s")
        return self.result

    async def __aiter__(self) -> AsyncIterator[Event]:
        async for events in self.batches():
            for event in events:
                yield event

    async def batches(self) -> AsyncIterator[list[Event]]:
        """The events from asyncio, every one queued by the time the reader wakes in one list
        (in order; the last list ends with the finished event)."""
        wake = asyncio.Event()
        with self._lock:
            self._waker = (asyncio.get_running_loop(), wake)
        while True:
            with self._lock:
                events = list(self._events)
                self._events.clear()
                if not events:
                    wake.clear()  # under the lock: a push after this sets it again
            if not events:
                await wake.wait()
                continue
            yield events
            if events[-1].finished:
                return
