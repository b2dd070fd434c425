"""The question sets `selfrag eval` (and calibration and training) run on: a SQuAD-format
JSON file or a JSONL file of `{question, golden_answers}`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from selfrag.infra.corpus.bounded_reads import JSONInputError, load_json

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
