"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically.

A checkpoint folder holds

    model.safetensors           the weights (a tied head is stored once); a LoRA run's
                                checkpoint holds its adapter instead (formats/peft.py's
                                adapter_config.json + adapter_model.safetensors)
    config.json                 {"model": ModelConfig.to_dict(), "train": {...}, "state": {...},
                                 "optimizer": {"param_groups": [...]}}
    tokenizer.json              see glassformer.tokenizers
    training_state.safetensors  optimizer moments and RNG states (only when training)

A training run folder keeps its checkpoints as `step-NNNNNNN/` folders and two symbolic links,
`latest` and `best`. A checkpoint is written whole into a temporary folder, every file is
fsynced, the folder is renamed into place, and only then is the link swapped (os.replace on a
link is atomic). A crash or Ctrl-C at any moment leaves the previous `latest` intact.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError

from ..errors import InputError
from ..model.config import ModelConfig
from ..model.encoder_decoder import build_model
from ..model.sizes import check_model_fits
from .chat_tokenizer import ChatTokenizer
from .files import read_json_object
from .tokenizers import load_tokenizer
from .validate import check_model

LINKS = ("latest", "best")
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors")  # a model, or a LoRA adapter


def has_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in WEIGHT_FILES)


def resolve(path: str | Path) -> Path:
    """The checkpoint folder `path` names: itself, or a run folder's `latest`."""
    path = Path(path)
    if has_weights(path):
        return path
    if has_weights(path / "latest"):
        return (path / "latest").resolve()
    raise FileNotFoundError(f"no glassformer checkpoint in {path} (expected model.safetensors)")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def optimizer_to_safe(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state_dict as (tensors for safetensors, JSON-able rest). No pickle."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_safe(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for key, value in meta["scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    groups = [
        {k: tuple(v) if k in ("betas", "ns_coefficients") else v for k, v in group.items()}
        for group in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def write_checkpoint(
    folder: str | Path,
    model: torch.nn.Module,
    tokenizer,
    meta: dict,
    optimizer: torch.optim.Optimizer | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    write_weights: Callable[[Path], None] | None = None,
) -> Path:
    """Write one complete checkpoint folder (created fresh; it must not exist yet).
    `write_weights(folder)` writes the weight files in place of model.safetensors (an adapter)."""
    folder = Path(folder)
    folder.mkdir(parents=True)
    if write_weights is None:
        safetensors.torch.save_model(model, str(folder / "model.safetensors"))
    else:
        write_weights(folder)
    meta = {**meta, "model": model.config.to_dict()}
    tensors = dict(extra_tensors or {})
    if optimizer is not None:
        opt_tensors, meta["optimizer"] = optimizer_to_safe(optimizer)
        tensors.update(opt_tensors)
    if tensors:
        safetensors.torch.save_file(tensors, str(folder / "training_state.safetensors"))
    _write_json(folder / "config.json", meta)
    tokenizer.save(folder / "tokenizer.json")
    for path in folder.iterdir():
        _fsync(path)
    _fsync(folder)
    return folder


def save_to_run(
    run_dir: str | Path,
    step: int,
    links: tuple[str, ...],
    model: torch.nn.Module,
    tokenizer,
    meta: dict,
    optimizer: torch.optim.Optimizer | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    write_weights: Callable[[Path], None] | None = None,
) -> Path:
    """Save the state at `step` as run_dir/step-NNNNNNN and point `links` (e.g. latest) at it.
    A checkpoint that one of `links` pointed to, and no link points to any more, is removed;
    step folders that no link pointed to before this save are never touched."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    final = run_dir / name
    if not (final.exists() and name in _linked(run_dir)):
        tmp = run_dir / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            write_checkpoint(tmp, model, tokenizer, meta, optimizer, extra_tensors, write_weights)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(final, ignore_errors=True)  # an unlinked leftover of an earlier crash
        os.replace(tmp, final)
        _fsync(run_dir)
    replaced = _linked(run_dir)
    for link in links:
        tmp_link = run_dir / f".{link}.tmp"
        tmp_link.unlink(missing_ok=True)
        os.symlink(name, tmp_link)
        os.replace(tmp_link, run_dir / link)
    _fsync(run_dir)
    for name in replaced - _linked(run_dir):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    return final


def _linked(run_dir: Path) -> set[str]:
    """The step folders the links name (plain names inside run_dir only)."""
    names = {os.readlink(run_dir / link) for link in LINKS if (run_dir / link).is_symlink()}
    return {n for n in names if n.startswith("step-") and "/" not in n}


RUN_FILES = ("latest", "best", "metrics.jsonl", "loss.png", "tokens.bin", "tokens.json")


def run_contents(out: Path) -> list[str]:
    """What a training run has left in `out`: step folders, links (broken ones too), files."""
    if not out.is_dir():
        return []
    names = [name for name in RUN_FILES if (out / name).exists() or (out / name).is_symlink()]
    return sorted(p.name for p in out.glob("step-*")) + names


def resume_source(out: Path) -> Path:
    """The checkpoint `latest` points to, or an error that says what is left instead."""
    latest = out / "latest"
    if has_weights(latest):
        return latest
    problem = "is a broken link" if latest.is_symlink() else "is missing"
    if not run_contents(out):
        raise FileNotFoundError(f"--resume: no checkpoint in {out}")
    best = out / "best"
    kept = f"; best still points to {os.readlink(best)}" if has_weights(best) else ""
    steps = sorted(p.name for p in out.glob("step-*"))
    raise FileNotFoundError(
        f"--resume: {latest} {problem}{kept} (step folders: {', '.join(steps) or 'none'}); "
        f"point it at one (ln -sfn STEP {latest}) to resume from there"
    )


@dataclass
class Checkpoint:
    """A checkpoint folder read back: everything except the weights, which `load_weights`
    copies into a model."""

    folder: Path
    config: ModelConfig
    meta: dict

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        folder = resolve(path)
        meta = read_json_object(folder / "config.json")
        if not isinstance(meta.get("model"), dict):
            raise InputError(folder / "config.json", 'has no "model_type", which names the family of a '
                             'Hugging Face model (llama, gpt2, qwen2, ...), nor the "model" object of a '
                             'Glassformer checkpoint')
        try:
            config = ModelConfig.from_dict(meta["model"])
            check_model_fits(config)  # before a model of its sizes is built
            return cls(folder, config, meta)
        except InputError as error:
            raise InputError(folder / "config.json", str(error)) from None

    def tokenizer(self):
        """The run's tokenizer; a chat model's keeps its template (ChatTokenizer)."""
        path = self.folder / "tokenizer.json"
        side = self.folder / "tokenizer_config.json"
        if side.is_file() and isinstance(read_json_object(side).get("chat_template"), str):
            return ChatTokenizer.load(path)
        return load_tokenizer(path)

    def load_weights(self, model: torch.nn.Module, device: str | torch.device = "cpu") -> None:
        load_weights(model, self.folder / "model.safetensors", device)

    def training_state(self) -> dict[str, torch.Tensor]:
        path = self.folder / "training_state.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"{self.folder} holds no training state to resume from")
        try:
            return safetensors.torch.load_file(str(path))
        except SafetensorError as error:
            raise InputError(path, f"corrupt or truncated safetensors file ({error})") from None

    def load_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.load_state_dict(optimizer_from_safe(self.training_state(), self.meta["optimizer"]))


def load_weights(model: torch.nn.Module, path: str | Path, device: str | torch.device = "cpu") -> None:
    """Strictly load a model.safetensors written by `write_checkpoint` (tied weights included).
    A tensor the model holds in floating point must be stored in floating point: integers
    would be cast without a word."""
    try:
        _check_float_storage(model, path)
        safetensors.torch.load_model(model, str(path), strict=True, device=str(device))
    except RuntimeError as error:  # missing, unexpected or misshapen tensors
        raise InputError(path, f"the weights do not fit the model: {error}") from None
    except SafetensorError as error:
        raise InputError(path, f"corrupt or truncated safetensors file ({error})") from None
    check_model(model, str(path))


def _check_float_storage(model: torch.nn.Module, path: str | Path) -> None:
    expected = model.state_dict()
    with safetensors.safe_open(str(path), "pt") as stored:
        for name in stored.keys():
            kind = stored.get_slice(name).get_dtype()  # "F32", "BF16", "I64", "BOOL", ...
            if name in expected and expected[name].is_floating_point() and not kind.startswith(("F", "BF")):
                raise InputError(path, f"tensor {name} is stored as {kind}, not a floating-point "
                                 f"type; the model holds it as {expected[name].dtype}")


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """(Transformer or EncoderDecoder, tokenizer, meta) from a checkpoint folder or a run folder."""
    checkpoint = Checkpoint.open(path)
    if not (checkpoint.folder / "model.safetensors").is_file():
        raise InputError(None, f"{checkpoint.folder} holds a LoRA adapter, not a whole model: fold it "
                         "into its base with glassformer export --merge-lora")
    tokenizer = checkpoint.tokenizer()
    if tokenizer.vocab_size > checkpoint.config.vocab_size:
        raise InputError(checkpoint.folder, f"the tokenizer has {tokenizer.vocab_size} tokens but "
                         f"the model {checkpoint.config.vocab_size}: they do not belong together")
    model = build_model(checkpoint.config).to(device)
    checkpoint.load_weights(model, device)
    return model, tokenizer, checkpoint.meta
