"""The serving engine and the server's settings given hostile values from Python: each refused
at construction in one line naming the field, and the engine serving on afterwards; clients that
send their headers slowly, or nothing at all, answered with 408 and cut off."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from servers import serving

import glassformer
from glassformer import Transformer, get_preset
from glassformer.cli import main
from glassformer.errors import InputError
from glassformer.generation.config import GenerationConfig
from glassformer.serving import Engine, EngineConfig, RequestParams
from glassformer.serving.api.server import ServerConfig
from glassformer.serving.errors import CapacityError, EngineStopped

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(get_preset("tiny-llama").replace(context_length=64)).eval()


@pytest.mark.parametrize(("field", "value"), [
    ("max_new_tokens", 2.5), ("max_new_tokens", NAN), ("max_new_tokens", INF), ("max_new_tokens", "5"),
    ("max_new_tokens", True), ("max_new_tokens", 0), ("beams", 2.0), ("beams", 0), ("logprobs", 1.5),
    ("logprobs", -1), ("logprobs", NAN), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.0),
    ("length_penalty", NAN), ("length_penalty", INF), ("stop", "x"), ("stop", ("",)), ("stop", (1,)),
    ("eos_ids", (1.5,)), ("eos_ids", [1]), ("eos_ids", (-1,)), ("sampling", {"temperature": 1.0}),
])
def test_every_request_field_is_checked_at_construction(field, value):
    for kind in (RequestParams, GenerationConfig):
        if field not in {f.name for f in dataclasses.fields(kind)}:  # the engine's own: logprobs
            continue
        with pytest.raises(ValueError, match=f"^{field}: "):
            kind(**{field: value})


@pytest.mark.parametrize(("field", "value"), [
    ("top_k", 2.5), ("top_k", "3"), ("temperature", INF), ("top_p", NAN), ("min_p", "0.1"),
    ("max_new_tokens", "5"), ("logprobs", 1.5), ("use_cache", "no"), ("overflow", "wrap")])
def test_flat_settings_name_the_field(field, value):
    """As a JSON line of `glassformer generate --prompts-file` gives them."""
    kind = GenerationConfig if field in ("use_cache", "overflow") else RequestParams
    with pytest.raises(ValueError, match=f"^{field}: "):
        kind.from_fields(**{field: value})


def test_the_engine_refuses_at_submit_and_serves_on(model):
    engine = Engine(model, None, EngineConfig(n_blocks=16, block_size=4))
    for params, field in (({"max_new_tokens": 2}, "params"), (RequestParams(logprobs=1000), "logprobs")):
        with pytest.raises(ValueError, match=f"^{field}: "):
            engine.submit([1, 2, 3], params)
    for prompt in ([1.5, 2], [True], ["a"]):
        with pytest.raises(ValueError, match="^prompt: "):
            engine.submit(prompt)
    handle = engine.submit([1, 2, 3], RequestParams(max_new_tokens=3, eos_ids=(), logprobs=2))
    engine.run_until_done()
    result = handle.wait(0)
    assert result.stop_reason == "max_new_tokens" and len(result.generated_ids) == 3


def test_submit_and_start_after_close_raise(model):
    engine = Engine(model, None, EngineConfig(n_blocks=8)).start()
    engine.close()
    with pytest.raises(EngineStopped, match="closed"):
        engine.submit([1, 2])
    with pytest.raises(EngineStopped, match="closed"):
        engine.start()


@pytest.fixture
def one_thread():
    """A tiny model's products: one intra-op thread (more only wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_hundred_requests_mixing_beams_on_a_small_pool_all_end(model, one_thread):
    """Beams of 1 to 6 and plain requests arriving between steps on a pool a few requests fill,
    some cancelled: no step fails the engine for want of a block or comes back with nothing to
    do, every request ends with its result or is refused at submission naming its field, and
    every block comes back."""
    rng = random.Random(0)
    engine = Engine(model, None, EngineConfig(n_blocks=40, block_size=2, token_budget=32, max_batch=8))
    handles, refused, steps = [], [], 0
    for _ in range(100):
        prompt = [rng.randrange(96) for _ in range(rng.randint(1, 20))]
        params = RequestParams(max_new_tokens=rng.randint(1, 10), beams=rng.choice([1, 1, 2, 3, 4, 6]),
                               eos_ids=())
        try:
            handles.append((engine.submit(prompt, params), params))
        except InputError as error:
            assert error.field in ("beams", "prompt") and isinstance(error, CapacityError)
            refused.append(error)
        if rng.random() < 0.05:
            rng.choice(handles)[0].cancel()
        for _ in range(rng.randint(0, 2)):
            engine.step()
            steps += 1
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 1500, "the engine stopped making progress"
    assert len(handles) > 60 and refused and engine.scheduler.preemptions > 0
    for handle, params in handles:
        result = handle.wait(0)
        assert result.stop_reason in ("max_new_tokens", "cancelled"), result.stop_reason
        if result.stop_reason == "max_new_tokens":
            assert len(result.generated_ids) == params.max_new_tokens
    assert engine.blocks.used == 0


