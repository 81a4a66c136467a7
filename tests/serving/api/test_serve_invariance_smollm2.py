"""`glassformer serve` on the real SmolLM2-135M-Instruct, in every weight mode: the same
completion sent alone, then 8 copies at staggered times (each joining while the earlier ones
decode, so prefill and decoding rows share steps), three rounds, greedy and seeded. Every
copy must be the lone answer, token for token."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from servers import staggered
from test_serve_command import free_port

pytestmark = pytest.mark.slow

PROMPT = "The meaning of life is"
COPIES, ROUNDS = 8, 3
BODIES = {
    "greedy": {"model": "m", "prompt": PROMPT, "max_tokens": 32, "temperature": 0},
    "seeded": {"model": "m", "prompt": PROMPT, "max_tokens": 32, "temperature": 1.0, "seed": 11},
}


def _serve(model_path, mode: str):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "from glassformer.cli import main; raise SystemExit(main())", "serve",
         "--model", str(model_path), "--name", "m", "--port", str(port), "--quantize", mode],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k != "GLASSFORMER_API_KEY"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url, server
        except httpx.TransportError:
            time.sleep(0.2)


def _complete(url: str, body: dict) -> str:
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.parametrize("mode", ["none", "bf16", "int8", "int4", "gguf"])
def test_every_copy_is_the_lone_answer(smollm2_path, mode):
    url, server = _serve(smollm2_path, mode)
    try:
        differ = {}
        for kind, body in BODIES.items():
            lone = _complete(url, body)
            answers = []
            for _ in range(ROUNDS):
                answers += staggered(lambda body=body: _complete(url, body), COPIES, 0.05)
            differ[kind] = sum(answer != lone for answer in answers)
        assert differ == {"greedy": 0, "seeded": 0}, f"{mode}: copies that differ of {len(answers)}"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
