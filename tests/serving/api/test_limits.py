"""Limits and lifetimes: API keys, a full queue (429), a client that goes away (its request is
cancelled and its KV blocks are free), timeouts, and /metrics showing it all."""

import json
import time

import httpx
import pytest
from conftest import serving

from glassformer.serving import EngineConfig
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
