"""One model, every path: random decoder-only configs through every way glassformer runs them.

For a drawn `ModelConfig` with random weights and a weight format, the paths are:
  - `generate` on the plain model (module path, nn.Linear);
  - `generate` after `quantize_model(copy, fmt)`: the fused C++ step where its table accepts
    the config (every field drawn here but T5's relative bias and post-norm), else the module
    path, and the uncached module path (`use_cache=False`);
  - the serving `Engine` with reference and with fast attention, the request alone and
    batched with other random requests arriving at other steps.
The oracle is the module path of the model each path runs: a full forward (no cache) over
the path's own tokens. Its int8 / int4 layers run the same kernels at any number of rows,
and its float layers the same function summed in another order.

Checks, per path:
  - greedy: each token is the oracle's argmax at that step. A different token is accepted
    only where the oracle's top-2 logit margin is below the format's tolerance TIGHT (two
    paths may round a near-tie either way); anything else fails;
  - the engine's logprob of each greedy token is the oracle's within TIGHT;
  - seeded sampling (temperature 1, the same seed) gives the same tokens on every path;
  - the engine alone and batched give the same tokens exactly (batch invariance);
  - the quantized model's oracle logits are within FORMAT_TOLERANCE of the plain model's,
    and its greedy tokens are the plain model's argmax unless the plain margin is below it
    (not for UNBOUNDED_FORMATS, where the format's rounding itself exceeds it).
A path that cannot compute a config may refuse it with a ValueError naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from glassformer import ModelConfig, Transformer
from glassformer.accel import fast_decode, kernels
from glassformer.accel.quantize import quantize_model
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.generation.sampling import SamplingConfig
from glassformer.serving import Engine, EngineConfig, RequestParams

FORMATS = ("plain", "none", "bf16", "int8", "int4")
# Logits on the same weights by two paths: float rounding only (summation order, fused ops).
# int8 / int4 layers round their activations to 8 bits per block, so a float difference of
# one ulp upstream may move an activation by a whole step: a few hundredths in the logits.
TIGHT = {"plain": 2e-3, "none": 2e-3, "bf16": 2e-3, "int8": 3e-2, "int4": 3e-2}
# Logits of the quantized model against the plain model's, in units of the plain logits'
# standard deviation: the weight format's own rounding (int8 / int4 round the activations
# too), measured on these random models at about half of each bound (4-bit blocks of
# Gaussian weights move the logits by over one std).
FORMAT_TOLERANCE = {"plain": 1e-4, "none": 1e-4, "bf16": 0.1, "int8": 0.6, "int4": 2.5}
# Output norms without input norms ("out") scale each sublayer's output, rounding and all, to
# the size of the residual stream, where pre-norm blocks add a fraction of it: int4's rounding
# of these random weights then moves the logits by up to 4.3 std, and a plain model holding
# int4's dequantized weights by as much (the format's own rounding, not a path's). There the
# format is not held against the plain model; every path is still held against its oracle.
UNBOUNDED_FORMATS = {("int4", "out")}
PROMPT, NEW, SEED = 8, 10, 7
SAMPLING = SamplingConfig(temperature=1.0)
FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels are not built")


@st.composite
def configs(draw) -> tuple[ModelConfig, str]:
    position = draw(st.sampled_from(["learned", "sinusoidal", "rope", "alibi", "relative", "none"]))
    d_model = draw(st.sampled_from([32, 48, 64]))
    n_heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if d_model % h == 0]))
    n_kv_heads = draw(st.sampled_from([h for h in (None, 1, 2, n_heads) if h is None or n_heads % h == 0]))
    d_head = draw(st.sampled_from([None, 8, 12, 16]))
    if position == "rope" and (d_head or d_model // n_heads) % 2:
        d_head = 16
    rope = {}
    if position == "rope":
        scaling = draw(st.sampled_from(["none", "linear", "ntk", "yarn", "longrope"]))
        head = d_head or d_model // n_heads
        rope = {"rope_scaling": scaling, "rope_factor": 1.0 if scaling == "none" else 2.0,
                "rope_theta": draw(st.sampled_from([100.0, 10000.0])),
                "rotary_dim": draw(st.sampled_from([None, min(head, max(4, head // 4 * 2))])),
                "rope_local_theta": draw(st.sampled_from([None, 50.0]))}  # the sliding layers
        if scaling == "yarn":
            rope |= {"rope_beta_fast": draw(st.sampled_from([32.0, 8.0])),
                     "rope_truncate": draw(st.booleans()),
                     "rope_attention_factor": draw(st.sampled_from([None, 1.25]))}
        if scaling == "longrope":  # an original context of 16: texts cross it while decoding
            pairs = (rope["rotary_dim"] or head) // 2
            rope |= {"rope_original_context": 16, "rope_short_factors": (1.5,) * pairs,
                     "rope_long_factors": tuple(1.0 + 3.0 * i for i in range(pairs))}
    norm = draw(st.sampled_from(["layernorm", "rmsnorm"]))
    norm_placement = draw(st.sampled_from(["pre", "post", "out", "sandwich"]))
    scale_scores = draw(st.booleans())
    # Gemma's pieces: per-layer windows (then no model-wide one), soft-caps, the score scale
    sliding_window = draw(st.sampled_from([None, 5, 12]))
    layer_windows = draw(st.sampled_from([None, (4, None), (None, 7)])) if sliding_window is None else None
    gemma = {
        "norm_weight_offset": draw(st.sampled_from([0.0, 1.0])) if norm == "rmsnorm" else 0.0,
        "embed_scale": draw(st.booleans()),
        "attn_softcap": draw(st.sampled_from([None, 0.5, 20.0])),
        "final_softcap": draw(st.sampled_from([None, 1.0, 30.0])),
        "attn_scale": draw(st.sampled_from([None, 4.0, 64.0])) if scale_scores else None,
        "layer_windows": layer_windows,
    }
    config = ModelConfig(
        vocab_size=draw(st.sampled_from([50, 64, 97])),
        context_length=64,
        d_model=d_model,
        n_layers=2,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_head=d_head,
        d_ff=draw(st.sampled_from([None, 40, 72, 100])),
        position=position,
        **rope,
        norm=norm,
        norm_placement=norm_placement,
        qk_norm=draw(st.sampled_from(["none", "head", "all"])),
        parallel_block=norm_placement == "pre" and draw(st.booleans()),
        norm_bias=draw(st.booleans()),
        activation=draw(st.sampled_from(["relu", "gelu", "gelu_tanh", "silu"])),
        gated=draw(st.booleans()),
        attn_bias=draw(st.booleans()),
        attn_out_bias=draw(st.booleans()),
        mlp_bias=draw(st.booleans()),
        lm_head_bias=draw(st.booleans()),
        final_norm=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()),
        sliding_window=sliding_window,
        attention_kernel=draw(st.sampled_from(["reference", "sdpa", "flash"])),
        scale_scores=scale_scores,
        scale_head_input=draw(st.booleans()),
        init_std=0.2,
        **gemma,
    )
    return config, draw(st.sampled_from(FORMATS))


@dataclasses.dataclass
class Case:
    config: ModelConfig
    fmt: str
    seed: int  # the weights'
    prompt: list[int]
    others: list[tuple[list[int], RequestParams]]  # requests sharing the engine's steps
    arrivals: list[int]  # the step before which each batched request is submitted


@torch.inference_mode()
def _logits(oracle: Transformer, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The oracle's next-token logits (len(tokens), V) at each step of prompt + tokens: one
    pass over the whole text, or under LongRoPE, whose set follows the text's length, a pass
    over the text as it was at each step."""
    if oracle.config.rope_scaling == "longrope":
        return torch.cat([oracle(torch.tensor([prompt + tokens[:i]]))[0, -1:].float()
                          for i in range(len(tokens))])
    ids = torch.tensor([prompt + tokens[:-1]])  # (1, T)
    return oracle(ids)[0, len(prompt) - 1 :].float()


