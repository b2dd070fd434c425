"""Every series the Serve application exports (`METRICS`): its name, kind, help, labels and
buckets, and which deployments record it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
"""The methods counted under their own name; any other counts as `other`."""

Kind = Literal["counter", "histogram", "gauge"]
Source = Literal["ingress", "engine"]

# Ray Serve adds these tags to every series a replica exports; a label may not reuse them.
RAY_SERVE_TAGS = frozenset({"deployment", "replica", "application", "route"})


@dataclass(frozen=True)
class MetricSpec:
    """One series family. `preset`: label values shown (at 0) before their first event, so a
    rate over them exists from the start. `source`: the deployments that record it, the
    ingress or the engine replicas (`BranchPool`, `RetrievalDecider`)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    preset: tuple[tuple[str, ...], ...] = ()
    source: Source = "ingress"

    def __post_init__(self) -> None:
        if not self.name.startswith("selfrag_"):
            raise ValueError(f"{self.name}: selfrag's metrics are named selfrag_*")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counters, and only counters, end in _total")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"{self.name}: histograms, and only histograms, have buckets")
        if reserved := RAY_SERVE_TAGS.intersection(self.labels):
            raise ValueError(f"{self.name}: label(s) {sorted(reserved)} are Ray Serve's tags")
        if any(len(values) != len(self.labels) for values in self.preset):
            raise ValueError(f"{self.name}: a preset needs one value per label")


METRICS: dict[str, MetricSpec] = {
    spec.name: spec
    for spec in (
        # --- the ingress ---------------------------------------------------------------------
        MetricSpec(
            "selfrag_http_requests_total",
            "counter",
            "HTTP requests by method (`other` for an unusual one), route (`unmatched` when "
            "none) and status code.",
            ("method", "path", "status"),
        ),
        MetricSpec(
            "selfrag_http_request_duration_seconds",
            "histogram",
            "Time to the response start, by route.",
            ("path",),
            LATENCY_BUCKETS,
        ),
        MetricSpec(
            "selfrag_rejected_total",
            "counter",
            "Requests refused: overloaded (503) or past their deadline (504).",
            ("reason",),
            preset=(("overloaded",), ("deadline",)),
        ),
        MetricSpec(
            "selfrag_inflight_answers",
            "gauge",
            "Admitted answers whose decoder still runs (a slot of serve.max_inflight).",
        ),
        MetricSpec(
            "selfrag_streams_abandoned_total",
            "counter",
            "Streams whose client disconnected before the answer; the decode was cancelled.",
        ),
        MetricSpec(
            "selfrag_query_cache_total",
            "counter",
            "Query cache lookups: hit, miss, or error (cache bypassed).",
            ("outcome",),
            preset=(("hit",), ("miss",), ("error",)),
        ),
        MetricSpec(
            "selfrag_query_cache_tier_total",
            "counter",
            "Query cache by tier: memory/redis hits, misses, Redis errors and calls bypassed "
            "while Redis is down, and answers read from Redis but refused (redis_rejected_*).",
            ("event",),
        ),
        MetricSpec("selfrag_answers_total", "counter", "Answers decoded (not from cache)."),
        MetricSpec("selfrag_decoding_steps_total", "counter", "Segment steps decoded."),
        MetricSpec("selfrag_retrievals_total", "counter", "Steps that retrieved passages."),
        MetricSpec(
            "selfrag_branches_total",
            "counter",
            "Branches opened, pruned before drafting (min_relevance, relevance_margin), and "
            "removed by hard filters (before or after drafting).",
            ("outcome",),
            preset=(("opened",), ("pruned",), ("filtered",)),
        ),
        MetricSpec("selfrag_abstained_total", "counter", "Answers that abstained."),
        MetricSpec(
            "selfrag_remote_calls_total",
            "counter",
            "Calls from the decoder to other deployments, by the deployment called (target) "
            "and method.",
            ("target", "method"),
        ),
        MetricSpec(
            "selfrag_remote_bytes_total",
            "counter",
            "Pickled bytes of those calls' arguments (sent) and results (received).",
            ("target", "method", "direction"),
        ),
        # --- the engine replicas (BranchPool, RetrievalDecider) -------------------------------
        MetricSpec(
            "selfrag_batch_requests",
            "histogram",
            "Concurrent requests merged into one engine call, per critique method.",
            ("method",),
            BATCH_BUCKETS,
            source="engine",
        ),
        MetricSpec(
            "selfrag_batch_branches",
            "histogram",
            "Branches (sequences) in one engine call, per critique method.",
            ("method",),
            BATCH_BUCKETS,
            source="engine",
        ),
        MetricSpec(
            "selfrag_kv_cache_tier_total",
            "counter",
            "Passage KV-state store by tier: memory/redis hits, misses, puts, Redis errors and "
            "bypassed calls, and states read from Redis but refused (redis_rejected_*).",
            ("event",),
            source="engine",
        ),
    )
}


def specs_of(source: Source) -> list[MetricSpec]:
    """The series that `source` records."""
    return [spec for spec in METRICS.values() if spec.source == source]
