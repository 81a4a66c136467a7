"""Run one forward pass with every site recorded and reduce it to a compact JSON-able dict.

Floats are rounded, previews cut to a corner of each tensor, and each layer's attention weights
sent once as flat arrays, so a 30-layer × 9-head model still makes a small, fast page.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ...errors import InputError
from ...model.encoder_decoder import EncoderDecoder
from ...model.kv_cache import KVCache
from ...model.sites import parse_site
from ...model.transformer import Transformer
from ..attribution import TENTHS, attention_rollout, integrated_gradients, token_baseline
from ..lens import residual_sites, top_tokens
from ..trace import capture, run_with_cache
from .steps import DIM_SYMBOLS, input_steps, layer_steps, output_steps

ROWS, COLS = 6, 8  # the corner of each tensor shown in the report
# The page holds T × T attention weights per head and layer: at 256 tokens a 30-layer, 9-head
# model sends 18M of them, tens of MB, and the attributions take minutes on a CPU.
MAX_TOKENS = 256


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
    dims = parse_site(name).dims
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


def _logit_lens(model: Transformer | EncoderDecoder, tokenizer, residuals: list[torch.Tensor]) -> list[dict]:
    """The top token (and its probability) read out of each residual stream at every position."""
    lens = top_tokens(model, residuals, top_k=1)
    return [{"tokens": [token_text(tokenizer, int(i)) for i in ids[0, :, 0]],
             "probs": [round(float(p), 3) for p in probs[0, :, 0]]}
            for ids, probs in zip(lens.ids, lens.probs, strict=True)]


def _check_length(n_tokens: int, context_length: int, max_tokens: int) -> None:
    if n_tokens == 0:
        raise InputError("text", "nothing to trace (it encodes to no tokens)")
    if n_tokens > context_length:
        raise InputError("text", f"{n_tokens} tokens exceed context_length={context_length}")
    if n_tokens > max_tokens:  # the page holds T × T weights per head and layer
        raise InputError("text", f"{n_tokens} tokens, over the journey's limit of {max_tokens} "
                         "(max_tokens, --max-tokens): trace a shorter text or raise the limit")


def _silent(stage: str) -> None:
    pass


def collect_journey(
    model: Transformer, tokenizer, text: str, top_k: int = 10, ig_steps: int = 4,
    max_tokens: int = MAX_TOKENS, progress: Callable[[str], None] = _silent,
) -> dict:
    """Everything the report shows for `text`: sites with shapes, dims, stats and previews;
    attention weights; next tokens; logit lens; rollout and integrated-gradient attributions;
    and one decode step of the most likely next token against the KV cache. An encoder
    (bidirectional) reads the text with its tokenizer's special tokens and predicts at its
    first mask token (else at the last position); it has no decode step. A text of more than
    `max_tokens` tokens is refused; `progress` hears each stage as it begins."""
    if model.training:
        raise InputError("journey", "call model.eval() first (dropout is random)")
    if isinstance(model, EncoderDecoder):
        return collect_seq2seq_journey(model, tokenizer, text, top_k, max_tokens=max_tokens,
                                       progress=progress)
    config = model.config
    encode = tokenizer.encode if config.causal else getattr(tokenizer, "encode_sequence", tokenizer.encode)
    ids_list = encode(text)
    T = len(ids_list)
    _check_length(T, config.context_length, max_tokens)
    progress(f"the forward pass over {T} tokens")
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

    progress("integrated gradients")
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
    residuals = [acts[site] for site in residual_sites(config)]
    progress("the logit lens and the tensors' summaries")
    return {
        "text": text,
        "tokens": [token_text(tokenizer, i) for i in ids_list],
        "ids": ids_list,
        "config": config.to_dict(),
        "sizes": {"H": config.n_heads, "KV": config.kv_heads, "d_head": config.head_dim,
                  "d": config.d_model, "d_ff": config.ff_dim, "v": config.vocab_size, "L": L},
        "dim_symbols": DIM_SYMBOLS,
        "steps": {"input": input_steps(config), "layer": layer_steps(config, model.hooks.sites),
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


def collect_seq2seq_journey(model: EncoderDecoder, tokenizer, text: str, top_k: int = 10,
                            n_decoded: int = 8, max_tokens: int = MAX_TOKENS,
                            progress: Callable[[str], None] = _silent) -> dict:
    """The journey of an encoder-decoder: `text` is the source; the decoder reads its start
    token and up to n_decoded greedy tokens after it. The layers shown are the decoder's (its
    causal self-attention and its cross-attention, decoder tokens × source tokens); the
    encoder's own weights come as `encoder_attention`. No attribution is computed."""
    config = model.config
    source = tokenizer.encode(text)
    _check_length(len(source), config.context_length, max_tokens)
    progress(f"the encoder over {len(source)} tokens and up to {n_decoded} decoded")
    device = model.lm_head.weight.device
    ids = torch.tensor([source], device=device)  # (1, S)
    decoded = [config.decoder_start_id]
    with torch.no_grad():
        memory = model.encode(ids)
        while len(decoded) <= min(n_decoded, config.context_length - 1):
            step = model.head(model.forward_hidden(torch.tensor([decoded], device=device), memory))
            token = int(step[0, -1].argmax())
            if token == tokenizer.eos_id:
                break
            decoded.append(token)
        with capture(model) as acts:
            logits = model(ids, torch.tensor([decoded], device=device))  # (1, U, vocab)
    last = logits[0, -1].float()
    L, H = config.n_layers, config.n_heads

    def maps(stack: str, site: str, n_layers: int) -> list:
        return [[_weights(acts[f"{stack}.blocks.{i}.{site}"][0, h].flatten()) for h in range(H)]
                for i in range(n_layers)]  # [layer][head]: rows × columns, row-major

    residuals = [acts[site] for site in residual_sites(config)]
    return {
        "text": text,
        "tokens": [token_text(tokenizer, i) for i in decoded],
        "ids": decoded,
        "source_tokens": [token_text(tokenizer, i) for i in source],
        "source_ids": source,
        "prefix": "decoder.",
        "config": config.to_dict(),
        "sizes": {"H": H, "KV": config.kv_heads, "d_head": config.head_dim, "d": config.d_model,
                  "d_ff": config.ff_dim, "v": config.vocab_size, "L": L, "S": len(source)},
        "dim_symbols": DIM_SYMBOLS,
        "steps": {"input": input_steps(config), "layer": layer_steps(config, model.hooks.sites),
                  "output": output_steps(config)},
        "sites": [_site(name, tensor) for name, tensor in acts.items()],
        "attention": maps("decoder", "attn.pattern", L),  # U × U, causal
        "cross_attention": maps("decoder", "cross.pattern", L),  # U × S
        "encoder_attention": maps("encoder", "attn.pattern", config.n_encoder_layers),  # S × S
        "decode_step": None,
        "next_tokens": _top(tokenizer, last.softmax(dim=-1), last, top_k),
        "logit_lens": _logit_lens(model, tokenizer, residuals),
        "attribution": None,
    }
