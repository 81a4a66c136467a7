import dataclasses
import json

import pytest
import torch

from glassformer import PRESETS, Transformer, get_preset
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.generation.core import decode_one_token, prefill
from glassformer.generation.generate import GenerationConfig, generate, generate_batch, stream
from glassformer.generation.sampling import SamplingConfig
from glassformer.model.kv_cache import KVCache

CAUSAL = sorted(n for n in PRESETS if n.startswith("tiny-") and get_preset(n).causal
                and not get_preset(n).n_encoder_layers)  # decoder-only
GREEDY = dict(eos_ids=())  # no end-of-text: runs are as long as asked


def _model(name: str = "tiny-llama", **changes) -> Transformer:
    torch.manual_seed(0)
    # a large init spreads the logits and the attention, so every cached key matters
    return Transformer(get_preset(name).replace(init_std=0.3, **changes)).eval()


def _prompt(n: int, seed: int = 0, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _naive_greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """The oracle: run the whole sequence through the model, take the argmax of the last row."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", CAUSAL)
def test_cached_and_uncached_greedy_are_identical_and_match_the_oracle(name):
    model, prompt = _model(name), _prompt(9)
    cached = generate(model, prompt, GenerationConfig(max_new_tokens=16, **GREEDY))
    uncached = generate(model, prompt, GenerationConfig(max_new_tokens=16, use_cache=False, **GREEDY))
    assert cached.generated_ids == uncached.generated_ids == _naive_greedy(model, prompt, 16)
    assert cached.stop_reason == "max_new_tokens" and cached.n_generated == 16


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-alibi", "tiny-gpt1", "tiny-mistral"])
def test_sliding_past_the_window_is_the_same_with_and_without_the_cache(name):
    model, prompt = _model(name), _prompt(20)
    config = GenerationConfig(max_new_tokens=40, overflow="slide", **GREEDY)
    cached = generate(model, prompt, config)
    uncached = generate(model, prompt, dataclasses.replace(config, use_cache=False))
    assert cached.generated_ids == uncached.generated_ids
    assert cached.n_generated == 40 and cached.stop_reason == "max_new_tokens"


def test_decode_one_token_equals_the_last_row_of_a_full_forward():
    model, ids = _model("tiny-mistral"), torch.tensor([_prompt(12), _prompt(12, seed=1)])
    cache = KVCache(model.config, 2)
    with torch.no_grad():
        prefill(model, ids[:, :11], cache)
        step = decode_one_token(model, ids[:, 11], cache)
        full = model(ids)[:, -1]
    torch.testing.assert_close(step, full)


def test_a_bidirectional_model_cannot_use_the_cache_but_generates_without_it():
    model = _model("tiny-bidirectional")
    with pytest.raises(ValueError, match="use_cache"):
        generate(model, [1, 2, 3], GenerationConfig(max_new_tokens=2))
    assert generate(model, [1, 2, 3], GenerationConfig(max_new_tokens=2, use_cache=False)).n_generated == 2


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt1", "tiny-alibi", "tiny-mistral"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_batched_generation_equals_one_by_one(name, use_cache):
    model = _model(name)
    prompts = [_prompt(11, seed=1), _prompt(3, seed=2), _prompt(7, seed=3)]
    config = GenerationConfig(max_new_tokens=10, use_cache=use_cache, **GREEDY)
    batched = generate_batch(model, prompts, config)
    alone = [generate(model, p, config) for p in prompts]
    assert [r.generated_ids for r in batched] == [r.generated_ids for r in alone]


def test_batched_rows_stop_independently_and_penalties_count_each_row():
    model = _model()
    prompts = [_prompt(8, seed=4), _prompt(2, seed=5)]
    first = generate(model, prompts[1], GenerationConfig(max_new_tokens=6, **GREEDY))
    eos = first.generated_ids[2]  # row 1 meets this token early
    config = GenerationConfig(
        max_new_tokens=6, eos_ids=(eos,), sampling=SamplingConfig(temperature=0, presence_penalty=0.7)
    )
    batched = generate_batch(model, prompts, config)
    assert [r.generated_ids for r in batched] == [generate(model, p, config).generated_ids for p in prompts]


def test_end_of_text_stops_and_is_kept_in_the_ids():
    model, prompt = _model(), _prompt(5)
    free = generate(model, prompt, GenerationConfig(max_new_tokens=8, **GREEDY)).generated_ids
    eos = free[3]
    result = generate(model, prompt, GenerationConfig(max_new_tokens=8, eos_ids=(eos,)))
    assert result.generated_ids == free[: free.index(eos) + 1] and result.stop_reason == "eos"


def _chars() -> CharTokenizer:
    return CharTokenizer("".join(chr(32 + i) for i in range(95)))  # 95 chars + end-of-text = 96


def test_stop_strings_spanning_tokens_cut_the_text_at_the_first_completed_one():
    model, tok = _model(), _chars()
    prompt = tok.encode("Once upon")
    free = generate(model, prompt, GenerationConfig(max_new_tokens=20, **GREEDY), tok)
    assert free.text == tok.decode(free.generated_ids)
    stop = free.text[5:8]  # three characters: spans three tokens
    later = free.text[12:14]
    config = GenerationConfig(max_new_tokens=20, stop=(later, stop), **GREEDY)
    result = generate(model, prompt, config, tok)
    # oracle: the first prefix (characters = tokens here) containing a stop string, cut there
    n = next(n for n in range(len(free.text) + 1) if stop in free.text[:n] or later in free.text[:n])
    index, first = min((free.text[:n].find(s), s) for s in (later, stop) if s in free.text[:n])
    assert result.text == free.text[:index]
    assert result.generated_ids == free.generated_ids[:n]
    assert (result.stop_reason, result.stop_string) == ("stop_string", first)


def test_stream_yields_each_token_as_it_is_made_and_matches_the_result():
    model, tok = _model(), _chars()
    config = GenerationConfig(max_new_tokens=12, stop=("~~~",), **GREEDY)
    run = stream(model, tok.encode("abc"), config, tok)
    pieces = list(run)
    assert [p.token_id for p in pieces] == run.result.generated_ids
    assert "".join(p.text for p in pieces) == run.result.text
    partial = stream(model, tok.encode("abc"), config, tok)
    first = next(iter(partial))  # available before the rest exists
    assert first.token_id == run.result.generated_ids[0] and partial.result is None


def test_byte_tokens_stream_to_the_same_text_as_decoding_all_at_once():
    class Bytes:
        eos_id = None

        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    model, tok = _model(vocab_size=256), Bytes()
    prompt = list("é€".encode())
    run = stream(model, prompt, GenerationConfig(max_new_tokens=24, **GREEDY), tok)
    pieces = [p.text for p in run]
    assert "".join(pieces) == run.result.text == tok.decode(run.result.generated_ids)


def test_seed_reproduces_a_sample():
    model, prompt = _model(), _prompt(4)
    sampling = SamplingConfig(temperature=1.5, top_p=0.95)
    runs = [
        generate(model, prompt, GenerationConfig(max_new_tokens=12, sampling=sampling, seed=s, **GREEDY))
        for s in (3, 3, 4)
    ]
    assert runs[0].generated_ids == runs[1].generated_ids != runs[2].generated_ids


@pytest.mark.parametrize(
    "sampling", [SamplingConfig(top_k=1), SamplingConfig(top_p=1e-6), SamplingConfig(temperature=1e-5)]
)
def test_degenerate_sampling_equals_greedy(sampling):
    model, prompt = _model(), _prompt(6)
    greedy = generate(model, prompt, GenerationConfig(max_new_tokens=10, **GREEDY))
    config = GenerationConfig(max_new_tokens=10, sampling=sampling, seed=0, **GREEDY)
    sampled = generate(model, prompt, config)
    assert sampled.generated_ids == greedy.generated_ids


def test_presence_penalty_forbids_repeats():
    model, prompt = _model(), _prompt(6)
    config = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=0, presence_penalty=1e6))
    ids = generate(model, prompt, config).generated_ids
    assert len(set(ids)) == len(ids) and not set(ids) & set(prompt)


def test_a_too_long_prompt_is_an_error_unless_truncated():
    model = _model()  # context_length 32
    prompt = _prompt(40)
    with pytest.raises(ValueError, match="truncate"):
        generate(model, prompt, GenerationConfig(max_new_tokens=4))
    result = generate(model, prompt, GenerationConfig(max_new_tokens=4, truncate=True, **GREEDY))
    assert result.prompt_ids == prompt[-28:] and result.truncated_tokens == 12
    assert result.generated_ids == _naive_greedy(model, prompt[-28:], 4)


def test_at_the_end_of_the_window_generation_stops_with_a_reason():
    model, prompt = _model(), _prompt(20)
    result = generate(model, prompt, GenerationConfig(max_new_tokens=50, **GREEDY))
    # positions 20..31 take the fed tokens; the last one's prediction has no position left
    assert result.stop_reason == "context_full" and result.n_generated == 32 - 20 + 1
    assert result.generated_ids == _naive_greedy(model, prompt, 13)


def test_result_serializes_with_the_documented_fields():
    model, tok = _model(), _chars()
    result = generate(model, tok.encode("hi"), GenerationConfig(max_new_tokens=3, **GREEDY), tok)
    data = json.loads(json.dumps(result.to_dict()))
    for key in ("prompt_ids", "generated_ids", "text", "n_generated", "prefill_tokens_per_second",
                "decode_tokens_per_second", "stop_reason"):
        assert key in data
    assert data["n_generated"] == 3 and data["decode_tokens_per_second"] > 0


@pytest.mark.parametrize(
    "changes", [dict(max_new_tokens=0), dict(beams=0), dict(overflow="wrap"), dict(stop="END")]
)
def test_config_rejects_bad_values(changes):
    with pytest.raises(ValueError, match=next(iter(changes))):
        GenerationConfig(**changes)


def _checkpoint(tmp_path, model: Transformer):
    from glassformer.formats.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path / "ckpt", model, _chars(), {})


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_cli_json_reports_the_same_generation_as_the_library(tmp_path, capsys, kv_dtype):
    from glassformer.cli import main

    model = _model()
    folder = _checkpoint(tmp_path, model)
    status = main(["generate", "--model", str(folder), "Hello", "-n", "6", "--ignore-eos", "--json",
                   "--kv-dtype", kv_dtype])
    data = json.loads(capsys.readouterr().out)
    config = GenerationConfig(max_new_tokens=6, kv_dtype=kv_dtype, **GREEDY)
    expected = generate(model, _chars().encode("Hello"), config, _chars())
    assert status == 0
    assert (data["generated_ids"], data["text"]) == (expected.generated_ids, expected.text)
    assert data["n_generated"] == 6 and data["stop_reason"] == "max_new_tokens"


def test_cli_streams_text_and_reports_mistakes_in_one_line(tmp_path, capsys):
    from glassformer.cli import main

    folder = _checkpoint(tmp_path, _model())
    sampled = ["-n", "4", "--temperature", "0.9", "--seed", "1"]
    assert main(["generate", "--model", str(folder), "Hi", *sampled]) == 0
    out = capsys.readouterr()
    assert out.out.endswith("\n") and "stop:" in out.err
    assert main(["generate", "--model", str(folder), "x" * 40]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glassformer: error: prompt:") and "--truncate" in err and err.count("\n") == 1