def _check_greedy(where: str, logits: torch.Tensor, tokens: list[int], tolerance: float) -> str:
    """Why the tokens are not each the argmax of their step's logits (or within `tolerance`
    of it), or "" when they are."""
    for step, (row, token) in enumerate(zip(logits, tokens, strict=True)):
        best = int(row.argmax())
        gap = float(row[best] - row[token])
        if token != best and gap >= tolerance:
            return (f"{where}: step {step} picked {token}, the oracle {best} by a margin of "
                    f"{gap:.3g} (tolerance {tolerance:.3g})")
    return ""


def _engine(model, requests, attention, arrivals):
    """Runs (prompt, params) requests, request i submitted before step arrivals[i]; returns
    each request's (tokens, logprobs of its tokens)."""
    engine = Engine(model, None, EngineConfig(attention=attention, block_size=4, n_blocks=64,
                                              token_budget=12, max_batch=4))
    handles, step = {}, 0
    while len(handles) < len(requests) or engine.has_work():
        for i, (prompt, params) in enumerate(requests):
            if arrivals[i] == step:
                handles[i] = engine.submit(prompt, params)
        engine.step()
        step += 1
        assert step < 500, "the engine did not finish"
    out = []
    for i in range(len(requests)):
        events = [e for e in handles[i] if e.token_id is not None]
        logprobs = [e.logprobs.logprob for e in events if e.logprobs is not None]
        out.append((handles[i].result.generated_ids, logprobs))
    return out


def _refused(error: ValueError) -> bool:
    """Whether a path refused the config in one line that names a ModelConfig field."""
    message = str(error)
    return "\n" not in message and message.split(":")[0].strip() in FIELDS


