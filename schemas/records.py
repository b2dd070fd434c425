"""The records batch jobs and evaluations write, one JSON object per line.

`selfrag batch --out FILE` writes a `BatchRecord` per input id; `selfrag eval --out DIR` writes
an `EvalRecord` per (system, question) to `DIR/records.jsonl`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from selfrag.schemas.decoding import CRITIQUE_SOURCES, DecodingConfig
from selfrag.schemas.errors import ErrorKind

BASELINES = ("closed-book", "vanilla-rag", "vanilla-rag-long")
"""The systems Self-RAG is compared with (`pipeline.evaluation.baselines`)."""
SYSTEMS = (*BASELINES, *(f"selfrag-{source}" for source in CRITIQUE_SOURCES))
"""The QA systems `selfrag eval` runs (`EvalRecord.system`)."""
DEFAULT_SYSTEMS = ("closed-book", "vanilla-rag", "selfrag-likelihood", "selfrag-learned")
DEFAULT_LONGFORM_SYSTEMS = (
    "closed-book",
    "vanilla-rag-long",
    "selfrag-likelihood",
    "selfrag-learned",
)
"""The default systems on a question set whose questions list facts (long answers)."""

RecordErrorType = ErrorKind | Literal["invalid", "malformed"]
"""An answer path error kind, or an input problem: `invalid` (the row's config or question
fails validation) or `malformed` (the row could not be read)."""


class RecordError(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: RecordErrorType
    message: str


class BatchRecord(BaseModel):
    """One line of a batch output: an answer, or why there is none."""

    model_config = ConfigDict(extra="forbid")

    id: str
    status: Literal["ok", "error"]
    question: str | None = Field(None, description="None when the row could not be read.")
    response: dict[str, Any] | None = Field(None, description="An `AnswerResponse` as JSON.")
    error: RecordError | None = None
    duplicate_of: str | None = Field(
        None, description="The id whose answer this one reuses (same question and config)."
    )
    line: int | None = Field(None, description="Input line of a malformed row.")

    def to_json(self) -> dict[str, Any]:
        """The record as written: the fields it was given, nothing else."""
        return self.model_dump(mode="json", exclude_unset=True)


class EvalUnit(BaseModel):
    """A piece of an answer that can carry citations: a Self-RAG segment, a baseline's
    sentence (its `[n]` markers read as the passages they name)."""

    model_config = ConfigDict(extra="forbid")

    text: str
    cited: list[str] = Field(description="Ids of the passages it cites.")


class EvalPassage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    title: str | None = None
    text: str


class EvalRecord(BaseModel):
    """One system's answer to one evaluation question, with what the report needs."""

    model_config = ConfigDict(extra="forbid")

    system: str
    id: str
    question: str
    answerable: bool
    golds: list[str]
    answer: str
    abstained: bool
    retrieved: bool
    s_sup: float | None
    p_ret: float | None
    cited: list[str]
    cited_has_answer: list[bool]
    latency_ms: float
    prefill_tokens: int
    decode_tokens: int
    evidence_branches: int
    branches_pruned: int
    abstention_score: float | None = Field(
        None,
        description="Higher means answer: the quantity the system abstains by "
        "(jobs/evaluation/abstention.py); None ranks below every score.",
    )
    support: float | None = Field(
        None, description="The support that decided abstention (`AnswerResponse.support`)."
    )
    config: DecodingConfig | None = Field(
        None, description="The config the answer was made with (Self-RAG's: settled)."
    )
    units: list[EvalUnit] | None = Field(
        None, description="Long-form questions only: the answer's units and their citations."
    )
    passages: list[EvalPassage] | None = Field(
        None, description="Long-form questions only: every passage the answer was given."
    )
