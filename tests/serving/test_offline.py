"""Offline batches: LanguageModel.generate_many and `glassformer generate --prompts-file`."""

import json

import pytest

from glassformer import LanguageModel
from glassformer.cli import main
from glassformer.formats import checkpoint
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.serving import RequestParams

TOKENIZER = CharTokenizer("abcdefghij klmnopqrstuvwxyz.")


@pytest.fixture
def lm(tiny):
    return LanguageModel(tiny(vocab_size=TOKENIZER.vocab_size), TOKENIZER)


def test_generate_many_equals_generate_in_prompt_order(lm):
    texts = ["the cat", "a dog sat on", "x"]
    many = lm.generate_many(texts, max_new_tokens=8, eos_ids=())
    for text, result in zip(texts, many, strict=True):
        alone = lm.generate(text, max_new_tokens=8, eos_ids=())
        assert result.generated_ids == alone.generated_ids and result.text == alone.text


def test_generate_many_takes_settings_per_prompt_and_reports_each(lm):
    params = [RequestParams.from_fields(max_new_tokens=n, eos_ids=()) for n in (3, 5)]
    seen = []
    results = lm.generate_many(["ab", "cd"], params=params, on_result=lambda i, r: seen.append(i))
    assert [r.n_generated for r in results] == [3, 5] and sorted(seen) == [0, 1]
    with pytest.raises(ValueError, match="params"):
        lm.generate_many(["ab"], params=params)
    with pytest.raises(ValueError, match="colour: unknown setting"):
        RequestParams.from_fields(colour=1)


def test_cli_prompts_file_prints_a_line_per_request_and_a_summary(lm, tmp_path, capsys):
    checkpoint.save_to_run(tmp_path / "run", 1, ("latest",), lm.model, TOKENIZER, {})
    lines = [{"prompt": "the cat", "max_new_tokens": 4},
             {"prompt": "a dog", "temperature": 0.8, "seed": 3, "stop": "zz"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    model = str(tmp_path / "run")
    assert main(["generate", "--model", model, "--prompts-file", str(path), "-n", "6", "--ignore-eos"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert len(out) == 3
    assert out[0]["n_generated"] == 4 and out[1]["n_generated"] == 6
    assert out[0]["generated_ids"] == lm.generate("the cat", max_new_tokens=4, eos_ids=()).generated_ids
    assert {"prompt_ids", "text", "stop_reason", "decode_tokens_per_second"} <= set(out[0])
    summary = out[2]
    assert summary["requests"] == 2 and summary["total_tokens_per_second"] > 0
    assert 0 <= summary["ttft_p50"] <= summary["ttft_p95"] and summary["peak_rss_mb"] > 0
    path.write_text('{"prompt": "ab", "colour": 1}\n', encoding="utf-8")
    assert main(["generate", "--model", model, "--prompts-file", str(path)]) == 2
    assert "prompts.jsonl:1: colour: unknown setting" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", model, "--prompts-file", str(path)]) == 2
