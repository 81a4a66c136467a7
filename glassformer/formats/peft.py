"""LoRA adapters in PEFT's layout: `adapter_config.json` + `adapter_model.safetensors`.

Keys are those PEFT writes for a Llama-family model (LlamaForCausalLM and kin):

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight

with A (r, d_in) and B (d_out, r). Tensors come in and go out as {(layer, target): (A, B)}
(training/lora.py holds the layers they belong to).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import InputError
from .validate import check_tensor

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}
_TARGET_OF = {name.split(".")[1]: t for t, name in PEFT_NAMES.items()}
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


def adapter_key(layer: int, target: str, matrix: str) -> str:
    return f"base_model.model.model.layers.{layer}.{PEFT_NAMES[target]}.lora_{matrix}.weight"


def write_adapter(folder: Path, tensors: dict, rank: int, alpha: float, dropout: float,
                  targets: tuple[str, ...], base: str) -> None:
    """Write the two files of a PEFT LoRA adapter into the existing `folder`."""
    files = {}
    for (layer, target), (a, b) in tensors.items():
        files[adapter_key(layer, target, "A")] = a.detach().to("cpu").contiguous()
        files[adapter_key(layer, target, "B")] = b.detach().to("cpu").contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
              "target_modules": sorted(PEFT_NAMES[t].split(".")[1] for t in targets),
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
              "alpha_pattern": {}}
    save_file(files, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter(folder: str | Path) -> tuple[dict[str, Any], dict]:
    """(settings {rank, alpha, dropout, targets, base}, {(layer, target): (A, B)}) of a PEFT
    LoRA adapter folder; anything else PEFT can express but this cannot is refused, and so is
    a tensor holding NaN or Inf (named)."""
    folder = Path(folder)
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"no LoRA adapter in {folder} (expected {path.name})")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(config_path, f"not valid JSON ({error})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise InputError(config_path, f"not a LoRA adapter (peft_type {config.get('peft_type')!r})"
                         if isinstance(config, dict) else f"{config_path}: expected a JSON object")
    for field, plain in (("use_dora", False), ("use_rslora", False), ("bias", "none")):
        if config.get(field, plain) != plain:
            raise InputError(config_path, f"{field}={config[field]!r} is not supported")
    for field in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise InputError(config_path, f"{field}={config[field]!r} is not supported")
    modules = config.get("target_modules") or []
    if isinstance(modules, str) or any(m not in _TARGET_OF for m in modules):
        raise InputError(config_path, f"target_modules {modules!r}: expected a list among "
                         f"{', '.join(_TARGET_OF)}")
    try:
        files = load_file(str(weights_path))
    except SafetensorError as error:
        raise InputError(weights_path, f"corrupt or truncated safetensors file ({error})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in files.items():
        match = _KEY.fullmatch(key)
        if match is None or match[3] not in _TARGET_OF:
            raise InputError(weights_path, f"unexpected tensor {key}")
        check_tensor(value, key, str(weights_path))  # NaN / Inf refused by name
        pairs.setdefault((int(match[1]), _TARGET_OF[match[3]]), {})[match[4]] = value
    incomplete = [k for k, v in pairs.items() if set(v) != {"A", "B"}]
    if incomplete:
        raise InputError(weights_path, f"layer {incomplete[0][0]} {incomplete[0][1]} lacks "
                         "lora_A or lora_B")
    settings = {"rank": config.get("r"), "alpha": config.get("lora_alpha"),
                "dropout": config.get("lora_dropout", 0.0),
                "targets": tuple(t for t in PEFT_NAMES if PEFT_NAMES[t].split(".")[1] in modules),
                "base": config.get("base_model_name_or_path")}
    return settings, {k: (v["A"], v["B"]) for k, v in sorted(pairs.items())}
