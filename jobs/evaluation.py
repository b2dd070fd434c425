"""`selfrag eval`: run QA systems over a question set against an indexed corpus and report.

Per-question records are appended to `OUT/records.jsonl` as they finish, so an interrupted
run resumes where it stopped (a record is keyed by system and question id). The report is
always rebuilt from every record of the requested systems and questions.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from selfrag.infra.corpus.bounded_reads import JSONInputError, load_json
from selfrag.jobs.abstention import (
    abstention_score,
    curve_rows,
    render_abstention_table,
    score_name,
    write_curves,
)
from selfrag.pipeline.critics import Branch, native_token_ids
from selfrag.pipeline.evaluation.qa_metrics import (
    Outcome,
    accuracy_coverage,
    contains_answer,
    summarize,
)
from selfrag.pipeline.scoring import retrieval_probability
from selfrag.runtime.answer_client import LocalAnswerClient
from selfrag.schemas.answer import AnswerRequest, AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.records import SYSTEMS, EvalRecord

if TYPE_CHECKING:
    from selfrag.runtime.system import LocalRuntime

RECORDS_FILE = "records.jsonl"
# A SQuAD file nests 9 levels (data, article, paragraphs, qas, answers): far past this is not a
# dataset, and is refused before anything walks it.
MAX_DATASET_DEPTH = 64
REPORT_COLUMNS = (
    "accuracy",
    "f1",
    "abstain_rate",
    "wrong_confident_rate",
    "overall",
    "retrieval_rate",
    "citation_precision",
    "s_sup_correct",
    "s_sup_wrong",
    "s_sup_auc",
    "pruned_rate",
    "p50_ms",
    "p95_ms",
    "prefill_tokens",
)


class EvalError(ValueError):
    """Bad evaluation input (missing file, unknown format or system)."""


@dataclass(frozen=True)
class EvalQuestion:
    id: str
    question: str
    golds: tuple[str, ...]
    answerable: bool
    article: str | None = None
    context: str | None = None
    paragraph_id: str | None = None


# --- datasets ---------------------------------------------------------------------------------


def load_questions(
    path: Path, *, article: str | None = None, limit: int | None = None
) -> list[EvalQuestion]:
    """Questions of a SQuAD-format JSON file or a JSONL file of `{question, golden_answers}`.

    SQuAD v2 `is_impossible` questions are unanswerable (their `plausible_answers` are traps and
    are not gold). `article` keeps one SQuAD article (underscores and spaces match alike);
    `limit` keeps the first N questions after that filter.
    """
    if not path.exists():
        raise EvalError(f"dataset not found: {path}")
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        if article is not None:
            raise EvalError("--article applies to SQuAD-format JSON only")
        questions = list(_read_jsonl_questions(path))
    elif path.suffix.lower() == ".json":
        questions = list(_read_squad_questions(path, article))
        if article is not None and not questions:
            raise EvalError(f"no article titled {article!r} in {path}")
    else:
        raise EvalError(f"unknown dataset format for {path}: expected SQuAD .json or .jsonl")
    if limit is not None:
        questions = questions[:limit]
    if not questions:
        raise EvalError(f"no questions in {path}")
    return questions


def _read_squad_questions(path: Path, article: str | None) -> Iterable[EvalQuestion]:
    try:
        data = load_json(path.read_text(encoding="utf-8"), MAX_DATASET_DEPTH)
    except (JSONInputError, UnicodeDecodeError) as exc:
        raise EvalError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise EvalError(f"{path} is not SQuAD format (no 'data' list of articles)")
    wanted = article.replace(" ", "_") if article else None
    for a, art in enumerate(data["data"]):
        raw_title = str(art.get("title") or f"article{a}")
        if wanted is not None and raw_title.replace(" ", "_") != wanted:
            continue
        for p, para in enumerate(art.get("paragraphs", [])):
            for qa in para.get("qas", []):
                impossible = bool(qa.get("is_impossible", False))
                golds = () if impossible else tuple(x["text"] for x in qa.get("answers", []))
                yield EvalQuestion(
                    id=str(qa["id"]),
                    question=str(qa["question"]).strip(),
                    golds=golds,
                    answerable=not impossible and bool(golds),
                    article=raw_title,
                    context=para.get("context"),
                    # Matches the document ids of infra.corpus.reading for SQuAD files.
                    paragraph_id=f"squad:{raw_title}:{p}",
                )


def _read_jsonl_questions(path: Path) -> Iterable[EvalQuestion]:
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = load_json(line, MAX_DATASET_DEPTH)
            golds = tuple(str(g) for g in record.get("golden_answers", []))
            question = str(record["question"]).strip()
        except JSONInputError as exc:
            raise EvalError(
                f"{path}:{n}: not a {{question, golden_answers}} record: {exc}"
            ) from None
        except (KeyError, TypeError, AttributeError) as exc:
            raise EvalError(f"{path}:{n}: not a {{question, golden_answers}} record") from exc
        yield EvalQuestion(
            id=str(record.get("id", n)), question=question, golds=golds, answerable=bool(golds)
        )


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


def parse_systems(spec: str, rag: LocalRuntime | None = None) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise EvalError("--systems names no system")
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown:
        raise EvalError(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    return list(dict.fromkeys(names))


def runner_for(
    rag: LocalRuntime, system: str, config: DecodingConfig, probe_p_ret: bool
) -> Callable[[EvalQuestion], tuple[AnswerResponse, float | None, int]]:
    """A function answering one question with `system`: (response, first-step p_ret, extra
    prefill tokens spent on a p_ret probe)."""
    from selfrag.pipeline.evaluation.baselines import BaselineAnswerer

    if system in ("closed-book", "vanilla-rag"):
        baseline = BaselineAnswerer(rag.engine, rag.store)
        retrieve = system == "vanilla-rag"
        return lambda q: (baseline.answer(q.question, config, retrieve=retrieve), None, 0)
    source = system.removeprefix("selfrag-")
    if source == "native" and native_token_ids(rag.engine) is None:
        raise EvalError("selfrag-native needs a Self-RAG checkpoint; this model has no tokens")
    cfg = rag.answer_path.settle(config.model_copy(update={"critique": source}))
    client = LocalAnswerClient.for_runtime(rag)

    def run(q: EvalQuestion) -> tuple[AnswerResponse, float | None, int]:
        extra = 0
        p_ret: float | None = None
        if probe_p_ret and cfg.mode != "adaptive":
            # The δ curve needs p_ret even when decoding did not ask for it. The likelihood
            # critic caches this closed-book draft and reuses it as the no-retrieval branch.
            (decision,) = rag.critic(source).retrieval([Branch(q.question, "", None)])
            p_ret, extra = retrieval_probability(decision.probs), decision.prefill_tokens
        response = client.answer(AnswerRequest(question=q.question), config=cfg).response
        if p_ret is None and response.segments and response.segments[0].p_ret is not None:
            p_ret = response.segments[0].p_ret
        return response, p_ret, extra

    return run


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
    ).model_dump(mode="json")


def outcome(record: dict[str, Any]) -> Outcome:
    return Outcome(
        answerable=bool(record["answerable"]),
        golds=tuple(record["golds"]),
        answer=str(record["answer"]),
        abstained=bool(record["abstained"]),
        retrieved=bool(record["retrieved"]),
        s_sup=record.get("s_sup"),
        cited_has_answer=tuple(record.get("cited_has_answer", [])),
        latency_ms=float(record["latency_ms"]),
        prefill_tokens=int(record["prefill_tokens"]),
        evidence_branches=int(record.get("evidence_branches", 0)),
        branches_pruned=int(record.get("branches_pruned", 0)),
        abstention_score=record.get("abstention_score"),
    )


def read_records(path: Path) -> list[dict[str, Any]]:
    """Records of an earlier (maybe interrupted) run; a torn last line is ignored."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(load_json(line))
        except JSONInputError:
            continue
    return records


