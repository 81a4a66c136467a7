"""Servers for tests: the app under uvicorn on a free 127.0.0.1 port from a thread (always shut
down), and copies of one request sent at staggered times."""

import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import uvicorn

from glassformer.language_model import LanguageModel
from glassformer.serving import EngineConfig
from glassformer.serving.api.app import ServerConfig, create_app
from glassformer.serving.api.connection import header_limited


@contextmanager
def serving(language_model: LanguageModel, config: ServerConfig, engine: EngineConfig,
            grace: float = 5):
    """A running server; yields (base_url, app)."""
    app = create_app(language_model, config, engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=grace,
                                           http=header_limited(config.header_timeout_s)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "server did not stop"


def staggered(send: Callable[[], str], copies: int, delay: float) -> list[str | None]:
    """`send()` from `copies` threads, the i-th starting i·delay seconds after the first (so
    later copies join while earlier ones decode); each thread's answer."""
    answers: list[str | None] = [None] * copies

    def run(i: int) -> None:
        time.sleep(delay * i)
        answers[i] = send()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(copies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    return answers
