"""Chat: the cache reused across turns gives the tokens a fresh generation would, and reads
only the new part of the conversation; interrupted replies stay in the history; every sampling
option (Python and `glassformer chat` flags) answers as `generate` on the rendered prompt."""

from __future__ import annotations

import io

import pytest

from glassformer.cli import main
from glassformer.formats.export import export_hf
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation.chat import ChatSession
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.generation.sampling import SamplingConfig
from glassformer.language_model import load

GREEDY = SamplingConfig(temperature=0.0)
# every option of SamplingConfig (and of `glassformer chat`), strong enough to change the reply
OPTIONS = {
    "temperature": (SamplingConfig(temperature=1.5), ["--temperature", "1.5"]),
    "top_k": (SamplingConfig(temperature=1.0, top_k=3), ["--temperature", "1", "--top-k", "3"]),
    "top_p": (SamplingConfig(temperature=1.0, top_p=0.6), ["--temperature", "1", "--top-p", "0.6"]),
    "min_p": (SamplingConfig(temperature=1.0, min_p=0.2), ["--temperature", "1", "--min-p", "0.2"]),
    "repetition_penalty": (SamplingConfig(temperature=0.0, repetition_penalty=3.0),
                           ["--repetition-penalty", "3"]),
    "presence_penalty": (SamplingConfig(temperature=0.0, presence_penalty=3.0),
                         ["--presence-penalty", "3"]),
    "frequency_penalty": (SamplingConfig(temperature=0.0, frequency_penalty=1.5),
                          ["--frequency-penalty", "1.5"]),
}


def fresh_reply(model, tokenizer, messages, max_new_tokens, sampling=GREEDY, seed=None):
    """The reply generated from scratch (no cache carried over) for the whole conversation."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)
    result = generate(model, ids, config)
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


def test_an_fp8_cache_kept_across_turns_answers_as_generate_with_an_fp8_cache(chat_model):
    model, tokenizer = chat_model
    session = ChatSession(model, tokenizer, max_new_tokens=6, kv_dtype="fp8")
    for text in ["hello there", "how are you?"]:
        history = [*session.messages, {"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True)
        config = GenerationConfig(max_new_tokens=6, sampling=GREEDY, kv_dtype="fp8")
        expected = [t for t in generate(model, ids, config).generated_ids if t != tokenizer.eos_id]
        assert "".join(session.reply(text)) == tokenizer.decode(expected)
    assert str(session.cache.keys[0].dtype) == "torch.float8_e4m3fn"


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


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_every_sampling_option_replies_as_generate_does(chat_model, option):
    model, tokenizer = chat_model
    sampling = OPTIONS[option][0]
    session = ChatSession(model, tokenizer, sampling, max_new_tokens=12, seed=7)
    history = [{"role": "user", "content": "hello there"}]
    expected = fresh_reply(model, tokenizer, history, 12, sampling, seed=7)
    assert expected != fresh_reply(model, tokenizer, history, 12)  # the option matters here
    assert "".join(session.reply("hello there")) == tokenizer.decode(expected)


@pytest.mark.parametrize("option", ["repetition_penalty", "presence_penalty", "frequency_penalty"])
def test_penalties_count_the_whole_conversation(chat_model, option):
    model, tokenizer = chat_model
    sampling = OPTIONS[option][0]
    session = ChatSession(model, tokenizer, sampling, max_new_tokens=8)
    for text in ["hello there", "how are you?", "fine thanks"]:
        history = [*session.messages, {"role": "user", "content": text}]
        expected = fresh_reply(model, tokenizer, history, 8, sampling)
        assert "".join(session.reply(text)) == tokenizer.decode(expected)


def test_a_seeded_conversation_is_reproducible(chat_model):
    model, tokenizer = chat_model
    sampling = OPTIONS["temperature"][0]
    runs = []
    for seed in (3, 3, 4):
        session = ChatSession(model, tokenizer, sampling, max_new_tokens=8, seed=seed)
        runs.append([" ".join(session.reply(t)) for t in ("hello there", "fine thanks")])
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_cli_answers_with_every_sampling_flag(chat_model, tmp_path, monkeypatch, capsys, option):
    folder = export_hf(*chat_model, tmp_path / "hf")
    sampling, flags = OPTIONS[option]
    loaded = load(str(folder))
    session = ChatSession(loaded.model, loaded.tokenizer, sampling, max_new_tokens=6, seed=5)
    expected = "".join(session.reply("hello there"))
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\n"))
    assert main(["chat", "--model", str(folder), "-n", "6", "--seed", "5", *flags]) == 0
    out = capsys.readouterr()
    assert out.out == expected + "\n" and expected.strip() and not out.err.strip()


def test_cli_refuses_a_bad_sampling_flag_in_one_line(chat_model, tmp_path, capsys):
    folder = export_hf(*chat_model, tmp_path / "hf")
    assert main(["chat", "--model", str(folder), "--top-p", "0"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("glassformer: error: --top-p:") and err.count("\n") == 1


@pytest.mark.slow
def test_cli_chats_with_the_pretrained_model_under_a_repetition_penalty(monkeypatch, capsys,
                                                                       smollm2_path):
    path = str(smollm2_path)
    loaded = load(path, quantize="none")  # as `glassformer chat` loads it
    question = "What is the capital of France?"
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True)
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.2)
    expected = generate(loaded.model, ids, GenerationConfig(16, sampling), loaded.tokenizer).text
    monkeypatch.setattr("sys.stdin", io.StringIO(question + "\n"))
    assert main(["chat", "--model", path, "-n", "16", "--repetition-penalty", "1.2"]) == 0
    assert capsys.readouterr().out == expected + "\n" and "Paris" in expected
