"""The walkthrough's text: each hook site as a step of the forward pass, with its equation.

Steps follow the order of the pass; a layer's steps are written once (site names relative to
`blocks.{i}`) and shown for whichever layer is selected. Each piece a family switches on is
written into the equation of the step it changes: the embedding scale (embed.tokens), the
norm's (1 + g) (every norm), QK-norm (attn.q_norm / k_norm), partial rotary (attn.q / k),
the score scale and soft-cap (attn.scores), per-layer windows (attn.masked_scores), sandwich
and output norms (attn_out_norm, mlp_out_norm), the parallel residual (norm2, resid_post) and
the final soft-cap (logits).
"""

from __future__ import annotations

from collections.abc import Mapping

from ...model.config import ModelConfig
from ...model.sites import Site

# How a named dimension is written in the equations (c: tokens in the context).
DIM_SYMBOLS = {
    "batch": "B", "pos": "c", "query": "c", "key": "c", "d_model": "d", "head": "H",
    "kv_head": "KV", "d_head": "d_head", "d_ff": "d_ff", "vocab": "v",
}
ACTIVATION_NAMES = {"relu": "ReLU", "gelu": "GELU", "gelu_tanh": "GELU_tanh", "silu": "SiLU"}


def _norm(config: ModelConfig) -> str:
    gain = f"({config.norm_weight_offset:g} + g)" if config.norm_weight_offset else "g"
    if config.norm == "rmsnorm":
        return f"RMSNorm(x) = x / √(mean(x²) + ε) ⊙ {gain}"
    return f"LayerNorm(x) = (x − mean(x)) / √(var(x) + ε) ⊙ {gain} + b"


def _tokens(config: ModelConfig) -> str:
    return "E_token[ids] · √d" if config.embed_scale else "E_token[ids]"


def _scores(config: ModelConfig) -> tuple[str, str]:
    """attn.scores' equation and note: the scale, and the soft-cap where there is one."""
    scores = "Q Kᵀ / √d_head" if config.scale_scores else "Q Kᵀ"
    note = "row i: how well query i matches every key"
    if config.attn_scale is not None:
        scores = f"Q Kᵀ / √{config.attn_scale:g}"
        note += f"; scaled by {config.attn_scale:g}^-½ in place of d_head^-½"
    if config.attn_softcap is None:
        return f"A = {scores}", note
    cap = config.attn_softcap
    return (f"A = c · tanh({scores} / c),  c = {cap:g}",
            f"{note}; soft-capped: every score squashed smoothly into (−{cap:g}, {cap:g})")


def _mask(config: ModelConfig) -> str:
    mask = "M: 0 where query i may see key j, −∞ where it may not"
    if config.causal:
        mask += " (j > i: the future)"
    if config.layer_windows is not None:
        local = [i for i, window in enumerate(config.layer_windows) if window is not None]
        sizes = sorted({config.layer_windows[i] for i in local})
        mask += (f", or i − j ≥ W on the local layers {', '.join(map(str, local))} (W = "
                 f"{', '.join(map(str, sizes))}); the other layers are global") if local else ""
    elif config.sliding_window:
        mask += f", or i − j ≥ {config.sliding_window} (outside the window)"
    if config.position == "alibi":
        mask += "; plus the ALiBi bias −slope_h·(i − j)"
    if config.position == "relative":
        mask += "; plus T5's learned bias per head and bucket of distance j − i"
    return mask


def input_steps(config: ModelConfig) -> list[dict]:
    pe = {
        "learned": ("E_pos[0 … c−1]", "rows of the learned (context × d) position table"),
        "sinusoidal": ("PE(m, 2i) = sin(m / 10000^(2i/d)),  PE(m, 2i+1) = cos(m / 10000^(2i/d))",
                       "fixed sinusoids, one frequency per pair of dimensions"),
    }
    position_note = {
        "rope": "No position vector is added: RoPE rotates Q and K by their positions in every layer.",
        "alibi": "No position vector is added: ALiBi adds −slope·(i − j) to every attention score.",
        "none": "No position information at all: only the causal mask tells tokens apart.",
        "relative": "No position vector is added: T5 adds a learned bias per head and bucket of "
                    "distance to every attention score.",
    }
    note = "row ids[i] of the (v × d) table E_token for every token"
    if config.embed_scale:
        note += ", times √d (in the model's dtype) so the rows match the stream's scale"
    steps = [{"site": "embed.tokens", "title": "Token embedding lookup", "equation": _tokens(config),
              "note": note}]
    if config.position in pe:
        equation, note = pe[config.position]
        steps.append({"site": "embed.positions", "title": "Position encoding", "equation": equation,
                      "note": note})
        steps.append({"site": "embed.out", "title": "Input embedding",
                      "equation": f"I_emb = {_tokens(config)} + E_pos", "note": "the residual stream begins"})
    else:
        steps.append({"site": "embed.out", "title": "Input embedding",
                      "equation": f"I_emb = {_tokens(config)}", "note": position_note[config.position]})
    if config.n_token_types:  # before embed.out, which it joins
        steps.insert(-1, {"site": "embed.token_types", "title": "Segment embedding",
                          "equation": "E_type[token_types]",
                          "note": "which segment each token belongs to (sentence A or B)"})
    if config.n_token_types or config.embed_norm:
        out = steps[-1]
        out["equation"] += " + E_type" * bool(config.n_token_types)
        if config.embed_norm:
            out["equation"] = f"I_emb = Norm({out['equation'].removeprefix('I_emb = ')})"
            out["note"] = f"{_norm(config)}; the residual stream begins"
    return steps


