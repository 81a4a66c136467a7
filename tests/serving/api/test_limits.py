"""Limits and lifetimes: API keys, a full queue (429), a client that goes away (its request is
cancelled and its KV blocks are free), timeouts, and /metrics showing it all."""

import concurrent.futures
import contextlib
import json
import logging
import socket
import time

import httpx
import pytest
from conftest import serving

from glassformer.serving import EngineConfig, sampler
from glassformer.serving.api.app import ServerConfig

MODEL = "tiny"
STEP_S = 0.02  # each engine step is slowed to this so requests are still running when the test acts


@pytest.fixture
def slow_server(language_model):
    """A server whose steps take STEP_S, one request per step, one more in the queue."""

    def start(**config):
        running = serving(language_model, ServerConfig(MODEL, max_tokens=100, **{"max_queue": 1, **config}),
                          EngineConfig(n_blocks=64, max_batch=1))
        url, app = running.__enter__()
        engine = app.state.server.engine
        run = engine.runner.run

        def slowed(plan):
            time.sleep(STEP_S)
            return run(plan)

        engine.runner.run = slowed
        opened.append(running)
        return url, engine

    opened = []
    yield start
    for running in opened:
        running.__exit__(None, None, None)


def body(**changes):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 100, "temperature": 0,
            "glassformer": {"ignore_eos": True}} | changes


def metric(http, name) -> float:
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith(name + " ")]
    assert lines, f"{name} not in /metrics"
    return float(lines[0].split()[1])


def wait_until(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_api_key_guards_every_v1_route(language_model):
    with serving(language_model, ServerConfig(MODEL, api_key="s3cret", max_tokens=8)) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as http:
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
                for reply in (http.get("/v1/models", headers=headers),
                              http.post("/v1/completions", json=body(max_tokens=2), headers=headers)):
                    assert reply.status_code == 401
                    assert reply.json()["error"]["type"] == "authentication_error"
            good = {"Authorization": "Bearer s3cret"}
            assert http.get("/v1/models", headers=good).status_code == 200
            assert http.post("/v1/completions", json=body(max_tokens=2), headers=good).status_code == 200
            assert http.get("/health").status_code == 200
            assert http.get("/metrics").status_code == 200  # not covered unless asked
            for path in ("/ui", "/ui/state", "/ui/requests"):
                assert http.get(path).status_code == 401
                assert http.get(path, headers=good).status_code == 200
                assert http.get(path, params={"key": "s3cret"}).status_code == 200  # a browser's way
                assert http.get(path, params={"key": "nope"}).status_code == 401
    config = ServerConfig(MODEL, api_key="s3cret", max_tokens=8, metrics_need_key=True)
    with serving(language_model, config) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_full_queue_is_429_with_retry_after(slow_server):
    url, engine = slow_server()
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body(stream=True)) as first:
            lines = first.iter_lines()  # kept: closing it would close the connection
            next(lines)  # running
            with http.stream("POST", "/v1/completions", json=body(stream=True)) as second:
                assert second.status_code == 200  # admitted, queued behind the first
                third = http.post("/v1/completions", json=body())
                assert third.status_code == 429 and third.headers["retry-after"] == "1"
                assert third.json()["error"]["type"] == "rate_limit_error"
        wait_until(lambda: metric(http, "glassformer_kv_blocks_used") == 0)
        assert http.post("/v1/completions", json=body(max_tokens=3)).json()["usage"]["completion_tokens"] == 3
        assert metric(http, 'glassformer_requests_total{route="/v1/completions",status="429"}') == 1


def test_disconnect_mid_stream_cancels_and_frees_blocks(slow_server):
    url, engine = slow_server()
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body(stream=True)) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
            wait_until(lambda: metric(http, "glassformer_kv_blocks_used") > 0)
        wait_until(lambda: metric(http, "glassformer_kv_blocks_used") == 0, timeout=1.0)
        assert metric(http, "glassformer_kv_blocks_free") == engine.blocks.n_blocks
        assert engine.stats.tokens_generated < 50  # it stopped long before its 100 tokens
        assert http.get("/health").status_code == 200


def test_disconnect_while_waiting_for_a_whole_answer_cancels(slow_server):
    url, engine = slow_server()
    with httpx.Client(base_url=url, timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body())
    with httpx.Client(base_url=url, timeout=30) as http:
        wait_until(lambda: metric(http, "glassformer_kv_blocks_used") == 0, timeout=1.0)
    assert engine.stats.tokens_generated < 60


def test_a_request_past_its_time_gets_504_not_a_finish_reason(slow_server):
    url, engine = slow_server(request_timeout_s=0.3)
    with httpx.Client(base_url=url, timeout=30) as http:
        reply = http.post("/v1/completions", json=body())
        assert reply.status_code == 504
        error = reply.json()["error"]
        assert error["code"] == "timeout" and "0.3 s" in error["message"]
        wait_until(lambda: metric(http, "glassformer_kv_blocks_used") == 0, timeout=1.0)
        assert metric(http, 'glassformer_requests_total{route="/v1/completions",status="504"}') == 1
    assert 0 < engine.stats.tokens_generated < 60


def test_a_stream_past_its_time_ends_with_an_error_event(slow_server):
    url, engine = slow_server(request_timeout_s=0.3)
    with httpx.Client(base_url=url, timeout=30) as http:
        reply = http.post("/v1/completions", json=body(stream=True, stream_options={"include_usage": True}))
    events = [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
              for line in reply.text.splitlines() if line.startswith("data: ")]
    assert reply.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "timeout"
    chunks = events[:-2]
    assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)  # never "length"
    assert all("usage" not in c for c in chunks)


