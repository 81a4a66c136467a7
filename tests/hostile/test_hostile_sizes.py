"""Sizes checked before anything is allocated: every numeric flag of generate, serve and train
that sizes memory, and every size key of a config.json, set to 10¹², is refused within 5 s
in one line naming it; the numeric flags that size nothing are listed with why, so a new flag
is classified before it ships."""

from __future__ import annotations

import argparse
import json
import shutil
import time

import pytest
from hostile_helpers import checkpoint_folder, hf_folder

from glassformer.cli import build_parser
from glassformer.generation.config import RequestParams
from glassformer.serving.block_manager import BlockManager
from glassformer.serving.sequence import Sequence

HUGE = str(10**12)

# (command, its flag): how the command is run around the flag
SIZES = {
    "generate": ["--kv-memory-mb", "--block-size", "--max-batch", "--threads",
                 "--window", "--sink-tokens"],
    "serve": ["--kv-memory-mb", "--block-size", "--max-batch", "--threads",
              "--window", "--sink-tokens", "--port", "--max-body-kb", "--max-capture-mb"],
    "train": ["--context-length", "--d-model", "--n-layers", "--n-heads", "--n-kv-heads", "--d-head",
              "--d-ff", "--rotary-dim", "--n-token-types", "--batch-size", "--grad-accum", "--threads"],
}
# Numeric flags that size no memory: a value, a budget or a limit checked where it is used.
NOT_SIZES = {
    "generate": {"--temperature", "--top-p", "--min-p", "--repetition-penalty", "--presence-penalty",
                 "--frequency-penalty", "--length-penalty", "--seed", "--rope-factor",
                 "--max-new-tokens",  # cut at the window (stop reason context_full)
                 "--top-k", "--beams",  # at most the vocabulary's tokens are ranked
                 "--chunk-tokens",  # a document's chunks are at most the document
                 "--token-budget"},  # a ceiling: a step takes the tokens its requests have
    "serve": {"--max-queue", "--max-request-tokens", "--token-budget",  # limits on what requests ask
              "--body-timeout", "--header-timeout", "--timeout", "--grace",  # seconds
              "--replicas"},  # Ray's to place
    "train": {"--rope-theta", "--rope-factor", "--rope-original-context", "--rope-low-freq-factor",
              "--rope-high-freq-factor", "--rope-beta-fast", "--rope-beta-slow",
              "--rope-attention-factor", "--norm-eps", "--dropout", "--init-std", "--decoder-start-id",
              "--norm-weight-offset", "--attn-softcap", "--final-softcap", "--attn-scale",
              "--rope-local-theta", "--lr", "--min-lr", "--weight-decay", "--muon-lr",
              "--muon-momentum", "--beta1", "--beta2", "--grad-clip", "--val-fraction", "--seed",
              "--lora-alpha", "--lora-dropout",
              "--max-iters", "--max-time", "--warmup-iters", "--lr-decay-iters", "--eval-interval",
              "--eval-iters", "--log-interval", "--sample-tokens",  # budgets and schedules
              "--sliding-window", "--relative-max-distance",  # a reach, not a table
              "--relative-buckets",  # T5's table: refused by the weights' check with position=relative
              "--n-encoder-layers",  # an encoder-decoder: refused with the objective clm
              "--vocab-size",  # the tokenizer learns at most what the text holds
              "--lora-rank"},  # needs --init; checked against the pretrained model's sizes
}


def _numeric_flags(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.option_strings[-1] for a in sub.choices[command]._actions if a.option_strings
            and a.type is not None and getattr(a.type, "__name__", "") not in
            ("str", "device", "lora_spec", "tuple", "_parse", "parse") and a.nargs is None}


@pytest.mark.parametrize("command", sorted(SIZES))
def test_every_numeric_flag_is_classified(command):
    flags = _numeric_flags(command)
    assert flags - set(SIZES[command]) - NOT_SIZES[command] == set()
    assert set(SIZES[command]) & NOT_SIZES[command] == set()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sizes")
    model = checkpoint_folder(root / "model")
    (root / "p.jsonl").write_text('{"prompt": "hello"}\n')
    (root / "text.txt").write_text("to be or not to be, that is the question\n" * 60)
    return root, model


