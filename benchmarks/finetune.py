"""Fine-tuning a pretrained model: Glassformer against transformers + peft, a LoRA quality run,
and the cost of serving an adapter.

    python benchmarks/finetune.py [--model smollm2-135m-instruct] [--steps 10] [--batch 4]
        [--seq 512] [--threads N] [--repeats 3]
    python benchmarks/finetune.py --quality [--minutes 10]
    python benchmarks/finetune.py --served [--requests 8] [--new-tokens 64]

Speed (default): full fine-tuning and LoRA (rank 16, alpha 32, every linear layer of every
block) of the same weights, on the same tokens (tinyshakespeare in the model's tokenizer), at
the same sequence length, batch and threads, in float32. Glassformer runs `train --init` as
its users do; the baseline is transformers' model (+ peft's LoRA) in a plain loop: AdamW,
cross-entropy, gradient clipping at 1. Each contender runs as its own process, one after
another in alternating rounds, and reports training tokens/s (every step timed, the first
included, as `train` counts them; loading and saving left out) and its peak resident memory;
the ratios are printed.

--quality: LoRA on the first 90% of tinyshakespeare's characters for --minutes, then the
held-out perplexity (windows of --seq tokens over the last 10%) and a greedy sample, before
and after.

--served: the engine's anchor workload ("The meaning of life is", --new-tokens greedy, --requests
at once) on the converted model as `glassformer serve` runs it, with no adapter and with half
the requests on a rank-16 all-linear adapter: tokens/s each and the adapter's cost.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import numpy as np
import torch
import torch.nn.functional as F

from glassformer.data import tinyshakespeare

DATA = tinyshakespeare()
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONTENDERS = ("glassformer full", "transformers full", "glassformer lora", "transformers+peft lora")
ANCHOR = "The meaning of life is"


def prepare(model: str, data: Path, folder: Path) -> tuple[Path, Path]:
    """The base as a Hugging Face folder (both sides read the same weights) and the text's
    token ids in its tokenizer (uint32)."""
    from glassformer import load
    from glassformer.formats.export import export_hf

    language_model = load(model)
    hf = export_hf(language_model.model, language_model.tokenizer, folder / "base")
    ids = np.asarray(language_model.tokenizer.encode(data.read_text(encoding="utf-8")), dtype=np.uint32)
    ids.tofile(folder / "tokens.bin")
    return hf, folder / "tokens.bin"


def glassformer_worker(args: argparse.Namespace, method: str) -> float:
    """Training tokens/s of `glassformer train --init` (LoRA or full)."""
    from glassformer.training.config import TrainConfig
    from glassformer.training.loop import train

    lora = {"lora_rank": 16, "lora_alpha": 32.0} if method == "lora" else {}
    config = TrainConfig(init=str(args.base), batch_size=args.batch, max_iters=args.steps, lr=args.lr,
                         warmup_iters=0, eval_interval=10**9, eval_iters=1, log_interval=args.steps,
                         sample_tokens=0, device="cpu", **lora)
    with tempfile.TemporaryDirectory() as out:
        summary = train(args.data, Path(out) / "run", {"context_length": args.seq}, config,
                        progress=False, echo=lambda s: None)
    return summary["tokens_per_second"]


def transformers_worker(args: argparse.Namespace, method: str) -> float:
    """Training tokens/s of transformers' model (+ peft's LoRA) in a plain float32 loop."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.float32)
    if method == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                           target_modules=PEFT_TARGETS))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)
    ids = torch.from_numpy(np.fromfile(args.tokens, dtype=np.uint32).astype(np.int64))
    generator = torch.Generator().manual_seed(1337)
    seconds = 0.0
    for _ in range(args.steps):
        start = time.perf_counter()
        starts = torch.randint(0, len(ids) - args.seq - 1, (args.batch,), generator=generator)
        rows = torch.stack([ids[s : s + args.seq + 1] for s in starts.tolist()])  # (B, T + 1)
        logits = model(input_ids=rows[:, :-1]).logits  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - start
    return args.steps * args.batch * args.seq / seconds


