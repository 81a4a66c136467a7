"""Every shell and Python example in the README and the guides (docs/guides/*.md) runs.

Each document's examples run in order in a scratch folder that holds what they name: the
corpus at glassformer/data/tinyshakespeare.txt (an excerpt), corpus/, held_out.txt,
CHECKPOINT_FOLDER (a tiny checkpoint), t5-folder/ and bert-folder/ (tiny Hugging Face
folders). Commands run as written plus the small settings in SMALL (fewer training steps,
fewer new tokens); those that name SmolLM2 run on the real model, in the slow tests. Every
`glassformer` command line, including those not run here (SKIPPED, with the test that runs
them), must parse."""

from __future__ import annotations

import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from glassformer import Transformer, get_preset
from glassformer.cli import build_parser, main
from glassformer.data import tinyshakespeare
from glassformer.formats import checkpoint
from glassformer.formats.tokenizers import CharTokenizer

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)

# (the start of an example, why it is not run here and what runs it instead)
SKIPPED = (
    ("bash scripts/", "installs into .venv: CI runs scripts/test.sh; tests/cli/test_main_script.py"),
    (".venv/bin/", "installs packages or serves the site: tests/test_docs.py builds it"),
    ("torchrun ", "several processes: tests/training/test_ddp.py"),
    ("glassformer serve ", "a server that runs until stopped: tests/serving/api/test_serve_command.py"),
    ("glassformer experiment ", "a 10-minute budget: tests/experiments/test_experiment_command.py"),
    ("glassformer compare --model smollm2", "transformers reads the GGUF for most of a minute: "
                                            "tests/interpret/test_compare.py"),
    ("glassformer export --model smollm2", "writes 540 MB: tests/formats/test_export_bert.py"),
    ("from openai import", "a client of a running server: tests/serving/api"),
    ("curl ", "a client of a running server: tests/serving/api calls the same routes"),
)
# What each command is given beyond the example, to stay small (later flags win).
SMALL = {
    "train": ["--eval-interval", "2", "--eval-iters", "1", "--batch-size", "2", "--context-length", "32",
              "--sample-tokens", "0", "--no-progress"],
    "generate": ["-n", "4"],
    "chat": ["-n", "8"],
    "journey": ["--ig-steps", "1", "--force"],
}


@dataclass(frozen=True)
class Example:
    doc: str
    line: int
    kind: str  # "bash": one command line; "python": one block
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def smollm2(self) -> bool:
        return "smollm2" in self.text or (self.text.startswith("glassformer chat")
                                          and "--model" not in self.text)

    @property
    def skipped(self) -> str | None:
        return next((why for start, why in SKIPPED if self.text.startswith(start)), None)

    def argv(self) -> list[str] | None:
        """The `glassformer` command's arguments (after `-m glassformer` under torchrun)."""
        words = shlex.split(self.text, comments=True)
        if words[:1] == ["glassformer"]:
            return words[1:]
        if "glassformer" in words and words[words.index("glassformer") - 1] == "-m":
            return words[words.index("glassformer") + 1:]
        return None


def examples(path: Path) -> list[Example]:
    text, found = path.read_text(encoding="utf-8"), []
    for fence in FENCE.finditer(text):
        line = text[:fence.start()].count("\n") + 2
        if fence.group(1) == "python":
            found.append(Example(path.name, line, "python", fence.group(2)))
            continue
        for number, command in enumerate(fence.group(2).replace("\\\n", " ").splitlines(), line):
            if command.strip() and not command.lstrip().startswith("#"):
                found.append(Example(path.name, number, "bash", command.strip()))
    return found


ALL = [e for doc in DOCS for e in examples(doc)]


def test_every_documented_command_parses():
    commands = [(e, e.argv()) for e in ALL if e.kind == "bash" and e.argv() is not None]
    assert len(commands) > 30
    for example, argv in commands:
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{example.where}: {example.text!r} does not parse")


def test_the_docs_hold_examples_of_every_kind():
    assert {e.kind for e in ALL} == {"bash", "python"}
    assert any(e.smollm2 for e in ALL) and any(not e.smollm2 and not e.skipped for e in ALL)


def _scratch(tmp_path: Path, names: str) -> Path:
    """The folder the examples run in, with what `names` (the document) mentions."""
    repo = tmp_path / "repo"
    data = repo / "glassformer" / "data"
    data.mkdir(parents=True)
    text = tinyshakespeare().read_text(encoding="utf-8")[:40_000]
    (data / "tinyshakespeare.txt").write_text(text, encoding="utf-8")
    (repo / "held_out.txt").write_text(text[-3000:], encoding="utf-8")
    (repo / "corpus").mkdir()
    for i in range(2):
        (repo / "corpus" / f"part{i}.txt").write_text(text[i * 15_000:(i + 1) * 15_000], encoding="utf-8")
    if "CHECKPOINT_FOLDER" in names:
        tokenizer = CharTokenizer("".join(sorted(set(text))))
        torch.manual_seed(0)
        model = Transformer(get_preset("tiny-llama").replace(vocab_size=tokenizer.vocab_size)).eval()
        checkpoint.save_to_run(repo / "CHECKPOINT_FOLDER", 1, ("latest",), model, tokenizer, {})
    if "t5-folder/" in names:
        from glassformer.formats.export import export_hf
        from glassformer.formats.tokenizers import HFTokenizer
        from glassformer.model.encoder_decoder import EncoderDecoder

        torch.manual_seed(0)
        tokenizer = HFTokenizer.train_bpe([text[:5000]], 300)
        export_hf(EncoderDecoder(get_preset("tiny-t5").replace(vocab_size=tokenizer.vocab_size,
                                                               context_length=128)),
                  tokenizer, repo / "t5-folder")
    if "bert-folder/" in names:
        from bert_folder import save_bert

        save_bert(repo / "bert-folder")
    return repo


def _run(example: Example, namespace: dict, capsys) -> None:
    if example.kind == "python":
        exec(compile(example.text, example.where, "exec"), namespace)
        return
    argv = example.argv()
    assert argv is not None, f"{example.where}: not a glassformer command: {example.text!r}"
    small = SMALL.get(argv[0], [])
    if argv[0] == "train":
        small = [*small, "--max-iters", "4" if "--resume" in argv else "2"]
    stdin = sys.stdin
    sys.stdin = io.StringIO("Hello\n/exit\n")  # chat reads lines until /exit
    try:
        code = main([*argv, *small])
    finally:
        sys.stdin = stdin
    err = capsys.readouterr().err
    assert code == 0, f"{example.where}: {example.text!r} exited {code}: {err[-2000:]}"


def _run_all(doc: str, smollm2: bool, tmp_path, monkeypatch, capsys) -> None:
    chosen = [e for e in ALL if e.doc == doc and e.smollm2 == smollm2 and not e.skipped]
    if not chosen:
        pytest.skip(f"{doc}: no examples of this kind")
    path = next(d for d in DOCS if d.name == doc)
    monkeypatch.chdir(_scratch(tmp_path, path.read_text(encoding="utf-8")))
    namespace: dict = {}
    for example in chosen:
        _run(example, namespace, capsys)


@pytest.mark.parametrize("doc", [d.name for d in DOCS])
def test_examples_run_on_tiny_models(doc, tmp_path, monkeypatch, capsys):
    _run_all(doc, False, tmp_path, monkeypatch, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("doc", sorted({e.doc for e in ALL if e.smollm2 and not e.skipped}))
def test_smollm2_examples_run(doc, smollm2_path, tmp_path, monkeypatch, capsys):
    _run_all(doc, True, tmp_path, monkeypatch, capsys)
