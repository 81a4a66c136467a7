"""The real `openai` client against the server: every answer equals `generate` on that request
alone (greedy, or sampled with the same seed)."""

import openai
import pytest
import torch

from glassformer.generation.generate import GenerationConfig, generate
from glassformer.generation.sampling import SamplingConfig

MODEL = "tiny"  # the name conftest serves the model under


@pytest.fixture(scope="module")
def api(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield client


def expected(language_model, ids, n, stop=(), seed=None, **sampling):
    config = GenerationConfig(max_new_tokens=n, sampling=SamplingConfig(**{"temperature": 0.0, **sampling}),
                              seed=seed, stop=stop)
    return generate(language_model.model, ids, config, language_model.tokenizer)


def test_completion_equals_generate(api, language_model):
    prompt = "The meaning of life is"
    reply = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    oracle = expected(language_model, language_model.encode(prompt), 12)
    assert reply.choices[0].text == oracle.text
    assert reply.choices[0].finish_reason == ("length" if oracle.stop_reason == "max_new_tokens" else "stop")
    assert reply.usage.prompt_tokens == len(oracle.prompt_ids)
    assert reply.usage.completion_tokens == len(oracle.generated_ids)
    assert reply.usage.total_tokens == len(oracle.prompt_ids) + len(oracle.generated_ids)


def test_token_id_prompt(api, language_model):
    ids = language_model.encode("hello world")
    reply = api.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert reply.choices[0].text == expected(language_model, ids, 8).text


def test_chat_uses_the_template(api, language_model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    reply = api.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                        temperature=0)
    ids = language_model.tokenizer.apply_chat_template(messages)
    oracle = expected(language_model, ids, 10)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == oracle.text
    assert reply.usage.prompt_tokens == len(ids)


def test_streamed_chat_equals_the_whole_answer(api):
    messages = [{"role": "user", "content": "the cat sat"}]
    whole = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1


def test_streamed_completion(api, language_model):
    chunks = list(api.completions.create(model=MODEL, prompt="a dog ran", max_tokens=20, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected(
        language_model, language_model.encode("a dog ran"), 20).text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stop_string_cuts_the_text(api, language_model):
    ids = language_model.encode("the cat")
    free = expected(language_model, ids, 30).text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip(), "the oracle text is too short to pick a stop string"
    reply = api.completions.create(model=MODEL, prompt="the cat", max_tokens=30, temperature=0, stop=[stop])
    oracle = expected(language_model, ids, 30, stop=(stop,))
    assert reply.choices[0].text == oracle.text and stop not in reply.choices[0].text
    assert reply.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats_and_equals_generate(api, language_model):
    ids = language_model.encode("hello")
    settings = dict(temperature=0.9, top_p=0.95, seed=1234)
    first = api.completions.create(model=MODEL, prompt="hello", max_tokens=15, **settings)
    again = api.completions.create(model=MODEL, prompt="hello", max_tokens=15, **settings)
    other = api.completions.create(model=MODEL, prompt="hello", max_tokens=15, **{**settings, "seed": 99})
    oracle = expected(language_model, ids, 15, **settings)
    assert first.choices[0].text == again.choices[0].text == oracle.text
    assert other.choices[0].text != first.choices[0].text


def test_penalties_and_extra_sampling_fields(api, language_model):
    ids = language_model.encode("the cat sat")
    reply = api.completions.create(model=MODEL, prompt="the cat sat", max_tokens=12, temperature=0,
                                   frequency_penalty=1.5, presence_penalty=0.5,
                                   extra_body={"repetition_penalty": 1.3, "top_k": 5, "min_p": 0.05})
    oracle = expected(language_model, ids, 12, frequency_penalty=1.5, presence_penalty=0.5,
                      repetition_penalty=1.3, top_k=5, min_p=0.05)
    assert reply.choices[0].text == oracle.text


def test_models_lists_the_served_model(api):
    assert [m.id for m in api.models.list().data] == [MODEL]


def test_errors_reach_the_client_as_openai_errors(api):
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="gpt-4", prompt="x")


def oracle_logprobs(language_model, ids, generated, top):
    """Each generated token's log-probability and the `top` likeliest, from one full forward."""
    logprobs = torch.log_softmax(language_model.logits(ids + generated).float(), dim=-1)
    rows = logprobs[len(ids) - 1 : len(ids) - 1 + len(generated)]
    chosen = [rows[j, t].item() for j, t in enumerate(generated)]
    return chosen, [rows[j].topk(top) for j in range(len(generated))]


def test_completion_logprobs_equal_the_model(api, language_model):
    ids = language_model.encode("the cat")
    reply = api.completions.create(model=MODEL, prompt="the cat", max_tokens=8, temperature=0, logprobs=3)
    oracle = expected(language_model, ids, 8)
    chosen, tops = oracle_logprobs(language_model, ids, oracle.generated_ids, 3)
    got = reply.choices[0].logprobs
    assert got.tokens == [language_model.tokenizer.decode([t]) for t in oracle.generated_ids]
    torch.testing.assert_close(torch.tensor(got.token_logprobs), torch.tensor(chosen), atol=1e-4, rtol=0)
    for top, (values, token_ids) in zip(got.top_logprobs, tops, strict=True):
        assert list(top) == [language_model.tokenizer.decode([t]) for t in token_ids.tolist()]
        torch.testing.assert_close(torch.tensor(list(top.values())), values, atol=1e-4, rtol=0)
    assert got.text_offset == [sum(len(t) for t in got.tokens[:j]) for j in range(len(got.tokens))]


def test_chat_logprobs_streamed_and_whole_agree_with_the_model(api, language_model):
    messages = [{"role": "user", "content": "hello"}]
    settings = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                    top_logprobs=2)
    whole = api.chat.completions.create(**settings).choices[0].logprobs.content
    streamed = [entry for c in api.chat.completions.create(**settings, stream=True)
                if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    ids = language_model.tokenizer.apply_chat_template(messages)
    oracle = expected(language_model, ids, 6)
    chosen, tops = oracle_logprobs(language_model, ids, oracle.generated_ids, 2)
    for entries in (whole, streamed):
        tokens = [language_model.tokenizer.decode([t]) for t in oracle.generated_ids]
        assert [e.token for e in entries] == tokens
        torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), torch.tensor(chosen),
                                   atol=1e-4, rtol=0)
        for entry, (values, _) in zip(entries, tops, strict=True):
            assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
            torch.testing.assert_close(torch.tensor([t.logprob for t in entry.top_logprobs]), values,
                                       atol=1e-4, rtol=0)
