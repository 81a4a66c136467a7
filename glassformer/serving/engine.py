"""The engine: requests submitted at any time, run together step after step; `step` reads
plan -> batch -> run -> pick -> deliver (the scheduler, the runner, the sampler).

A request whose own work fails inside a step (its pick, its text, its beams, its logits turned
NaN or Inf) ends alone with an error event; only a failed forward pass, which every request
shares, stops the engine (EngineStopped for later requests). `step()` can be driven by hand
(tests, offline batches); `start()` runs it on a background thread that sleeps while nothing
waits. `submit` and `cancel` are safe from any thread: they only queue work for the next step.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence as Ids

import torch

from ..accel.threads import ThreadPolicy, hand_over_cores
from ..errors import InputError
from ..generation.config import GenerationResult, RequestParams
from ..generation.stopping import Decoder
from ..model.transformer import Transformer
from .adapters import Adapters
from .beam import BeamGroup
from .block_manager import BlockManager
from .capture import new_rows
from .config import EngineConfig
from .errors import AdapterInUse, EngineStopped, UnknownAdapter
from .executors import CAPABILITIES
from .handle import Event, RequestHandle, Wakeups
from .kv_pool import KVPool, pool_blocks
from .requests import check_request, result_of, too_large
from .runner import ModelRunner
from .sampler import Outcome, Picked, pick
from .scheduler import Scheduler, StepPlan
from .sequence import Sequence
from .stats import EngineStats, StepTrace
from .step import StepBatch

log = logging.getLogger("glassformer.serving.engine")


class Engine:
    def __init__(self, model: Transformer, tokenizer: Decoder | None = None,
                 config: EngineConfig | None = None, threads: ThreadPolicy | None = None,
                 base: str | None = None) -> None:
        """`threads`: the process's thread policy, revisited before each step of the background
        thread (None: torch's thread count is left as it is); `base`: the model's source, which a
        LoRA adapter's base name must match where both are known here."""
        config = config or EngineConfig()
        reason = CAPABILITIES.why_not(model.config)
        if reason is not None:
            raise InputError(None, reason)
        if config.sink is not None:
            config.sink.check(model.config)
        if config.compile and model.has_fused_step:
            raise InputError("compile", "compiles the plain PyTorch weights; not with --quantize "
                             "(a fused C++ step)")
        device = model.embed.tokens.weight.device
        deterministic = config.deterministic and device.type == "cuda"  # on the CPU it is so already
        if deterministic and not torch.are_deterministic_algorithms_enabled():
            raise InputError("deterministic", "on CUDA, call glassformer.accel.precision.use_precision "
                             "with a deterministic Precision before the model's first product "
                             "(the command line's --deterministic does)")
        self.model, self.tokenizer, self.config, self.threads = model.eval(), tokenizer, config, threads
        mc = model.config
        n_blocks = config.n_blocks
        if n_blocks is None:
            n_blocks = pool_blocks(mc, config.kv_memory_mb, config.block_size, config.kv_dtype, device)
        # a sink request's blocks hold a ring of slots, not a prefix: nothing to share
        self.blocks = BlockManager(n_blocks, config.block_size, config.prefix_caching and config.sink is None)
        self.pool = KVPool(mc, n_blocks, config.block_size, config.kv_dtype, device, scratch=config.compile)
        self.scheduler = Scheduler(self.blocks, config, mc)
        self.adapters = Adapters(mc, base, model.embed.tokens.weight.dtype, device)
        self.runner = ModelRunner(model, self.pool, config, self.adapters, deterministic)
        # how many tokens a request may reach: the window, or any number under the sink policy
        self.window = mc.context_length if config.sink is None else math.inf
        self.stats = EngineStats()
        self.trace: deque[StepTrace] = deque(maxlen=config.trace_length)
        self._handles: dict[str, tuple[Sequence | BeamGroup, RequestHandle]] = {}
        self._ids = itertools.count()  # the numbers of requests submitted without an id
        self._wakeups = Wakeups()  # the asyncio readers to wake after this step (handle.py)
        self._inbox: list[Sequence] = []
        self._cancels: set[str] = set()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False  # close() was called: the thread stops, no more requests
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ any thread

    def submit(self, prompt: Ids[int], params: RequestParams | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue a request (prompt token ids); returns its handle at once."""
        mc, params = self.model.config, params or RequestParams()
        if self._error is not None:
            raise EngineStopped(f"engine: stopped after an error ({self._error!r})")
        prompt = check_request(self.model, prompt, params, self.window, self.config.sink, self.blocks,
                               self.tokenizer is not None)
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        seq = Sequence(prompt, params, mc.vocab_size, self.tokenizer, request_id, self.runner.device)
        unit = BeamGroup(seq, self.tokenizer, mc.context_length) if params.beams > 1 else seq
        handle = RequestHandle(seq.id, self.cancel)
        with self._wake:
            if self._closed:
                raise EngineStopped("engine: closed; submit to a new Engine")
            if seq.id in self._handles:
                raise InputError("request_id", f"{seq.id!r} is already in use")
            if params.adapter is not None:
                if params.adapter not in self.adapters.loaded:
                    raise UnknownAdapter("adapter", f"no LoRA adapter named {params.adapter!r} is loaded "
                                     f"(loaded: {', '.join(self.adapters.loaded) or 'none'})")
                seq.prefix_root = self.adapters.loaded[params.adapter].key
            self._handles[seq.id] = (unit, handle)
            self._inbox.append(seq)
            self._wake.notify_all()
        return handle

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter in folder `path` as `name`, from any thread; ValueError
        (naming lora_name or lora_path) for one this model cannot take."""
        adapter = self.adapters.read(name, path)  # the files are read outside the lock
        with self._wake:
            if name in self.adapters.loaded:
                raise InputError("lora_name", f"{name!r} is loaded already; unload it first")
            self.adapters.loaded[name] = adapter

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`, from any thread: UnknownAdapter when none is loaded by
        that name, AdapterInUse while requests that name it are unfinished."""
        with self._wake:
            if name not in self.adapters.loaded:
                raise UnknownAdapter("lora_name", f"no adapter named {name!r} is loaded")
            users = [unit for unit, _ in self._handles.values() if unit.root.params.adapter == name]
            if users:
                raise AdapterInUse("lora_name", f"{name!r} is in use by {len(users)} unfinished "
                                   "request(s); unload it once they end")
            del self.adapters.loaded[name]

    def cancel(self, request_id: str) -> None:
        with self._wake:
            self._cancels.add(request_id)
            self._wake.notify_all()

    def start(self) -> Engine:
        """Run steps on a background thread until `close()`."""
        if self._closed:
            raise EngineStopped("engine: closed; start a new Engine")
        if self._thread is None:
            hand_over_cores()  # the caller's OpenMP threads would make the engine's sleep
            self._thread = threading.Thread(target=self._loop, name="glassformer-engine", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread after its current step; requests still running are cancelled."""
        with self._wake:
            self._closed = True
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
        with self._wake:  # (a reentrant lock: the stepping thread's wait asks it too)
            return bool(self._inbox or self._cancels) or self.scheduler.has_work()

    # ------------------------------------------------------------------ the stepping thread

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    self._wake.wait_for(lambda: self._closed or self.has_work())
                    if self._closed:
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
            if request_id in self._handles:
                self._end(self._handles[request_id][0])
        self._wakeups.send()

    def _finish(self, unit: Sequence | BeamGroup, event: Event, result: GenerationResult) -> None:
        for seq in unit.members:
            self.scheduler.remove(seq)
        with self._wake:
            entry = self._handles.pop(unit.id, None)
        if entry is not None:  # (a request that failed while finishing was answered already)
            self.stats.finished += 1
            entry[1].push(event, self._wakeups, result)

    def step(self) -> StepTrace | None:
        """One scheduling round and forward pass; None when there was nothing to run. Call it
        (or run_until_done) only while the background thread is not started."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("step: the engine's own thread is stepping it (see start/close)")
        self._intake()
        plan = self.scheduler.schedule()
        for seq in plan.refused:  # alone on the pool it could not start (submit's check forestalls it)
            self._end(seq.unit, too_large(seq.unit.members, self.blocks))
        if not plan.scheduled:
            self._wakeups.send()
            return None
        start, batch = time.perf_counter(), self.runner.batch(plan)
        logits = self.runner.run(batch)  # (R, V)
        ready = self.scheduler.advance(plan)
        self._deliver(ready, pick(ready, logits))
        return self._record(plan, batch, len(ready), start)

    def _record(self, plan: StepPlan, batch: StepBatch, sampled: int, start: float) -> StepTrace:
        """The step's trace (kept in `trace`) and its counts in `stats`."""
        trace = StepTrace(self.stats.steps, start, time.perf_counter() - start,
                          [(r.seq.id, r.n) for r in batch.requests], [s.id for s in plan.preempted],
                          [(r.path.name, r.path.reason) for r in batch.requests])
        self.trace.append(trace)
        self.stats.record(plan, sampled, self.scheduler, self.blocks)
        return trace

    def _deliver(self, ready: list[Sequence], outcomes: list[Outcome]) -> None:
        """Each ready sequence's outcome (sampler.py) to its request: a token streamed, a beam
        group ranked, or the error that ends that request alone."""
        for seq, outcome in zip(ready, outcomes, strict=True):
            if seq.unit.id not in self._handles:
                continue  # its request ended earlier in this step (another beam's error)
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                if isinstance(outcome, Picked):
                    self._emit(seq, outcome)
                elif outcome is not None and outcome.advance(self.scheduler):
                    result = outcome.result()
                    event = Event(outcome.id, None, result.text or "", True, result.stop_reason)
                    self._finish(outcome, event, result)
            except Exception as error:
                self._end(seq.unit, error)
        self._wakeups.send()  # one wake-up per event loop for the step's events

    def _emit(self, seq: Sequence, picked: Picked) -> None:
        """Accept a request's next token and stream it (the last event once it stopped)."""
        piece = seq.accept(picked.token, self.window)
        event = Event(seq.id, picked.token, piece, seq.stop_reason is not None, seq.stop_reason,
                      picked.logprobs, captured=new_rows(seq))
        if event.finished:
            self._finish(seq, event, result_of(seq))
        else:
            self._handles[seq.id][1].push(event, self._wakeups)

    def _end(self, unit: Sequence | BeamGroup, error: Exception | None = None) -> None:
        """End a request before its time with a last event of no token: cancelled, or failed
        inside a step with `error` (the other requests go on)."""
        seq, message = unit.root, None
        seq.stop_reason, seq.finish_time = "cancelled", time.perf_counter()
        if error is not None:
            log.error("engine: request %s failed: %r", unit.id, error, exc_info=error)
            seq.stop_reason, message = "error", f"{type(error).__name__}: {error}"
        self._finish(unit, Event(seq.id, None, "", True, seq.stop_reason, error=message), result_of(seq))

    def run_until_done(self) -> None:
        """Step on this thread until every submitted request has finished."""
        while self.has_work():
            self.step()
