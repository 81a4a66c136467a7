"""The tutorial page: one prompt through a SmolLM2-shaped model, token by token, every shape.

`tutorial_markdown()` builds a small seeded model with SmolLM2-135M's architecture (RoPE,
RMSNorm, SwiGLU, grouped-query attention, a tied head) and a character tokenizer, runs the
prompt through it with every hook site recorded, and writes the page from what it computed:
no figure on the page is typed in. It needs no network and no downloaded weights.
"""

from __future__ import annotations

import torch

from glassformer import KVCache, Transformer, get_preset
from glassformer.formats.tokenizers import CharTokenizer
from glassformer.interpret.trace import run_with_cache
from glassformer.model.sites import parse_site

PROMPT = "The cat sat"
ALPHABET = " .,abcdefghijklmnopqrstuvwxyzT"
SEED = 0


def _model() -> tuple[Transformer, CharTokenizer]:
    tokenizer = CharTokenizer("".join(sorted(ALPHABET)))
    config = get_preset("smollm2-135m").replace(
        vocab_size=tokenizer.vocab_size, context_length=64, d_model=48, n_layers=2,
        n_heads=3, n_kv_heads=1, d_ff=128,
    )
    torch.manual_seed(SEED)
    return Transformer(config).eval(), tokenizer


def _shown(text: str) -> str:
    """A token as printed in a table: a space as ␣."""
    return text.replace(" ", "␣")


def _shape(tensor: torch.Tensor, name: str) -> str:
    dims = parse_site(name).dims
    return " × ".join(f"{d} {n}" for d, n in zip(dims, tensor.shape, strict=True))


def _matrix(rows: torch.Tensor, queries: list[str], keys: list[str], digits: int = 3) -> str:
    """A (query, key) matrix as a markdown table, keys across and queries down."""
    head = "| query \\ key | " + " | ".join(f"`{c}`" for c in keys) + " |"
    lines = [head, "|---" * (len(keys) + 1) + "|"]
    for label, row in zip(queries, rows.tolist(), strict=True):
        cells = ["−∞" if v == float("-inf") else f"{v:.{digits}f}" for v in row]
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _values(vector: torch.Tensor, n: int = 6) -> str:
    return "[" + ", ".join(f"{v:+.3f}" for v in vector[:n].tolist()) + ", …]"


def _rms(vector: torch.Tensor) -> float:
    return vector.pow(2).mean().sqrt().item()


def tutorial_markdown() -> str:
    model, tokenizer = _model()
    config = model.config
    full = get_preset("smollm2-135m")
    ids = tokenizer.encode(PROMPT)
    chars = [_shown(tokenizer.decode([i])) for i in ids]
    batch = torch.tensor([ids])  # (1, T)
    logits, sites = run_with_cache(model, batch)
    T = len(ids)
    out = [
        "# Tutorial: one prompt, token by token",
        "",
        "This page follows the prompt "
        f"`{PROMPT!r}` through a model with SmolLM2-135M's architecture, from characters to the",
        "next token and one decode step against the KV cache. Every number on it was computed when",
        "the documentation was built (`docs/tutorial.py`, run by the site's build hook), by a model",
        f"with random weights (seed {SEED}) small enough to print: {config.n_layers} layers instead of",
        f"{full.n_layers}, d_model {config.d_model} instead of {full.d_model}, {config.n_heads} query heads",
        f"sharing {config.kv_heads} key/value head instead of {full.n_heads} sharing {full.kv_heads},",
        f"d_ff {config.d_ff} instead of {full.d_ff}, and a character vocabulary of {config.vocab_size}",
        f"instead of {full.vocab_size:,} byte-level BPE tokens. The steps and their order are SmolLM2's;",
        "with the real weights (`glassformer journey --model smollm2-135m-instruct`) the same sites",
        "carry the same names, with the larger sizes.",
        "",
        "The names in `code` are hook sites: `run_with_cache(model, ids)` returns each of them",
        "(see the [interpretability guide](guides/interpretability.md)).",
        "",
        "```python",
        "from glassformer.interpret.trace import run_with_cache",
        "",
        "logits, sites = run_with_cache(model, ids)      # ids: (1, T)",
        "```",
        "",
        "## 1. Text to ids",
        "",
        f"The tokenizer gives one id per character: T = {T} tokens, a batch of one, so the model's",
        f"input `ids` has shape (1, {T}).",
        "",
        "| position | " + " | ".join(str(p) for p in range(T)) + " |",
        "|---" * (T + 1) + "|",
        "| token | " + " | ".join(f"`{c}`" for c in chars) + " |",
        "| id | " + " | ".join(str(i) for i in ids) + " |",
        "",
    ]
    emb = sites["embed.tokens"]
    out += [
        "## 2. Embedding",
        "",
        f"Each id selects a row of the token table E_token ({config.vocab_size} × {config.d_model}).",
        f"`embed.tokens`: {_shape(emb, 'embed.tokens')}. The first values of the row for",
        f"`{chars[0]}`: {_values(emb[0, 0])}. SmolLM2 adds no position vector here: positions enter",
        "each attention layer as a rotation of the queries and keys (RoPE), so `embed.out` is the",
        "token rows themselves.",
        "",
    ]
    out += _block_zero(config, sites, chars)
    out += [
        "## 4. The other blocks",
        "",
        "Every block has the same sites and shapes; the residual stream leaving one enters the next.",
        "",
        "| site | shape | RMS of the last token's row |",
        "|---|---|---|",
    ]
    for i in range(1, config.n_layers):
        for site in ("resid_pre", "attn.out", "resid_mid", "mlp.out", "resid_post"):
            name = f"blocks.{i}.{site}"
            out.append(f"| `{name}` | {_shape(sites[name], name)} | {_rms(sites[name][0, -1]):.3f} |")
    out += [""]
    out += _head_and_decode(model, tokenizer, logits, sites, ids, chars)
    return "\n".join(out) + "\n"