def _argv(command: str, flag: str, root, model) -> list[str]:
    context = ["--context", "sink", "--window", "8"] if flag in ("--window", "--sink-tokens") else []
    if command == "generate":
        return ["generate", "--model", model, "--prompts-file", root / "p.jsonl", *context, flag, HUGE]
    if command == "serve":
        return ["serve", "--model", model, "--port", "0", *context, flag, HUGE]
    return ["train", "--data", root / "text.txt", "--out", root / f"run{flag}", "--preset", "tiny-llama",
            "--max-iters", "1", "--no-progress", flag, HUGE]


@pytest.mark.parametrize("command, flag", [(c, f) for c, flags in SIZES.items() for f in flags])
def test_a_size_of_10_12_is_refused_at_once_naming_the_flag(command, flag, folders, refused):
    root, model = folders
    refused(_argv(command, flag, root, model), flag, root, seconds=5)


HF_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("hf") / "llama")


@pytest.mark.parametrize("key", HF_SIZES)
def test_a_config_json_size_of_10_12_is_refused_naming_the_key_and_file(key, hf_model, tmp_path, refused):
    folder = tmp_path / "model"
    shutil.copytree(hf_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {key: 10**12}))
    line = refused(["generate", "--model", folder, "-n", "1", "hi"], f"error: {key}: ", folder, seconds=5)
    assert line.endswith(f"in {folder / 'config.json'})")


def test_a_vocabulary_the_tensors_do_not_have_is_refused_before_the_weights_are_built(
        hf_model, tmp_path, refused):
    """config.json's vocab_size against the file's token table (300 rows), on a model without
    memory: the refusal names the tensor and the file."""
    folder = tmp_path / "model"
    shutil.copytree(hf_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": 4_000_000}))
    line = refused(["generate", "--model", folder, "-n", "1", "hi"], "embed_tokens.weight", folder, seconds=5)
    assert "(300, 32)" in line and "config.json" in line


def test_the_block_manager_takes_no_memory_for_blocks_never_used():
    start = time.perf_counter()
    blocks = BlockManager(10**12, 16)
    seq = Sequence(list(range(40)), RequestParams(), vocab_size=100)
    assert blocks.grow(seq, 40) == [] and seq.block_table == [0, 1, 2]
    assert blocks.free_count == 10**12 - 3 and len(blocks.blocks) == 3
    blocks.release(seq)
    assert blocks.free_count == 10**12 and time.perf_counter() - start < 1


@pytest.mark.parametrize("flags, smallest", [
    (["--kv-memory-mb", "0.001"], "0.002 MiB"),  # a block: 2 x 16 tokens x 2 heads x 8 x 4 bytes
    (["--block-size", "100000", "--kv-memory-mb", "1"], "12.208 MiB"),
])
def test_a_pool_too_small_for_one_block_names_both_flags_and_the_smallest_pool(
        flags, smallest, folders, refused):
    root, model = folders
    line = refused(["generate", "--model", model, "--prompts-file", root / "p.jsonl", *flags],
                   "--kv-memory-mb", root, seconds=5)
    assert "--block-size" in line and f"smallest pool that works is {smallest}" in line


@pytest.mark.parametrize("key", ["vocab_size", "context_length", "d_model", "n_layers", "d_ff",
                                 "n_token_types"])
def test_a_checkpoint_config_size_of_10_12_is_refused_before_the_model_is_built(key, folders, tmp_path,
                                                                                refused):
    folder = tmp_path / "model"
    shutil.copytree(folders[1], folder)
    meta = json.loads((folder / "config.json").read_text())
    meta["model"][key] = 10**12
    (folder / "config.json").write_text(json.dumps(meta))
    refused(["generate", "--model", folder, "-n", "1", "hi"], f"{folder / 'config.json'}: {key}: ", folder,
            seconds=5)
