"""A tiny random model with a real byte-level tokenizer and a chat template, served by uvicorn on
127.0.0.1 (a free port) from a thread; the fixture always shuts the server down."""

from contextlib import contextmanager

import httpx
import pytest
import servers
import torch
from tokenizers import Tokenizer, decoders, models

from glassformer import Transformer, get_preset
from glassformer.formats.chat_tokenizer import ChatTokenizer
from glassformer.language_model import LanguageModel
from glassformer.serving import EngineConfig
from glassformer.serving.api.app import ServerConfig

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHARS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?<>\n0123456789"
EOT = "<|endoftext|>"
MODEL = "tiny"


@pytest.fixture(scope="session")
def language_model() -> LanguageModel:
    vocab = {c: i for i, c in enumerate(CHARS)} | {EOT: len(CHARS)}
    chars = Tokenizer(models.BPE(vocab, merges=[]))  # one token per character, each valid text
    chars.add_special_tokens([EOT])
    chars.decoder = decoders.Fuse()
    tokenizer = ChatTokenizer(chars, eos_token=EOT, chat_template=TEMPLATE)
    torch.manual_seed(0)
    config = get_preset("tiny-llama").replace(init_std=0.3, context_length=128,
                                              vocab_size=tokenizer.vocab_size)
    return LanguageModel(Transformer(config).eval(), tokenizer, MODEL)


@contextmanager
def serving(language_model, config: ServerConfig | None = None, engine: EngineConfig | None = None):
    """A running server of the tiny model; yields (base_url, app)."""
    config = config or ServerConfig(MODEL, max_tokens=64)
    with servers.serving(language_model, config, engine or EngineConfig(n_blocks=256, max_batch=8)) as up:
        yield up


@pytest.fixture(scope="module")
def served(language_model):
    with serving(language_model) as running:
        yield running


@pytest.fixture(scope="module")
def base_url(served):
    return served[0]


@pytest.fixture
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as http:
        yield http
