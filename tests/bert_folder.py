"""A tiny random BertForMaskedLM built with transformers (the oracle) and saved as a Hugging
Face folder with a WordPiece tokenizer trained on tinyshakespeare, for the BERT tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from glassformer.data import tinyshakespeare

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = 400


def wordpiece() -> Tokenizer:
    text = tinyshakespeare().read_text(encoding="utf-8")[:200_000].split("\n\n")
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(text, trainers.WordPieceTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tokenizer


def save_bert(folder: Path, seed: int = 1, **config):
    """A random BertForMaskedLM (eval mode) saved into `folder` with its tokenizer."""
    import transformers

    torch.manual_seed(seed)
    fields = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=96, max_position_embeddings=64, initializer_range=0.2,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0) | config
    hf_config = transformers.BertConfig(**fields)
    hf_config._attn_implementation = "eager"
    model = transformers.BertForMaskedLM(hf_config).eval()
    model.save_pretrained(folder)
    wordpiece().save(str(folder / "tokenizer.json"))
    tokens = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
              "cls_token": "[CLS]", "mask_token": "[MASK]"}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64} | tokens))
    (folder / "special_tokens_map.json").write_text(json.dumps(tokens))
    return model
