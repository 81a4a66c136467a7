"""Every kind of bad request gets a 4xx in OpenAI's error shape with a message naming the
problem (never a 5xx, a traceback or a file path), and the server answers correctly after."""

import json

import pytest

from glassformer.generation.generate import GenerationConfig, generate
from glassformer.generation.sampling import SamplingConfig

MODEL = "tiny"
OMIT = object()  # a field left out of the body


def completion(**changes):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
    return {k: v for k, v in (body | changes).items() if v is not OMIT}


def chat(**changes):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {k: v for k, v in (body | changes).items() if v is not OMIT}


C, CHAT = "/v1/completions", "/v1/chat/completions"
CASES = [  # (id, path, body, status, param, a fragment of the message)
    ("json-malformed", C, b'{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    ("json-array", C, b"[1, 2]", 400, None, "JSON object"),
    ("json-string", C, b'"hello"', 400, None, "JSON object"),
    ("json-empty", C, b"", 400, None, "not valid JSON"),
    ("json-trailing-garbage", C, b'{"model": "tiny", "prompt": "a"} x', 400, None, "not valid JSON"),
    ("prompt-missing", C, completion(prompt=OMIT), 400, "prompt", "required"),
    ("model-missing", C, completion(model=OMIT), 400, "model", "required"),
    ("model-empty", C, completion(model=""), 400, "model", "at least 1"),
    ("model-unknown", C, completion(model="gpt-4"), 404, "model", "not served here"),
    ("prompt-empty", C, completion(prompt=""), 400, "prompt", "at least 1"),
    ("prompt-empty-ids", C, completion(prompt=[]), 400, "prompt", "at least 1"),
    ("prompt-number", C, completion(prompt=123), 400, "prompt", ""),
    ("prompt-mixed-ids", C, completion(prompt=[1, "a"]), 400, "prompt", ""),
    ("prompt-negative-id", C, completion(prompt=[-1]), 400, "prompt", "greater than or equal to 0"),
    ("prompt-id-out-of-vocab", C, completion(prompt=[100000]), 400, "prompt", "token ids must be in"),
    ("prompt-too-long", C, completion(prompt="a" * 200), 400, "prompt", "context holds 128"),
    ("max-tokens-zero", C, completion(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    ("max-tokens-negative", C, completion(max_tokens=-5), 400, "max_tokens", "greater than or equal to 1"),
    ("max-tokens-string", C, completion(max_tokens="10"), 400, "max_tokens", "integer"),
    ("max-tokens-float", C, completion(max_tokens=1.5), 400, "max_tokens", "integer"),
    ("max-tokens-bool", C, completion(max_tokens=True), 400, "max_tokens", "integer"),
    ("max-tokens-over-cap", C, completion(max_tokens=100000), 400, "max_tokens", "at most 64"),
    ("temperature-negative", C, completion(temperature=-1), 400, "temperature", "greater than or equal to 0"),
    ("temperature-too-high", C, completion(temperature=3), 400, "temperature", "less than or equal to 2"),
    ("temperature-string", C, completion(temperature="hot"), 400, "temperature", "number"),
    ("temperature-bool", C, completion(temperature=True), 400, "temperature", "number"),
    ("top-p-zero", C, completion(top_p=0), 400, "top_p", "greater than 0"),
    ("top-p-over-one", C, completion(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    ("top-k-zero", C, completion(top_k=0), 400, "top_k", "greater than or equal to 1"),
    ("top-k-float", C, completion(top_k=2.5), 400, "top_k", "integer"),
    ("min-p-negative", C, completion(min_p=-0.1), 400, "min_p", "greater than or equal to 0"),
    ("presence-penalty-high", C, completion(presence_penalty=3), 400, "presence_penalty", "less than"),
    ("frequency-penalty-low", C, completion(frequency_penalty=-3), 400, "frequency_penalty", "greater than"),
    ("repetition-penalty-zero", C, completion(repetition_penalty=0), 400, "repetition_penalty",
     "greater than 0"),
    ("seed-string", C, completion(seed="x"), 400, "seed", "integer"),
    ("seed-float", C, completion(seed=1.5), 400, "seed", "integer"),
    ("seed-too-large", C, completion(seed=2**64), 400, "seed", "must be in [-9223372036854775808, "),
    ("seed-too-small", C, completion(seed=-(2**63) - 1), 400, "seed", "must be in"),
    ("stop-number", C, completion(stop=5), 400, "stop", ""),
    ("stop-five-strings", C, completion(stop=list("abcde")), 400, "stop", "at most 4"),
    ("stop-empty-string", C, completion(stop=[""]), 400, "stop", "must not be empty"),
    ("n-over-bound", C, completion(n=17), 400, "n", "less than or equal to 16"),
    ("n-zero", CHAT, chat(n=0), 400, "n", "greater than or equal to 1"),
    ("n-string", C, completion(n="2"), 400, "n", "integer"),
    ("best-of-under-n", C, completion(n=3, best_of=2), 400, "best_of", "at least n (3)"),
    ("best-of-over-bound", C, completion(best_of=17), 400, "best_of", "less than or equal to 16"),
    ("best-of-stream", C, completion(best_of=2, stream=True), 400, "best_of", "stream"),
    ("best-of-chat", CHAT, chat(best_of=2), 400, "best_of", "unknown field"),
    ("beams-stream", C, completion(use_beam_search=True, best_of=2, temperature=0, stream=True), 400,
     "use_beam_search", "stream"),
    ("beams-sampling", C, completion(use_beam_search=True, best_of=2), 400, "use_beam_search", "sampling"),
    ("beams-width-one", C, completion(use_beam_search=True, temperature=0), 400, "use_beam_search", "width"),
    ("beams-logprobs", C, completion(use_beam_search=True, best_of=2, temperature=0, logprobs=1), 400,
     "logprobs", "beams"),
    ("n-with-trace", C, completion(n=2, glassformer={"trace": ["blocks.0.resid_post"]}), 400, "glassformer",
     "one plain choice"),
    ("beams-with-lens", C, completion(use_beam_search=True, best_of=2, temperature=0,
                                      glassformer={"lens": {"top_k": 2}}), 400, "glassformer",
     "use_beam_search"),
    ("beams-with-steer", C, completion(use_beam_search=True, best_of=2, temperature=0,
                                       glassformer={"ablate": ["blocks.0.attn.head.0"]}), 400,
     "glassformer.ablate", "beams"),
    ("stream-string", C, completion(stream="yes"), 400, "stream", "boolean"),
    ("stream-options-string", C, completion(stream=True, stream_options={"include_usage": "yes"}), 400,
     "stream_options.include_usage", "boolean"),
    ("stream-options-unknown", C, completion(stream_options={"chunk": 1}), 400, "stream_options.chunk",
     "unknown field"),
    ("unknown-field", C, completion(foo=1), 400, "foo", "unknown field"),
    ("logit-bias-unsupported", C, completion(logit_bias={"1": 5}), 400, "logit_bias", "unknown field"),
    ("echo-unsupported", C, completion(echo=True), 400, "echo", ""),
    ("logprobs-too-many", C, completion(logprobs=6), 400, "logprobs", "less than or equal to 5"),
    ("logprobs-bool", C, completion(logprobs=True), 400, "logprobs", "integer"),
    ("chat-top-logprobs-alone", CHAT, chat(top_logprobs=2), 400, "top_logprobs", "needs logprobs"),
    ("chat-top-logprobs-too-many", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "less than or equal to 20"),
    ("glassformer-unknown", C, completion(glassformer={"x": 1}), 400, "glassformer.x", "unknown field"),
    ("chat-messages-empty", CHAT, chat(messages=[]), 400, "messages", "at least 1"),
    ("chat-messages-missing", CHAT, chat(messages=OMIT), 400, "messages", "required"),
    ("chat-messages-string", CHAT, chat(messages="hello"), 400, "messages", ""),
    ("chat-role-unknown", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages.0.role", "'user'"),
    ("chat-content-missing", CHAT, chat(messages=[{"role": "user"}]), 400, "messages.0.content", "required"),
    ("chat-content-number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages.0.content", ""),
    ("chat-content-image", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages.0.content", ""),
    ("chat-max-completion-zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens",
     "greater than or equal to 1"),
    ("chat-model-unknown", CHAT, chat(model="llama"), 404, "model", "not served here"),
    ("chat-prompt-key", CHAT, chat(prompt="hi"), 400, "prompt", "unknown field"),
    ("chat-too-long", CHAT, chat(messages=[{"role": "user", "content": "a" * 300}]), 400, "prompt",
     "context holds 128"),
]


def _post(client, path, body, headers=None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=raw, headers={"content-type": "application/json", **(headers or {})})


def _check_error(reply, status, param=None, fragment=""):
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert fragment in error["message"] and error["message"]
    for leak in ("Traceback", ".py", "/work", "/root", "site-packages"):
        assert leak not in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("path, body, status, param, fragment", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_request(client, path, body, status, param, fragment):
    _check_error(_post(client, path, body), status, param, fragment)


def test_unknown_route_and_wrong_method(client):
    _check_error(client.get("/v1/nope"), 404, fragment="no such route")
    _check_error(client.get("/v1/completions"), 405, fragment="not allowed")


def test_body_over_the_limit_is_413(client):
    big = completion(prompt="a" * (1 << 20 + 1))
    reply = _post(client, C, big)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "body_too_large"


def test_chunked_body_over_the_limit_is_413(client):
    def chunks():  # no Content-Length: the size is counted as it arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(20):
            yield b"a" * 65536
        yield b'"}'

    reply = client.post(C, content=chunks(), headers={"content-type": "application/json"})
    assert reply.status_code == 413


def test_the_server_answers_correctly_after_them(client, language_model):
    for _, path, body, *_ in CASES[:10]:
        _post(client, path, body)
    reply = _post(client, C, completion(prompt="the cat", max_tokens=10, temperature=0))
    assert reply.status_code == 200
    oracle = generate(language_model.model, language_model.encode("the cat"),
                      GenerationConfig(max_new_tokens=10, sampling=SamplingConfig(temperature=0.0)),
                      language_model.tokenizer)
    assert reply.json()["choices"][0]["text"] == oracle.text
    assert client.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                  None])
def test_a_body_not_sent_as_json_is_415(client, kind):
    """A page's form or text/plain POST needs no CORS preflight: only application/json is read."""
    raw = json.dumps(completion()).encode()
    headers = {} if kind is None else {"content-type": kind}
    reply = client.post(C, content=raw, headers=headers)
    assert reply.status_code == 415 and reply.json()["error"]["code"] == "unsupported_media_type"
    with_charset = {"content-type": "application/json; charset=utf-8"}
    assert _post(client, C, completion(), with_charset).status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/ui/state", "/health"])
def test_a_foreign_host_or_origin_is_403(client, path):
    for headers, code in (({"host": "evil.example"}, "host_not_allowed"),
                          ({"host": "evil.example:80"}, "host_not_allowed"),
                          ({"origin": "http://evil.example"}, "origin_not_allowed"),
                          ({"origin": "null"}, "origin_not_allowed")):
        reply = client.get(path, headers=headers)
        assert reply.status_code == 403, headers
        error = reply.json()["error"]
        assert error["type"] == "permission_error" and error["code"] == code
    for headers in ({"host": "localhost:1234"}, {"origin": "http://localhost:8000"},
                    {"origin": "http://127.0.0.1"}):
        assert client.get(path, headers=headers).status_code == 200, headers
