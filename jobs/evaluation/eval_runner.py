"""`selfrag eval`: run QA systems over a question set against an indexed corpus and report.

Per-question records are appended to `OUT/records.jsonl` as they finish, so an interrupted
run resumes where it stopped (a record is keyed by system and question id). The report is
always rebuilt from every record of the requested systems and questions.

The parts, by job: `jobs.evaluation.eval_questions` (the question sets),
`jobs.evaluation.eval_report` (the records read back and the report),
`jobs.evaluation.longform_report` (long answers judged), `jobs.evaluation.abstention`
(abstention scores and curves), `jobs.evaluation.eval_plots` (`--plot`) and
`jobs.evaluation.ray_eval` (`--ray`); this module runs the systems.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tqdm import tqdm

from selfrag.infra.file_lock import open_lines_for_append
from selfrag.jobs.evaluation.abstention import abstention_score
from selfrag.jobs.evaluation.eval_questions import EvalError, EvalQuestion
from selfrag.jobs.evaluation.eval_report import RECORDS_FILE, read_records, write_report
from selfrag.pipeline.critics import Branch, Critic, native_token_ids
from selfrag.pipeline.evaluation.longform_metrics import Unit, marker_units
from selfrag.pipeline.evaluation.qa_metrics import contains_answer
from selfrag.pipeline.protocols import LanguageModel
from selfrag.pipeline.scoring import retrieval_probability
from selfrag.runtime.answer_client import AnswerClient, ClientPassages
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.records import (
    BASELINES,
    DEFAULT_LONGFORM_SYSTEMS,
    DEFAULT_SYSTEMS,
    SYSTEMS,
    EvalPassage,
    EvalRecord,
    EvalUnit,
)

if TYPE_CHECKING:
    from selfrag.runtime.system import LocalRuntime


# --- corpus -----------------------------------------------------------------------------------


def corpus_indexed(rag: LocalRuntime, corpus: Path) -> bool:
    """True when the first and last passages of `corpus` are found in the index by their own
    text (a cheap check through the public search API; re-indexing is idempotent anyway)."""
    from selfrag.infra.corpus.reading import CorpusError, read_documents
    from selfrag.jobs.indexing import passage_splitter

    r = rag.settings.retrieval
    first = last = None
    for item in read_documents(corpus, r.max_document_bytes):  # streamed: only two are kept
        if not isinstance(item, CorpusError):
            first = first or item
            last = item
    if first is None or last is None:
        return True
    split = passage_splitter(r, rag.embedder)
    for doc in (first, last):
        passage = split(doc)[0]
        hits = rag.store.search(passage.text, 3)
        if passage.id not in {h.id for h in hits}:
            return False
    return True


def ensure_indexed(rag: LocalRuntime, corpora: Sequence[Path] | None, progress: bool) -> None:
    """Index every corpus the store does not hold yet. Without corpora the existing index is
    used as it is, and must not be empty."""
    from selfrag.jobs.indexing import index_corpus

    if not corpora:
        if rag.store.count() == 0:
            raise EvalError(
                f"the index in {rag.settings.home} is empty: run `selfrag index PATH` first, "
                "or pass --corpus PATH"
            )
        return
    for corpus in corpora:
        if not corpus.exists():
            raise EvalError(f"corpus not found: {corpus}")
    for corpus in corpora:
        if rag.store.count() and corpus_indexed(rag, corpus):
            continue
        print(f"indexing {corpus} ...", file=sys.stderr)
        report = index_corpus(
            corpus,
            rag.store,
            progress=progress,
            retrieval=rag.settings.retrieval,
        )
        print(f"{corpus}: {report.passages} passages indexed", file=sys.stderr)


# --- running systems --------------------------------------------------------------------------


def parse_systems(spec: str | None, questions: Sequence[EvalQuestion] = ()) -> list[str]:
    """The systems `--systems` names; without it the defaults, the long-form ones
    (`vanilla-rag-long` for `vanilla-rag`) when a question lists facts."""
    if spec is None:
        long_form = any(q.facts for q in questions)
        return list(DEFAULT_LONGFORM_SYSTEMS if long_form else DEFAULT_SYSTEMS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise EvalError("--systems names no system")
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise EvalError(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


class EvalModel(Protocol):
    """What an evaluation runs in this process besides its answer client: the engine the
    baselines generate with, and the critics the p_ret probe reads (`LocalRuntime`)."""

    @property
    def engine(self) -> LanguageModel: ...

    def critic(self, source: str) -> Critic: ...


def system_request(question: str, system: str, config: DecodingConfig) -> AnswerRequest:
    """What the Self-RAG system `system` (`selfrag-<source>`) asks its answer client: the
    evaluation's dials, with its critique source; the client settles the rest."""
    dials = config.model_dump(exclude_none=True) | {"critique": system.removeprefix("selfrag-")}
    return AnswerRequest.model_validate({"question": question, "config": dials})


