"""Prometheus text-format metrics of the HTTP endpoint and the branch pool.

Kept dependency-free and picklable: the branch pool records its batch sizes in `BatchStats`,
hands a snapshot to the ingress through a deployment handle, and the ingress renders it
next to its own request counters.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from selfrag.schemas.answer import AnswerResponse

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)

Labels = Mapping[str, str]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


@dataclass
class Histogram:
    """Cumulative-bucket histogram, as Prometheus defines it."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def samples(self, name: str, labels: Labels) -> list[str]:
        out = [
            f"{name}_bucket{_labels({**labels, 'le': _number(b)})} {c}"
            for b, c in zip(self.buckets, self.counts, strict=True)
        ]
        out.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {self.total}")
        out.append(f"{name}_sum{_labels(labels)} {_number(self.sum)}")
        out.append(f"{name}_count{_labels(labels)} {self.total}")
        return out


def family(
    name: str, kind: str, help_text: str, samples: Iterable[tuple[Labels, float]]
) -> list[str]:
    """A counter or gauge family: HELP, TYPE and one line per labelled sample."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples]
    return lines


def histogram_family(
    name: str, help_text: str, histograms: Iterable[tuple[Labels, Histogram]]
) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for labels, h in histograms:
        lines += h.samples(name, labels)
    return lines


@dataclass
class BatchStats:
    """Sizes of the engine calls the branch pool formed, per critique method."""

    requests: dict[str, Histogram] = field(default_factory=dict)
    branches: dict[str, Histogram] = field(default_factory=dict)

    def record(self, method: str, n_requests: int, n_branches: int) -> None:
        self.requests.setdefault(method, Histogram(BATCH_BUCKETS)).observe(n_requests)
        self.branches.setdefault(method, Histogram(BATCH_BUCKETS)).observe(n_branches)

    def render(self) -> list[str]:
        return [
            *histogram_family(
                "selfrag_batch_requests",
                "Concurrent requests merged into one engine call, per critique method.",
                [({"method": m}, h) for m, h in sorted(self.requests.items())],
            ),
            *histogram_family(
                "selfrag_batch_branches",
                "Branches (sequences) in one engine call, per critique method.",
                [({"method": m}, h) for m, h in sorted(self.branches.items())],
            ),
        ]


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    errors: int = 0


class Metrics:
    """Request, latency, answer and cache counters of one ingress replica. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, int], int] = {}
        self._latency: dict[str, Histogram] = {}
        self.cache = CacheCounters()
        self._answers = 0
        self._usage: dict[str, int] = {
            "steps": 0,
            "retrievals": 0,
            "branches_opened": 0,
            "branches_pruned": 0,
            "branches_filtered": 0,
            "abstained": 0,
        }
        self._deadline_exceeded = 0
        self._rejected_overload = 0
        self._inflight = 0
        self._streams_abandoned = 0
        # (deployment, method) -> [calls, bytes sent, bytes received]
        self._remote: dict[tuple[str, str], list[int]] = {}

    def observe_request(self, method: str, path: str, status: int, seconds: float) -> None:
        with self._lock:
            key = (method, path, status)
            self._requests[key] = self._requests.get(key, 0) + 1
            self._latency.setdefault(path, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def observe_answer(self, r: AnswerResponse) -> None:
        """Count the work of a freshly decoded answer (cache hits did none)."""
        with self._lock:
            self._answers += 1
            u = r.usage
            self._usage["steps"] += u.steps
            self._usage["retrievals"] += u.retrievals
            self._usage["branches_opened"] += u.branches_opened
            self._usage["branches_pruned"] += u.branches_pruned
            self._usage["branches_filtered"] += u.branches_filtered
            self._usage["abstained"] += int(r.abstained)

    def count_cache(self, outcome: str) -> None:
        with self._lock:
            setattr(self.cache, outcome, getattr(self.cache, outcome) + 1)

    def count_overload(self) -> None:
        with self._lock:
            self._rejected_overload += 1

    def count_deadline(self) -> None:
        with self._lock:
            self._deadline_exceeded += 1

    def set_inflight(self, n: int) -> None:
        """Admitted answers whose decoder still runs (a 504'd one counts until it ends)."""
        with self._lock:
            self._inflight = n

    def count_remote(self, deployment: str, method: str, sent: int, received: int) -> None:
        """One call from the decoder to another deployment, and its pickled payload sizes."""
        with self._lock:
            row = self._remote.setdefault((deployment, method), [0, 0, 0])
            row[0] += 1
            row[1] += sent
            row[2] += received

    def count_stream_abandoned(self) -> None:
        """A stream whose client went away before its answer; its decode was cancelled."""
        with self._lock:
            self._streams_abandoned += 1

    def render(self, extra: Sequence[str] = ()) -> str:
        """The Prometheus text exposition (format 0.0.4) of everything counted here."""
        with self._lock:
            u = dict(self._usage)
            steps = u["steps"]
            lines = [
                *family(
                    "selfrag_http_requests_total",
                    "counter",
                    "HTTP requests by method, route and status code.",
                    [
                        ({"method": m, "path": p, "status": str(s)}, n)
                        for (m, p, s), n in sorted(self._requests.items())
                    ],
                ),
                *histogram_family(
                    "selfrag_http_request_duration_seconds",
                    "Time to the response start, by route.",
                    [({"path": p}, h) for p, h in sorted(self._latency.items())],
                ),
                *family(
                    "selfrag_rejected_total",
                    "counter",
                    "Requests refused: overloaded (503) or past their deadline (504).",
                    [
                        ({"reason": "overloaded"}, self._rejected_overload),
                        ({"reason": "deadline"}, self._deadline_exceeded),
                    ],
                ),
                *family(
                    "selfrag_inflight_answers",
                    "gauge",
                    "Admitted answers whose decoder still runs (a slot of serve.max_inflight).",
                    [({}, self._inflight)],
                ),
                *family(
                    "selfrag_streams_abandoned_total",
                    "counter",
                    "Streams whose client disconnected before the answer; the decode was "
                    "cancelled.",
                    [({}, self._streams_abandoned)],
                ),
                *family(
                    "selfrag_query_cache_total",
                    "counter",
                    "Query cache lookups: hit, miss, or error (cache bypassed).",
                    [
                        ({"outcome": "hit"}, self.cache.hits),
                        ({"outcome": "miss"}, self.cache.misses),
                        ({"outcome": "error"}, self.cache.errors),
                    ],
                ),
                *family(
                    "selfrag_answers_total",
                    "counter",
                    "Answers decoded (not from cache).",
                    [({}, self._answers)],
                ),
                *family(
                    "selfrag_decoding_steps_total",
                    "counter",
                    "Segment steps decoded.",
                    [({}, steps)],
                ),
                *family(
                    "selfrag_retrievals_total",
                    "counter",
                    "Steps that retrieved passages.",
                    [({}, u["retrievals"])],
                ),
                *family(
                    "selfrag_retrieval_rate",
                    "gauge",
                    "Retrieving steps / all steps since start.",
                    [({}, u["retrievals"] / steps if steps else 0.0)],
                ),
                *family(
                    "selfrag_branches_total",
                    "counter",
                    "Branches opened, pruned by min_relevance, and removed by hard filters.",
                    [
                        ({"outcome": "opened"}, u["branches_opened"]),
                        ({"outcome": "pruned"}, u["branches_pruned"]),
                        ({"outcome": "filtered"}, u["branches_filtered"]),
                    ],
                ),
                *family(
                    "selfrag_remote_calls_total",
                    "counter",
                    "Calls from the decoder to other deployments, by deployment and method.",
                    [
                        ({"deployment": d, "method": m}, row[0])
                        for (d, m), row in sorted(self._remote.items())
                    ],
                ),
                *family(
                    "selfrag_remote_bytes_total",
                    "counter",
                    "Pickled bytes of those calls' arguments (sent) and results (received).",
                    [
                        ({"deployment": d, "method": m, "direction": direction}, row[i])
                        for (d, m), row in sorted(self._remote.items())
                        for i, direction in ((1, "sent"), (2, "received"))
                    ],
                ),
                *family(
                    "selfrag_abstained_total",
                    "counter",
                    "Answers that abstained.",
                    [({}, u["abstained"])],
                ),
            ]
        return "\n".join([*lines, *extra]) + "\n"
