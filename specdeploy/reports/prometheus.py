"""Prometheus metrics derived from cycle records, on a registry the application passes in.

    from prometheus_client import CollectorRegistry, start_http_server
    from specdeploy.reports.prometheus import SpecDecodingMetrics

    registry = CollectorRegistry()
    metrics = SpecDecodingMetrics(registry)
    start_http_server(9400, registry=registry)          # expose /metrics over HTTP
    for result in pipeline.generate(prompts, config):
        metrics.observe_all(result.records)
"""

from __future__ import annotations

from collections.abc import Iterable

from ..runtime.telemetry import CycleRecord

PHASES = ("draft", "verify", "accept", "cache")
BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class SpecDecodingMetrics:
    """Counters and histograms of speculative decoding; one ``observe`` per cycle record."""

    def __init__(self, registry, namespace: str = "specdeploy", max_positions: int = 16):
        from prometheus_client import Counter, Histogram

        self.max_positions = max_positions
        self.cycles = Counter("cycles", "Speculative cycles (per request row)", namespace=namespace, registry=registry)
        self.drafted = Counter("drafted_tokens", "Draft tokens proposed and verified", namespace=namespace,
                               registry=registry)
        self.accepted = Counter("accepted_tokens", "Draft tokens accepted, by 1-based draft position",
                                ["position"], namespace=namespace, registry=registry)
        self.committed = Counter("committed_tokens", "Tokens committed to outputs", namespace=namespace,
                                 registry=registry)
        # the same count under its name before 0.5, kept for dashboards that read it
        self.emitted = Counter("emitted_tokens", "Deprecated: committed_tokens", namespace=namespace, registry=registry)
        self.phase = Histogram("cycle_phase_seconds", "Time per cycle and row in each phase", ["phase"],
                               namespace=namespace, registry=registry, buckets=BUCKETS)

    def observe(self, record: CycleRecord) -> None:
        self.cycles.inc()
        self.drafted.inc(record.drafted)
        for position in range(1, record.accepted + 1):
            self.accepted.labels(position=str(min(position, self.max_positions))).inc()
        self.committed.inc(record.committed)
        self.emitted.inc(record.committed)
        for phase in PHASES:
            self.phase.labels(phase=phase).observe(getattr(record, f"{phase}_s"))

    def observe_all(self, records: Iterable[CycleRecord]) -> None:
        for record in records:
            self.observe(record)