def _block_zero(config, sites: dict, chars: list[str]) -> list[str]:
    p = "blocks.0."
    x, n1 = sites[p + "resid_pre"], sites[p + "norm1"]
    q, k, v = sites[p + "attn.q"], sites[p + "attn.k"], sites[p + "attn.v"]
    scores, masked = sites[p + "attn.scores"], sites[p + "attn.masked_scores"]
    pattern, context = sites[p + "attn.pattern"], sites[p + "attn.context"]
    hidden = sites[p + "mlp.hidden"]
    last = len(chars) - 1
    top = pattern[0, 0, last].topk(3)
    lines = [
        "## 3. Block 0, step by step",
        "",
        "### Norm",
        "",
        f"`{p}resid_pre` ({_shape(x, p + 'resid_pre')}) is the residual stream entering the block.",
        "RMSNorm divides each row by its root mean square and multiplies by a learned gain:",
        f"the last token's row has RMS {_rms(x[0, -1]):.4f} before and {_rms(n1[0, -1]):.4f} after",
        f"(`{p}norm1`, the gain is 1 at initialisation).",
        "",
        "### Queries, keys and values",
        "",
        f"- `{p}attn.q`: {_shape(q, p + 'attn.q')}: {config.n_heads} heads of d_head {config.head_dim}.",
        f"- `{p}attn.k`: {_shape(k, p + 'attn.k')} and `{p}attn.v`: {_shape(v, p + 'attn.v')}:",
        f"  grouped-query attention: {config.kv_heads} key/value head(s), each read by",
        f"  {config.n_rep} query heads each, so the cache holds {config.kv_heads}/{config.n_heads}",
        "  of what multi-head attention would.",
        "",
        "Queries and keys are rotated by their position (RoPE) before the scores are taken.",
        "",
        "### Scores, mask, softmax",
        "",
        f"A = Q Kᵀ / √{config.head_dim} (`{p}attn.scores`, {_shape(scores, p + 'attn.scores')}).",
        "Head 0:",
        "",
        _matrix(scores[0, 0], chars, chars, 2),
        "",
        f"The causal mask M puts −∞ above the diagonal (`{p}attn.masked_scores`): a token sees",
        "itself and the tokens before it, never the ones after.",
        "",
        _matrix(masked[0, 0], chars, chars, 2),
        "",
        f"α = softmax(A + M) along each row (`{p}attn.pattern`): every row sums to 1",
        f"(largest deviation {(pattern.sum(-1) - 1).abs().max().item():.1e}).",
        "",
        _matrix(pattern[0, 0], chars, chars),
        "",
        f"The last token, `{chars[last]}`, gives most weight in head 0 to positions "
        + ", ".join(f"{i} (`{chars[i]}`, {w:.3f})" for w, i in zip(top.values.tolist(),
                                                                top.indices.tolist(), strict=True))
        + ".",
        "",
        "### Context, output projection, residual",
        "",
        f"- `{p}attn.context`: {_shape(context, p + 'attn.context')}: αV, each head's weighted",
        "  average of the value rows.",
        f"- `{p}attn.out`: {_shape(sites[p + 'attn.out'], p + 'attn.out')}: the heads concatenated",
        f"  ({config.n_heads} × {config.head_dim} = {config.n_heads * config.head_dim})",
        "  and multiplied by W_O.",
        f"- `{p}resid_mid` = resid_pre + attn.out: the last row's RMS goes from",
        f"  {_rms(x[0, -1]):.4f} to {_rms(sites[p + 'resid_mid'][0, -1]):.4f}.",
        "",
        "### Feed-forward",
        "",
        f"- `{p}norm2`: {_shape(sites[p + 'norm2'], p + 'norm2')}, RMSNorm again.",
        f"- `{p}mlp.hidden`: {_shape(hidden, p + 'mlp.hidden')}: SwiGLU, SiLU(x W_gate) ⊙ x W_up;",
        f"  {(hidden[0, -1].abs() < 1e-2).float().mean().item():.0%} of the last row's entries are",
        "  within 0.01 of zero.",
        f"- `{p}mlp.out`: {_shape(sites[p + 'mlp.out'], p + 'mlp.out')}: hidden W_down, back to d_model.",
        f"- `{p}resid_post` = resid_mid + mlp.out, leaving the block.",
        "",
    ]
    return lines


