"""Training objectives side by side on tinyshakespeare: causal LM (clm), masked LM (mlm) and
T5's span corruption (span).

    python benchmarks/objectives.py [--data PATH] [--budget 40] [--steps 10] [--repeats 3]
                                    [--threads N] [--out objectives.png]

1. Each objective trains a model of the same width for the same wall time (--budget seconds):
   clm and mlm the same BERT-shaped stack of 4 layers (causal for clm, bidirectional for
   mlm), span a T5-shaped encoder-decoder of 2 + 2 layers (its cross-attention makes it about
   12% larger; the table prints each count), through `glassformer.training.loop.train`. The
   loss curves against seconds go in one PNG and a table prints each final validation loss.
   The losses measure different tasks (the next character; a masked character seen from both
   sides; the characters of the dropped spans): compare each curve's fall, not the numbers.
2. tokens/s of one training step (forward, backward, AdamW) on identical batches, Glassformer's
   against transformers' own model on the same shapes: masked LM against BertForMaskedLM,
   span corruption against T5ForConditionalGeneration; in alternating rounds so a busy machine
   slows both alike; the ratios are printed.

Adding an objective here is one more entry in RUNS.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
import torch

from glassformer import Transformer, get_preset
from glassformer.accel.fast_training import use_fast_training
from glassformer.data import tinyshakespeare
from glassformer.formats.checkpoint import load_model
from glassformer.interpret.params import count_parameters
from glassformer.training.config import TrainConfig
from glassformer.training.loop import train
from glassformer.training.masking import apply_masks, draw_choices
from glassformer.training.metrics import read_metrics
from glassformer.training.objectives import OBJECTIVES
from glassformer.training.span import corrupt, span_counts

DEFAULT_DATA = tinyshakespeare()
# One model shape for every objective; only the attention mask follows the objective.
MODEL = get_preset("tiny-bert").replace(context_length=64, d_model=128, n_layers=4, n_heads=4,
                                        d_ff=512, pooler=False)
TRAIN = TrainConfig(batch_size=12, max_iters=10**6, lr=1e-3, min_lr=1e-4, warmup_iters=10,
                    lr_decay_iters=2000, eval_interval=10**6, eval_iters=20, log_interval=5,
                    sample_tokens=0, device="cpu", seed=1337)
SPAN_MODEL = get_preset("tiny-t5").replace(context_length=64, d_model=128, n_layers=2,
                                           n_encoder_layers=2, n_heads=4, d_head=32, d_ff=512)
RUNS = {  # objective -> its model
    "clm": MODEL.replace(causal=True),
    "mlm": MODEL.replace(causal=False),
    "span": SPAN_MODEL,
}


def run_objective(name: str, data: Path, budget: float, folder: Path) -> dict:
    model = RUNS[name]
    summary = train(data, folder / name, model, TRAIN.replace(objective=name, max_time=budget),
                    progress=False, echo=lambda _: None)
    records = [r for r in read_metrics(folder / name / "metrics.jsonl") if "lr" in r]
    curve = [(r["tokens_seen"] / r["tokens_per_second"], r["train_loss"]) for r in records]
    trained, _, _ = load_model(folder / name / "latest")
    return {"summary": summary, "curve": curve, "vocab": trained.config.vocab_size,
            "params": count_parameters(trained)["total"]}


def plot(results: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    axes = figure.add_subplot()
    for name, result in results.items():
        seconds, losses = zip(*result["curve"], strict=True)
        axes.plot(seconds, losses, label=f"{name} (train)")
    axes.set_xlabel("training seconds (loaded machine)")
    axes.set_ylabel("loss (nats per predicted token)")
    axes.set_title("Objectives at equal parameters and equal wall time")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def batches(vocab: int, mask_id: int, n: int, generator: torch.Generator):
    """n masked-LM batches (inputs, targets) of random characters."""
    B, T = TRAIN.batch_size, MODEL.context_length
    for _ in range(n):
        ids = torch.randint(0, mask_id, (B, T), generator=generator)
        yield apply_masks(ids, draw_choices(B, T, generator), mask_id, vocab)


def step_rates(vocab: int, steps: int, rounds: int) -> tuple[list[float], list[float]]:
    """tokens/s of Glassformer's and transformers' masked-LM step, alternating rounds."""
    import transformers

    torch.manual_seed(0)
    ours = use_fast_training(Transformer(MODEL.replace(vocab_size=vocab, causal=False)))
    theirs = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=vocab, hidden_size=MODEL.d_model, num_hidden_layers=MODEL.n_layers,
        num_attention_heads=MODEL.n_heads, intermediate_size=MODEL.ff_dim,
        max_position_embeddings=MODEL.context_length, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, layer_norm_eps=MODEL.norm_eps))
    ours.train(), theirs.train()
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for m in (ours, theirs)}

    def our_loss(x, y):
        return OBJECTIVES["mlm"].loss(ours, (x, y))

    def their_loss(x, y):
        return theirs(input_ids=x, labels=y).loss

    def rate(model, loss_fn, seed: int) -> float:
        optimizer = optimizers[id(model)]
        data = list(batches(vocab, vocab - 1, steps + 2, torch.Generator().manual_seed(seed)))
        for i, (x, y) in enumerate(data):
            if i == 2:  # two warm-up steps
                start = time.perf_counter()
            loss_fn(x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return steps * x.numel() / (time.perf_counter() - start)

    a, b = [], []
    for r in range(rounds):
        a.append(rate(ours, our_loss, r))
        b.append(rate(theirs, their_loss, r))
    return a, b


def span_batches(vocab: int, n: int, generator: torch.Generator):
    """n span-corruption batches (inputs, decoder inputs, targets) of random characters; the
    top ids of the vocabulary are the sentinels, id 0 end-of-text and the start token."""
    B, T = TRAIN.batch_size, SPAN_MODEL.context_length
    n_spans = span_counts(T)[1]
    sentinels = torch.arange(vocab - n_spans, vocab)  # (n_spans,)
    for _ in range(n):
        ids = torch.randint(1, vocab - n_spans, (B, T), generator=generator)
        masks = OBJECTIVES["span"].draw_masks(B, T, generator)  # (B, T)
        yield corrupt(ids, masks, sentinels, 0, 0)


def span_step_rates(vocab: int, steps: int, rounds: int) -> tuple[list[float], list[float]]:
    """tokens/s (encoder + decoder tokens) of Glassformer's and transformers' T5 step."""
    import transformers

    from glassformer.model.encoder_decoder import build_model

    torch.manual_seed(0)
    config = SPAN_MODEL.replace(vocab_size=vocab)
    ours = build_model(config)
    theirs = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=vocab, d_model=config.d_model, d_kv=config.d_head, d_ff=config.d_ff,
        num_layers=config.n_encoder_layers, num_decoder_layers=config.n_layers,
        num_heads=config.n_heads, relative_attention_num_buckets=config.relative_buckets,
        relative_attention_max_distance=config.relative_max_distance, dropout_rate=0.0,
        feed_forward_proj="relu", layer_norm_epsilon=config.norm_eps, tie_word_embeddings=True,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=0))
    ours.train(), theirs.train()
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for m in (ours, theirs)}

    def rate(model, loss_fn, seed: int) -> float:
        optimizer = optimizers[id(model)]
        data = list(span_batches(vocab, steps + 2, torch.Generator().manual_seed(seed)))
        for i, batch in enumerate(data):
            if i == 2:  # two warm-up steps
                start = time.perf_counter()
            loss_fn(batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        tokens = batch[0].numel() + batch[1].numel()
        return steps * tokens / (time.perf_counter() - start)

    def their_loss(batch):
        inputs, decoder_inputs, targets = batch
        return theirs(input_ids=inputs, decoder_input_ids=decoder_inputs, labels=targets).loss

    a, b = [], []
    for r in range(rounds):
        a.append(rate(ours, lambda batch: OBJECTIVES["span"].loss(ours, batch), r))
        b.append(rate(theirs, their_loss, r))
    return a, b


def report_rates(title: str, ours: list[float], theirs: list[float], their_name: str, args,
                 record: harness.Record) -> None:
    ratio = statistics.median(o / t for o, t in zip(ours, theirs, strict=True))
    mine, other = harness.Timing(tuple(ours)), harness.Timing(tuple(theirs))
    print(f"{title}, batch {TRAIN.batch_size} x {MODEL.context_length} tokens, "
          f"{args.repeats} alternating rounds of {args.steps} steps:")
    print(f"  glassformer  {mine.median:>9,.0f} tokens/s")
    print(f"  transformers {other.median:>9,.0f} tokens/s ({their_name})")
    print(f"  ratio glassformer / transformers: {ratio:.2f} (median of rounds; > 1: faster)")
    record.figure(f"{title}, glassformer", mine, "tokens/s")
    record.figure(f"{title}, transformers ({their_name})", other, "tokens/s")
    record.ratio(f"{title}, glassformer / transformers tokens/s (median of rounds)", ratio)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--budget", type=float, default=40.0, help="training seconds per objective")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (step speed)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("objectives.png"))
    harness.add_arguments(parser, repeats=3)
    args = parser.parse_args()
    if not args.data.is_file():
        sys.exit(f"no corpus at {args.data} (give --data)")
    if args.threads:
        torch.set_num_threads(args.threads)
    record = harness.start("objectives", args)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_objective(name, args.data, args.budget, Path(tmp)) for name in RUNS}
    plot(results, args.out)
    vocab = results["mlm"]["vocab"]  # the character vocabulary + end-of-text + [MASK]
    print(f"{torch.get_num_threads()} threads; budget {args.budget:g} s each")
    print(f"{'objective':<10} {'params':>9} {'iters':>6} {'tokens/s':>9} {'final val loss':>15}")
    for name, result in results.items():
        s = result["summary"]
        print(f"{name:<10} {result['params']:>9,} {s['iters']:>6} {s['tokens_per_second']:>9,.0f} "
              f"{s['val_loss']:>15.4f}")
        record.figure(f"{name}, training", s["tokens_per_second"], "tokens/s", iters=s["iters"],
                      params=result["params"])
        record.figure(f"{name}, final validation loss", s["val_loss"], "loss")
    print(f"loss curves: {args.out}")
    report_rates("masked-LM training step", *step_rates(vocab, args.steps, args.repeats),
                 "BertForMaskedLM", args, record)
    report_rates("span-corruption training step", *span_step_rates(results["span"]["vocab"], args.steps,
                 args.repeats), "T5ForConditionalGeneration", args, record)
    record.figure("peak memory", harness.peak_mb(), "MB")
    record.write()


if __name__ == "__main__":
    main()
