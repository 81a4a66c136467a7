import json

import pytest
import torch

from glassformer import Transformer
from glassformer.cli import main
from glassformer.formats import checkpoint
from glassformer.formats.tokenizers import HFTokenizer
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.generation.retrieval import retrieve
from glassformer.model.presets import get_preset

WORDS = "the quick brown fox jumps over a lazy dog while the cat sat on a warm mat"
NEEDLE = "The secret number of Verona is 4821."
QUESTION = "What is the secret number of Verona?"


@pytest.fixture
def run(tmp_path):
    tokenizer = HFTokenizer.train_bpe([WORDS, NEEDLE, QUESTION] * 9, 300)
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny-llama").replace(vocab_size=tokenizer.vocab_size,
                                                         init_std=0.3)).eval()
    checkpoint.save_to_run(tmp_path / "run", 1, ("latest",), model, tokenizer, {"train": {"lr": 0.01}})
    document = tmp_path / "document.txt"
    document.write_text(" ".join([WORDS] * 30 + [NEEDLE] + [WORDS] * 30), encoding="utf-8")
    return tmp_path / "run", model, tokenizer, document


def test_retrieve_puts_the_best_chunks_that_fit_before_the_question(run, capsys):
    folder, model, tokenizer, document = run
    window = model.config.context_length
    assert len(tokenizer.encode(document.read_text())) > 4 * window
    args = ["generate", "--model", str(folder), "--prompt-file", str(document), "--context", "retrieve",
            "--question", QUESTION, "--ranking", "bm25", "--chunk-tokens", "16", "-n", "4", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["prompt_ids"]) <= window - 4
    text = tokenizer.decode(result["prompt_ids"])
    assert text.endswith(f"\n\n{QUESTION}") and NEEDLE in text
    expected = retrieve(model, tokenizer, document.read_text(), QUESTION,
                        lambda c: tokenizer.encode(f"{c}\n\n{QUESTION}" if c else QUESTION),
                        window - 4, 16, "bm25")
    assert result["prompt_ids"] == expected.ids
    reference = generate(model, expected.ids, GenerationConfig(max_new_tokens=4), tokenizer)
    assert result["generated_ids"] == reference.generated_ids


@pytest.mark.parametrize("extra, message", [
    (["--context", "retrieve"], "--question: give it with --context retrieve"),
    (["--question", "why?"], "--question: give it with --context retrieve"),
    (["--context", "retrieve", "--question", "why?", "-n", "100000"], "limit:"),
    (["--context", "retrieve", "--question", "why?", "-n", "4"], "--chunk-tokens: 256 exceed the"),
])
def test_mistakes_are_one_line(run, capsys, extra, message):
    folder, _, _, document = run
    assert main(["generate", "--model", str(folder), "--prompt-file", str(document), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
