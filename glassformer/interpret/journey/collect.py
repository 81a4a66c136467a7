"""Run one forward pass with every site recorded and reduce it to a compact JSON-able dict.

Floats are rounded, previews cut to a corner of each tensor, and each layer's attention weights
sent once as flat arrays, so a 30-layer × 9-head model still makes a small, fast page.
"""

from __future__ import annotations

import numpy as np
import torch

from ...model.kv_cache import KVCache
from ...model.transformer import Transformer
from ..attribution import TENTHS, attention_rollout, integrated_gradients, token_baseline
from ..trace import run_with_cache, site_dims
from .steps import DIM_SYMBOLS, input_steps, layer_steps, output_steps

ROWS, COLS = 6, 8  # the corner of each tensor shown in the report


def _weights(t: torch.Tensor) -> list:
    """Attention weights to 3 decimals (in float64, so 0.043 stays 0.043 in JSON)."""
    return np.round(t.double().cpu().numpy(), 3).tolist()


def _round(array: np.ndarray, digits: int = 3) -> list:
    """Nested lists of floats with `digits` significant digits; ±inf and nan become None."""
    out = np.vectorize(lambda v: float(f"{v:.{digits}g}"), otypes=[object])(array)
    out[~np.isfinite(array)] = None
    return out.tolist()


def _stats(t: torch.Tensor) -> dict:
    finite = t[torch.isfinite(t)].double()
    if finite.numel() == 0:
        return {"mean": None, "std": None, "min": None, "max": None}
    values = {
        "mean": finite.mean(), "std": finite.std(correction=0), "min": finite.min(), "max": finite.max()
    }
    return {name: float(f"{float(v):.4g}") for name, v in values.items()}


def _site(name: str, tensor: torch.Tensor) -> dict:
    dims = site_dims(name)
    t = tensor.float().cpu()
    corner = t[0, :, :ROWS, :COLS] if dims[1] in ("head", "kv_head") else t[0, :ROWS, :COLS]
    site = {"name": name, "shape": list(tensor.shape), "dims": list(dims), "stats": _stats(t)}
    if not name.endswith(".pattern"):  # the weights travel whole, once, in "attention"
        site["preview"] = _round(corner.numpy())
    return site


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if token_id < tokenizer.vocab_size else f"<{token_id}>"


def _top(tokenizer, probs: torch.Tensor, logits: torch.Tensor, k: int) -> list[dict]:
    values, ids = probs.topk(min(k, probs.shape[-1]))
    return [
        {"id": int(i), "token": token_text(tokenizer, int(i)), "prob": float(f"{float(p):.4g}"),
         "logit": float(f"{float(logits[i]):.4g}")}
        for p, i in zip(values, ids, strict=True)
    ]


def _logit_lens(model: Transformer, tokenizer, residuals: list[torch.Tensor]) -> list[dict]:
    """The top token (and its probability) read out of each residual stream at every position."""
    rows = []
    with torch.no_grad():
        for resid in residuals:
            h = model.final_norm(resid) if model.final_norm is not None else resid
            probs = model.head(h)[0].float().softmax(dim=-1)  # (T, vocab)
            top_p, top_id = probs.max(dim=-1)  # (T,)
            rows.append({
                "tokens": [token_text(tokenizer, int(i)) for i in top_id],
                "probs": [round(float(p), 3) for p in top_p],
            })
    return rows


