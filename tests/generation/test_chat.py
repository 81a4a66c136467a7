"""Chat: the cache reused across turns gives the tokens a fresh generation would, and reads
only the new part of the conversation; interrupted replies stay in the history."""

from __future__ import annotations

import io

import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.cli import main
from glassformer.formats.chat_tokenizer import ChatTokenizer
from glassformer.formats.export import export_hf
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation.chat import ChatSession
from glassformer.generation.generate import GenerationConfig, generate

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model():
    base = HFTokenizer.train_bpe(["hello there, how are you today? fine thanks"] * 9, 280)
    base.tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer = ChatTokenizer(base.tokenizer, "<|im_end|>", "<|im_start|>", TEMPLATE)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, context_length=256, d_model=32,
                         n_layers=2, n_heads=4, n_kv_heads=2, position="rope", norm="rmsnorm",
                         activation="silu", gated=True, attn_bias=False, attn_out_bias=False,
                         mlp_bias=False, init_std=0.3)
    return Transformer(config).eval(), tokenizer


def fresh_reply(model, tokenizer, messages, max_new_tokens):
    """The reply generated from scratch (no cache carried over) for the whole conversation."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    result = generate(model, ids, GenerationConfig(max_new_tokens=max_new_tokens))
    return [t for t in result.generated_ids if t != tokenizer.eos_id]


def test_turns_reuse_the_cache(chat_model):
    model, tokenizer = chat_model
    session = ChatSession(model, tokenizer, max_new_tokens=6)
    for turn, text in enumerate(["hello there", "how are you?", "fine thanks"]):
        history = [*session.messages, {"role": "user", "content": text}]
        expected = fresh_reply(model, tokenizer, history, 6)
        reply = "".join(session.reply(text))
        assert reply == tokenizer.decode(expected)
        full = len(tokenizer.apply_chat_template(history, add_generation_prompt=True))
        if turn:  # only the tokens after the cached conversation were read
            assert session.last_prefill < full - 8
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 3


def test_interrupted_reply_is_kept(chat_model):
    model, tokenizer = chat_model
    session = ChatSession(model, tokenizer, max_new_tokens=20)
    stream = session.reply("hello there")
    next(stream)
    stream.close()  # what Ctrl-C does to the loop
    assert session.messages[-1]["role"] == "assistant"
    assert session.cache.length == len(session.cached_ids)
    history = [*session.messages, {"role": "user", "content": "fine"}]
    assert "".join(session.reply("fine")) == tokenizer.decode(fresh_reply(model, tokenizer, history, 20))


def test_no_template_is_refused(chat_model):
    model, tokenizer = chat_model
    with pytest.raises(ValueError, match="chat template"):
        ChatSession(model, HFTokenizer(tokenizer.tokenizer, "<|im_end|>"))


def test_cli_reads_lines_until_end_of_input(chat_model, tmp_path, monkeypatch, capsys):
    folder = export_hf(*chat_model, tmp_path / "hf")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n/reset\nhow are you?\n"))
    assert main(["chat", "--model", str(folder), "-n", "4"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
