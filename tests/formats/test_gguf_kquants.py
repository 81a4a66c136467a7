"""GGUF files in K-quants and Q5_x loaded with keep_blocks: every matrix held in the file's own
blocks (no float32 copy), its weights those of the dequantizing load bit for bit, its logits
within the kernels' activation rounding of the float model's; a file mixing types in one
product the way llama.cpp's Q4_K_M does (q, k in Q4_K, v in Q6_K) keeps each part in its type
and runs the fused step, generation and the engine's rows alike (tests/fused_paths.py).

K-quant blocks are random but valid (gguf cannot quantize to them): random quants and
scales, fp16 factors small enough for weights of a trained model's size."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import test_loaders_gguf as files
import torch
from fused_paths import check_fused_step
from test_loaders_gguf import VOCAB, Q, hf_weights, write_gguf

from glassformer import Transformer
from glassformer.accel import QuantizedLinear, kquants
from glassformer.accel.quantized_embedding import QuantizedEmbedding
from glassformer.accel.stacked_linear import StackedLinear
from glassformer.formats.gguf import load_gguf
from glassformer.formats.gguf_file import GGUFFile

# each K-quant's fp16 fields (offset in its block) and their size, for weights of about 0.05
K_FIELDS = {Q.Q4_K: ((0, 2), 3e-4), Q.Q5_K: ((0, 2), 1.5e-4), Q.Q6_K: ((208,), 3e-5),
            Q.Q3_K: ((108,), 3e-4)}
KEPT = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.Q5_0, Q.Q5_1]
QUANTIZED = files.encode  # gguf's quantizer for the types it has


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    """Stored bytes of a tensor: 1-D norms stay F32; K-quants random valid blocks (above)."""
    if w.ndim == 1 or qtype not in K_FIELDS:
        return QUANTIZED(w, qtype, rng)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n, k = w.shape
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    fields, scale = K_FIELDS[qtype]
    for at in fields:
        values = (np.abs(rng.standard_normal((n, k // block))) * scale).astype(np.float16)
        raw[..., at:at + 2] = values.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1), qtype


@pytest.fixture
def kquant_files(monkeypatch):
    monkeypatch.setattr(files, "encode", encode)


@pytest.fixture(scope="module")
def source():
    torch.manual_seed(0)
    return hf_weights(Transformer(files.CONFIG))


def held_floats(model) -> list[str]:
    tensors = {id(t): (name, t) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    return [name for name, t in tensors.values() if t.dtype == torch.float32 and t.dim() > 1]


def check_same_model(exact, compact):
    """The kept model's weights are the dequantizing load's, bit for bit, its logits close."""
    for name, layer in compact.linear_layers().items():
        expected = exact.get_submodule(name).weight
        torch.testing.assert_close(layer.dequantized_weight(), expected, atol=0, rtol=0)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the kernels round activations to int8 per block: close only
        torch.testing.assert_close(compact(ids[:, :1]), exact(ids[:, :1]), atol=0.15, rtol=0.05)
        torch.testing.assert_close(compact(ids), exact(ids), atol=0.3, rtol=0.05)


@pytest.mark.filterwarnings("ignore::glassformer.formats.validate.WeightWarning")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("qtype", KEPT, ids=lambda q: q.name)
def test_blocks_kept_in_the_file_s_layout(kquant_files, source, tmp_path, qtype, tied):
    path = tmp_path / "k.gguf"
    write_gguf(path, source, qtype, omit=("output.weight",) if tied else ())
    exact, _ = load_gguf(path)
    compact, _ = load_gguf(path, keep_blocks=True)
    fmt = kquants.BY_TYPE[qtype.name]
    layers = compact.linear_layers()
    assert all(isinstance(layer, QuantizedLinear) and layer.mode == fmt for layer in layers.values())
    check_same_model(exact, compact)
    assert held_floats(compact) == []  # float32 holds norm gains and RoPE frequencies only
    tensors = {id(t): t for _, t in [*compact.named_parameters(), *compact.named_buffers()]}
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    stored = sum(info.n_bytes for info in GGUFFile(path).tensors.values())
    rope = compact.rope_inv_freq  # the one tensor not read from the file
    assert held <= stored + rope.numel() * rope.element_size()  # each block once, as stored
    table = compact.embed.tokens
    assert isinstance(table, QuantizedEmbedding)
    assert (table.qweight.data_ptr() == compact.lm_head.qweight.data_ptr()) == tied
    ids = torch.tensor([[5, 0, VOCAB - 1], [7, 7, 3]])
    torch.testing.assert_close(table(ids), exact.embed.tokens.weight[ids], atol=0, rtol=0)


# What llama-quantize's Q4_K_M writes for a small model: most matrices Q4_K, some v and down
# Q6_K (so one layer's q; k; v mixes types), the head Q6_K; a Q5_0 and a Q8_0 tensor as its
# fallbacks for rows that are no whole super-blocks write.
MIXED = {"blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K, "output.weight": Q.Q6_K,
         "blk.1.attn_k.weight": Q.Q5_0, "blk.1.ffn_up.weight": Q.Q8_0}


@pytest.mark.filterwarnings("ignore::glassformer.formats.validate.WeightWarning")
def test_a_q4_k_m_mix_keeps_each_part_in_its_type(kquant_files, source, tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, source, Q.Q4_K, overrides=MIXED)
    exact, _ = load_gguf(path)
    compact, _ = load_gguf(path, keep_blocks=True)
    qkv, up = compact.blocks[0].attn.qkv, compact.blocks[1].mlp.up
    assert isinstance(qkv, StackedLinear) and [p.mode for p in qkv.parts] == ["q4_k", "q6_k"]
    assert [p.out_features for p in qkv.parts] == [qkv.out_features - 128, 128]  # q; k, then v
    assert [p.mode for p in compact.blocks[1].attn.qkv.parts] == ["q4_k", "q5_0", "q4_k"]
    assert [p.mode for p in up.parts] == ["q4_k", "int8"]
    assert compact.blocks[0].mlp.down.mode == "q6_k" and compact.lm_head.mode == "q6_k"
    check_same_model(exact, compact)
    assert held_floats(compact) == []
    check_fused_step(lambda: load_gguf(path, keep_blocks=True)[0], [3, 1, 4, 1, 5, 9, 2, 6])