def collect_journey(
    model: Transformer, tokenizer, text: str, top_k: int = 10, ig_steps: int = 4
) -> dict:
    """Everything the report shows for `text`: sites with shapes, dims, stats and previews;
    attention weights; next tokens; logit lens; rollout and integrated-gradient attributions;
    and one decode step of the most likely next token against the KV cache. An encoder
    (bidirectional) reads the text with its tokenizer's special tokens and predicts at its
    first mask token (else at the last position); it has no decode step."""
    if model.training:
        raise ValueError("journey: call model.eval() first (dropout is random)")
    config = model.config
    encode = tokenizer.encode if config.causal else getattr(tokenizer, "encode_sequence", tokenizer.encode)
    ids_list = encode(text)
    if not ids_list:
        raise ValueError("text: nothing to trace (it encodes to no tokens)")
    T = len(ids_list)
    if T > config.context_length:
        raise ValueError(f"text: {T} tokens exceed context_length={config.context_length}")
    device = model.lm_head.weight.device
    ids = torch.tensor([ids_list], device=device)  # (1, T)
    decode = config.causal and T < config.context_length
    cache = KVCache(config, 1, max_length=T + 1) if decode else None
    logits, acts = run_with_cache(model, ids, cache=cache)
    mask_id = None if config.causal else getattr(tokenizer, "mask_id", None)
    position = ids_list.index(mask_id) if mask_id in ids_list else T - 1
    last = logits[0, position].float()  # (vocab,)
    probs = last.softmax(dim=-1)
    next_tokens = _top(tokenizer, probs, last, top_k)
    L = config.n_layers
    patterns = [acts[f"blocks.{i}.attn.pattern"] for i in range(L)]  # (1, H, T, T) each

    decode_step = None
    if decode:
        next_id = torch.tensor([[next_tokens[0]["id"]]], device=device)  # (1, 1)
        names = [f"blocks.{i}.attn.pattern" for i in range(L)]
        _, step = run_with_cache(model, next_id, names=names, cache=cache)
        decode_step = {
            "token": next_tokens[0]["token"],
            "attention": [_weights(step[n][0, :, 0]) for n in names],
        }  # per layer (H, T + 1): the new query's row against the cached keys

    target = next_tokens[0]["id"]
    reference = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.bos_id
    if reference is not None:  # a real token's embedding: a smooth path, unlike zeros
        baseline = token_baseline(model, ids, reference)
        baseline_text = f"E_token[{token_text(tokenizer, reference)!r}] at every position but the first"
        ig = integrated_gradients(model, ids, target, position, baseline=baseline, steps=ig_steps,
                                  edges=TENTHS)
    else:
        baseline_text = "zeros"
        ig = integrated_gradients(model, ids, target, position, steps=ig_steps)
    rollout = attention_rollout(patterns)[0, position]  # (T,)
    residuals = [acts["embed.out"]] + [acts[f"blocks.{i}.resid_post"] for i in range(L)]
    return {
        "text": text,
        "tokens": [token_text(tokenizer, i) for i in ids_list],
        "ids": ids_list,
        "config": config.to_dict(),
        "sizes": {"H": config.n_heads, "KV": config.kv_heads, "d_head": config.head_dim,
                  "d": config.d_model, "d_ff": config.ff_dim, "v": config.vocab_size, "L": L},
        "dim_symbols": DIM_SYMBOLS,
        "steps": {"input": input_steps(config), "layer": layer_steps(config),
                  "output": output_steps(config)},
        "sites": [_site(name, tensor) for name, tensor in acts.items()],
        "attention": [
            [_weights(p[0, h].flatten()) for h in range(config.n_heads)]
            for p in patterns
        ],  # [layer][head]: the T × T weights, row-major
        "decode_step": decode_step,
        "next_tokens": next_tokens,  # at prediction.position
        "prediction": {"position": position,
                       "title": "Next-token probabilities" if position == T - 1 and mask_id is None
                       else "Masked-token probabilities"},
        "logit_lens": _logit_lens(model, tokenizer, residuals),
        "attribution": {
            "target": next_tokens[0]["token"],
            "baseline": baseline_text,
            "rollout": [round(float(v), 4) for v in rollout],
            "integrated_gradients": [round(float(v), 4) for v in ig.attributions],
            "logit": round(ig.logit, 4),
            "baseline_logit": round(ig.baseline_logit, 4),
            "completeness_gap": float(f"{ig.completeness_gap:.3g}"),
        },
    }
