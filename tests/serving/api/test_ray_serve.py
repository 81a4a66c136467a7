"""Ray Serve: a local Ray instance (loopback only) runs two replicas of the server over a tiny
model; both come up, and answers through Ray's proxy equal `generate` on each request alone."""

import asyncio
import socket

import httpx
import pytest

from glassformer.formats.checkpoint import write_checkpoint
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.generation.sampling import SamplingConfig
from glassformer.serving import EngineConfig
from glassformer.serving.api.app import ServerConfig

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install glassformer[ray]")
serve = pytest.importorskip("ray.serve")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_replicas_answer_like_generate(tmp_path, language_model):
    from glassformer.serving.api.ray_serve import application

    folder = write_checkpoint(tmp_path / "model", language_model.model, language_model.tokenizer, {})
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    port = free_port()  # after Ray's own processes have taken their ports
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(str(folder), "none", ServerConfig("tiny", max_tokens=32),
                              EngineConfig(n_blocks=128, max_batch=4), replicas=2, cpus_per_replica=0.5))
        replicas = serve.status().applications["default"].deployments["glassformer"].replica_states
        assert replicas == {"RUNNING": 2}
        prompts = ["the cat", "hello world", "a dog ran", "The meaning of life is", "x", "park"]

        async def ask_all():
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
                replies = await asyncio.gather(*(http.post("/v1/completions", json={
                    "model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0}) for p in prompts))
            return [r.json()["choices"][0]["text"] for r in replies]

        texts = asyncio.run(ask_all())
        config = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(temperature=0.0))
        assert texts == [generate(language_model.model, language_model.encode(p), config,
                                  language_model.tokenizer).text for p in prompts]
    finally:
        serve.shutdown()
        ray.shutdown()