def runner_for(
    client: AnswerClient,
    model: EvalModel,
    system: str,
    config: DecodingConfig,
    probe_p_ret: bool,
) -> Callable[[EvalQuestion], tuple[AnswerResponse, float | None, int]]:
    """A function answering one question with `system`: (response, first-step p_ret, extra
    prefill tokens spent on a p_ret probe). The Self-RAG systems answer through `client`; a
    baseline generates with `model`'s engine, vanilla RAG from the passages `client`
    retrieves in the store's order (the ones Self-RAG's first step would read)."""
    from selfrag.pipeline.evaluation.baselines import BaselineAnswerer

    if system in BASELINES:
        baseline = BaselineAnswerer(model.engine, ClientPassages(client))
        retrieve = system != "closed-book"
        long_form = system == "vanilla-rag-long"
        return lambda q: (
            baseline.answer(q.question, config, retrieve=retrieve, long_form=long_form),
            None,
            0,
        )
    source = system.removeprefix("selfrag-")
    if source == "native" and native_token_ids(model.engine) is None:
        raise EvalError("selfrag-native needs a Self-RAG checkpoint; this model has no tokens")

    def run(q: EvalQuestion) -> tuple[AnswerResponse, float | None, int]:
        extra = 0
        p_ret: float | None = None
        if probe_p_ret and config.mode != "adaptive":
            # The δ curve needs p_ret even when decoding did not ask for it. The likelihood
            # critic caches this closed-book draft and reuses it as the no-retrieval branch.
            (decision,) = model.critic(source).retrieval([Branch(q.question, "", None)])
            p_ret, extra = retrieval_probability(decision.probs), decision.prefill_tokens
        response = client.answer(system_request(q.question, system, config)).response
        if p_ret is None and response.segments and response.segments[0].p_ret is not None:
            p_ret = response.segments[0].p_ret
        return response, p_ret, extra

    return run


def answer_units(system: str, r: AnswerResponse) -> list[Unit]:
    """The units an answer's citations are judged on (`longform_metrics`): Self-RAG's segments
    with their citations; a baseline's sentences with the passages their `[n]` markers name,
    numbered as it was shown them."""
    if system.startswith("selfrag-"):
        return [
            Unit(s.text.strip(), (s.citation.passage_id,) if s.citation else ()) for s in r.segments
        ]
    return marker_units(r.answer, [p.id for p in r.passages])


def make_record(
    system: str, q: EvalQuestion, r: AnswerResponse, p_ret: float | None, extra: int, ms: float
) -> dict[str, Any]:
    """The per-question record kept in records.jsonl (everything the report needs)."""
    sups = [s.s_sup for s in r.segments if s.s_sup is not None]
    by_id = {p.id: p for p in r.passages}
    cited_ids = list(
        dict.fromkeys(s.citation.passage_id for s in r.segments if s.citation is not None)
    )
    if system == "vanilla-rag":
        # Vanilla RAG cites nothing per segment: it is credited with every passage it was given.
        cited_ids = list(by_id)
    cited = [contains_answer(by_id[i].text, q.golds) if i in by_id else False for i in cited_ids]
    units = passages = None
    if q.facts:
        units = [EvalUnit(text=u.text, cited=list(u.cited)) for u in answer_units(system, r)]
        passages = [EvalPassage(id=p.id, title=p.title, text=p.text) for p in r.passages]
    return EvalRecord(
        system=system,
        id=q.id,
        question=q.question,
        answerable=q.answerable,
        golds=list(q.golds),
        answer=r.answer,
        abstained=r.abstained,
        retrieved=r.usage.retrievals > 0,
        s_sup=sum(sups) / len(sups) if sups else None,
        p_ret=p_ret,
        cited=cited_ids,
        cited_has_answer=cited,
        latency_ms=round(ms, 1),
        prefill_tokens=r.usage.prefill_tokens + extra,
        decode_tokens=r.usage.decode_tokens,
        evidence_branches=r.usage.evidence_branches,
        branches_pruned=r.usage.branches_pruned,
        abstention_score=abstention_score(system, r),
        support=r.support,
        config=r.config,
        units=units,
        passages=passages,
    ).model_dump(mode="json", exclude=None if q.facts else {"units", "passages"})


def run_evaluation(
    client: AnswerClient,
    model: EvalModel,
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    out: Path,
    config: DecodingConfig,
    *,
    progress: bool = True,
    probe_p_ret: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Answer every question with every system (skipping records already in `out`): the
    Self-RAG systems through `client`, the baselines with `model` (`runner_for`); then write
    and return the report. `config`: the evaluation's dials, not settled (each system's client
    settles them with its critique source)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RECORDS_FILE
    done = {(r["system"], r["id"]) for r in read_records(path)}
    todo = [(s, q) for s in systems for q in questions if (s, q.id) not in done]
    bar = tqdm(total=len(todo), desc="eval", unit="answer", file=sys.stderr, disable=not progress)
    runners: dict[str, Callable[[EvalQuestion], tuple[AnswerResponse, float | None, int]]] = {}
    with open_lines_for_append(path) as sink:
        for system, q in todo:
            if system not in runners:
                runners[system] = runner_for(client, model, system, config, probe_p_ret)
            bar.set_postfix(system=system)
            started = clock()
            response, p_ret, extra = runners[system](q)
            ms = (clock() - started) * 1e3
            sink.write(json.dumps(make_record(system, q, response, p_ret, extra, ms)) + "\n")
            sink.flush()
            bar.update(1)
    bar.close()
    return write_report(out, questions, systems, config)