def test_a_request_that_ends_at_max_tokens_says_length(slow_server):
    url, engine = slow_server(request_timeout_s=30)
    with httpx.Client(base_url=url, timeout=30) as http:
        reply = http.post("/v1/completions", json=body(max_tokens=3)).json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 3


def test_metrics_report_requests_and_latencies(slow_server):
    url, engine = slow_server()
    with httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(2):
            assert http.post("/v1/completions", json=body(max_tokens=5)).status_code == 200
        http.post("/v1/completions", json=body(max_tokens=0))
        assert metric(http, 'glassformer_requests_total{route="/v1/completions",status="200"}') == 2
        assert metric(http, 'glassformer_requests_total{route="/v1/completions",status="400"}') == 1
        assert metric(http, "glassformer_time_to_first_token_seconds_count") == 2
        assert metric(http, "glassformer_time_per_output_token_seconds_count") == 2
        assert metric(http, "glassformer_time_per_output_token_seconds_sum") >= 2 * STEP_S * 0.9
        assert metric(http, "glassformer_generated_tokens_total") == 10
        assert metric(http, "glassformer_tokens_per_second") > 0
        for name in ("glassformer_queue_length", "glassformer_running_batch_size",
                     "glassformer_kv_blocks_cached", "glassformer_prefix_hit_rate",
                     "glassformer_preemptions_total"):
            metric(http, name)


def test_allowed_hosts_and_origins_widen_the_defaults(language_model):
    config = ServerConfig(MODEL, max_tokens=8, allowed_hosts=("127.0.0.1", "box.lan"),
                          allowed_origins=("https://app.example",))
    with serving(language_model, config) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/health", headers={"host": "box.lan:8000"}).status_code == 200
        assert http.get("/health", headers={"host": "localhost"}).status_code == 403  # not listed here
        assert http.get("/health", headers={"origin": "https://app.example"}).status_code == 200
        assert http.get("/health", headers={"origin": "http://box.lan:3000"}).status_code == 200
        assert http.get("/health", headers={"origin": "https://evil.example"}).status_code == 403
    with serving(language_model, ServerConfig(MODEL, max_tokens=8, allowed_hosts=("*",),
                                              allowed_origins=("*",))) as (url, _):
        headers = {"host": "anything.example", "origin": "https://anywhere.example"}
        assert httpx.get(f"{url}/health", headers=headers, timeout=30).status_code == 200


@pytest.fixture
def server_log():
    """Records of the server's loggers (uvicorn's do not reach the root logger)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "glassformer")]
    for logger in loggers:
        logger.addHandler(handler)
    yield records
    for logger in loggers:
        logger.removeHandler(handler)


HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n")


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def test_a_slow_body_gets_408_and_the_connection_closes(language_model, server_log):
    with serving(language_model, ServerConfig(MODEL, max_tokens=8, body_timeout_s=0.5)) as (url, _):
        start = time.monotonic()
        with socket.create_connection(_address(url), timeout=5) as sock:
            sock.sendall(HEAD % 60 + b'{"model": "tiny", ')  # and then nothing
            reply = b""
            with contextlib.suppress(TimeoutError):
                while chunk := sock.recv(65536):  # until the server closes (or the 5 s run out)
                    reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b'"code":"timeout"' in reply
        assert time.monotonic() - start < 4  # closed by the server, not by the client's 5 s
    assert not [r for r in server_log if r.levelno >= logging.ERROR or r.exc_info]


def test_a_client_that_leaves_mid_body_leaves_no_traceback(language_model, server_log):
    with serving(language_model, ServerConfig(MODEL, max_tokens=8)) as (url, _):
        for _ in range(2):
            with socket.create_connection(_address(url), timeout=5) as sock:
                sock.sendall(HEAD % 500 + b'{"model": "tiny"')  # short of its Content-Length, then gone
            time.sleep(0.2)
        assert httpx.post(f"{url}/v1/completions", json=body(max_tokens=2), timeout=30).status_code == 200
    assert not [r for r in server_log if r.levelno >= logging.ERROR or r.exc_info]


def test_a_request_larger_than_the_cache_says_so(language_model):
    with serving(language_model, ServerConfig(MODEL, max_tokens=100),
                 EngineConfig(n_blocks=4, block_size=16)) as (url, _):
        reply = httpx.post(f"{url}/v1/completions", json=body(prompt="a" * 30, max_tokens=60), timeout=30)
        assert reply.status_code == 400
        error = reply.json()["error"]
        # the prompt fits: max_tokens is what does not
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert "needs 96 tokens of cache" in error["message"] and "the server holds 64" in error["message"]


def test_an_engine_failure_in_one_request_leaves_the_others_answered(language_model, monkeypatch):
    """A failure injected into one request's sampling while others share its steps: it gets a
    500 in OpenAI's shape, the others the text they get alone, and the server goes on."""
    with serving(language_model, ServerConfig(MODEL, max_tokens=32)) as (url, app):
        draw = sampler.draw

        def failing(seq, logits):
            if seq.params.seed == 13 and len(seq.generated) == 4:
                raise RuntimeError("injected")
            return draw(seq, logits)

        def ask(seed):
            reply = httpx.post(f"{url}/v1/completions", timeout=60,
                               json=body(prompt="the cat", max_tokens=24, temperature=1.0, seed=seed))
            return reply.status_code, reply.json()

        alone = {seed: ask(seed) for seed in (1, 2)}
        monkeypatch.setattr(sampler, "draw", failing)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            together = dict(zip((1, 13, 2), pool.map(ask, (1, 13, 2)), strict=True))
        status, failed = together.pop(13)
        assert status == 500 and failed["error"]["code"] == "engine_error"
        assert "injected" in failed["error"]["message"]
        for seed, (status, answer) in together.items():
            assert status == 200
            assert answer["choices"][0]["text"] == alone[seed][1]["choices"][0]["text"]
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
