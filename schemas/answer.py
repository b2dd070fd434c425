"""Request and response of one answered question."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from selfrag.schemas.decoding import (
    MAX_ANSWER_TOKENS,
    DecodingConfig,
    DecodingOverrides,
    SupportLevel,
)
from selfrag.schemas.settings import COLLECTION_NAME
from selfrag.schemas.text import has_visible_text

StopReason = Literal["timeout_s", "max_prefill_tokens"]
"""The budget that ended a decode early."""

MAX_QUESTION_CHARS = 2000


class AnswerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(..., min_length=1, max_length=MAX_QUESTION_CHARS)
    config: DecodingOverrides = Field(default_factory=DecodingOverrides)
    collection: str | None = Field(
        None,
        pattern=COLLECTION_NAME,
        description="The index collection to answer from (default: the served one, "
        "retrieval.collection).",
    )
    max_tokens: int | None = Field(
        None,
        ge=4,
        le=MAX_ANSWER_TOKENS,
        description="Caps the answer's length: max_answer_tokens and max_segment_tokens are "
        "brought within it (OpenAI's max_tokens).",
    )

    @classmethod
    def of(cls, question: str, **dials: Any) -> AnswerRequest:
        """A request from keyword dials, as the Python API and the framework adapters take
        them: `max_tokens` and `collection` as themselves, any other a `DecodingConfig` field
        (pydantic's ValidationError names a bad one)."""
        max_tokens = dials.pop("max_tokens", None)
        collection = dials.pop("collection", None)
        return cls.model_validate(
            {
                "question": question,
                "config": dials,
                "max_tokens": max_tokens,
                "collection": collection,
            }
        )

    @field_validator("question")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        value = value.strip()
        if not has_visible_text(value):
            raise ValueError(
                "question must contain visible text (not only whitespace, control or "
                "zero-width characters)"
            )
        return value


class Evidence(BaseModel):
    """The sentence of the cited passage that best supports the segment
    (`pipeline/evidence.py`): `passage.text[start:end] == text`."""

    start: int = Field(ge=0, description="Offset of the sentence's first character.")
    end: int = Field(ge=0, description="Offset just past its last character.")
    text: str


SegmentFlag = Literal["uncited", "unsupported_terms", "low_support"]


class Citation(BaseModel):
    passage_id: str
    title: str | None = None
    url: str | None = Field(None, description="The document's own URL, when the corpus gave one.")
    page: int | None = Field(
        None, ge=1, description="The page of a PDF the passage is on (1-based), when it has one."
    )
    evidence: Evidence | None = Field(
        None, description="The passage's sentence that best supports the segment, if any."
    )


class SegmentOut(BaseModel):
    """One generated segment with the critique that selected it."""

    text: str
    citation: Citation | None = Field(
        None, description="The passage this segment was drafted from."
    )
    retrieved: bool = Field(description="Whether retrieval fired for this segment's step.")
    p_ret: float | None = Field(None, ge=0.0, le=1.0, description="None when mode is always/never.")
    s_rel: float | None = Field(None, ge=0.0, le=1.0)
    s_sup: float | None = Field(None, ge=0.0, le=1.0)
    s_use: float | None = Field(None, ge=-1.0, le=1.0)
    novelty: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="The share of the segment's content words that neither the question nor "
        "the answer before it holds (pipeline/grounding.py): what it adds. None without any.",
    )
    is_sup: SupportLevel | None = Field(None, description="Most likely IsSup label.")
    unsupported_terms: list[str] = Field(
        default_factory=list,
        description="Numbers and names the segment states that neither its passage nor the "
        "question holds (pipeline/grounding.py): content its citation does not back.",
    )
    flags: list[SegmentFlag] = Field(
        default_factory=list,
        description="Why a reader should check this segment before relying on it: uncited (an "
        "answer that retrieved, and this segment cites nothing), unsupported_terms (see "
        "unsupported_terms), low_support (IsSup below full).",
    )
    logprob: float = Field(description="log p(segment | question, passage), summed over tokens.")
    n_tokens: int
    score: float = Field(description="S, the ranking score of the segment.")


class PassageOut(BaseModel):
    id: str
    title: str | None = None
    url: str | None = Field(None, description="The document's own URL, when the corpus gave one.")
    text: str
    score: float = Field(description="Retrieval score from the store.")
    similarity: float | None = Field(
        None,
        description="The embedder's cosine of the query and the passage (the retriever's dense "
        "score; `score` is a fused rank score when the search is hybrid).",
    )
    corpus: str | None = Field(
        None,
        description="The corpus file or folder the passage was indexed from, when the index "
        "recorded it: the key of its own support threshold (`min_support_score_by_corpus`).",
    )


class Usage(BaseModel):
    prefill_tokens: int = 0
    decode_tokens: int = 0
    branches_opened: int = 0
    evidence_branches: int = Field(0, description="Branches opened with a retrieved passage.")
    branches_pruned: int = 0
    branches_filtered: int = 0
    retrievals: int = 0
    steps: int = 0
    stopped_by: StopReason | None = Field(
        None, description="The budget that ended decoding early, if one did."
    )


class AnswerResponse(BaseModel):
    question: str
    answer: str
    abstained: bool
    support: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="s_sup times passage similarity (each branch's s_sup weighed by its "
        "passage's `similarity`, when the retriever gives one) of the first step's grounded "
        "branch that passes every hard filter but the support threshold with the most support "
        "above its threshold (`support_threshold`): with that filter on, an answer whose first "
        "step retrieved abstains exactly when this is None or below it. None when nothing "
        "grounded was drafted first (no retrieval, every passage pruned).",
    )
    support_threshold: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="The support threshold that branch was held to: min_support_score, or its "
        "passage's corpus's own (min_support_score_by_corpus); 0 with the filter off.",
    )
    segments: list[SegmentOut]
    passages: list[PassageOut]
    usage: Usage
    timings_ms: dict[str, float]
    model_id: str
    critique: str = Field(description="Critique source actually used.")
    config: DecodingConfig
