"""/metrics: vLLM's metric names beside specdeploy's own, from the records and times of finished requests.

vLLM's (labels ``model_name`` and ``engine``, so that its dashboards and queries work unchanged):
the spec-decode counters (``vllm:spec_decode_num_drafts`` counts cycles that drafted, apart from plain
steps, so ``1 + rate(vllm:spec_decode_num_accepted_tokens_total) / rate(vllm:spec_decode_num_drafts_total)``
is the mean accepted length), request counts by finish reason, token counters, time-to-first-token,
inter-token (one per cycle that committed tokens), queue, prefill, decode, inference and end-to-end
histograms, running and waiting requests, KV-cache usage. specdeploy's: the per-cycle counters and phase
times (``reports.prometheus``), requests by finish reason, HTTP responses by route and status (apart).
One of several replicas labels every sample with the replica and node it comes from (``served``), so that the
series of replicas scraped through one address stay apart.
"""

from __future__ import annotations

import time
from collections import Counter as Tally

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from ..reports.prometheus import SpecDecodingMetrics

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# vLLM's buckets, so that its dashboards' quantiles read the same
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                       40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                   960.0, 1920.0, 7680.0)
# a row's finish reason as OpenAI (and vLLM's request_success) name it; "abort": ended by the server's drain
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort", "error": "error", "abort": "abort"}
METRIC_LABELS = ("replica", "node")  # what tells replicas' series apart (``ServerMetrics``' constant labels)


