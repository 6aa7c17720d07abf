"""A worker process's Prometheus metrics: where each job's time went, tokens, retries, and the engine's state.

Job metrics carry the same numbers as the job's timings row, observed once that row is committed. Engine
gauges (`EngineThread.stats()`, a round trip to the engine's process), the process's CPU and memory and each
thread's CPU are collected at most every `CONVOQ_METRICS_REFRESH_S` by one thread (`process.scrape.Snapshot`), not
at each scrape, so a flood of scrapes asks the engine nothing. Each process serves its own registry on
`CONVOQ_WORKER_METRICS_PORT` or, when another process on the host holds that, the next free port above it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.interface import EngineStats
from jobs.settings import Settings
from jobs.status import JobStatus
from process import scrape
from worker.results import Stored
from worker.thread_cpu import ThreadCpuCollector

log = logging.getLogger(__name__)

# from an interactive reply (tens of ms) to bulk work that waited behind others for hours
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 14400)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PORT_TRIES = scrape.PORT_TRIES  # worker processes on one host (one per GPU) share CONVOQ_WORKER_METRICS_PORT


class EngineMetric(NamedTuple):
    name: str
    kind: str  # "gauge" | "counter"
    help: str


def gauge(name: str, documentation: str) -> EngineMetric:
    return EngineMetric(name, "gauge", documentation)


def counter(name: str, documentation: str) -> EngineMetric:
    return EngineMetric(name, "counter", documentation)


# `EngineStats` field -> its metric: every field has one (`EngineCollector` looks each up)
ENGINE_METRICS = {
    "running": gauge("convoq_engine_running_requests", "Requests the engine is running"),
    "waiting": gauge("convoq_engine_waiting_requests", "Requests waiting in the engine's scheduler"),
    "interactive_running": gauge("convoq_engine_interactive_running_requests",
                                 "Interactive requests the engine is running (priority at or above the interactive one)"),
    "interactive_waiting": gauge("convoq_engine_interactive_waiting_requests",
                                 "Interactive requests waiting in the engine's scheduler"),
    "kv_blocks_total": gauge("convoq_engine_kv_blocks_allocated", "KV blocks allocated in the pools so far"),
    "kv_blocks_used": gauge("convoq_engine_kv_blocks_used", "KV blocks in use"),
    "kv_blocks_peak": gauge("convoq_engine_kv_blocks_peak", "Most KV blocks in use after any step's scheduling"),
    "kv_blocks_max": gauge("convoq_engine_kv_blocks_max", "KV blocks the memory budget allows"),
    "kv_usage": gauge("convoq_engine_kv_usage_ratio", "Fraction of the KV cache budget in use"),
    "kv_window_blocks_used": gauge("convoq_engine_kv_window_blocks_used", "KV blocks in use by sliding-window layers"),
    "preemptions": counter("convoq_engine_preemptions", "Sequences pre-empted to free KV cache"),
    "preemptions_spared": counter("convoq_engine_preemptions_spared",
                                  "Pre-emptions not done because the sequence had been pre-empted often enough"),
    "bulk_rows_deferred": counter("convoq_engine_bulk_rows_deferred",
                                  "Bulk decode rows left out of a step to keep an interactive latency target"),
    "limited_steps": counter("convoq_engine_limited_steps",
                             "Steps an interactive latency target (or a newcomer's wait) kept short"),
    "step_fixed_s": gauge("convoq_engine_step_fixed_seconds",
                          "The fixed part of a step's cost, as the engine's online fit has it"),
    "step_per_token_s": gauge("convoq_engine_step_per_prefill_token_seconds",
                              "A step's cost per prefill token, as the engine's online fit has it"),
    "step_per_row_s": gauge("convoq_engine_step_per_decode_row_seconds",
                            "A step's cost per decode row, as the engine's online fit has it"),
    "step_per_context_s": gauge("convoq_engine_step_per_context_token_seconds",
                                "A step's cost per context token a decode row reads, as the engine's online fit has it"),
    "step_per_draft_row_s": gauge("convoq_engine_step_per_draft_row_seconds",
                                  "A step's cost per row verifying drafts, beyond its tokens, as the engine's online fit "
                                  "has it"),
    "steps": counter("convoq_engine_steps", "Forward passes the engine ran (each one batch)"),
    "tokens_generated": counter("convoq_engine_tokens_generated", "Tokens the engine sampled"),
    "tokens_computed": counter("convoq_engine_tokens_computed",
                               "Tokens run through the model (prompt tokens not served from cache, and generated ones)"),
    "prefix_cache_queries_tokens": counter("convoq_engine_prefix_cache_query_tokens",
                                           "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hit_tokens": counter("convoq_engine_prefix_cache_hit_tokens",
                                       "Prompt tokens served from the prefix cache (host hits included)"),
    "prefix_cache_hit_rate": gauge("convoq_engine_prefix_cache_hit_ratio",
                                   "Fraction of prompt tokens served from the prefix cache"),
    "host_hit_tokens": counter("convoq_engine_host_cache_hit_tokens",
                               "Prompt tokens served from blocks brought back from the host-memory tier"),
    "host_prefetch_hit_rate": gauge("convoq_engine_host_prefetch_hit_ratio",
                                    "Fraction of the blocks copied back from the host tier that a request then used"),
    "prefix_cached_blocks": gauge("convoq_engine_prefix_cached_blocks", "KV blocks held by the prefix cache"),
    "evictions": counter("convoq_engine_prefix_cache_evictions", "Blocks evicted from the prefix cache"),
    "host_evictions": counter("convoq_engine_host_cache_evictions", "Blocks evicted from the host-memory tier"),
    "draft_tokens": counter("convoq_engine_draft_tokens",
                            "Draft tokens the engine proposed and verified (speculative decoding, CONVOQ_SPECULATIVE)"),
    "draft_tokens_accepted": counter("convoq_engine_draft_tokens_accepted",
                                     "Of the draft tokens verified, those accepted: tokens a step yielded beyond one per row"),
    "draft_rows": counter("convoq_engine_draft_rows", "Decode rows that carried draft tokens into a step"),
    "draft_accepted_length": gauge("convoq_engine_draft_accepted_length_mean",
                                   "Draft tokens accepted per row that carried drafts, over the engine's life"),
    "loop_gap_p50_ms": gauge("convoq_engine_loop_gap_p50_milliseconds",
                             "Median of the engine loop's idle time between back-to-back steps"),
    "loop_gap_p95_ms": gauge("convoq_engine_loop_gap_p95_milliseconds",
                             "95th percentile of the engine loop's idle time between back-to-back steps"),
    "loop_gaps": counter("convoq_engine_loop_gaps", "Idle gaps between back-to-back steps the engine loop measured"),
    "restarts": counter("convoq_engine_restarts",
                        "Times the engine process stalled and was killed and started again (`CONVOQ_ENGINE_STALL_S`)"),
}


class EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.stats()
        except Exception as exc:  # the engine thread changes its state while we read it; try next scrape
            log.warning("worker metrics: engine stats unavailable (%s)", exc)
            return
        for field in fields(EngineStats):
            metric = ENGINE_METRICS[field.name]
            family = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
            yield family(metric.name, metric.help, value=float(getattr(stats, field.name)))


class WorkerMetrics:
    """`snapshot`: the figures that cost a read of the kernel or the engine, as last collected (`refresh_s`)."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 refresh_s: float = Settings.model_fields["metrics_refresh_s"].default) -> None:
        self.registry = registry or CollectorRegistry()
        # process_cpu_seconds_total over convoq_jobs_finished_total is this worker's CPU per job, and the thread
        # collector says which of its threads spends it (`worker.thread_cpu`)
        self.snapshot = scrape.Snapshot([ProcessCollector(registry=None), ThreadCpuCollector()], refresh_s)
        self.registry.register(self.snapshot)
        self.served_on: int | None = None  # the port `start` serves the registry on

        def seconds(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, ["priority"], buckets=SECONDS_BUCKETS, registry=self.registry)

        self.queue_wait = seconds("convoq_job_queue_wait_seconds", "Job created -> first scheduled by the engine")
        self.ttft = seconds("convoq_job_time_to_first_token_seconds", "Job created -> first generated token")
        self.prefill = seconds("convoq_job_prefill_seconds", "Engine time in steps that prefilled the job")
        self.decode = seconds("convoq_job_decode_seconds", "First -> last generated token")
        self.end_to_end = seconds("convoq_job_end_to_end_seconds", "Job created -> result stored")
        self.batch_size = Histogram("convoq_job_batch_size", "Largest engine batch the job ran in",
                                    buckets=BATCH_BUCKETS, registry=self.registry)
        self.finished = Counter("convoq_jobs_finished", "Jobs this worker brought to a terminal status",
                                ["status"], registry=self.registry)
        self.generated = Counter("convoq_generated_tokens", "Tokens generated for stored results",
                                 registry=self.registry)
        self.reused = Counter("convoq_prompt_tokens_reused", "Prompt tokens whose KV came from the prefix cache",
                              registry=self.registry)
        self.host_reused = Counter("convoq_host_tokens_reused",
                                   "Reused prompt tokens brought back from the host-memory tier",
                                   registry=self.registry)
        self.conversation_jobs = Counter(
            "convoq_conversation_jobs", "Jobs with a conversation claimed here, by the queue their message came from: "
            "`home` (this worker's own: affinity sent it here), `shared` (any worker's)", ["queue"],
            registry=self.registry)
        self.retries = Counter("convoq_job_retries", "Failed attempts sent back to the queue for another try",
                               registry=self.registry)
        self.stale_writes = Counter("convoq_stale_writes_refused",
                                    "Writes of runs that had lost their job's lease (refused, never applied)",
                                    registry=self.registry)

    @classmethod
    def start(cls, port: int, engine_stats: Callable[[], EngineStats],
              refresh_s: float = Settings.model_fields["metrics_refresh_s"].default) -> WorkerMetrics:
        """Metrics for this process, served on `port` or, when another process on the host has it (one worker
        per GPU share a host and its settings), the first free one of the next `PORT_TRIES - 1`; `port` 0:
        recorded, not served. The port taken is logged and kept in `served_on`."""
        metrics = cls(refresh_s=refresh_s)
        metrics.snapshot.collectors.append(EngineCollector(engine_stats))
        if not port:
            return metrics
        served = scrape.serve(metrics.registry, port, "worker", PORT_TRIES)
        if served is not None:
            metrics.served_on = served[0]
            metrics.snapshot.start()
        return metrics

    def observe(self, priority: int, stored: Stored, generated_tokens: int) -> None:
        """A job whose outcome `results.store` has committed, with the timings row it wrote."""
        self.finished.labels(stored.status.value).inc()
        t = stored.timing
        if t is None:
            return
        label = str(priority)
        self.queue_wait.labels(label).observe(t["queue_wait_ms"] / 1e3)
        self.ttft.labels(label).observe(t["ttft_ms"] / 1e3)
        self.prefill.labels(label).observe(t["prefill_ms"] / 1e3)
        self.decode.labels(label).observe(t["decode_ms"] / 1e3)
        self.end_to_end.labels(label).observe(t["end_to_end_ms"] / 1e3)
        self.batch_size.observe(t["batch_size"])
        self.generated.inc(generated_tokens)
        self.reused.inc(t["prompt_tokens_reused"])
        self.host_reused.inc(t["host_tokens_reused"])

    def finished_total(self) -> int:
        """Jobs this worker brought to a terminal status so far, whatever the status."""
        return int(sum(sample.value for family in self.finished.collect() for sample in family.samples
                       if sample.name.endswith("_total")))

    def conversation_job(self, home: bool) -> None:
        """A job with a conversation was claimed here, from this worker's own queue or a shared one."""
        self.conversation_jobs.labels("home" if home else "shared").inc()

    def gave_up(self) -> None:
        """A job failed for good after its last attempt."""
        self.finished.labels(JobStatus.failed.value).inc()

    def retried(self) -> None:
        self.retries.inc()

    def refused(self) -> None:
        """A write of this worker was refused: the job's lease had moved on (see `worker.results`)."""
        self.stale_writes.inc()