def _rotary(config: ModelConfig) -> str:
    """What RoPE turns: every dimension of each head, or the first rotary_dim (partial)."""
    if config.rotary_dim is None:
        return ""
    rest = config.head_dim - config.rotary_dim
    return (f"; partial rotary: RoPE_r turns each head's first r = {config.rotary_dim} of its "
            f"{config.head_dim} dimensions, the other {rest} pass as they are")


def _residuals(config: ModelConfig) -> dict[str, tuple[str, str]]:
    """resid_mid's and resid_post's equation and note, by where the norms sit and whether the
    block is parallel."""
    placement = config.norm_placement
    attn = {"pre": "MultiHead(x̂)", "out": "Norm(MultiHead(x))",
            "sandwich": "Norm(MultiHead(x̂))"}.get(placement)
    ffn = {"pre": "FFN(x̂)", "out": "Norm(FFN(x))", "sandwich": "Norm(FFN(x̂))"}.get(placement)
    if attn is None:  # post-norm: each add is inside its norm step
        return {"resid_mid": ("x (after the first add & norm)", "attention writes into the residual stream"),
                "resid_post": ("x", "the input of the next layer")}
    mid = (f"x ← x + {attn}", "attention writes into the residual stream")
    if config.parallel_block:
        return {"resid_mid": (f"x + {attn}", "attention's write; the feed-forward does not read it"),
                "resid_post": (f"x ← x + {attn} + FFN(x̂₂)",
                               "parallel residual: both sublayers read the block's input and "
                               "add to it together; the input of the next layer")}
    return {"resid_mid": mid, "resid_post": (f"x ← x + {ffn}", "the input of the next layer")}


def layer_steps(config: ModelConfig, sites: Mapping[str, Site]) -> list[dict]:
    """The steps of one block, those whose sites the model has (`sites`: its Hooks.sites)."""
    inputs = config.norm_placement in ("pre", "sandwich")  # a norm before each sublayer
    x_in = "x̂" if inputs else "x"
    q, k = f"{x_in} W_Q", f"{x_in} W_K"
    if config.qk_norm != "none":
        q, k = f"Norm_Q({q})", f"Norm_K({k})"
    if config.position == "rope":
        rope = "RoPE" if config.rotary_dim is None else "RoPE_r"
        q, k = f"{rope}({q})", f"{rope}({k})"
    over = "each head's d_head" if config.qk_norm == "head" else "all heads together"
    scores, scores_note = _scores(config)
    act = ACTIVATION_NAMES[config.activation]
    ffn_in = "x̂₂" if config.parallel_block else x_in
    hidden = (f"{act}({ffn_in} W_gate) ⊙ ({ffn_in} W_up)" if config.gated
              else f"{act}({ffn_in} W_1 + b_1)")
    gqa = ""
    if config.kv_heads < config.n_heads:
        gqa = f"; {config.kv_heads} key/value heads, each shared by {config.n_rep} query heads (GQA)"
    residuals = _residuals(config)
    norm2 = {"site": "norm2", "title": "Norm before the feed-forward" if inputs
             else "Add & norm (feed-forward)",
             "equation": f"x̂ = {_norm(config)}" if inputs else "x = Norm(x + FFN(x))", "note": ""}
    if config.parallel_block:
        norm2 |= {"equation": "x̂₂ = Norm₂(x_in)",
                  "note": f"parallel block: the feed-forward reads the block's input x_in (as "
                          f"attention does), not x + attention; {_norm(config)}"}
    steps = [
        {"site": "resid_pre", "title": "Residual stream in", "equation": "x",
         "note": "what the layer reads (and adds to)"},
        {"site": "norm1", "title": "Norm before attention" if inputs else "Add & norm (attention)",
         "equation": f"x̂ = {_norm(config)}" if inputs else "x = Norm(x + MultiHead(x))",
         "note": "" if inputs else "post-norm: the norm follows the residual add"},
        {"site": "attn.q_norm", "title": "Query norm (QK-norm)", "equation": f"Norm_Q({x_in} W_Q)",
         "note": f"RMSNorm over {over}, before RoPE: x / √(mean(x²) + ε) ⊙ g_Q"},
        {"site": "attn.k_norm", "title": "Key norm (QK-norm)", "equation": f"Norm_K({x_in} W_K)",
         "note": f"RMSNorm over {over}, before RoPE: x / √(mean(x²) + ε) ⊙ g_K"},
        {"site": "attn.q", "title": "Queries", "equation": f"Q = {q}",
         "note": "split into H heads of d_head dimensions" + _rotary(config)},
        {"site": "attn.k", "title": "Keys", "equation": f"K = {k}",
         "note": "one key per token" + gqa + _rotary(config)},
        {"site": "attn.v", "title": "Values", "equation": f"V = {x_in} W_V",
         "note": "what each token hands on when attended to" + gqa},
        {"site": "attn.scores", "title": "Raw scores", "equation": scores, "note": scores_note},
        {"site": "attn.masked_scores", "title": "Mask", "equation": "A_masked = A + M",
         "note": _mask(config)},
        {"site": "attn.pattern", "title": "Attention weights", "equation": "α = softmax(A_masked)",
         "note": "each row sums to 1; hover the heatmap for a weight"},
        {"site": "attn.context", "title": "Weighted sum of values", "equation": "head_h = α V",
         "note": "each query's mix of the values it attends to"},
        {"site": "attn.out", "title": "Concatenate heads, project",
         "equation": "MultiHead = concat(head_1, …, head_H) W_O", "note": "back to d dimensions"},
        {"site": "attn_out_norm", "title": "Norm of the attention output",
         "equation": "Norm(MultiHead)", "note": f"{_norm(config)}, on the sublayer's output: "
         + ("sandwiched between the norm before it and the add" if inputs
            else "no norm before the sublayer, one after it")},
        {"site": "resid_mid", "title": "Residual add", "equation": residuals["resid_mid"][0],
         "note": residuals["resid_mid"][1]},
        norm2,
        {"site": "mlp.hidden", "title": "Feed-forward hidden layer", "equation": hidden,
         "note": "position-wise: every token alone, d → d_ff"},
        {"site": "mlp.out", "title": "Feed-forward output", "equation": "FFN = hidden W_2",
         "note": "d_ff → d"},
        {"site": "mlp_out_norm", "title": "Norm of the feed-forward output",
         "equation": "Norm(FFN)", "note": f"{_norm(config)}, on the sublayer's output"},
        {"site": "resid_post", "title": "Residual stream out", "equation": residuals["resid_post"][0],
         "note": residuals["resid_post"][1]},
    ]
    if config.n_encoder_layers:
        pre = config.norm_placement == "pre"
        at = next(i for i, step in enumerate(steps) if step["site"] == ("norm2" if pre else "resid_mid"))
        steps[at:at] = cross_steps(pre, " / √d_head" if config.scale_scores else "")
    prefix = "decoder." if config.n_encoder_layers else ""  # an encoder-decoder shows its decoder
    return [step for step in steps if f"{prefix}blocks.0.{step['site']}" in sites]


