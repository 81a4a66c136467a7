"""`glassformer serve` as a process: it serves a checkpoint folder on loopback, and on SIGTERM
stops accepting, lets the running request finish, then exits 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import torch

from glassformer import Transformer, get_preset
from glassformer.formats.checkpoint import write_checkpoint


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_lets_the_running_request_finish_then_exits_0(tmp_path, language_model):
    torch.manual_seed(0)  # a model a little larger than the others so the request is still running
    config = get_preset("tiny-llama").replace(context_length=1024, d_model=128, n_layers=4, d_ff=256,
                                              vocab_size=language_model.tokenizer.vocab_size)
    folder = write_checkpoint(tmp_path / "model", Transformer(config).eval(), language_model.tokenizer, {})
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "from glassformer.cli import main; raise SystemExit(main())", "serve",
         "--model", str(folder), "--name", "m",
         "--port", str(port), "--max-tokens", "1000", "--grace", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "GLASSFORMER_API_KEY"})
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            deadline = time.monotonic() + 120
            while True:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            body = {"model": "m", "prompt": "hello", "max_tokens": 1000, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "glassformer": {"ignore_eos": True}}
            with http.stream("POST", "/v1/completions", json=body) as reply:
                lines = reply.iter_lines()
                assert next(lines).startswith("data: ")
                server.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                refused = _refused(f"{url}/health")  # while the request still streams
                rest = [line for line in lines if line]
            assert refused, "a new connection was accepted after SIGTERM"
            assert rest[-1] == "data: [DONE]"
            usage = json.loads(rest[-2].removeprefix("data: "))["usage"]
            assert usage["completion_tokens"] == 1000  # it ran to the end, not cancelled
            assert json.loads(rest[-3].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        code = server.wait(60)
    assert code == 0, server.stdout.read().decode()[-2000:]
    assert _refused(f"{url}/health")


def _refused(url: str) -> bool:
    try:
        httpx.get(url, timeout=2)
    except httpx.TransportError:
        return True
    return False


def test_without_the_serve_extra_it_names_the_install_in_one_line():
    code = ("import sys; sys.modules['uvicorn'] = sys.modules['fastapi'] = None\n"  # as if not installed
            "from glassformer.cli import main; raise SystemExit(main(['serve', '--model', 'tiny']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "glassformer: error: serve: the module uvicorn is missing; install the serve extra: "
        "pip install 'glassformer[serve]'"]
    assert "Traceback" not in done.stderr
