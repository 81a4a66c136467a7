"""Glassformer -> a Hugging Face model folder that `transformers` loads (the reverse of huggingface.py).

The family is the registry's (families.written_as: the most specific family that claims the
config), and its entry writes the config.json, refusing with the field that stops it what
its files cannot say; its key map places the tensors. The folder is written whole beside its
destination and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..model.config import ModelConfig
from ..model.encoder_decoder import EncoderDecoder
from ..model.transformer import Transformer
from .families import written_as
from .tokenizers import HFTokenizer
from .validate import check_model_finite

_BERT_SPECIALS = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                  "unk_token": "[UNK]"}


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config.json for a Glassformer config."""
    return written_as(config).write(config)


def export_hf(model: Transformer | EncoderDecoder, tokenizer: Any, folder: str | Path) -> Path:
    """Write config.json, model.safetensors and (for tokenizers.json-based tokenizers) the
    tokenizer files into a new folder (a non-finite weight is refused by name); returns it."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is not a folder")
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty")
    check_model_finite(model, "model")  # never a folder the loaders would refuse
    config = model.config
    hf = hf_config(config)
    ours = model.state_dict()
    tensors = {}
    for e in written_as(config).keys(config):
        t = ours[e.ours] if e.rows is None else ours[e.ours][e.rows[0]:e.rows[1]]
        if e.order is not None:  # theirs = ours[argsort(order)]
            t = t[torch.tensor(e.order).argsort()]
        tensors[e.hf] = (t.T if e.transpose else t).detach().to("cpu").contiguous()
    if isinstance(tokenizer, HFTokenizer):
        hf |= {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
        hf |= {f"{name}_id": vocab[token] for name, token in getattr(tokenizer, "specials", {}).items()
               if token in vocab}  # pad_token_id, unk_token_id
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if isinstance(tokenizer, HFTokenizer):
            _save_tokenizer(tokenizer, tmp)
        if folder.exists():
            folder.rmdir()
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _save_tokenizer(tokenizer: HFTokenizer, folder: Path) -> None:
    tokenizer.save(folder / "tokenizer.json")  # a ChatTokenizer also writes tokenizer_config.json
    side = folder / "tokenizer_config.json"
    config = json.loads(side.read_text()) if side.is_file() else {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token}
    if tokenizer.mask_token is not None:  # an encoder's: the mask and BERT's other specials
        vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
        config |= {"mask_token": tokenizer.mask_token}
        config |= {key: token for key, token in _BERT_SPECIALS.items() if token in vocab}
    side.write_text(json.dumps(config, indent=2) + "\n")