def cross_steps(pre: bool, scale: str) -> list[dict]:
    """A decoder block's cross-attention sublayer (encoder-decoders)."""
    x_in = "x̂" if pre else "x"
    return [
        {"site": "resid_self", "title": "Residual add (self-attention)", "equation": "x ← x + MultiHead(x̂)",
         "note": "then the decoder reads the encoder"},
        {"site": "norm_cross",
         "title": "Norm before cross-attention" if pre else "Add & norm (cross-attention)",
         "equation": "x̂ = Norm(x)" if pre else "x = Norm(x + Cross(x, m))", "note": ""},
        {"site": "cross.q", "title": "Cross-attention queries", "equation": f"Q = {x_in} W_Q",
         "note": "from the decoder; keys and values come from the encoder output m"},
        {"site": "cross.pattern", "title": "Cross-attention weights",
         "equation": f"α = softmax(Q (m W_K)ᵀ{scale} + M)",
         "note": "rows: decoder tokens; columns: encoder (source) tokens; no causal mask"},
        {"site": "cross.out", "title": "Cross-attention output",
         "equation": "Cross = concat(α m W_V per head) W_O", "note": "added to the residual stream"},
    ]


def output_steps(config: ModelConfig) -> list[dict]:
    steps = []
    if config.final_norm:
        site = "decoder.final_norm" if config.n_encoder_layers else "final_norm"
        steps.append({"site": site, "title": "Final norm", "equation": f"h = {_norm(config)}",
                      "note": ""})
    if config.head == "mlm":
        steps.append({"site": "head_transform", "title": "Masked-LM transform",
                      "equation": f"h ← Norm({ACTIVATION_NAMES[config.activation]}(h W_t + b_t))",
                      "note": "a dense layer, its activation and a norm before the decoder"})
    head = "W_head = E_token (tied)" if config.tie_embeddings else "W_head: its own (v × d) matrix"
    bias = " + b" if config.lm_head_bias else ""
    logits = f"h W_headᵀ{bias}"
    if config.final_softcap is not None:
        logits = f"c · tanh(({logits}) / c),  c = {config.final_softcap:g}"
        head += f"; soft-capped: every logit squashed smoothly into (−{config.final_softcap:g}, " \
                f"{config.final_softcap:g})"
    steps.append({"site": "logits", "title": "Logits", "equation": f"logits = {logits}", "note": head})
    return steps
