"""Which path a row takes through a decode or serving step, and why: one decision for every
loop that could take the fused step.

    fused     the fused C++ step (accel/fast_decode.py): every layer in one call, no Python
              between layers; where it computes exactly what the row asks
    modules   the model's own modules: the reference, which computes everything (hook sites,
              steering, every cache format, the sink policy)

`choose_path` is asked by `decode_one_token` (one sequence over a dense cache) and by the
serving engine (each request's rows over the paged pool); its reason is what the engine's
step trace shows for the row. The model itself says whether it has a fused step now
(`Transformer.fused_step`: converted, eval mode, no grad, no hooks; `fast_decode.why_not`
names why not).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..accel.fast_decode import why_not
from ..model.sites import Site, parse_site
from ..model.transformer import Transformer
from .config import RequestParams

FUSED, MODULES, GRAPH = "fused", "modules", "graph"

# Prompts up to this many tokens take the fused step in the engine; a longer one's prompt
# rows keep the module path, whose attention over a chunk is one product for all its rows,
# while the fused step's goes row by row (int4 SmolLM2 on 2 cores: 1.25x faster at 1,024
# tokens, even at 2,048, 0.73x at 4,096). A prompt's length is the request's own, so each of
# its tokens still takes one path whatever shares its steps.
FUSED_PROMPT_TOKENS = 2048

# FlexAttention's kernels on CUDA (Triton, PyTorch 2.11) take heads of at least this many
# dimensions (the graph executor's); the CPU's take any.
FLEX_CUDA_HEAD_DIM = 16


@dataclass(frozen=True)
class Path:
    name: str  # FUSED, MODULES or GRAPH
    reason: str  # why, in words


@dataclass(frozen=True)
class Asks:
    """What a row asks of its step, as far as its path goes."""

    kv_dtype: str | None = "fp32"  # its keys' and values' format (None: not chosen yet, float32)
    moves_keys: bool = False  # its cache positions keys itself (the sink policy)
    own_positions: bool = False  # dense rows at positions of their own (left padding)
    sequences: int = 1  # dense: the sequences of the call (the dense fused step takes one)
    paged: bool = False  # rows over the serving engine's paged pool (the step's `rows`)
    attention: str = "fast"  # the engine's attention ("reference": the module path's)
    params: RequestParams | None = None  # the request's settings (capture, steering, adapter)
    adapter_fused: bool = True  # its adapter, if it names one, is built for the fused step
    prompt: int = 0  # the length of the prompt whose rows these are (0: generated tokens)
    graph: bool = False  # the engine runs decoding rows as a compiled graph (serving/graph_path.py)


def choose_path(model: Transformer, asks: Asks) -> Path:
    """The path a row of `model` takes, and why."""
    reason = module_reason(asks)
    if reason is None and asks.graph:
        reason = graph_reason(model, asks)
        if reason is None:
            return Path(GRAPH, "a plain decoding row, in the bucket's graph")
    if reason is not None:
        return Path(MODULES, reason)
    if not model.has_fused_step:
        return Path(MODULES, "the model has no fused step (glassformer.quantize gives one)")
    step = model.fused_step()
    if step is None:
        return Path(MODULES, why_not(model) or "the fused step declines the model as it is now")
    if asks.paged and not hasattr(step, "rows"):
        return Path(MODULES, "the installed fused step decodes one dense cache only")
    params = asks.params
    if params is not None and params.capture:
        return Path(FUSED, "it captures only sites the fused step emits (residuals, attn.out, mlp.out)")
    if params is not None and params.lens is not None:
        return Path(FUSED, "its lens reads the residuals the fused step emits")
    return Path(FUSED, "the fused step computes every row it asks")


def module_reason(asks: Asks) -> str | None:
    """Why the row's asks alone keep it on the module path, whatever the model; or None. The
    reason names the executor that declines: the graph executor where the engine runs one
    (`asks.graph`), else the fused step."""
    executor = "the graph executor" if asks.graph else "the fused step"
    if asks.kv_dtype not in (None, "fp32"):
        return f"{asks.kv_dtype} keys and values ({executor} reads float32)"
    if asks.moves_keys:
        return f"the sink policy moves keys ({executor} keeps each at its text position)"
    if asks.own_positions or asks.sequences != 1:
        return f"several sequences or padded rows over a dense cache ({executor} takes one)"
    if asks.attention != "fast":
        return f"{asks.attention} attention asked ({executor} runs the fast one)"
    if asks.graph:  # what else keeps a row off the graph is graph_reason's to say
        return None
    if asks.prompt > FUSED_PROMPT_TOKENS:
        return f"a prompt over {FUSED_PROMPT_TOKENS} tokens (one attention product per chunk)"
    params = asks.params
    if params is None:
        return None
    if params.changes_model:
        return "it steers or ablates (the fused step has no hook sites)"
    unseen = [site for site in params.capture if fused_source(site) is None]
    if unseen:
        return f"it captures {unseen[0]}, a site the fused step does not emit"
    if params.adapter is not None and not asks.adapter_fused:
        return f"its adapter {params.adapter!r} is not built for the fused step"
    return None


def graph_reason(model: Transformer, asks: Asks) -> str | None:
    """Why a row the module path could take stays there rather than the graph executor
    (plain decoding rows over FlexAttention's masks: causal, a sliding window); or None."""
    config, params = model.config, asks.params
    if model.has_fused_step:
        return ("the model runs a fused C++ step (a --quantize conversion); the graph executor runs "
                "the plain weights")
    if asks.prompt:
        return "a prompt's chunk (the graph executor runs one new token per row)"
    if params is not None and params.inspects:
        return "it captures, steers or reads the lens (the graph executor has no hook sites)"
    if params is not None and params.adapter is not None:
        return f"its adapter {params.adapter!r} runs on the module path (not in the graph executor)"
    if config.position not in ("rope", "learned", "sinusoidal", "none"):
        return (f"{config.position} positions bias the scores (the graph executor's mask is causal "
                "and a window)")
    if config.attn_softcap is not None:
        return "soft-capped scores (the graph executor's attention is plain)"
    if config.layer_windows is not None:
        return "windows differ by layer (the graph executor's mask has one window)"
    if config.rope_long_factors is not None:
        return "LongRoPE turns a request by one of two sets (the graph executor reads one table)"
    if model.embed.tokens.weight.is_cuda and config.head_dim < FLEX_CUDA_HEAD_DIM:
        return (f"heads of {config.head_dim} dimensions (the graph executor's FlexAttention needs "
                f"{FLEX_CUDA_HEAD_DIM} on CUDA)")
    return None


def fused_source(site: str | Site) -> tuple[str, int] | None:
    """Where the fused decode step's emitted rows hold a site (FastDecoder.rows): in its
    residuals, 0 the embedding's output (= blocks.0.resid_pre) and i + 1 the stream after block
    i (blocks.{i}.resid_post = blocks.{i+1}.resid_pre); in its writes, 2 i block i's attn.out
    and 2 i + 1 its mlp.out. None for a site it does not emit."""
    site = site if isinstance(site, Site) else parse_site(site)
    layer, name = site.layer, site.name
    if not site.stack and name == "embed.out":
        return "residuals", 0
    if site.stack or layer is None:
        return None
    if name in ("resid_pre", "resid_post"):
        return "residuals", layer + (name == "resid_post")
    if name in ("attn.out", "mlp.out"):
        return "writes", 2 * layer + (name == "mlp.out")
    return None
