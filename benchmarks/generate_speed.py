"""Generation speed: decode tokens/s with and without the KV cache at several prompt lengths,
prefill tokens/s, the share of decode time outside matrix work, and Hugging Face `generate`
on the same weights as the competitor (ratio > 1: glassformer is faster).

Both are timed inside one generation: prefill = prompt tokens / time to the first new token,
decode = (N - 1) / time from the first to the last new token (HF through a streamer that notes
the time of each token); the median of --repeats rounds (min and max in the record), the two
alternating. Run:
    .venv/bin/python benchmarks/generate_speed.py                 # small random Llama-shaped model
    .venv/bin/python benchmarks/generate_speed.py --smollm2       # SmolLM2-135M-Instruct (GGUF)
    .venv/bin/python benchmarks/generate_speed.py --compile       # + torch.compile of the decode step
"""

from __future__ import annotations

import argparse
import time

import harness
import torch
import transformers

from glassformer import Transformer
from glassformer.formats.huggingface import config_from_hf, state_dict
from glassformer.generation.core import decode_one_token, prefill
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.model.kv_cache import KVCache

MATRIX_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_efficient_attention")


def small_models() -> tuple[Transformer, torch.nn.Module]:
    """A random Llama-shaped model (4 layers, d=256, GQA) in transformers and in glassformer."""
    hf_config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    return _ours_from_hf(hf, hf_config.to_dict()), hf


def smollm2_models() -> tuple[Transformer, torch.nn.Module]:
    from glassformer.formats.gguf import load_gguf
    from glassformer.formats.hub import model_path

    path = model_path("smollm2-135m-instruct")
    ours, _ = load_gguf(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return ours, hf


def _ours_from_hf(hf: torch.nn.Module, hf_config: dict) -> Transformer:
    config = config_from_hf(hf_config)
    model = Transformer(config).eval()
    tensors = {k: v.detach() for k, v in hf.state_dict().items()}
    model.load_state_dict(state_dict(config, hf_config["model_type"], tensors, model), strict=True)
    return model


class _Clock:
    """A transformers streamer that notes when the first and the last new token appear."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:  # first call: the prompt; then one call per new token
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def ours_once(model: Transformer, prompt: list[int], n: int, use_cache: bool) -> tuple[float, float, list]:
    """(prefill tokens/s, decode tokens/s, generated ids) from the GenerationResult's own clock."""
    result = generate(model, prompt, GenerationConfig(max_new_tokens=n, eos_ids=(), use_cache=use_cache))
    return result.prefill_tokens_per_second, result.decode_tokens_per_second, result.generated_ids


def hf_once(model: torch.nn.Module, prompt: list[int], n: int, use_cache: bool) -> tuple[float, float, list]:
    ids, clock = torch.tensor([prompt]), _Clock()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, use_cache=use_cache, pad_token_id=0, streamer=clock)
    first, last = clock.times[1], clock.times[-1]  # the first new token ends the prefill
    return len(prompt) / (first - start), (n - 1) / (last - first), out[0, len(prompt):].tolist()


def rounds(repeats: int, runs, prompt: list[int], n: int, use_cache: bool) -> list[tuple]:
    """Each (run, model)'s prefill and decode rates over `repeats` rounds, alternating, and its ids."""
    results = [[] for _ in runs]
    for _ in range(repeats):
        for mine, (run, model) in zip(results, runs, strict=True):
            mine.append(run(model, prompt, n, use_cache))
    return [(harness.Timing(tuple(r[0] for r in rs)), harness.Timing(tuple(r[1] for r in rs)), rs[0][2])
            for rs in results]


