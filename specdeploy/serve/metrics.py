"""/metrics: the speculative decoding counters plus the server's own (requests, latency, load)."""

from __future__ import annotations

import time

from ..reports.prometheus import SpecDecodingMetrics

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, scheduler):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        self.decoding = SpecDecodingMetrics(registry)
        ns = "specdeploy"
        self.requests = Counter("requests", "Requests by outcome (finish reason, or the HTTP status refused with)",
                                ["outcome"], namespace=ns, registry=registry)
        self.latency = Histogram("request_seconds", "From submission to the last token", namespace=ns,
                                 registry=registry, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens prefilled", namespace=ns, registry=registry)
        Gauge("running_rows", "Rows decoding or prefilling", namespace=ns, registry=registry).set_function(
            lambda: scheduler.rows)
        Gauge("queued_requests", "Requests waiting for a row", namespace=ns, registry=registry).set_function(
            lambda: len(scheduler.queue))

    def finished(self, ticket, row) -> None:
        """Called on the scheduler's thread when a request ends (prometheus_client is thread-safe)."""
        self.requests.labels(outcome=str(row.finish_reason)).inc()
        self.latency.observe(time.perf_counter() - ticket.submitted)
        self.prompt_tokens.inc(len(row.prompt_ids))
        self.decoding.observe_all(row.records)

    def refused(self, status: int) -> None:
        self.requests.labels(outcome=str(status)).inc()

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
