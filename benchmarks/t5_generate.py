"""Encoder-decoder generation speed: greedy decoding of a t5-small-shaped model (random
weights, 60M parameters) from one source, glassformer (encoder once, KV cache with the
cross-attention keys and values kept) against Hugging Face `generate` on the same weights.

End-to-end seconds per generation (encoder + N new tokens), best of --repeats rounds, the two
alternating; ratio > 1: glassformer is faster. End-of-text is switched off in both so every
round makes N tokens, and the tokens are checked equal. Run:
    .venv/bin/python benchmarks/t5_generate.py [--source 64] [--new 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import time

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
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ours, hf = models()
    source = torch.randint(2, ours.config.vocab_size, (1, args.source),
                           generator=torch.Generator().manual_seed(1))
    config = GenerationConfig(max_new_tokens=args.new, eos_ids=())
    best_ours = best_hf = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        mine = generate(ours, source[0].tolist(), config).generated_ids
        best_ours = min(best_ours, time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad():
            theirs = hf.generate(source, attention_mask=torch.ones_like(source), do_sample=False,
                                 num_beams=1, max_new_tokens=args.new, decoder_start_token_id=0)
        best_hf = min(best_hf, time.perf_counter() - start)
    same = mine == theirs[0, 1:].tolist()
    print(f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"t5-small shape, source {args.source} tokens, {args.new} new tokens, greedy")
    print(f"glassformer  {best_ours:.3f} s   ({args.new / best_ours:.1f} tok/s)")
    print(f"transformers {best_hf:.3f} s   ({args.new / best_hf:.1f} tok/s)")
    print(f"ratio (transformers / glassformer): {best_hf / best_ours:.2f}   tokens equal: {same}")


if __name__ == "__main__":
    main()
