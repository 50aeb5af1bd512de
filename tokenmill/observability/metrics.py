"""Prometheus metrics of the server, vLLM-compatible names under the `tokenmill:` prefix.

Request latencies are measured in the api server, where clients see them: TTFT for every
request that got a token, the other per-request histograms for requests whose client stayed to
the end (aborts are counted by `request_success{finished_reason="abort"}`). Engine state and
step timings come from the engine core's latest `EngineStats` (cumulative, so nothing is lost
between scrapes) and are exported by a custom collector.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tokenmill.ipc.messages import ClientOutput, EngineStats, HostKVCacheCounts, SpecDecodeCounts
from tokenmill.observability.feedback import FeedbackLog, response_id_of
from tokenmill.observability.histogram import Histogram as EngineHistogram
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PREFIX = "tokenmill:"
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


@dataclass
class ChoiceTracker:
    """Client-side timing of one engine request (one choice of one prompt)."""

    request_id: str
    params: SamplingParams
    submitted: float = field(default_factory=time.time)
    last_output: float | None = None
    token_ids: list[int] = field(default_factory=list)


class _EngineCollector(Collector):
    """Exports the latest engine stats snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats, labels = self.stats, [self.model_name]
        if stats is None:
            return
        gauges = {
            "num_requests_running": ("Requests in the running batch.", stats.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", stats.num_waiting),
            "kv_cache_usage_perc": (
                "Fraction of KV-cache pages in use (1 = full).",
                stats.kv_used_pages / max(stats.kv_total_pages, 1),
            ),
            "cuda_graphs_pending": (
                "CUDA graphs and builds ahead still to capture in the background (a step "
                "that needs one waits for its capture; 0: all done).",
                stats.graphs_pending,
            ),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            yield g
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                     stats.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.",
                                  stats.prefix_cache_hits),
            "num_preemptions": ("Requests preempted (recomputed later).", stats.num_preemptions),
            "prompt_tokens": ("Prompt tokens prefilled.", stats.prompt_tokens),
            "generation_tokens": ("Tokens generated.", stats.generation_tokens),
        }  # fmt: skip
        yield from _counter_families(counters, labels)
        success = CounterMetricFamily(
            PREFIX + "request_success", "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )  # fmt: skip
        for reason in ("stop", "length", "abort", "error"):
            success.add_metric([self.model_name, reason], stats.finished.get(reason, 0))
        yield success
        if stats.spec_decode is not None:
            yield from _spec_decode_families(stats.spec_decode, labels)
        if stats.host_kv_cache is not None:
            yield from _host_kv_cache_families(stats.host_kv_cache, labels)
        if (encoder := stats.vision_encoder) is not None:
            yield from _counter_families({
                "vision_encoder_images": ("Images run through the vision encoder.",
                                          encoder.images_encoded),
                "vision_encoder_cache_hits": ("Images whose encoder outputs were reused (same "
                                              "image content).", encoder.cache_hits),
                "vision_encoder_seconds": ("Seconds the vision encoder ran (device time on "
                                           "CUDA).", encoder.seconds),
            }, labels)  # fmt: skip
        docs = {
            "scheduler_step_seconds": "Host time of one engine step (not waiting for the GPU).",
            "model_forward_seconds": "Device time of one forward pass and its sampling.",
            "model_forward_seconds_prefill_steps": "model_forward_seconds of steps with only "
            "prefill rows (prompt chunks).",
            "model_forward_seconds_mixed_steps": "model_forward_seconds of steps with prefill "
            "rows beside decode rows.",
            "model_forward_seconds_decode_steps": "model_forward_seconds of steps with only "
            "decode rows (decodes, speculative verifies).",
            "scheduler_step_seconds_prefill_steps": "scheduler_step_seconds of the engine "
            "steps that launched a step with only prefill rows.",
            "scheduler_step_seconds_mixed_steps": "scheduler_step_seconds of the engine steps "
            "that launched a step with prefill rows beside decode rows.",
            "scheduler_step_seconds_decode_steps": "scheduler_step_seconds of the engine steps "
            "that launched a step with only decode rows.",
            "iteration_tokens_total": "Tokens processed per engine step.",
            "spec_decode_chosen_drafts": "Drafts verified per request and step, of requests "
            "with drafts to offer (0: adaptive speculation left them out).",
        }
        for name, hist in stats.histograms.items():
            yield _histogram_family(PREFIX + name, docs.get(name, name), hist, labels)


def _counter_families(
    counters: dict[str, tuple[str, float]], labels: list[str]
) -> Iterator[Metric]:
    """One counter per `name: (doc, value)`, labelled by the model name."""
    for name, (doc, value) in counters.items():
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric(labels, value)
        yield c


def _spec_decode_families(spec: SpecDecodeCounts, labels: list[str]) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters: drafts, drafted and accepted tokens, and accepted
    tokens per draft position."""
    counters = {
        "spec_decode_num_drafts": ("Draft proposals verified (one per request and step).",
                                   spec.num_drafts),
        "spec_decode_num_draft_tokens": ("Drafted tokens verified.", spec.num_draft_tokens),
        "spec_decode_num_accepted_tokens": ("Drafted tokens accepted.",
                                            spec.num_accepted_tokens),
    }  # fmt: skip
    yield from _counter_families(counters, labels)
    per_position = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Drafted tokens accepted, by position in the draft (0 = first).",
        labels=["model_name", "position"],
    )
    for position, value in enumerate(spec.accepted_per_position):
        per_position.add_metric([*labels, str(position)], value)
    yield per_position


def _host_kv_cache_families(host: HostKVCacheCounts, labels: list[str]) -> Iterator[Metric]:
    """The host KV tier: hits, bytes each way, load time (counters) and its usage (a gauge)."""
    counters = {
        "host_kv_cache_hits": ("Prompt tokens loaded back from the host KV tier instead of "
                               "recomputed.", host.hit_tokens),
        "host_kv_cache_bytes_loaded": ("Bytes copied host to device.", host.bytes_loaded),
        "host_kv_cache_bytes_written": ("Bytes copied device to host.", host.bytes_written),
        "host_kv_cache_load_seconds": ("Seconds spent loading pages back (device time on CUDA).",
                                       host.load_seconds),
    }  # fmt: skip
    yield from _counter_families(counters, labels)
    usage = GaugeMetricFamily(
        PREFIX + "host_kv_cache_usage_perc", "Fraction of host KV tier pages in use (1 = full).",
        labels=["model_name"],
    )  # fmt: skip
    usage.add_metric(labels, host.used_pages / max(host.total_pages, 1))
    yield usage


def _histogram_family(
    name: str, doc: str, hist: EngineHistogram, labels: list[str]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    cumulative, buckets = 0, []
    for bound, count in zip([*hist.bounds, float("inf")], hist.counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
    family.add_metric(labels, buckets, hist.total)
    return family


class ServerMetrics:
    """The server's registry, per-request observations, request traces and request logs."""

    def __init__(
        self,
        model_name: str,
        trace_file: str | None,
        log_requests: bool,
        max_recent_requests: int = 100_000,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between tokens.", LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time waiting to be scheduled.",
                          LATENCY_BUCKETS)  # fmt: skip
        self.prefill = hist("request_prefill_time_seconds", "Scheduled to first token.",
                            LATENCY_BUCKETS)  # fmt: skip
        self.decode = hist("request_decode_time_seconds", "First token to finish.",
                           LATENCY_BUCKETS)  # fmt: skip
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.",
                                  TOKEN_BUCKETS)  # fmt: skip
        self.generation_tokens = hist("request_generation_tokens", "Tokens per request.",
                                      TOKEN_BUCKETS)  # fmt: skip
        self.rejected = Counter(
            PREFIX + "request_rejected", "Requests refused with 503 because the server was "
            "overloaded (--max-waiting-requests).", ["model_name"], registry=self.registry,
        ).labels(model_name)  # fmt: skip
        self.startup_seconds = Gauge(
            PREFIX + "startup_seconds", "Seconds of each phase of the server's start-up, set "
            "when it is ready: the api server's (server_*, waiting_for_engine, ready_message) "
            "and the engine core's, which run side by side, and total, from launch to ready.",
            ["model_name", "phase"], registry=self.registry,
        )  # fmt: skip
        self.log_requests = log_requests
        self._trace: IO[str] | None = None
        if trace_file:  # one line per finished request, flushed per line; closed by close()
            try:
                self._trace = open(trace_file, "a", buffering=1)  # noqa: SIM115
            except OSError as exc:
                why = f"cannot open {trace_file!r}: {exc.strerror}"
                raise ValueError(f"trace_file: {why}") from None
        self.feedback = FeedbackLog(
            model_name, self.registry, max_recent_requests, trace_file, self.write_trace
        )

    def on_ready(self, startup_seconds: Mapping[str, float]) -> None:
        """Record the start-up's phases (`observability.startup`)."""
        for phase, seconds in startup_seconds.items():
            self.startup_seconds.labels(self.model_name, phase).set(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def on_output(self, tracker: ChoiceTracker, out: ClientOutput) -> None:
        """Record one output of a choice (tokens and, at the end, the engine's metrics)."""
        now = time.time()
        if out.token_ids:
            if tracker.last_output is None:
                self.ttft.observe(now - tracker.submitted)
            else:
                gap = (now - tracker.last_output) / len(out.token_ids)
                for _ in out.token_ids:
                    self.itl.observe(gap)
            tracker.last_output = now
            tracker.token_ids.extend(out.token_ids)
        if out.finish_reason is not None:
            self._on_finish(tracker, out, now)

    def _on_finish(self, tracker: ChoiceTracker, out: ClientOutput, now: float) -> None:
        self.e2e.observe(now - tracker.submitted)
        self.generation_tokens.observe(len(tracker.token_ids))
        self.prompt_tokens.observe(out.num_prompt_tokens)
        m = out.metrics
        if m is not None:
            for hist, value in (
                (self.queue, m.queue_seconds),
                (self.prefill, m.prefill_seconds),
                (self.decode, m.decode_seconds),
            ):
                if value is not None:
                    hist.observe(value)
        response_id = response_id_of(tracker.request_id)
        record = {
            "event": "request",
            "request_id": tracker.request_id,
            "response_id": response_id,
            "prompt_token_ids": m.prompt_token_ids if m is not None else None,
            "output_token_ids": tracker.token_ids,
            "arrival_time": tracker.submitted,
            "engine_arrival_time": m.arrival_time if m is not None else None,
            "scheduled_time": m.scheduled_time if m is not None else None,
            "first_token_time": m.first_token_time if m is not None else None,
            "finish_time": now,
            "num_prompt_tokens": out.num_prompt_tokens,
            "num_cached_tokens": out.num_cached_tokens,
            "num_preemptions": m.num_preemptions if m is not None else None,
            "finish_reason": out.finish_reason,
            "sampling_params": msgspec.to_builtins(tracker.params),
        }
        self.feedback.requests.add(response_id, self.write_trace(record))
        if self.log_requests:
            logger.info(
                "request %s finished (%s): %d prompt tokens (%d cached), %d output tokens, "
                "%.3f s, %d preemptions",
                tracker.request_id, out.finish_reason, out.num_prompt_tokens,
                out.num_cached_tokens, len(tracker.token_ids), now - tracker.submitted,
                record["num_preemptions"] or 0,
            )  # fmt: skip

    def write_trace(self, record: dict[str, Any]) -> int | None:
        """Append one line to the trace file; its byte offset (None without a trace file)."""
        if self._trace is None:
            return None
        line = json.dumps(record) + "\n"  # ASCII (json.dumps escapes): a char is a byte
        # The replicas of a deployment (`--replicas`) append to one --trace-file: the offset is
        # where this append ended, read under a lock that keeps theirs out between the two.
        fd = self._trace.fileno()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            self._trace.write(line)  # line-buffered: flushed, at the end of the file
            return os.lseek(fd, 0, os.SEEK_CUR) - len(line)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
