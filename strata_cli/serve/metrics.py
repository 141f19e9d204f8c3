"""`strata serve`'s /metrics: Prometheus counters and histograms over the requests answered.

Every figure comes from what serve-stdio's frames already carry (a done frame's `usage` and
`stats`, docs/serve.md) plus the times the HTTP worker sees: arrival, the first text delta, each
later delta, the done frame. Needs prometheus-client (the `serve` extra). Documented in
docs/http.md ("Metrics").
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
WINDOW_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The server's counters, in a registry of their own (nothing process-wide).

    Args:
        queued: how many requests wait (read when /metrics is scraped).
        running: 1 while a request runs, else 0.
    """

    def __init__(self, *, queued: Callable[[], int], running: Callable[[], int]):
        self.registry = registry = CollectorRegistry()

        def counter(name: str, text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, text, labels, registry=registry)

        self.http_requests = counter("strata_http_requests", "HTTP requests answered, by endpoint and status code",
                                     ("endpoint", "status"))
        self.finished = counter("strata_requests_finished",
                                "completions answered, by strata's finish reason (stop, length, context, cancelled)",
                                ("finish_reason",))
        self.cancelled_by_client = counter("strata_requests_client_gone",
                                           "completions whose client went away before the answer")
        self.prompt_tokens = counter("strata_prompt_tokens", "prompt tokens of answered completions")
        self.completion_tokens = counter("strata_completion_tokens", "tokens generated")
        self.prefix_hits = counter("strata_prefix_cache_hits", "completions that restored a prefix checkpoint")
        self.prefix_misses = counter("strata_prefix_cache_misses", "completions that prefilled from the start")
        self.cached_tokens = counter("strata_prefix_cache_tokens",
                                     "prompt positions restored from a checkpoint instead of prefilled")
        self.windows = counter("strata_windows", "decode windows run (one forward pass each)")
        self.decode_seconds = counter("strata_decode_seconds", "wall time of all decode windows")
        self.drafts_offered = counter("strata_drafts_offered", "drafts the model verified")
        self.drafts_kept = counter("strata_drafts_kept", "verified drafts the model agreed with")
        self.drafts_offered_global = counter("strata_suffix_cache_drafts_offered",
                                             "of strata_drafts_offered, those from the cross-request suffix cache")
        self.drafts_kept_global = counter("strata_suffix_cache_drafts_kept",
                                          "of strata_drafts_kept, those from the cross-request suffix cache")
        self.expert_hits = counter("strata_expert_cache_hits", "streamed experts already resident when picked")
        self.expert_misses = counter("strata_expert_cache_misses", "streamed experts read on demand")
        self.expert_bytes = counter("strata_expert_cache_read_bytes", "bytes of streamed experts read from storage",
                                    ("kind",))
        self.ttft = Histogram("strata_time_to_first_token_seconds",
                              "from the request's arrival (queue wait included) to its first generated text",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.window = Histogram("strata_window_seconds",
                                "time between a request's consecutive text deltas: one decode window each "
                                "(several when a window's text is held back, as a stop string's start is)",
                                buckets=WINDOW_BUCKETS, registry=registry)
        self.request_seconds = Histogram("strata_request_seconds", "from arrival to the answer's end",
                                         buckets=REQUEST_BUCKETS, registry=registry)
        Gauge("strata_queued_requests", "requests waiting behind the one running",
              registry=registry).set_function(queued)
        Gauge("strata_running_requests", "requests running (0 or 1)", registry=registry).set_function(running)

    def record_done(self, done: dict) -> None:
        """Count one answered completion from its done frame (serve-stdio's)."""
        usage, stats = done["usage"], done["stats"]
        self.finished.labels(done["finish_reason"]).inc()
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.completion_tokens.inc(usage["completion_tokens"])
        if usage["prompt_tokens"]:  # a request cancelled before it started looked nothing up
            (self.prefix_hits if usage["cached_tokens"] else self.prefix_misses).inc()
        self.cached_tokens.inc(usage["cached_tokens"])
        self.windows.inc(stats.get("windows", 0))
        self.decode_seconds.inc(stats.get("decode_seconds", 0.0))
        for counter, key in ((self.drafts_offered, "drafts_offered"), (self.drafts_kept, "drafts_kept"),
                             (self.drafts_offered_global, "drafts_offered_global"),
                             (self.drafts_kept_global, "drafts_kept_global")):
            counter.inc(stats.get(key, 0))
        experts = stats.get("experts")
        if experts:
            self.expert_hits.inc(experts.get("hits", 0))
            self.expert_misses.inc(experts.get("misses", 0))
            self.expert_bytes.labels("demand").inc(experts.get("bytes_read", 0))
            self.expert_bytes.labels("prefetch").inc(experts.get("prefetched_bytes", 0))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
