"""`glassformer serve` as a process: it serves a checkpoint folder on loopback, and on SIGTERM
stops accepting, lets the running requests finish within the grace (then answers them with
OpenAI's error shape), then exits 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import torch

from glassformer import Transformer, get_preset
from glassformer.formats.checkpoint import write_checkpoint


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def served_process(tmp_path, language_model, *flags):
    """`glassformer serve` of a model a little larger than the others (so a long request is still
    running when the test acts), in a process; yields (url, process)."""
    torch.manual_seed(0)
    config = get_preset("tiny-llama").replace(context_length=1024, d_model=128, n_layers=4, d_ff=256,
                                              vocab_size=language_model.tokenizer.vocab_size)
    folder = write_checkpoint(tmp_path / "model", Transformer(config).eval(), language_model.tokenizer, {})
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "from glassformer.cli import main; raise SystemExit(main())", "serve",
         "--model", str(folder), "--name", "m", "--port", str(port), "--max-request-tokens", "1000", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "GLASSFORMER_API_KEY"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url, server
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        server.wait(60)


LONG = {"model": "m", "prompt": "hello", "max_tokens": 1000, "temperature": 0,
        "glassformer": {"ignore_eos": True}}


def test_sigterm_lets_the_running_request_finish_then_exits_0(tmp_path, language_model):
    with served_process(tmp_path, language_model, "--grace", "60") as (url, server):
        with httpx.Client(base_url=url, timeout=60) as http:
            body = LONG | {"stream": True, "stream_options": {"include_usage": True}}
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
        code = server.wait(60)
        assert code == 0, server.stdout.read().decode()[-2000:]
        assert _refused(f"{url}/health")


def test_past_the_grace_requests_end_in_openai_error_shape(tmp_path, language_model):
    """SIGTERM with --grace 1 while a whole answer and a stream run: the first gets a 503 JSON
    error, the second an error event then [DONE]; no traceback, exit 0."""
    with served_process(tmp_path, language_model, "--grace", "1") as (url, server):
        whole = {}
        waiting = threading.Thread(target=lambda: whole.update(
            reply=httpx.post(f"{url}/v1/completions", json=LONG, timeout=60)))
        waiting.start()
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG | {"stream": True}, timeout=60) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
            server.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        waiting.join(60)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "server_shutdown"
        assert whole["reply"].status_code == 503
        assert whole["reply"].json()["error"]["code"] == "server_shutdown"
        code = server.wait(60)
        log = server.stdout.read().decode()
        assert code == 0 and "Traceback" not in log and "CancelledError" not in log, log[-2000:]


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