def run_worker(args: argparse.Namespace, contender: str) -> dict:
    """One contender in its own process: {"tokens_per_second", "peak_mb"}."""
    command = [sys.executable, __file__, "--worker", contender, "--base", str(args.base),
               "--tokens", str(args.tokens), "--data", str(args.data), "--steps", str(args.steps),
               "--batch", str(args.batch), "--seq", str(args.seq), "--lr", str(args.lr),
               "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{contender}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def speed(args: argparse.Namespace, record: harness.Record, folder: Path) -> None:
    args.base, args.tokens = prepare(args.model, args.data, folder)
    args.steps = args.steps or 10
    rates = {name: [] for name in CONTENDERS}
    peaks = {name: [] for name in CONTENDERS}
    for _ in range(args.repeats):
        for name in CONTENDERS:
            result = run_worker(args, name)
            rates[name].append(result["tokens_per_second"])
            peaks[name].append(result["peak_mb"])
    print(f"{args.model}: sequence {args.seq}, batch {args.batch}, {args.steps} steps, "
          f"{args.threads} threads, float32")
    for name in CONTENDERS:
        timing = harness.Timing(tuple(rates[name]))
        print(f"{name:24s} {timing.text('tokens/s', 0)}, peak {max(peaks[name]):,.0f} MB")
        record.figure(f"{name}, training", timing, "tokens/s")
        record.figure(f"{name}, peak resident memory", max(peaks[name]), "MB")
    for method, ours, theirs in (("full", *CONTENDERS[:2]), ("lora", *CONTENDERS[2:])):
        faster = np.median(rates[ours]) / np.median(rates[theirs])
        smaller = max(peaks[ours]) / max(peaks[theirs])
        print(f"{method}: glassformer / {theirs.split()[0]} tokens/s {faster:.2f}x, "
              f"peak memory {smaller:.2f}x")
        record.ratio(f"{method}: glassformer / {theirs.split()[0]} tokens/s", faster)
        record.ratio(f"{method}: glassformer / {theirs.split()[0]} peak memory", smaller)


def windowed_perplexity(model, ids: np.ndarray, seq: int, batch: int) -> float:
    """exp of the mean next-token loss over consecutive windows of `seq` tokens."""
    losses, count = 0.0, 0
    starts = list(range(0, len(ids) - seq - 1, seq))
    with torch.no_grad():
        for i in range(0, len(starts), batch):
            rows = torch.from_numpy(np.stack([ids[s : s + seq + 1] for s in starts[i : i + batch]]))
            rows = rows.long()  # (b, seq + 1)
            logits = model(rows[:, :-1])  # (b, seq, V)
            losses += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1),
                                      reduction="sum").item()
            count += rows[:, 1:].numel()
    return math.exp(losses / count)


def quality(args: argparse.Namespace, record: harness.Record, folder: Path) -> None:
    from glassformer import load
    from glassformer.language_model import LanguageModel
    from glassformer.training.config import TrainConfig
    from glassformer.training.loop import train
    from glassformer.training.lora import apply_adapter, merge_lora

    text = args.data.read_text(encoding="utf-8")
    cut = int(0.9 * len(text))
    (folder / "train.txt").write_text(text[:cut], encoding="utf-8")
    language_model = load(args.model)
    held = np.asarray(language_model.tokenizer.encode(text[cut:]), dtype=np.int64)[: args.eval_tokens]

    def measure(model) -> tuple[float, str]:
        sample = LanguageModel(model, language_model.tokenizer).generate(args.prompt, args.sample_tokens)
        return windowed_perplexity(model, held, args.seq, args.batch), sample.text

    before = measure(language_model.model)
    config = TrainConfig(init=args.model, batch_size=args.batch, max_iters=args.steps or 10**9,
                         max_time=args.minutes * 60, lr=args.lr, min_lr=args.lr / 10,
                         warmup_iters=min(20, args.steps or 20), eval_interval=10**9, eval_iters=1,
                         log_interval=10, sample_tokens=0, val_fraction=0.01, device="cpu",
                         lora_rank=16, lora_alpha=32.0)
    summary = train(folder / "train.txt", folder / "run", {"context_length": args.seq}, config,
                    progress=False, echo=lambda s: None)
    tuned = load(args.model).model
    apply_adapter(tuned, folder / "run", base=args.model)
    after = measure(merge_lora(tuned))
    drop = 1 - after[0] / before[0]
    print(f"LoRA r=16 on {args.model}: {summary['iters']} steps, {summary['tokens_seen']:,} tokens in "
          f"{summary['wall_seconds']:.0f} s ({summary['tokens_per_second']:.0f} tokens/s), "
          f"{args.threads} threads")
    print(f"held-out perplexity (last 10%, {len(held):,} tokens): before {before[0]:.2f}, after "
          f"{after[0]:.2f} ({drop:.1%} lower)")
    print(f"sample before: {before[1]!r}\nsample after:  {after[1]!r}")
    record.figure("held-out perplexity before", before[0], "perplexity")
    record.figure("held-out perplexity after", after[0], "perplexity")
    record.figure("LoRA training", summary["tokens_per_second"], "tokens/s", steps=summary["iters"])
    record.ratio("held-out perplexity drop", drop)
    record.notes.update(sample_before=before[1], sample_after=after[1], prompt=args.prompt)