def test_a_beam_group_too_large_for_the_pool_is_refused_at_once_and_the_rest_served(model):
    with Engine(model, None, EngineConfig(n_blocks=20, block_size=2)) as engine:  # its own thread
        served = engine.submit([1, 2, 3], RequestParams(max_new_tokens=6, beams=3, eos_ids=()))
        start = time.perf_counter()
        with pytest.raises(InputError, match=r"^beams: the request needs 56 tokens of cache") as refused:
            engine.submit([1] * 10, RequestParams(max_new_tokens=4, beams=4, eos_ids=()))
        assert refused.value.field == "beams" and time.perf_counter() - start < 1
        assert served.wait(30).stop_reason == "max_new_tokens"


def test_a_group_that_cannot_start_on_an_empty_pool_ends_alone_with_an_error(model, one_thread):
    """The scheduler's last guard, which submit's check forestalls: the pool shrinks under a
    group admitted to it. Once it is alone and still cannot go on, it ends with an error event
    naming `beams`; the next request is served."""
    engine = Engine(model, None, EngineConfig(n_blocks=40, block_size=2, token_budget=32))
    big = engine.submit(list(range(1, 13)), RequestParams(max_new_tokens=6, beams=3, eos_ids=()))
    small = engine.submit([1, 2, 3], RequestParams(max_new_tokens=2, eos_ids=()))
    blocks = engine.blocks
    assert not blocks.blocks  # none taken yet
    blocks.n_blocks = 10
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 100, "the engine stopped making progress"
    events = list(big)
    assert events[-1].stop_reason == "error" and "CapacityError: beams: 3 sequence(s)" in events[-1].error
    assert small.wait(0).stop_reason == "max_new_tokens" and blocks.used == 0


@pytest.mark.parametrize(("block_size", "beams"), [(1, (4,)), (2, (4,)), (1, (4, 1))])
def test_generate_with_beams_on_a_small_pool_prints_every_result(gguf_file, tmp_path, capsys, block_size,
                                                                 beams):
    """`glassformer generate --prompts-file` with beams on a pool of 143 tokens: it used to spin
    forever (block size 1) or lose every result to a copy-on-write with no free block (2)."""
    lines = [{"prompt": "ab cd ef" * (i % 3 + 1), "beams": beams[i % len(beams)], "max_tokens": 12}
             for i in range(8)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    start = time.perf_counter()
    argv = ["--prompts-file", str(path), "--kv-memory-mb", "0.035", "--block-size", str(block_size)]
    assert main(["generate", "--model", str(gguf_file), *argv]) == 0
    assert time.perf_counter() - start < 20
    out = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert len(out) == 9 and out[8]["requests"] == 8
    assert all(r["stop_reason"] in ("max_new_tokens", "eos") for r in out[:8])


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 2.5), ("max_queue", -1), ("body_timeout_s", 0), ("request_timeout_s", INF),
    ("header_timeout_s", -1), ("allowed_hosts", "localhost"), ("allowed_origins", ("",))])
def test_server_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}: "):
        ServerConfig("m", **{field: value})


@contextmanager
def served(gguf_file, config: ServerConfig):
    """`glassformer serve`'s uvicorn settings on a free loopback port; yields its address."""
    with serving(glassformer.load(gguf_file), config, EngineConfig(n_blocks=32), grace=2) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n")
BODY = b'{"model": "m", "prompt": "ab", "max_tokens": 1}'


def _trickle(sock: socket.socket, data: bytes, every: float) -> None:
    """Sends `data` a byte at a time; stops early when the server has closed the connection."""
    for i in range(len(data)):
        try:
            sock.sendall(data[i:i + 1])
        except OSError:
            return
        time.sleep(every)


def _reply(sock: socket.socket) -> bytes:
    reply = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(65536):  # until the server closes (or the client's time is up)
            reply += chunk
    return reply


@pytest.mark.parametrize("earlier", [b"", REQUEST % len(BODY) + BODY], ids=["first", "kept-alive"])
def test_headers_sent_a_byte_at_a_time_get_408_and_a_closed_connection(earlier, gguf_file):
    with served(gguf_file, ServerConfig("m", header_timeout_s=1.0)) as address:
        with socket.create_connection(address, timeout=6) as sock:
            if earlier:  # a whole request first: the limit applies to the next one's headers too
                sock.sendall(earlier)
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            start = time.monotonic()
            sender = threading.Thread(target=_trickle, args=(sock, REQUEST % len(BODY), 0.3))
            sender.start()
            reply = _reply(sock)
            sender.join(10)
        assert time.monotonic() - start < 3  # closed by the server, not by the client's 6 s
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "timeout"


def test_a_connection_that_sends_nothing_is_closed(gguf_file):
    with served(gguf_file, ServerConfig("m", header_timeout_s=0.5)) as address:
        with socket.create_connection(address, timeout=5) as sock:
            start = time.monotonic()
            assert _reply(sock).startswith(b"HTTP/1.1 408")
            assert time.monotonic() - start < 3


def test_the_header_limit_does_not_cut_a_slow_body_or_a_long_answer(gguf_file):
    with served(gguf_file, ServerConfig("m", header_timeout_s=0.5, body_timeout_s=5)) as address:
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(REQUEST % len(BODY))
            time.sleep(1.0)  # past the header limit, within the body's
            sock.sendall(BODY)
            head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 200"), head
