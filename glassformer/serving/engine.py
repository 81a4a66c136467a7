"""The engine: requests submitted at any time, run together step after step.

    step:  plan = scheduler.schedule()       who runs, how many tokens each (scheduler.py)
           batch = runner.batch(plan)         the step as a value: rows, slots, paths (step.py)
           logits = runner.run(batch)         each path's executor, one read-out (runner.py)
           for each request that caught up:   pick its next token with its own generator,
               stream it, stop it or go on

A request whose own work fails inside a step (its pick, its text, its beams, its logits
turned NaN or Inf) ends alone with an error event; only a failed forward pass, which every
request shares, stops the engine. `step()` can be driven by hand (tests, offline batches);
`start()` runs it on a background thread that sleeps while nothing waits. `submit` and `cancel`
are safe from any thread: they only queue work that the stepping thread picks up at the start
of its next step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence as Ids
from dataclasses import dataclass

import torch

from ..accel.greedy import argmax_rows
from ..accel.threads import ThreadPolicy, hand_over_cores
from ..errors import InputError
from ..generation.config import GenerationResult, RequestParams
from ..generation.core import eos_ids
from ..generation.sampling import next_token
from ..generation.stopping import Decoder
from ..model.layers.positions import uses_long_factors
from ..model.sink import SinkPolicy
from ..model.transformer import Transformer
from .adapters import Adapters
from .beam import BeamGroup
from .block_manager import BlockManager
from .capture import new_rows
from .handle import Event, RequestHandle, Wakeups
from .kv_pool import KVPool, pool_blocks
from .paged_attention import ATTENTION, query_group
from .requests import NON_FINITE, broken_rows, check_request, logprobs_of, plain_greedy, result_of, too_large
from .runner import CAPABILITIES, ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence
from .stats import EngineStats, StepTrace

log = logging.getLogger("glassformer.serving.engine")


class AdapterInUse(ValueError):
    """An adapter that running requests still use cannot be unloaded."""


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    kv_memory_mb: float = 256.0  # the pool's size
    n_blocks: int | None = None  # overrides kv_memory_mb (tests)
    kv_dtype: str = "fp32"  # one of model/kv_formats.py KV_DTYPES
    max_batch: int = 16  # most requests in one step
    token_budget: int = 256  # most tokens in one step (prefill is cut into chunks to fit)
    prefix_caching: bool = True
    attention: str = "fast"  # "fast" | "reference"
    batch_invariant: bool = True  # row tiles: tokens independent of what shares a step (runner.py)
    trace_length: int = 1000  # steps kept in the trace
    # plain decoding rows as a compiled step per batch bucket (graph_path.py; CUDA graphs on a GPU)
    graph: bool = False
    # attention sinks (model/sink.py): every request keeps its first S and last W keys and
    # streams past the window. Per engine: the pool's accounting (S + W slots a request, no
    # prefix sharing) and the fused step's refusal follow from it, and a server takes it as flags.
    sink: SinkPolicy | None = None
    # on CUDA, a request's numbers bit for bit independent of what shares its step (runner.py:
    # fixed shapes); on the CPU the engine is so already and this changes nothing
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise InputError("attention", f"choose one of {ATTENTION}, got {self.attention!r}")
        if self.kv_memory_mb <= 0:
            raise InputError("kv_memory_mb", f"must be positive, got {self.kv_memory_mb}")
        if self.token_budget < self.max_batch:  # the one set away from its default is blamed
            field = "max_batch" if self.max_batch != EngineConfig.max_batch else "token_budget"
            raise InputError(field, f"a step of max_batch {self.max_batch} requests needs a token_budget "
                                    f"of as many tokens, got {self.token_budget}")
        if self.sink is not None and not isinstance(self.sink, SinkPolicy):
            raise InputError("sink", f"a SinkPolicy or None, got {type(self.sink).__name__}")
        if self.sink is not None and self.kv_dtype != "fp32":
            raise InputError("sink",
                             f"the sink policy keeps float32 keys; not with kv_dtype={self.kv_dtype!r}")
        if self.deterministic and not self.batch_invariant:
            raise InputError("deterministic", "needs batch_invariant=True (its products in row tiles)")


class Engine:
    def __init__(self, model: Transformer, tokenizer: Decoder | None = None,
                 config: EngineConfig = EngineConfig(), threads: ThreadPolicy | None = None,
                 base: str | None = None) -> None:
        """`threads`: the process's thread policy, revisited before each step of the
        background thread (None: torch's thread count is left as it is); `base`: the model's
        source, which a LoRA adapter's base name must match where both are known here."""
        reason = CAPABILITIES.why_not(model.config)
        if reason is not None:
            raise InputError(None, reason)
        if config.sink is not None:
            config.sink.check(model.config)
        self.model, self.tokenizer, self.config, self.threads = model.eval(), tokenizer, config, threads
        mc = model.config
        device = model.embed.tokens.weight.device
        n_blocks = config.n_blocks
        if n_blocks is None:
            n_blocks = pool_blocks(mc, config.kv_memory_mb, config.block_size, config.kv_dtype, device)
        # a sink request's blocks hold a ring of slots, not a prefix: nothing to share
        prefix_caching = config.prefix_caching and config.sink is None
        self.blocks = BlockManager(n_blocks, config.block_size, prefix_caching)
        fixed_shapes = config.deterministic and device.type == "cuda"
        if fixed_shapes and not torch.are_deterministic_algorithms_enabled():
            raise InputError("deterministic", "on CUDA, call glassformer.accel.precision.use_precision "
                             "with a deterministic Precision before the model's first product "
                             "(the command line's --deterministic does)")
        self.pool = KVPool(mc, n_blocks, config.block_size, config.kv_dtype, device, scratch=config.graph)
        # fast attention takes a prompt's queries in groups: the budget cuts prompts between them
        group = query_group(config.block_size, config.token_budget) if config.attention == "fast" else 1
        self.scheduler = Scheduler(self.blocks, config.max_batch, config.token_budget, config.sink, group)
        self.adapters = Adapters(mc, base, model.embed.tokens.weight.dtype, device)
        self.runner = ModelRunner(model, self.pool, config.attention, config.batch_invariant,
                                  config.sink, self.adapters, group, config.graph,
                                  config.max_batch if fixed_shapes else None)
        # how many tokens a request may reach: the window, or any number under the sink policy
        self.window = mc.context_length if config.sink is None else math.inf
        self.stats = EngineStats()
        self.trace: deque[StepTrace] = deque(maxlen=config.trace_length)
        self._handles: dict[str, tuple[Sequence, RequestHandle]] = {}
        self._wakeups = Wakeups()  # the asyncio readers to wake after this step (handle.py)
        self._inbox: list[Sequence] = []
        self._cancels: set[str] = set()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False  # close() was called: no more requests
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ any thread

    def submit(self, prompt: Ids[int], params: RequestParams | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue a request (prompt token ids); returns its handle at once."""
        mc, params = self.model.config, params or RequestParams()
        if self._error is not None:
            raise RuntimeError(f"engine: stopped after an error ({self._error!r})")
        prompt = check_request(self.model, prompt, params, self.window, self.config.sink, self.blocks,
                               self.tokenizer is not None)
        eos = eos_ids(params, self.tokenizer)
        seq = Sequence(prompt, params, mc.vocab_size, self.tokenizer, eos, request_id, self.runner.device)
        unit = BeamGroup(seq, self.tokenizer, mc.context_length) if params.beams > 1 else seq
        handle = RequestHandle(seq.id, self.cancel)
        with self._wake:
            if self._closed:
                raise RuntimeError("engine: closed; submit to a new Engine")
            if seq.id in self._handles:
                raise InputError("request_id", f"{seq.id!r} is already in use")
            if params.adapter is not None:
                if params.adapter not in self.adapters:
                    raise InputError("adapter", f"no LoRA adapter named {params.adapter!r} is loaded "
                                     f"(loaded: {', '.join(self.adapters.names()) or 'none'})")
                seq.prefix_root = self.adapters[params.adapter].key
            if mc.rope_scaling == "longrope" and uses_long_factors(mc, seq.prompt_len - 1):
                seq.turn_long()
            self._handles[seq.id] = (unit, handle)
            self._inbox.append(seq)
            self._wake.notify_all()
        return handle

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter in folder `path` as `name`, from any thread; ValueError
        (naming lora_name or lora_path) for one this model cannot take."""
        adapter = self.adapters.read(name, path)  # the files are read outside the lock
        with self._wake:
            self.adapters.add(adapter)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`, from any thread: KeyError when none is loaded by that
        name, AdapterInUse while requests that name it are unfinished."""
        with self._wake:
            users = [unit for unit, _ in self._handles.values()
                     if (unit.root if isinstance(unit, BeamGroup) else unit).params.adapter == name]
            if users and name in self.adapters:
                raise AdapterInUse(f"lora_name: {name!r} is in use by {len(users)} unfinished "
                                   "request(s); unload it once they end")
            self.adapters.remove(name)

    def cancel(self, request_id: str) -> None:
        with self._wake:
            self._cancels.add(request_id)
            self._wake.notify_all()

    def start(self) -> Engine:
        """Run steps on a background thread until `close()`."""
        if self._closed:
            raise RuntimeError("engine: closed; start a new Engine")
        if self._thread is None:
            self._stopping = False
            hand_over_cores()  # the caller's OpenMP threads would make the engine's sleep
            self._thread = threading.Thread(target=self._loop, name="glassformer-engine", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread after its current step; requests still running are cancelled."""
        with self._wake:
            self._stopping = self._closed = True
            self._cancels.update(self._handles)
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._intake()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def raise_error(self) -> None:
        """Re-raise the exception that ended the background thread, if one did."""
        if self._error is not None:
            raise self._error

    def has_work(self) -> bool:
        with self._wake:
            return bool(self._inbox or self._cancels) or self.scheduler.has_work()

    # ------------------------------------------------------------------ the stepping thread

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    self._wake.wait_for(lambda: self._stopping or self._inbox or self._cancels
                                        or self.scheduler.has_work())
                    if self._stopping:
                        return
                if self.threads is not None:
                    self.threads.revisit()  # other work on this CPU comes and goes (and per thread)
                self.step()
        except BaseException as error:  # a failed step ends every request, never hangs one
            self._error = error
            with self._wake:
                self._cancels.update(self._handles)
            self._intake()

    def _intake(self) -> None:
        """Admit submitted requests and apply cancellations."""
        with self._wake:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        for seq in inbox:
            self.scheduler.add(seq)
        for request_id in cancels:
            entry = self._handles.get(request_id)
            if entry is None:
                continue
            seq = entry[0].root if isinstance(entry[0], BeamGroup) else entry[0]
            seq.stop_reason, seq.finish_time = "cancelled", time.perf_counter()
            self._finish(entry[0], Event(seq.id, None, "", True, "cancelled"), result_of(seq))
        self._wakeups.send()

    def _finish(self, unit: Sequence | BeamGroup, event: Event, result: GenerationResult) -> None:
        for seq in unit.members if isinstance(unit, BeamGroup) else [unit]:
            self.scheduler.remove(seq)
        with self._wake:
            entry = self._handles.pop(unit.id, None)
        if entry is not None:  # (a request that failed while finishing was answered already)
            self.stats.finished += 1
            entry[1].push(event, result, self._wakeups)

    def _switch_long_texts(self) -> None:
        """LongRoPE: a text that has just grown past the original context gives its blocks back
        and is computed again, every key by the long set, as transformers' Phi-3 generation
        recomputes it (and as a preempted request is)."""
        mc = self.model.config
        if mc.rope_scaling != "longrope":
            return
        for seq in (*self.scheduler.running, *self.scheduler.waiting):
            if not seq.rope_long and uses_long_factors(mc, seq.num_tokens - 1):
                self.blocks.release(seq)
                if seq.group is not None:
                    seq.group.forget(seq)  # its logits come again once it is recomputed
                seq.turn_long()

    def step(self) -> StepTrace | None:
        """One scheduling round and forward pass; None when there was nothing to run. Call it
        (or run_until_done) only while the background thread is not started."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("step: the engine's own thread is stepping it (see start/close)")
        self._intake()
        self._switch_long_texts()
        plan = self.scheduler.schedule()
        for seq in plan.refused:  # alone on the pool it could not start (submit's check forestalls it)
            unit = seq.group if seq.group is not None else seq
            self._fail(unit, too_large(unit, self.blocks))
        if not plan.scheduled:
            self._wakeups.send()
            return None
        start = time.perf_counter()
        batch = self.runner.batch(plan)
        logits = self.runner.run(batch)  # (R, V)
        ready = self.scheduler.advance(plan)
        broken = broken_rows(logits)
        plain = [i for i, seq in enumerate(ready) if seq.group is None]
        plain_logits = logits if len(plain) == len(ready) else logits[plain]  # no copy when all
        greedy = [plain_greedy(ready[i]) for i in plain]
        argmax = argmax_rows(plain_logits).tolist() if any(greedy) else []  # (R,): each row's own
        drawn, failed = {}, set()  # plain row -> its draw (1,), still on the device
        for j, i in enumerate(plain):
            if not greedy[j] and i not in broken:
                try:  # a request that fails here fails alone
                    drawn[j] = self._sample(ready[i], plain_logits[j : j + 1])
                except Exception as error:
                    self._fail(ready[i], error)
                    failed.add(j)
        sampled = dict(zip(drawn, torch.cat(list(drawn.values())).tolist(), strict=True)) if drawn else {}
        for j, i in enumerate(plain):
            seq = ready[i]
            if j in failed:
                continue
            try:
                if i in broken:
                    raise FloatingPointError(NON_FINITE)
                self._emit(seq, argmax[j] if greedy[j] else sampled[j], logits[i])
            except Exception as error:
                self._fail(seq, error)
        for i, seq in enumerate(ready):
            group = seq.group
            if group is None or group.id not in self._handles:
                continue
            try:
                if i in broken:
                    raise FloatingPointError(NON_FINITE)
                if group.offer(seq, logits[i]):
                    self._advance_beams(group)
            except Exception as error:
                self._fail(group, error)
        self._wakeups.send()  # one wake-up per event loop for the step's events
        trace = StepTrace(self.stats.steps, start, time.perf_counter() - start,
                          [(r.seq.id, r.n) for r in batch.requests], [s.id for s in plan.preempted],
                          [(r.path.name, r.path.reason) for r in batch.requests])
        self.trace.append(trace)
        self.stats.record(plan, len(ready), self.scheduler, self.blocks)
        return trace

    def _advance_beams(self, group: BeamGroup) -> None:
        children, dropped = group.advance(self.blocks)
        for seq in dropped:
            self.scheduler.remove(seq)
        for seq in children:
            self.scheduler.adopt(seq)
        root = group.root
        if root.first_token_time is None:
            root.first_token_time = time.perf_counter()
        if group.winner is not None:
            now = time.perf_counter()
            result = group.result(root.first_token_time - root.arrival, now - root.first_token_time)
            event = Event(group.id, None, result.text or "", True, result.stop_reason)
            self._finish(group, event, result)

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """A draw from one row (1, V) with the request's settings and its own generator: (1,),
        on the logits' device (the step moves every draw to the host at once)."""
        return next_token(logits, seq.params.sampling, seq.generator, seq.counts)

    def _emit(self, seq: Sequence, token: int, logits: torch.Tensor) -> None:
        """Accept a request's next token and stream it (the last event once it stopped)."""
        piece = seq.accept(token, self.window)
        event = Event(seq.id, token, piece, seq.stop_reason is not None, seq.stop_reason,
                      logprobs_of(logits, token, seq.params.logprobs), captured=new_rows(seq))
        if event.finished:
            self._finish(seq, event, result_of(seq))
        else:
            self._handles[seq.id][1].push(event, wakeups=self._wakeups)

    def _fail(self, unit: Sequence | BeamGroup, error: Exception) -> None:
        """End one request that failed inside a step with an error event; the rest go on."""
        log.error("engine: request %s failed: %r", unit.id, error, exc_info=error)
        seq = unit.root if isinstance(unit, BeamGroup) else unit
        seq.stop_reason, seq.finish_time = "error", time.perf_counter()
        message = f"{type(error).__name__}: {error}"
        self._finish(unit, Event(seq.id, None, "", True, "error", error=message), result_of(seq))

    def run_until_done(self) -> None:
        """Step on this thread until every submitted request has finished."""
        while self.has_work():
            self.step()