@st.composite
def cases(draw) -> Case:
    config, fmt = draw(configs())
    vocab = config.vocab_size
    ids = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20)
    others = [(draw(ids), RequestParams(max_new_tokens=draw(st.integers(1, 12)), eos_ids=(), seed=3,
                                        sampling=SAMPLING)) for _ in range(2)]
    return Case(config, fmt, draw(st.integers(0, 2**16)),
                draw(st.lists(st.integers(0, vocab - 1), min_size=PROMPT, max_size=PROMPT)),
                others, [draw(st.integers(0, 4)) for _ in range(4)])


# 150 draws; test_forced_decisions.py reruns it on fewer under each forced decision
EXAMPLES = int(os.environ.get("GLASSFORMER_PROPERTY_EXAMPLES", "150"))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_every_path_computes_what_the_module_path_computes(case):
    check(case)


def check(case: Case) -> None:
    config, fmt, prompt = case.config, case.fmt, case.prompt
    torch.manual_seed(case.seed)
    plain = Transformer(config).eval()
    model = plain if fmt == "plain" else quantize_model(copy.deepcopy(plain), fmt)
    greedy = GenerationConfig(max_new_tokens=NEW, eos_ids=())
    sampled = GenerationConfig(max_new_tokens=NEW, eos_ids=(), seed=SEED, sampling=SAMPLING)
    oracle = model
    if fmt != "plain":  # the fused step takes every config its table accepts
        assert fast_decode.can_build(model) == (fast_decode.CAPABILITIES.why_not(config) is None)

    # generate: the plain module path, the converted model (fused step or module path), uncached
    runs = {"generate(plain)": plain, f"generate({fmt})": model}
    greedy_tokens, sampled_tokens = {}, {}
    for name, m in runs.items():
        greedy_tokens[name] = generate(m, prompt, greedy).generated_ids
        sampled_tokens[name] = generate(m, prompt, sampled).generated_ids
    uncached = f"generate({fmt}, use_cache=False)"
    for tokens, settings_ in ((greedy_tokens, greedy), (sampled_tokens, sampled)):
        no_cache = dataclasses.replace(settings_, use_cache=False)
        tokens[uncached] = generate(model, prompt, no_cache).generated_ids

    # the engine, alone and among other requests arriving at other steps
    lone = (prompt, RequestParams(max_new_tokens=NEW, eos_ids=(), logprobs=2))
    seeded = (prompt, RequestParams(max_new_tokens=NEW, eos_ids=(), seed=SEED, sampling=SAMPLING))
    engine_logprobs, problems = {}, []
    for attention in ("reference", "fast"):
        try:
            alone = _engine(model, [lone], attention, [0])[0]
            batched = _engine(model, [lone, seeded, *case.others], attention, case.arrivals)
        except ValueError as error:
            assert _refused(error), f"engine({attention}) failed without naming a field: {error}"
            continue
        where = f"engine({attention}, {fmt})"
        if batched[0][0] != alone[0]:
            problems.append(f"{where}: batched greedy tokens differ from alone")
        greedy_tokens[where] = alone[0]
        sampled_tokens[where] = batched[1][0]
        engine_logprobs[where] = alone

    # every path of the model's own weights against its oracle
    for where, tokens in greedy_tokens.items():
        if where == "generate(plain)" and fmt != "plain":
            continue
        problems.append(_check_greedy(where, _logits(oracle, prompt, tokens), tokens, TIGHT[fmt]))
    for where, (tokens, logprobs) in engine_logprobs.items():
        expected = torch.log_softmax(_logits(oracle, prompt, tokens), -1)
        expected = expected[torch.arange(len(tokens)), tokens]  # (NEW,)
        gap = float((torch.tensor(logprobs) - expected).abs().max())
        if gap > TIGHT[fmt]:
            problems.append(f"{where}: greedy tokens' logprobs off the oracle's by {gap:.3g}")
    reference = sampled_tokens[f"generate({fmt}, use_cache=False)"]
    for where, tokens in sampled_tokens.items():
        if where == "generate(plain)" and fmt not in ("plain", "none"):
            continue
        if tokens != reference:
            problems.append(f"{where}: seeded sampled tokens differ from the module path's")

    # the weight format against the plain model
    if (fmt, config.norm_placement) not in UNBOUNDED_FORMATS:
        tokens = greedy_tokens[f"generate({fmt}, use_cache=False)"]
        plain_logits = _logits(plain, prompt, tokens)
        tolerance = FORMAT_TOLERANCE[fmt] * max(float(plain_logits.std()), 1.0)
        gap = float((_logits(oracle, prompt, tokens) - plain_logits).abs().max())
        if gap > tolerance:
            problems.append(f"{fmt}: logits off the plain model's by {gap:.3g} (tolerance {tolerance:.3g})")
        problems.append(_check_greedy(f"generate({fmt}) against the plain model", plain_logits,
                                      tokens, tolerance))
    problems = [p for p in problems if p]
    assert not problems, f"{config} {fmt}:\n" + "\n".join(problems)
