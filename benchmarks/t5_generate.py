"""Encoder-decoder generation speed: greedy decoding of a t5-small-shaped model (random
weights, 60M parameters) from one source, glassformer (encoder once, KV cache with the
cross-attention keys and values kept) against Hugging Face `generate` on the same weights.

End-to-end seconds per generation (encoder + N new tokens), the median of --repeats rounds, the
two alternating; ratio > 1: glassformer is faster. End-of-text is switched off in both so every
round makes N tokens, and the tokens are checked equal. Run:
    .venv/bin/python benchmarks/t5_generate.py [--source 64] [--new 32] [--repeats 3]
"""

from __future__ import annotations

import argparse

import harness
import torch
import transformers

from glassformer.formats.huggingface import config_from_hf, state_dict
from glassformer.generation.generate import GenerationConfig, generate
from glassformer.model.encoder_decoder import EncoderDecoder


def models() -> tuple[EncoderDecoder, torch.nn.Module]:
    hf_config = transformers.T5Config(dropout_rate=0.0)  # t5-small's shape
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(hf_config).eval()
    hf.generation_config.eos_token_id = None
    config = config_from_hf(hf_config.to_dict() | {"model_type": "t5"})
    ours = EncoderDecoder(config).eval()
    tensors = {k: v.detach() for k, v in hf.state_dict().items()}
    ours.load_state_dict(state_dict(config, "t5", tensors, ours), strict=True)
    return ours, hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=int, default=64, help="source tokens")
    parser.add_argument("--new", type=int, default=32, help="new tokens")
    harness.add_arguments(parser, repeats=3)
    args = parser.parse_args()
    record = harness.start("t5_generate", args)
    ours, hf = models()
    source = torch.randint(2, ours.config.vocab_size, (1, args.source),
                           generator=torch.Generator().manual_seed(1))
    config = GenerationConfig(max_new_tokens=args.new, eos_ids=())
    out = {}

    def run_ours():
        out["ours"] = generate(ours, source[0].tolist(), config).generated_ids

    def run_hf():
        with torch.no_grad():
            out["hf"] = hf.generate(source, attention_mask=torch.ones_like(source), do_sample=False,
                                    num_beams=1, max_new_tokens=args.new, decoder_start_token_id=0)

    times = harness.alternating({"glassformer": run_ours, "transformers": run_hf}, args.repeats, warmup=0)
    same = out["ours"] == out["hf"][0, 1:].tolist()
    print(f"t5-small shape, source {args.source} tokens, {args.new} new tokens, greedy")
    for name, timing in times.items():
        print(f"{name:<12} {timing.text('s', 3)}   ({args.new / timing.median:.1f} tok/s)")
        record.figure(f"{name} generation", timing, "s")
    ratio = times["transformers"].median / times["glassformer"].median
    print(f"ratio (transformers / glassformer): {ratio:.2f}   tokens equal: {same}")
    record.ratio("transformers / glassformer time", ratio)
    record.figure("peak memory", harness.peak_mb(), "MB")
    record.notes["tokens equal"] = same
    record.write()


if __name__ == "__main__":
    main()
