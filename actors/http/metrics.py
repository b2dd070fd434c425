"""What the Serve application counts, each event recorded once into every backend that exports it.

`METRICS` defines every series (`MetricSpec`: name, kind, help, labels, buckets, and which
deployments record it): counters (`_total`) and histograms, and one gauge that is a level
(answers in flight); ratios (hit rates, retrieval rate) are left to PromQL. A `Recorder` hands
each event to its sinks (`MetricsSink`):

* `PrometheusSink`: prometheus_client in a registry of its own, with the process, platform
  and GC collectors. The ingress renders it at `GET /metrics`: one process, for a
  single-machine scrape.
* `RaySink`: `ray.serve.metrics`. Every replica exports its series through Ray's metrics
  agent on its node, tagged with `deployment`, `replica` and `application`; there the names
  carry Ray's `ray_` prefix (`ray_selfrag_batch_requests_bucket`).

`Metrics` is what the ingress records (requests, answers, the query cache, calls to the other
deployments); `EngineMetrics` what an engine replica records (its batch sizes and passage
KV-state store). Neither needs Ray: the HTTP layer's tests use a `PrometheusSink` alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from selfrag.schemas.answer import AnswerResponse

log = logging.getLogger("selfrag.metrics")

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


class MetricsSink(Protocol):
    """A metrics backend: receives every event a `Recorder` records, with its labels."""

    def inc(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        """Add `value` (>= 0) to a counter; 0 makes a new series show, where it can."""
        ...

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        """One observation of a histogram."""
        ...

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        """The current value of a gauge."""
        ...


class PrometheusSink:
    """prometheus_client metrics in a registry of this sink's own (several may live in one
    process, as in tests): the series of `source` (default: all), and the process collectors
    (CPU, memory, file descriptors, GC) unless `process` is False."""

    def __init__(self, source: Source | None = None, *, process: bool = True) -> None:
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry()
        if process:
            prom.ProcessCollector(registry=self.registry)
            prom.PlatformCollector(registry=self.registry)
            prom.GCCollector(registry=self.registry)
        self._metrics: dict[str, Any] = {}
        for spec in METRICS.values() if source is None else specs_of(source):
            labels = list(spec.labels)
            if spec.kind == "counter":
                metric: Any = prom.Counter(spec.name, spec.help, labels, registry=self.registry)
            elif spec.kind == "histogram":
                metric = prom.Histogram(
                    spec.name, spec.help, labels, buckets=spec.buckets, registry=self.registry
                )
            else:
                metric = prom.Gauge(spec.name, spec.help, labels, registry=self.registry)
            for values in spec.preset:
                metric.labels(*values)
            self._metrics[spec.name] = metric

    def _child(self, spec: MetricSpec, labels: Mapping[str, str]) -> Any:
        metric = self._metrics[spec.name]
        return metric.labels(**labels) if spec.labels else metric

    def inc(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        child = self._child(spec, labels)  # a new series shows at 0 from now on
        if value:
            child.inc(value)

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self._child(spec, labels).observe(value)

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self._child(spec, labels).set(value)

    def render(self) -> str:
        """The text exposition (format 0.0.4) of everything in the registry."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class RaySink:
    """`ray.serve.metrics` objects, one per `METRICS` entry, made here: build it in a replica,
    whose context tags every series (`deployment`, `replica`, `application`). Ray's metrics
    agent exports them on the node (`ray.nodes()[i]["MetricsExportPort"]`)."""

    def __init__(self) -> None:
        from ray.serve import metrics as serve_metrics

        self._metrics: dict[str, Any] = {}
        for spec in METRICS.values():
            if spec.kind == "counter":
                metric: Any = serve_metrics.Counter(spec.name, spec.help, spec.labels)
            elif spec.kind == "histogram":
                metric = serve_metrics.Histogram(
                    spec.name, spec.help, list(spec.buckets), spec.labels
                )
            else:
                metric = serve_metrics.Gauge(spec.name, spec.help, spec.labels)
            self._metrics[spec.name] = metric

    def inc(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        if value > 0:  # Ray's counters take positive increments only
            self._metrics[spec.name].inc(value, dict(labels))

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self._metrics[spec.name].observe(value, dict(labels))

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self._metrics[spec.name].set(value, dict(labels))


class Recorder:
    """Records each event once into all its sinks. Thread-safe. A sink that fails is logged
    (once per metric) and never fails the caller; a wrong name or label set raises (a bug)."""

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = tuple(sinks)
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, str, str], float] = {}
        self._failed: set[str] = set()

    def _spec(self, name: str, kind: Kind, labels: Mapping[str, str]) -> MetricSpec:
        spec = METRICS[name]
        if spec.kind != kind:
            raise TypeError(f"{name} is a {spec.kind}, not a {kind}")
        if set(labels) != set(spec.labels):
            raise ValueError(f"{name} takes labels {spec.labels}, got {tuple(labels)}")
        return spec

    def _each(self, method: str, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)(spec, labels, value)
            except Exception as exc:
                with self._lock:
                    first = spec.name not in self._failed
                    self._failed.add(spec.name)
                (log.warning if first else log.debug)(
                    "%s: %s failed to record: %s", spec.name, type(sink).__name__, exc
                )

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        spec = self._spec(name, "counter", labels)
        if value < 0:
            raise ValueError(f"{name}: a counter cannot go down ({value})")
        self._each("inc", spec, labels, value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._each("observe", self._spec(name, "histogram", labels), labels, value)

    def set(self, name: str, value: float, **labels: str) -> None:
        self._each("set", self._spec(name, "gauge", labels), labels, value)

    def sync_totals(self, name: str, label: str, totals: Mapping[str, float]) -> None:
        """Bring cumulative counts kept elsewhere (a cache's tier counters) into counter
        `name`, labelled `label`: each key's increase since the last sync. A count lower than
        last time started again from zero (its owner was reopened). A key seen for the first
        time shows, at 0 if it is 0, where the sink can show it."""
        deltas: list[tuple[str, float]] = []
        with self._lock:
            for key, total in totals.items():
                last = self._totals.get((name, label, key))
                self._totals[(name, label, key)] = total
                delta = total if last is None or total < last else total - last
                if delta > 0 or last is None:
                    deltas.append((key, delta))
        for key, delta in sorted(deltas):
            self.inc(name, delta, **{label: key})

    def render(self) -> str:
        """The text exposition of this recorder's `PrometheusSink` ("" without one)."""
        for sink in self.sinks:
            if isinstance(sink, PrometheusSink):
                return sink.render()
        return ""


_CACHE_OUTCOMES = {"hits": "hit", "misses": "miss", "errors": "error"}


class Metrics(Recorder):
    """What the HTTP ingress records. With no sinks given, a `PrometheusSink` of the ingress's
    series alone (the HTTP layer without Ray); the deployment gives it a `RaySink` as well."""

    def __init__(self, *sinks: MetricsSink) -> None:
        super().__init__(sinks or (PrometheusSink("ingress"),))

    def observe_request(self, method: str, path: str, status: int, seconds: float) -> None:
        """One HTTP request; `path` is its route's template. Methods outside `HTTP_METHODS`
        count as `other`: the method is the client's to choose, the series are not."""
        method = method if method in HTTP_METHODS else "other"
        self.inc("selfrag_http_requests_total", method=method, path=path, status=str(status))
        self.observe("selfrag_http_request_duration_seconds", seconds, path=path)

    def observe_answer(self, r: AnswerResponse) -> None:
        """Count the work of a freshly decoded answer (cache hits did none)."""
        u = r.usage
        self.inc("selfrag_answers_total")
        self.inc("selfrag_decoding_steps_total", u.steps)
        self.inc("selfrag_retrievals_total", u.retrievals)
        self.inc("selfrag_branches_total", u.branches_opened, outcome="opened")
        self.inc("selfrag_branches_total", u.branches_pruned, outcome="pruned")
        self.inc("selfrag_branches_total", u.branches_filtered, outcome="filtered")
        if r.abstained:
            self.inc("selfrag_abstained_total")

    def count_cache(self, event: str) -> None:
        """A query-cache lookup (`runtime.answering.AnswerEvents`): `hits`, `misses` or
        `errors` (the cache was bypassed)."""
        self.inc("selfrag_query_cache_total", outcome=_CACHE_OUTCOMES.get(event, event))

    def count_overload(self) -> None:
        self.inc("selfrag_rejected_total", reason="overloaded")

    def count_deadline(self) -> None:
        self.inc("selfrag_rejected_total", reason="deadline")

    def set_inflight(self, n: int) -> None:
        """Admitted answers whose decoder still runs (a 504'd one counts until it ends)."""
        self.set("selfrag_inflight_answers", n)

    def count_remote(self, target: str, method: str, sent: int, received: int) -> None:
        """One call from the decoder to deployment `target`, and its pickled payload sizes."""
        self.inc("selfrag_remote_calls_total", target=target, method=method)
        self.inc("selfrag_remote_bytes_total", sent, target=target, method=method, direction="sent")
        self.inc(
            "selfrag_remote_bytes_total",
            received,
            target=target,
            method=method,
            direction="received",
        )

    def count_stream_abandoned(self) -> None:
        """A stream whose client went away before its answer; its decode was cancelled."""
        self.inc("selfrag_streams_abandoned_total")

    def sync_query_cache(self, counters: Mapping[str, int]) -> None:
        """The query cache's tier counters (`infra.cache.tiers` `counters()`), as they are now."""
        self.sync_totals("selfrag_query_cache_tier_total", "event", counters)


class EngineMetrics(Recorder):
    """What an engine replica (`BranchPool`, `RetrievalDecider`) records."""

    def record_batch(self, method: str, n_requests: int, n_branches: int) -> None:
        """One engine call: how many requests' calls it merged, and their branches (the
        `runtime.merging.CallMerger`'s `on_batch`)."""
        self.observe("selfrag_batch_requests", n_requests, method=method)
        self.observe("selfrag_batch_branches", n_branches, method=method)

    def sync_kv_store(self, counters: Mapping[str, int]) -> None:
        """The passage KV-state store's tier counters, as they are now."""
        self.sync_totals("selfrag_kv_cache_tier_total", "event", counters)