def served_adapter(language_model, base: str, folder: Path) -> None:
    """A rank-16 adapter on every linear layer of `language_model` (loaded with no quantize;
    its model gets the LoRA layers), B random as a trained one's, saved in `folder` for `base`."""
    from glassformer.training.lora import LoRAConfig, add_lora, save_adapter

    config = LoRAConfig(16, 32.0)
    add_lora(language_model.model, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B is zero when a run starts: a trained adapter's is not
        for name, param in language_model.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 1e-3)
    save_adapter(folder, language_model.model, config, base)


def served(args: argparse.Namespace, record: harness.Record, folder: Path) -> None:
    """The anchor workload with no adapter, and with half its requests on one."""
    from glassformer import load
    from glassformer.serving import Engine, EngineConfig, RequestParams

    served_adapter(load(args.model), args.model, folder)
    served_model = load(args.model, quantize="none")
    engine = Engine(served_model.model, served_model.tokenizer, EngineConfig(), base=args.model)
    engine.load_adapter("adapter", str(folder))
    prompt = served_model.tokenizer.encode(ANCHOR)

    def workload(adapted: int) -> None:
        for i in range(args.requests):
            engine.submit(prompt, RequestParams(max_new_tokens=args.new_tokens, eos_ids=(),
                                                adapter="adapter" if i < adapted else None))
        engine.run_until_done()

    tokens = args.requests * args.new_tokens
    times = harness.alternating({"base": lambda: workload(0),
                                 "half": lambda: workload(args.requests // 2)}, args.repeats)
    base, half = times["base"].per(tokens), times["half"].per(tokens)
    cost = 1 - half.median / base.median
    print(f"anchor workload, {args.requests} requests x {args.new_tokens} tokens, {args.threads} threads")
    print(f"no adapter         {base.text('tokens/s', 1)}")
    print(f"half on an adapter {half.text('tokens/s', 1)}")
    print(f"the adapter's cost: {cost:.1%} of the throughput")
    record.figure("anchor workload, no adapter", base, "tokens/s")
    record.figure("anchor workload, half the requests on an adapter", half, "tokens/s")
    record.ratio("served adapter cost (1 - half / none)", cost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default 10; --quality: a cap, default none)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quality", action="store_true", help="the LoRA quality run")
    parser.add_argument("--minutes", type=float, default=10.0, help="--quality: training time")
    parser.add_argument("--eval-tokens", type=int, default=None, help="--quality: held-out tokens used")
    parser.add_argument("--prompt", default="ROMEO:\n", help="--quality: the sample's prompt")
    parser.add_argument("--sample-tokens", type=int, default=60)
    parser.add_argument("--served", action="store_true", help="the served-adapter throughput")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--base", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=Path, help=argparse.SUPPRESS)
    harness.add_arguments(parser, repeats=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker is not None:
        side, method = args.worker.split()
        rate = (glassformer_worker if side == "glassformer" else transformers_worker)(args, method)
        print(json.dumps({"tokens_per_second": rate, "peak_mb": harness.peak_mb()}))
        return
    mode = "quality" if args.quality else "served" if args.served else "speed"
    record = harness.start(f"finetune_{mode}" if mode != "speed" else "finetune", args)
    with tempfile.TemporaryDirectory(prefix="glassformer-finetune-") as folder:
        {"speed": speed, "quality": quality, "served": served}[mode](args, record, Path(folder))
    record.write()


if __name__ == "__main__":
    main()
