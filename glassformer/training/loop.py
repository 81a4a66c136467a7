"""The training loop, as a library function: `train(data, out_dir, model_config, train_config)`.

It reads top to bottom as nanoGPT's train.py does: open the run (run.py: checks, data, model,
optimizer, resume), then step until the budget is spent, logging every log_interval steps and
evaluating (and saving) every eval_interval steps and at the end. One step (step.py) draws
world_size · grad_accum · batch_size windows with the run's seeded generator; each process
takes its own slice, so the result does not depend on how many processes share the work.
AdamW (decay on matrices only) or Muon + AdamW (optim.py), warmup + cosine (schedule.py),
clipping, accumulation; evaluation on a fixed set of validation windows; checkpoints that
resume exactly.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from ..accel.threads import ThreadPolicy
from ..model.config import ModelConfig
from . import distributed
from .allocator import keep_freed_memory
from .config import TrainConfig
from .metrics import plot_losses
from .run import Run, check_finite
from .step import bf16_supported


def train(data, out_dir, model_config: ModelConfig | dict | None, config: TrainConfig,
          resume: bool = False, progress: bool = True, echo=tqdm.write,
          threads: ThreadPolicy | None = None, announce: Callable[[str], None] | None = None) -> dict:
    """Train on the text at `data` (file(s) or folder) into the run folder `out_dir`.
    With `config.init` the model is the pretrained one: `model_config` may then be None or
    give fields (a dict) that must agree with it (see training/pretrained.py).
    `echo` prints the evaluations and samples; `threads` (the process's policy, if any) is
    revisited every step; `announce` is told, in a line, of a tokenizer trained (a wait of
    seconds) before it starts. Returns a summary (iters, losses, tokens/s, checkpoint path ...)."""
    started = time.perf_counter()
    keep_freed_memory()
    process = distributed.setup(config.device)
    try:
        run = Run.open(data, Path(out_dir), model_config, config, resume, process, announce)
        return _loop(run, progress, echo, threads, started)
    finally:
        distributed.teardown(process)


def _loop(run: Run, progress: bool, echo, threads: ThreadPolicy | None, started: float) -> dict:
    """Steps until max_iters (or max_time, or Ctrl-C), logging every log_interval steps and
    evaluating (and saving) every eval_interval steps and at the end."""
    config, state, main = run.config, run.state, run.process.is_main
    interrupted = []
    previous = _on_sigint(lambda: interrupted.append(True))
    bar = tqdm(total=config.max_iters, initial=state.step, disable=not (main and progress),
               unit="it", dynamic_ncols=True)
    loop_start, run_tokens, run_seconds = time.perf_counter(), 0, 0.0
    # a run resumed at an evaluated step logs (and evaluates) that step no second time
    train_loss, val_loss = math.nan, math.nan if state.val_loss is None else state.val_loss
    try:
        while state.step < config.max_iters and not interrupted:
            if config.max_time and time.perf_counter() - loop_start >= config.max_time:
                break
            if threads is not None:
                threads.revisit()  # other work on this CPU comes and goes
            t0 = time.perf_counter()
            lr, loss = run.step()
            seconds = time.perf_counter() - t0
            run_tokens, run_seconds = run_tokens + run.tokens_per_step, run_seconds + seconds
            state.train_seconds += seconds
            bar.update(1)
            if state.step % config.log_interval == 0 or state.step == config.max_iters:
                train_loss = distributed.all_reduce_sum(run.process, loss).item() / run.process.world_size
                check_finite("training loss", train_loss, state.step, run.out)
                rate = run_tokens / max(run_seconds, 1e-9)
                bar.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{rate:,.0f}", refresh=False)
                run.metrics.append({"iter": state.step, "train_loss": train_loss, "lr": lr,
                                    "tokens_seen": state.tokens_seen, "tokens_per_second": rate})
            if state.step % config.eval_interval == 0:
                val_loss = run.evaluate(train_loss, echo, started)
        if interrupted:
            run.save(("latest",))
        elif state.val_step != state.step:
            val_loss = run.evaluate(train_loss, echo, started)
    finally:
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if main and (run.out / "metrics.jsonl").is_file():
        plot_losses(run.out / "metrics.jsonl", run.out / "loss.png")
    if interrupted:
        raise KeyboardInterrupt
    distributed.barrier(run.process)  # no rank returns before rank 0 has saved the run
    out = run.out
    return {
        "iters": state.step, "tokens_seen": state.tokens_seen, "train_loss": train_loss,
        "val_loss": val_loss, "val_perplexity": math.exp(val_loss) if val_loss == val_loss else None,
        "best_val_loss": state.best_val_loss, "tokens_per_second": run_tokens / max(run_seconds, 1e-9),
        "wall_seconds": time.perf_counter() - started, "checkpoint": str(out / "latest"),
        "best_checkpoint": str(out / "best"), "metrics": str(out / "metrics.jsonl"),
        "loss_curve": str(out / "loss.png"), "world_size": run.process.world_size,
        "rank": run.process.rank,
        "trainable_parameters": sum(p.numel() for p in run.model.parameters() if p.requires_grad),
        "dtype": "bfloat16" if config.dtype == "bfloat16" and bf16_supported(run.process.device)
                 else "float32",
    }


def _on_sigint(handler):
    """Ctrl-C finishes the current step and saves `latest`; a second one stops at once."""

    def first(signum, frame):
        handler()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    try:
        return signal.signal(signal.SIGINT, first)
    except ValueError:  # not the main thread: leave Ctrl-C alone
        return None