def run_evaluation(
    rag: LocalRuntime,
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    out: Path,
    config: DecodingConfig,
    *,
    progress: bool = True,
    probe_p_ret: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Answer every question with every system (skipping records already in `out`), then
    write and return the report."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / RECORDS_FILE
    done = {(r["system"], r["id"]) for r in read_records(path)}
    todo = [(s, q) for s in systems for q in questions if (s, q.id) not in done]
    bar = tqdm(total=len(todo), desc="eval", unit="answer", file=sys.stderr, disable=not progress)
    runners: dict[str, Callable[[EvalQuestion], tuple[AnswerResponse, float | None, int]]] = {}
    with path.open("a", encoding="utf-8") as sink:
        if sink.tell() and not path.read_bytes().endswith(b"\n"):
            sink.write("\n")  # end a line torn by an interrupted run; reading skips it
        for system, q in todo:
            if system not in runners:
                runners[system] = runner_for(rag, system, config, probe_p_ret)
            bar.set_postfix(system=system)
            started = clock()
            response, p_ret, extra = runners[system](q)
            ms = (clock() - started) * 1e3
            sink.write(json.dumps(make_record(system, q, response, p_ret, extra, ms)) + "\n")
            sink.flush()
            bar.update(1)
    bar.close()
    return write_report(out, questions, systems, config)


def build_report(
    records: Sequence[dict[str, Any]],
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    config: DecodingConfig | None = None,
) -> dict[str, Any]:
    """Summaries per system over the records of the given questions (latest record wins), with
    each system's abstention score and accuracy–coverage curve (`jobs.abstention`)."""
    ids = {q.id for q in questions}
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if r["id"] in ids and r["system"] in systems:
            latest[(r["system"], r["id"])] = r
    report: dict[str, Any] = {"systems": {}, "abstention_score": {}, "accuracy_coverage": {}}
    for system in systems:
        rows = [latest[(system, q.id)] for q in questions if (system, q.id) in latest]
        outcomes = [outcome(r) for r in rows]
        report["systems"][system] = summarize(outcomes)
        report["abstention_score"][system] = score_name(system)
        report["accuracy_coverage"][system] = curve_rows(accuracy_coverage(outcomes))
    report["questions"] = len(questions)
    if config is not None:
        report["config"] = config.model_dump(mode="json")
    return report


def write_report(
    out: Path,
    questions: Sequence[EvalQuestion],
    systems: Sequence[str],
    config: DecodingConfig | None = None,
) -> dict[str, Any]:
    report = build_report(read_records(out / RECORDS_FILE), questions, systems, config)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(render_table(report) + "\n", encoding="utf-8")
    write_curves(out, report)
    return report


def render_table(report: dict[str, Any]) -> str:
    """The report as Markdown: one table of every column (rates in %, latency in ms), then the
    abstention table (`jobs.abstention.render_abstention_table`)."""
    head = ["system", "n", *REPORT_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in report["systems"].items():
        cells = [name, str(row["questions"])]
        for col in REPORT_COLUMNS:
            cells.append(_cell(col, row.get(col)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + render_abstention_table(report)


SUMMARY_COLUMNS = (
    ("accuracy", "accuracy"),
    ("abstain_rate", "abstain"),
    ("wrong_confident_rate", "wrong+sure"),
    ("retrieval_rate", "retrieval"),
    ("p50_ms", "p50 ms"),
)
"""The columns `selfrag eval` prints (report field, heading); report.md has all of them."""


def render_summary(report: dict[str, Any]) -> str:
    """The report's headline columns as a plain-text table narrower than 80 columns."""
    width = max([len("system"), *(len(name) for name in report["systems"])])
    head = f"{'system':<{width}} {'n':>5}" + "".join(f" {h:>10}" for _, h in SUMMARY_COLUMNS)
    lines = [head]
    for name, row in report["systems"].items():
        cells = "".join(f" {_cell(col, row.get(col)):>10}" for col, _ in SUMMARY_COLUMNS)
        lines.append(f"{name:<{width}} {row['questions']:>5}{cells}")
    return "\n".join(lines)


def _cell(column: str, value: float | int | None) -> str:
    if value is None:
        return "–"
    if column.endswith("_ms") or column == "prefill_tokens":
        return f"{value:.0f}"
    if column.startswith("s_sup"):
        return f"{value:.2f}"
    return f"{100 * value:.1f}%"
