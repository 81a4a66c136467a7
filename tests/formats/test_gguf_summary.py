"""A GGUF file summarized from its header (`glassformer info`): what keep_blocks does with each
tensor, against what load_gguf(keep_blocks=True) does with the same file (the oracle); the
tokenizer's kind, pre-tokenizer and BOS rule; no tensor's data read."""

from __future__ import annotations

import numpy as np
import pytest
from test_loaders_gguf import CONFIG, Q, hf_weights, write_gguf

from glassformer.accel.quantized_embedding import QuantizedEmbedding
from glassformer.formats.gguf import load_gguf, tensor_map
from glassformer.formats.gguf_file import GGUFFile
from glassformer.formats.gguf_summary import FLOAT32, KEPT, summarize_gguf
from glassformer.model.transformer import Transformer

pytestmark = pytest.mark.filterwarnings("ignore::glassformer.formats.validate.WeightWarning")  # random Q6_K
# Q8_0 matrices, except: a layer with a type no kernel reads (Q2_K), a layer mixing two kept
# types (kept part by part), a K-quant, a float head, a Q4_1 table
OVERRIDES = {"blk.0.attn_k.weight": Q.Q2_K, "blk.1.attn_v.weight": Q.Q4_0,
             "blk.1.ffn_down.weight": Q.Q6_K, "output.weight": Q.F16, "token_embd.weight": Q.Q4_1}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = tmp_path_factory.mktemp("summary") / "mixed.gguf"
    write_gguf(path, hf_weights(Transformer(CONFIG)), Q.Q8_0, overrides=OVERRIDES)
    return path


def test_each_tensor_as_keep_blocks_takes_it(mixed):
    from glassformer.accel import QuantizedLinear
    from glassformer.accel.stacked_linear import StackedLinear

    summary = summarize_gguf(mixed)
    model, _ = load_gguf(mixed, keep_blocks=True)  # the oracle: what the loader does
    targets = tensor_map(model.config)
    kept = {name for name, target in targets.items()
            if isinstance(model.get_submodule(target.param.rsplit(".", 1)[0]),
                          (QuantizedLinear, StackedLinear))}
    if isinstance(model.embed.tokens, QuantizedEmbedding):
        kept.add("token_embd.weight")
    by_name = {t["name"]: t for t in summary.tensors}
    assert set(by_name) == set(targets)
    assert {n for n, t in by_name.items() if t["quantize_gguf"] == KEPT} == kept
    assert kept >= {"blk.0.attn_output.weight", "blk.1.attn_q.weight", "blk.1.attn_v.weight",
                    "blk.1.ffn_down.weight"}  # a test that can fail
    with GGUFFile(mixed) as file:
        for name, tensor in by_name.items():
            info = file.tensors[name]
            assert (tensor["type"], tuple(tensor["shape"]), tensor["bytes"]) == (
                info.qtype.name, info.shape, info.n_bytes)
    why = {n: t["why"] for n, t in by_name.items() if t["quantize_gguf"] == FLOAT32}
    assert why["blk.0.attn_q.weight"] == why["blk.0.attn_v.weight"] == (
        "its layer blocks.0.attn.qkv also holds Q2_K, which no kernel reads")
    assert why["blk.0.attn_k.weight"].startswith("no kernel reads Q2_K blocks")
    assert why["output.weight"] == "F16 is a float type: no blocks to keep"
    assert why["blk.0.attn_norm.weight"] == "a vector (norm or bias): float32 on every path"
    assert "token_embd.weight" in kept


def test_tokenizer_and_config_from_the_header(mixed):
    summary = summarize_gguf(mixed)
    model, tokenizer = load_gguf(mixed)
    assert summary.config == model.config
    assert (summary.tokenizer_kind, summary.pre_tokenizer) == ("gpt2 (byte-level BPE)", "smollm")
    assert (summary.tokenizer.add_bos, summary.tokenizer.bos_id, summary.tokenizer.end_ids) == (
        tokenizer.add_bos, tokenizer.bos_id, tokenizer.end_ids)
    assert summary.tokenizer.encode("the lazy dog") == tokenizer.encode("the lazy dog")


def test_no_tensor_data_is_read(mixed, tmp_path):
    """Every byte after the header made NaN: the loader refuses the file, the summary is
    the same as before."""
    with GGUFFile(mixed) as file:
        start = min(info.offset for info in file.tensors.values())
    data = mixed.read_bytes()
    nans = np.full(-(-(len(data) - start) // 4), np.nan, np.float32).tobytes()
    spoiled = tmp_path / "spoiled.gguf"
    spoiled.write_bytes(data[:start] + nans[:len(data) - start])
    with pytest.raises(ValueError, match="non-finite"):
        load_gguf(spoiled)
    assert summarize_gguf(spoiled).tensors == summarize_gguf(mixed).tensors
