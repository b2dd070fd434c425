"""The question sets `selfrag eval` (and calibration and training) run on: a SQuAD-format
JSON file or a JSONL file of `{question, golden_answers}`, whose records may list the `facts`
a long answer must state and a `split` (the long-form format, docs/long-form-metrics.md)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from selfrag.infra.corpus.bounded_reads import JSONInputError, load_json
from selfrag.pipeline.evaluation.longform_metrics import Fact

# A SQuAD file nests 9 levels (data, article, paragraphs, qas, answers): far past this is not a
# dataset, and is refused before anything walks it.
MAX_DATASET_DEPTH = 64


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
    facts: tuple[Fact, ...] = ()
    """The facts a long answer must state (a long-form question); empty for a short one."""
    split: str | None = None
    """"tune" or "report" where the set says (`load_questions(split=...)` keeps one)."""


def load_questions(
    path: Path, *, article: str | None = None, split: str | None = None, limit: int | None = None
) -> list[EvalQuestion]:
    """Questions of a SQuAD-format JSON file or a JSONL file of `{question, golden_answers}`
    (with `facts`, `split` where the set has them).

    SQuAD v2 `is_impossible` questions are unanswerable (their `plausible_answers` are traps and
    are not gold). `article` keeps one SQuAD article (underscores and spaces match alike);
    `split` the JSONL records of one split; `limit` the first N questions after those filters.
    """
    if not path.exists():
        raise EvalError(f"dataset not found: {path}")
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        if article is not None:
            raise EvalError("--article applies to SQuAD-format JSON only")
        questions = list(_read_jsonl_questions(path))
        if split is not None:
            questions = [q for q in questions if q.split == split]
            if not questions:
                raise EvalError(f"no question of split {split!r} in {path}")
    elif path.suffix.lower() == ".json":
        if split is not None:
            raise EvalError("--split applies to JSONL question sets only")
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
    seen: set[str] = set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = load_json(line, MAX_DATASET_DEPTH)
            facts = _facts(record.get("facts", []))
            golds = tuple(str(g) for g in record.get("golden_answers", []))
            question = str(record["question"]).strip()
            split = record.get("split")
        except JSONInputError as exc:
            raise EvalError(
                f"{path}:{n}: not a {{question, golden_answers}} record: {exc}"
            ) from None
        except (KeyError, TypeError, AttributeError) as exc:
            raise EvalError(f"{path}:{n}: not a {{question, golden_answers}} record") from exc
        except ValueError as exc:
            raise EvalError(f"{path}:{n}: {exc}") from None
        qid = str(record.get("id", n))
        if qid in seen:
            raise EvalError(f"{path}:{n}: question id {qid!r} is used twice")
        seen.add(qid)
        golds = golds or tuple(f.answers[0] for f in facts)
        yield EvalQuestion(
            id=qid,
            question=question,
            golds=golds,
            answerable=bool(golds),
            facts=facts,
            split=None if split is None else str(split),
        )


def _facts(raw: object) -> tuple[Fact, ...]:
    """A record's `facts` (LONGFORM_SCHEMA: each `{id, answers, part}`; other keys say where
    the fact is written and are not read here)."""
    if not isinstance(raw, list):
        raise ValueError("'facts' must be a list")
    facts = []
    for i, item in enumerate(raw):
        answers = item.get("answers") if isinstance(item, dict) else None
        if not (
            isinstance(answers, list)
            and answers
            and all(isinstance(a, str) and a.strip() for a in answers)
        ):
            raise ValueError(f"fact {i + 1} needs 'answers', a non-empty list of non-empty strings")
        facts.append(Fact(str(item.get("id", i + 1)), tuple(answers), str(item.get("part", ""))))
    ids = [f.id for f in facts]
    if len(set(ids)) < len(ids):
        raise ValueError("fact ids must be unique within a question")
    return tuple(facts)
