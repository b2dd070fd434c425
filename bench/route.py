"""Remote calls and bytes per decoding step: the Serve route with a call per critique read
("before") against the one that expands a whole step in one call ("after").

The same questions are decoded in-process on the real engine and index (no Ray). At every step
the objects that would cross process boundaries are pickled, as Ray pickles deployment-call
arguments and results, for both routes:

* before: decide → (decider forwards to) pool.retrieval, search, pool.relevance, pool.draft,
  pool.support, pool.utility, ranker.rank(full candidates: branches, passages, drafts' tokens);
* after: decider.decide, retriever.search_many, pool.expand(candidates, dials) → `StepWork`,
  ranker.rank(`Drafted` scores).

Reported: calls (hops) and KiB per step of each. The last line holds the figures as name=value.

    .venv/bin/python -m bench.route --home $SELFRAG_HOME --questions 8
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
from collections.abc import Sequence

from bench.serve_load import SMALL_CONFIG, questions
from selfrag.pipeline.branching import LocalBranchWorker, StepWork
from selfrag.pipeline.critics import Branch, LabelProbs
from selfrag.pipeline.ranking import Candidate, Hypothesis, StepRanking, rank_step
from selfrag.runtime.assembly import DecoderParts
from selfrag.schemas.decoding import DecodingConfig


def size(*objects: object) -> int:
    return len(pickle.dumps(objects, protocol=5))


class Recorder:
    """Wraps the local critique, ranker and retriever and adds up both routes' payloads."""

    def __init__(self, critique: LocalBranchWorker, source: str) -> None:
        self.critique = critique
        self.name = critique.name
        self.source = source
        self.steps: list[dict[str, int]] = []
        self._step: dict[str, int] = {}

    def _add(self, route: str, calls: int, n: int) -> None:
        self._step[f"{route}_calls"] = self._step.get(f"{route}_calls", 0) + calls
        self._step[f"{route}_bytes"] = self._step.get(f"{route}_bytes", 0) + n

    def retrieval(self, branches: Sequence[Branch]) -> list[LabelProbs]:
        out = self.critique.retrieval(branches)
        n = size(self.source, list(branches)) + size(out)
        self._add("before", 2, 2 * n)  # ingress → decider → pool, and back
        self._add("after", 1, n)
        return out

    def search(self, queries: Sequence[str], k: int, found: list[list[object]]) -> None:
        each = sum(size(q, k) + size(f) for q, f in zip(queries, found, strict=True))
        self._add("before", len(queries), each)
        self._add("after", 1, size(list(queries), k) + size(found))

    def expand(self, candidates: Sequence[Candidate], cfg: DecodingConfig) -> StepWork:
        sent_after = size(self.source, list(candidates), cfg, 30.0)
        work = self.critique.expand(candidates, cfg)
        self._add("after", 1, sent_after + size(work))
        evidence = [c for c in candidates if c.branch.passage is not None]
        drafted = [c for c in candidates if c.draft is not None]
        grounded = [c for c in drafted if c.branch.passage is not None]
        before = size(self.source, [c.branch for c in evidence]) + size([c.rel for c in evidence])
        before += size(self.source, [c.branch for c in drafted], cfg.max_segment_tokens)
        before += size([c.draft for c in drafted])
        before += size(self.source, [c.branch for c in grounded], [c.draft for c in grounded])
        before += size([c.sup for c in grounded])
        before += size(self.source, [c.branch for c in drafted], [c.draft for c in drafted])
        before += size([c.use for c in drafted])
        self._add("before", 4, before)
        self._candidates = [c for c in candidates if c.draft is not None]
        return work

    def rank(
        self,
        beam: Sequence[Hypothesis],
        live: Sequence[Hypothesis],
        drafted: Sequence[object],
        cfg: DecodingConfig,
    ) -> StepRanking:
        out = rank_step(beam, live, drafted, cfg)  # type: ignore[arg-type]
        back = size(out)
        self._add("after", 1, size(list(beam), list(live), list(drafted), cfg) + back)
        full = [c for c in self._candidates if c.draft is not None and c.draft.text.strip()]
        self._add("before", 1, size(list(beam), list(live), full, cfg) + back)
        self.steps.append(self._step)
        self._step = {}
        return out


class RecordingRetriever:
    def __init__(self, store: object, recorder: Recorder) -> None:
        self._store = store
        self._recorder = recorder

    def search(self, query: str, k: int) -> list[object]:
        return self._store.search(query, k)  # type: ignore[attr-defined,no-any-return]

    def search_many(self, queries: Sequence[str], k: int) -> list[list[object]]:
        found = self._store.search_many(queries, k)  # type: ignore[attr-defined]
        self._recorder.search(queries, k, found)
        return found  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--home", help="SELFRAG_HOME with an index (default: the settings').")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--critique", default="auto")
    args = p.parse_args(argv)
    if args.home:
        os.environ["SELFRAG_HOME"] = args.home
    from selfrag.infra.settings_loader import load_settings
    from selfrag.runtime.system import LocalRuntime

    config = DecodingConfig(**{**SMALL_CONFIG, "mode": "adaptive", "max_segments": 2})
    config = config.model_copy(update={"critique": args.critique})
    with LocalRuntime(load_settings()) as rag:
        config = rag.answer_path.settle(config)  # as the ingress settles it before decoding
        recorder = Recorder(LocalBranchWorker(rag.critic(config.critique)), config.critique)
        parts = DecoderParts(
            lambda _: recorder,  # type: ignore[arg-type,return-value]
            RecordingRetriever(rag.store, recorder),  # type: ignore[arg-type]
            rag.engine.model_id,
            ranker=recorder.rank,  # type: ignore[arg-type]
        )
        for q in questions()[: args.questions]:
            parts.decode(q, config)
    steps = recorder.steps
    figures: dict[str, str] = {"steps": str(len(steps))}
    print(f"{len(steps)} steps of {args.questions} questions, critique {recorder.name}")
    print(f"{'route':<7} {'calls/step':>10} {'KiB/step (median)':>18} {'KiB/step (mean)':>16}")
    for route in ("before", "after"):
        calls = statistics.mean(s.get(f"{route}_calls", 0) for s in steps)
        kib = [s.get(f"{route}_bytes", 0) / 1024 for s in steps]
        mid, mean = statistics.median(kib), statistics.mean(kib)
        print(f"{route:<7} {calls:>10.2f} {mid:>18.1f} {mean:>16.1f}")
        figures[f"{route}_calls_per_step"] = f"{calls:.2f}"
        figures[f"{route}_kib_per_step"] = f"{statistics.mean(kib):.1f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