def matrix_share(model: Transformer, prompt: list[int], n: int) -> tuple[float, float]:
    """(share of decode wall time in matrix ops, wall seconds per step), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    cache = KVCache(model.config, 1, max_length=len(prompt) + n + 1)
    with torch.inference_mode():
        token = prefill(model, torch.tensor([prompt]), cache).argmax(-1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(n):
                token = decode_one_token(model, token, cache).argmax(-1)
                token.item()
            wall = time.perf_counter() - start
    matrix = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATRIX_OPS) / 1e6
    return matrix / wall, wall / n


def compiled_decode_rate(model: Transformer, prompt: list[int], n: int, repeats: int) -> dict:
    """Eager and compiled decode tokens/s of a loop over decode_one_token with a preallocated cache
    (the prefill untimed), their rounds alternating."""
    compiled = torch.compile(decode_one_token)

    def loop(step) -> float:
        cache = KVCache(model.config, 1, max_length=len(prompt) + n + 1)
        with torch.inference_mode():
            token = prefill(model, torch.tensor([prompt]), cache).argmax(-1)
            start = time.perf_counter()
            for _ in range(n):
                token = step(model, token, cache).argmax(-1)
                token.item()
            return n / (time.perf_counter() - start)

    started = time.perf_counter()
    loop(compiled)  # compiles (a static graph, then one with a symbolic cache length)
    loop(compiled)
    print(f"  torch.compile warm-up: {time.perf_counter() - started:.0f} s")
    samples = [(loop(decode_one_token), loop(compiled)) for _ in range(repeats)]
    return {"eager": harness.Timing(tuple(s[0] for s in samples)),
            "compiled": harness.Timing(tuple(s[1] for s in samples))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct, not the small model")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the decode step")
    harness.add_arguments(parser, repeats=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    record = harness.start("generate_speed", args)
    ours, hf = smollm2_models() if args.smollm2 else small_models()
    lengths = args.prompt_lengths or ([16, 128, 512] if args.smollm2 else [16, 128, 512])
    n = args.new_tokens or (16 if args.smollm2 else 32)
    name = "SmolLM2-135M" if args.smollm2 else "small Llama (4 layers, d=256, GQA 8/4, vocab 4096)"
    print(f"{name}; {n} new tokens; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    vocab = ours.config.vocab_size
    header = (f"{'prompt':>6} {'prefill tok/s':>13} {'HF':>6} {'ratio':>5} | {'decode tok/s':>12} {'HF':>6} "
              f"{'ratio':>5} | {'no cache':>8} {'HF':>6} {'cache x':>7} | {'same ids':>8}")
    print(header)
    for length in lengths:
        prompt = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        runs = [(ours_once, ours), (hf_once, hf)]
        (pre_t, dec_t, ids), (hf_pre_t, hf_dec_t, hf_ids) = rounds(args.repeats, runs, prompt, n, True)
        (_, slow_t, slow_ids), (_, hf_slow_t, _) = rounds(1, runs, prompt, n, False)
        same = ids == hf_ids == slow_ids
        pre, dec, hf_pre, hf_dec = pre_t.median, dec_t.median, hf_pre_t.median, hf_dec_t.median
        slow, hf_slow = slow_t.median, hf_slow_t.median
        for label, timing in (("prefill", pre_t), ("prefill, transformers", hf_pre_t), ("decode", dec_t),
                              ("decode, transformers", hf_dec_t), ("decode without cache", slow_t),
                              ("decode without cache, transformers", hf_slow_t)):
            record.figure(f"prompt {length}: {label}", timing, "tokens/s")
        record.ratio(f"prompt {length}: prefill, glassformer / transformers", pre / hf_pre)
        record.ratio(f"prompt {length}: decode, glassformer / transformers", dec / hf_dec)
        record.notes[f"prompt {length}: same ids"] = same
        print(f"{length:>6} {pre:>13.0f} {hf_pre:>6.0f} {pre / hf_pre:>5.2f} | {dec:>12.1f} {hf_dec:>6.1f} "
              f"{dec / hf_dec:>5.2f} | {slow:>8.1f} {hf_slow:>6.1f} {dec / slow:>7.1f} | {str(same):>8}")
    prompt = list(range(1, lengths[len(lengths) // 2] + 1))
    share, step = matrix_share(ours, prompt, n)
    print(f"decode at prompt {len(prompt)}: {step * 1e3:.2f} ms/step under the profiler, "
          f"{share:.0%} in matrix ops ({', '.join(op.removeprefix('aten::') for op in MATRIX_OPS[:3])}, "
          f"attention), {1 - share:.0%} outside (Python, small ops, dispatch)")
    record.figure(f"decode at prompt {len(prompt)}: share in matrix ops", share, "fraction")
    if args.compile:
        rates = compiled_decode_rate(ours, prompt, n, args.repeats)
        eager, compiled = rates["eager"].median, rates["compiled"].median
        print(f"decode step at prompt {len(prompt)}: eager {eager:.1f} tok/s, "
              f"torch.compile {compiled:.1f} tok/s, x{compiled / eager:.2f}")
        for name, timing in rates.items():
            record.figure(f"decode at prompt {len(prompt)}, {name}", timing, "tokens/s")
        record.ratio("torch.compile / eager decode rate", compiled / eager)
    record.figure("peak memory", harness.peak_mb(), "MB")
    record.write()


if __name__ == "__main__":
    main()
