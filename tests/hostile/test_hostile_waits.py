"""Every long wait says what it waits for, in one line on stderr before it begins: a weight
conversion, a tokenizer trained, a KV pool taken whole, a compile. Short ones stay quiet, and
a refusal stays one line."""

from __future__ import annotations

import io
import sys

import torch
from hostile_helpers import CHARS

from glassformer import ModelConfig, Transformer
from glassformer.accel.quantize import quantize_model
from glassformer.cli import main
from glassformer.cli.waits import announce_engine
from glassformer.formats.checkpoint import write_checkpoint
from glassformer.formats.sources import ANNOUNCED_PARAMETERS
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.language_model import load
from glassformer.serving import EngineConfig


def test_a_conversion_of_ten_million_weights_is_announced_a_small_one_is_not(tmp_path):
    config = ModelConfig(vocab_size=96, context_length=32, d_model=512, n_layers=4, n_heads=8)
    torch.manual_seed(0)
    model = Transformer(config)
    assert sum(p.numel() for p in model.parameters()) >= ANNOUNCED_PARAMETERS
    folder = write_checkpoint(tmp_path / "model", model, CharTokenizer(CHARS), {})
    said: list[str] = []
    load(folder, quantize="int8", announce=said.append)
    assert said == [f"converting the weights of {folder} (int8) for the fused decode step"]
    small = write_checkpoint(tmp_path / "small", Transformer(config.replace(d_model=32, n_heads=2)),
                             CharTokenizer(CHARS), {})
    load(small, quantize="int8", announce=said.append)
    assert len(said) == 1


def test_a_bpe_tokenizer_trained_is_announced(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text("to be or not to be, that is the question\n" * 60)
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--preset", "tiny-llama",
                 "--tokenizer", "bpe", "--vocab-size", "300", "--max-iters", "1", "--no-progress",
                 "--eval-iters", "1", "--batch-size", "2", "--sample-tokens", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "glassformer: training a BPE tokenizer of up to 300 tokens on the text" in err


def test_a_pool_taken_whole_and_a_compile_are_announced(capsys):
    announce_engine(EngineConfig(kv_memory_mb=64), "cpu")  # grown as used: no wait
    assert capsys.readouterr().err == ""
    announce_engine(EngineConfig(kv_memory_mb=64, compile=True), "cpu")
    assert capsys.readouterr().err.splitlines() == [
        "glassformer: taking the KV pool's 64 MiB on cpu at once",
        "glassformer: compiling the engine's decode step (torch.compile), once for each batch size as "
        "it first comes: the first steps wait for it"]
    announce_engine(EngineConfig(kv_memory_mb=64), "cuda:0")
    assert len(capsys.readouterr().err.splitlines()) == 1


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_conversion_counts_its_layers_on_a_terminal_and_stays_quiet_elsewhere(monkeypatch):
    config = ModelConfig(vocab_size=96, context_length=32, d_model=32, n_layers=2, n_heads=2)
    for stderr, bar in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stderr)
        quantize_model(Transformer(config), "int8")
        layers = len(Transformer(config).linear_layers())
        assert (f"converting layers to int8:   0%|          | 0/{layers} [" in stderr.getvalue()) is bar
