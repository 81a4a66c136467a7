"""`/metrics`: the server's and the engine's state in Prometheus text format.

Request counts and latency histograms are recorded by the routes as requests end; the engine's
gauges (queue, batch, KV blocks, prefix hits, preemptions) are read from it at scrape time."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import Engine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineCollector:
    """Gauges read from the engine when Prometheus scrapes."""

    def __init__(self, engine: Engine, window_s: float = 10.0) -> None:
        self.engine, self.window_s = engine, window_s

    def collect(self):
        engine, stats = self.engine, self.engine.stats
        used = engine.blocks.n_blocks - engine.blocks.free_count  # live: a cancel frees at once
        yield from (
            GaugeMetricFamily("glassformer_queue_length", "requests waiting to be scheduled",
                              value=stats.waiting),
            GaugeMetricFamily("glassformer_running_batch_size", "requests in the last step",
                              value=stats.running),
            GaugeMetricFamily("glassformer_kv_blocks_used", "KV blocks referenced by a request", value=used),
            GaugeMetricFamily("glassformer_kv_blocks_free", "KV blocks available",
                              value=engine.blocks.n_blocks - used),
            GaugeMetricFamily("glassformer_kv_blocks_cached", "free KV blocks still holding a prefix",
                              value=stats.blocks_cached),
            GaugeMetricFamily("glassformer_prefix_hit_rate", "prompt tokens found in the prefix cache",
                              value=stats.prefix_hit_tokens / max(stats.prefix_query_tokens, 1)),
            GaugeMetricFamily("glassformer_tokens_per_second",
                              f"tokens computed per second over the last {self.window_s:g} s",
                              value=self._recent_rate()),
            CounterMetricFamily("glassformer_preemptions", "requests preempted for KV blocks",
                                value=stats.preemptions),
            CounterMetricFamily("glassformer_generated_tokens", "tokens generated",
                                value=stats.tokens_generated),
            CounterMetricFamily("glassformer_engine_steps", "engine steps run", value=stats.steps),
        )

    def _recent_rate(self) -> float:
        since = time.perf_counter() - self.window_s
        return sum(t.n_tokens for t in list(self.engine.trace) if t.start >= since) / self.window_s


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.requests = Counter("glassformer_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.ttft = Histogram("glassformer_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.per_token = Histogram("glassformer_time_per_output_token_seconds",
                                   "decode time per token after the first", buckets=LATENCY_BUCKETS,
                                   registry=self.registry)

    def record(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def observe(self, result) -> None:
        """Latencies of a finished request (a GenerationResult)."""
        if result.generated_ids:
            self.ttft.observe(result.prefill_seconds)
        if result.decode_steps:
            self.per_token.observe(result.decode_seconds / result.decode_steps)

    def text(self) -> bytes:
        return generate_latest(self.registry)