class ServerMetrics:
    """The server's registry; ``finished`` is the scheduler's ``on_finish``, ``responded`` the access log's count."""

    def __init__(self, scheduler, model_name: str, routes: tuple[str, ...] = (), labels: dict[str, str] | None = None):
        self.registry = CollectorRegistry()
        self.routes = set(routes)
        self.decoding = SpecDecodingMetrics(self.registry)
        self._declare_own(scheduler)
        self._declare_vllm(scheduler, model_name)
        # what /metrics serves: the registry, every sample labelled with ``labels`` (a replica's, under Ray)
        self.served = self.registry
        if labels:
            self.served = CollectorRegistry()
            self.served.register(Labelled(self.registry, labels))

    def _declare_own(self, scheduler) -> None:
        """specdeploy's own metrics: requests, HTTP responses, latency, rows, queue, suffix indexes, prefix cache."""
        registry, ns = self.registry, "specdeploy"
        self.requests = Counter("requests", "Requests that ran, by finish reason (eos, stop, length, cancelled, abort, error)",
                                ["finish_reason"], namespace=ns, registry=registry)
        self.http = Counter("http_responses", "HTTP responses by route (other: any unknown path) and status code",
                            ["route", "status"], namespace=ns, registry=registry)
        self.latency = Histogram("request_seconds", "From submission to the last token", namespace=ns,
                                 registry=registry, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens prefilled", namespace=ns, registry=registry)
        Gauge("running_rows", "Rows decoding or prefilling", namespace=ns, registry=registry).set_function(
            lambda: scheduler.row_count)
        Gauge("queued_requests", "Requests waiting for a row", namespace=ns, registry=registry).set_function(
            lambda: len(scheduler.queue))
        store = scheduler.pipeline.suffix_store  # earlier requests' texts, which later requests draft from
        for fact, help in (("bytes", "Memory the suffix indexes take (estimated), all scopes together"),
                           ("tokens", "Tokens the suffix indexes keep"), ("sequences", "Texts the suffix indexes keep"),
                           ("scopes", "Suffix index scopes (one per API key by default)")):
            Gauge(f"suffix_index_{fact}", help, namespace=ns, registry=registry).set_function(
                lambda fact=fact: store.stats()[fact])
        prefixes = scheduler.pipeline.prefix_cache  # finished requests' K/V, which later prompts reuse
        Gauge("prefix_cache_bytes", "Memory the kept K/V of finished requests take (--prefix-cache-bytes at most)",
              namespace=ns, registry=registry).set_function(lambda: prefixes.bytes)
        Gauge("prefix_cache_texts", "Finished requests' texts whose K/V is kept", namespace=ns,
              registry=registry).set_function(lambda: len(prefixes))

    def _declare_vllm(self, scheduler, model_name: str) -> None:
        """The metrics vLLM serves, under its names and labels, so that its dashboards read this server."""
        registry, labels = self.registry, {"model_name": model_name, "engine": "0"}

        def vllm(kind, name: str, help: str, extra: tuple[str, ...] = (), **options):
            metric = kind(f"vllm:{name}", help, [*labels, *extra], registry=registry, **options)
            return metric if extra else metric.labels(**labels)

        self.labels = labels
        vllm(Gauge, "num_requests_running", "Requests in the running batch").set_function(lambda: scheduler.row_count)
        vllm(Gauge, "num_requests_waiting", "Requests waiting for a row").set_function(lambda: len(scheduler.queue))
        capacity = scheduler.max_batch * scheduler.capacity
        vllm(Gauge, "kv_cache_usage_perc", "KV-cache usage: tokens the rows hold over --max-num-seqs x --max-model-len "
             "slots (1 means 100 percent)").set_function(lambda: scheduler.held_tokens / capacity)
        self.vllm_prompt_tokens = vllm(Counter, "prompt_tokens", "Prompt tokens prefilled")
        self.vllm_generation_tokens = vllm(Counter, "generation_tokens", "Tokens generated")
        self.prefix_queries = vllm(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = vllm(Counter, "prefix_cache_hits", "Prompt tokens whose K/V the prefix cache gave")
        self.success = vllm(Counter, "request_success", "Requests finished, by finish reason", ("finished_reason",))
        self.drafts = vllm(Counter, "spec_decode_num_drafts", "Cycles that drafted (plain steps apart)")
        self.draft_tokens = vllm(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed and verified")
        self.accepted_tokens = vllm(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = vllm(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each 0-based draft position", ("position",))
        self.ttft = vllm(Histogram, "time_to_first_token_seconds", "From arrival to the first token",
                         buckets=FIRST_TOKEN_BUCKETS)
        self.itl = vllm(Histogram, "inter_token_latency_seconds", "Between a request's successive cycles that committed "
                        "tokens", buckets=INTER_TOKEN_BUCKETS)
        self.e2e = vllm(Histogram, "e2e_request_latency_seconds", "From arrival to the end", buckets=REQUEST_BUCKETS)
        self.queued = vllm(Histogram, "request_queue_time_seconds", "Waiting for a row", buckets=REQUEST_BUCKETS)
        self.inference = vllm(Histogram, "request_inference_time_seconds", "From admission to the end",
                              buckets=REQUEST_BUCKETS)
        self.prefill = vllm(Histogram, "request_prefill_time_seconds", "From admission to the first token",
                            buckets=REQUEST_BUCKETS)
        self.decode = vllm(Histogram, "request_decode_time_seconds", "From the first token to the last",
                           buckets=REQUEST_BUCKETS)
        token_buckets = _one_two_five(scheduler.capacity)
        self.prompt_lengths = vllm(Histogram, "request_prompt_tokens", "Prompt tokens per request", buckets=token_buckets)
        self.generation_lengths = vllm(Histogram, "request_generation_tokens", "Tokens generated per request",
                                       buckets=token_buckets)

    def finished(self, ticket, row) -> None:
        """The scheduler's ``on_finish`` (its thread): counted on the request's event loop, before its responder
        hears that it ended, so that the decode loop pays nothing for it."""
        if not ticket.loop.is_closed():
            ticket.loop.call_soon_threadsafe(self._observe, ticket, row, time.perf_counter())

    def _observe(self, ticket, row, ended: float) -> None:
        reason = "abort" if ticket.ended_by else str(row.finish_reason)
        self.requests.labels(finish_reason=reason).inc()
        self.success.labels(**self.labels, finished_reason=OPENAI_FINISH.get(reason, reason)).inc()
        self.latency.observe(ended - ticket.submitted)
        self.e2e.observe(ended - ticket.submitted)
        admitted = ticket.admitted or ended
        self.queued.observe(admitted - ticket.submitted)
        self.inference.observe(ended - admitted)
        times = ticket.token_times
        if times:
            self.ttft.observe(times[0] - ticket.submitted)
            self.prefill.observe(times[0] - admitted)
            self.decode.observe(times[-1] - times[0])
            for gap in np.diff(times).tolist():
                self.itl.observe(gap)
        prompt, generated = len(row.prompt_ids), len(row.token_ids)
        self.prompt_tokens.inc(prompt)
        self.vllm_prompt_tokens.inc(prompt)
        self.vllm_generation_tokens.inc(generated)
        self.prefix_queries.inc(prompt)
        self.prefix_hits.inc(row.cached_tokens)
        self.prompt_lengths.observe(prompt)
        self.generation_lengths.observe(generated)
        self.decoding.observe_all(row.records)
        drafted = [r for r in row.records if r.drafted > 0]
        self.drafts.inc(len(drafted))
        self.draft_tokens.inc(sum(r.drafted for r in drafted))
        self.accepted_tokens.inc(sum(r.accepted for r in drafted))
        for position, count in Tally(i for r in drafted for i in range(r.accepted)).items():
            self.accepted_per_pos.labels(**self.labels, position=str(position)).inc(count)

    def responded(self, path: str, status: int) -> None:
        self.http.labels(route=path if path in self.routes else "other", status=str(status)).inc()


class Labelled(Collector):
    """Every sample of ``registry`` with ``labels`` added (prometheus_client has no registry-wide constant labels)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        self.registry, self.labels = registry, dict(labels)

    def collect(self):
        for family in self.registry.collect():
            family.samples = [sample._replace(labels={**sample.labels, **self.labels}) for sample in family.samples]
            yield family


def _one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10
