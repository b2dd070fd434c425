"""The Serve application's metrics (actors/http/metrics.py) without Ray: the definitions follow
Prometheus' conventions, each event reaches every sink once, the ingress's `/metrics` renders
prometheus_client's exposition with the process metrics, and the Grafana dashboard queries
only series the code defines."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping

import pytest

from selfrag.actors.http.metrics import (
    METRICS,
    RAY_SERVE_TAGS,
    EngineMetrics,
    Metrics,
    MetricSpec,
    PrometheusSink,
    Recorder,
)
from selfrag.schemas.decoding import DecodingConfig
from tests.http_fakes import metric_value as value
from tests.http_fakes import scripted_response
from tests.paths import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "selfrag.json"


class ListSink:
    """Every event it receives, as (kind, name, labels, value)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, str], float]] = []

    def inc(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self.events.append(("inc", spec.name, dict(labels), value))

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self.events.append(("observe", spec.name, dict(labels), value))

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self.events.append(("set", spec.name, dict(labels), value))


class BrokenSink(ListSink):
    def inc(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        raise RuntimeError("backend down")


def test_definitions_follow_prometheus_conventions():
    for name, spec in METRICS.items():
        assert name == spec.name and re.fullmatch(r"selfrag_[a-z0-9_]+", name)
        assert (spec.kind == "counter") == name.endswith("_total"), name
        if "duration" in name or "latency" in name:
            assert name.endswith("_seconds"), name
        assert not RAY_SERVE_TAGS & set(spec.labels), name  # Ray Serve adds those itself
        assert not {"rate", "ratio"} & set(name.split("_")), name  # ratios belong in PromQL
    # The one gauge is a level, not a ratio.
    assert [n for n, s in METRICS.items() if s.kind == "gauge"] == ["selfrag_inflight_answers"]
    with pytest.raises(ValueError, match="_total"):
        MetricSpec("selfrag_hits", "counter", "no suffix")
    with pytest.raises(ValueError, match="Ray Serve"):
        MetricSpec("selfrag_calls_total", "counter", "reserved label", ("deployment",))


def test_each_event_reaches_every_sink_once():
    a, b = ListSink(), ListSink()
    metrics = Metrics(a, b)
    metrics.observe_request("POST", "/v1/answer", 200, 0.3)
    metrics.count_cache("misses")
    metrics.set_inflight(2)
    request = {"method": "POST", "path": "/v1/answer", "status": "200"}
    assert a.events == [
        ("inc", "selfrag_http_requests_total", request, 1.0),
        ("observe", "selfrag_http_request_duration_seconds", {"path": "/v1/answer"}, 0.3),
        ("inc", "selfrag_query_cache_total", {"outcome": "miss"}, 1.0),
        ("set", "selfrag_inflight_answers", {}, 2),
    ]
    assert b.events == a.events


def test_a_method_the_client_made_up_is_counted_as_other():
    sink = ListSink()
    metrics = Metrics(sink)
    for method in ("GET", "PATCH", "BREW", "get", "X" * 1000):
        metrics.observe_request(method, "/v1/answer", 405, 0.001)
    methods = [e[2]["method"] for e in sink.events if e[0] == "inc"]
    assert methods == ["GET", "PATCH", "other", "other", "other"]


def test_a_failing_sink_does_not_fail_the_caller_or_the_other_sinks(caplog):
    good = ListSink()
    metrics = Metrics(BrokenSink(), good)
    # The logger's own level: whatever an earlier test left the root logger's at.
    with caplog.at_level(logging.WARNING, logger="selfrag.metrics"):
        metrics.count_overload()
        metrics.count_overload()
    assert [e[2] for e in good.events] == [{"reason": "overloaded"}] * 2
    assert sum("backend down" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_a_wrong_name_kind_or_label_set_is_a_bug_that_raises():
    recorder = Recorder([ListSink()])
    with pytest.raises(KeyError):
        recorder.inc("selfrag_nothing_total")
    with pytest.raises(TypeError):
        recorder.observe("selfrag_answers_total", 1.0)
    with pytest.raises(ValueError, match="labels"):
        recorder.inc("selfrag_rejected_total", reason="x", extra="y")


def test_the_ingress_exposition_counts_answers_and_has_process_metrics():
    metrics = Metrics()
    metrics.observe_answer(scripted_response("q", DecodingConfig()))
    metrics.count_remote("Retriever", "search_many", 100, 2000)
    text = metrics.render()
    assert value(text, "selfrag_answers_total") == 1
    assert value(text, "selfrag_decoding_steps_total") == 2
    assert value(text, "selfrag_branches_total", outcome="pruned") == 1
    assert value(text, "selfrag_branches_total", outcome="filtered") == 1
    assert value(text, "selfrag_abstained_total") == 0
    assert value(text, "selfrag_remote_calls_total", target="Retriever", method="search_many") == 1
    assert (
        value(
            text,
            "selfrag_remote_bytes_total",
            target="Retriever",
            method="search_many",
            direction="received",
        )
        == 2000
    )
    # Known outcomes are there at 0 before their first event, so rate() has a series.
    assert value(text, "selfrag_query_cache_total", outcome="hit") == 0
    assert value(text, "selfrag_rejected_total", reason="deadline") == 0
    # prometheus_client's process collector: CPU, memory, file descriptors of this process.
    assert value(text, "process_cpu_seconds_total") >= 0
    assert value(text, "process_resident_memory_bytes") > 0
    assert "selfrag_retrieval_rate" not in text  # a ratio: PromQL's job


def test_engine_batches_and_tier_counters_as_histograms_and_counter_deltas():
    sink = PrometheusSink("engine", process=False)
    engine = EngineMetrics([sink])
    engine.record_batch("draft", 3, 7)
    engine.record_batch("draft", 1, 2)
    engine.sync_kv_store({"miss": 2, "memory_hit": 0})
    # A tier seen at 0 shows at 0 (a rate over it exists before its first event).
    assert value(engine.render(), "selfrag_kv_cache_tier_total", event="memory_hit") == 0
    engine.sync_kv_store({"miss": 5, "memory_hit": 1})
    text = engine.render()
    assert value(text, "selfrag_batch_requests_bucket", method="draft", le="2.0") == 1
    assert value(text, "selfrag_batch_requests_bucket", method="draft", le="4.0") == 2
    assert value(text, "selfrag_batch_branches_sum", method="draft") == 9
    assert value(text, "selfrag_batch_branches_count", method="draft") == 2
    assert value(text, "selfrag_kv_cache_tier_total", event="miss") == 5
    assert value(text, "selfrag_kv_cache_tier_total", event="memory_hit") == 1
    # A store that was reopened counts from zero again: its new counts are added.
    engine.sync_kv_store({"miss": 1})
    assert value(engine.render(), "selfrag_kv_cache_tier_total", event="miss") == 6
    assert "process_cpu_seconds_total" not in text
    assert "selfrag_http_requests_total" not in text  # the ingress's, not an engine's


def test_two_ingress_metrics_in_one_process_keep_their_own_series():
    first, second = Metrics(), Metrics()
    first.count_stream_abandoned()
    assert value(first.render(), "selfrag_streams_abandoned_total") == 1
    assert value(second.render(), "selfrag_streams_abandoned_total") == 0


# --- the Grafana dashboard ---------------------------------------------------------------------

_SUFFIXES = {"_bucket": "histogram", "_sum": "histogram", "_count": "histogram"}


def _exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def _queried(expr: str) -> list[tuple[str, str]]:
    """(metric as defined in the code, series suffix) of each series `expr` reads."""
    out = []
    for series in re.findall(r"\$\{prefix\}([a-zA-Z_:][a-zA-Z0-9_:]*)", expr):
        if series in METRICS:
            out.append((series, ""))
            continue
        for suffix in _SUFFIXES:
            if series.endswith(suffix) and series.removesuffix(suffix) in METRICS:
                out.append((series.removesuffix(suffix), suffix))
                break
        else:
            out.append((series, "?"))
    return out


def test_the_dashboard_queries_only_metrics_the_code_defines():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["prefix"]["query"] == "ray_"  # Ray's export prefixes every series
    exprs = _exprs()
    assert exprs
    used = set()
    for expr in exprs:
        # Every metric name is written with the prefix variable, so both scrapes work.
        bare = re.findall(r"(?<![\w}])selfrag_\w+", expr)
        assert not bare, expr
        for name, suffix in _queried(expr):
            assert suffix != "?", f"{name} is no metric the code defines ({expr})"
            spec = METRICS[name]
            if suffix:
                assert spec.kind == "histogram", expr
            if spec.kind == "gauge":
                assert "rate(" not in expr, expr
            if spec.kind == "histogram":
                assert suffix, f"a histogram is read through _bucket/_sum/_count: {expr}"
            used.add(name)
        assert "rate(" not in expr or "[$__rate_interval]" in expr, expr
    # The main series all have a panel.
    assert {
        "selfrag_http_requests_total",
        "selfrag_http_request_duration_seconds",
        "selfrag_batch_requests",
        "selfrag_batch_branches",
        "selfrag_query_cache_total",
        "selfrag_branches_total",
        "selfrag_inflight_answers",
    } <= used
    assert any(e.startswith("histogram_quantile(0.95") for e in exprs)