def _head_and_decode(model, tokenizer, logits, sites, ids, chars) -> list[str]:
    config = model.config
    probs = logits[0, -1].softmax(-1)  # (vocab,)
    top = probs.topk(5)
    next_id = int(top.indices[0])
    cache = KVCache(config, batch_size=1)
    with torch.no_grad():
        model(torch.tensor([ids]), cache=cache)
    step_logits, step = run_with_cache(model, torch.tensor([[next_id]]), cache=cache)
    with torch.no_grad():
        whole = model(torch.tensor([ids + [next_id]]))  # (1, T + 1, vocab)
    diff = (step_logits[0, -1] - whole[0, -1]).abs().max().item()
    pattern = step["blocks.0.attn.pattern"]
    new = _shown(tokenizer.decode([next_id]))
    lines = [
        "## 5. Final norm, head, next token",
        "",
        f"`final_norm`: {_shape(sites['final_norm'], 'final_norm')}. `logits`:",
        f"{_shape(logits, 'logits')}: the head multiplies by the token table itself (tied",
        "embeddings). Generation reads the last row only; its softmax gives the next token's",
        "probabilities:",
        "",
        "| rank | token | id | probability |",
        "|---|---|---|---|",
    ]
    for rank, (p, i) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
        lines.append(f"| {rank} | `{tokenizer.decode([i])!r}` | {i} | {p:.4f} |")
    lines += [
        "",
        "With random weights the distribution is nearly flat "
        f"(the uniform probability is {1 / config.vocab_size:.4f}); a trained model puts most of its",
        f"mass on a few tokens. Greedy decoding takes the first: `{tokenizer.decode([next_id])!r}`.",
        "",
        "## 6. One decode step with the KV cache",
        "",
        "The prompt's keys and values were written to a `KVCache` during the first pass. The next",
        "step feeds only the new token, ids of shape (1, 1): block 0's `attn.q` is now",
        f"{_shape(step['blocks.0.attn.q'], 'blocks.0.attn.q')}, and `attn.pattern`",
        f"{_shape(pattern, 'blocks.0.attn.pattern')}: one query row against all {pattern.shape[-1]}",
        "keys, the cached ones and its own. Its logits equal those of running the whole",
        f"sequence again (largest difference {diff:.1e}), at the cost of one token instead of",
        f"{len(ids) + 1}.",
        "",
        "Head 0's weights for the new token:",
        "",
        _matrix(pattern[0, 0], [new], chars + [new]),
        "",
    ]
    return lines
