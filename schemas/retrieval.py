"""Retrieval without drafting: a request for the store's passages, and a passage with the
critique's relevance read."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from selfrag.schemas.answer import MAX_QUESTION_CHARS, PassageOut
from selfrag.schemas.decoding import CritiqueSource
from selfrag.schemas.settings import COLLECTION_NAME
from selfrag.schemas.text import has_visible_text

RetrievalOrder = Literal["relevance", "retriever"]


class RetrieveRequest(BaseModel):
    """The passages the store finds for a query, as the decoder's first step reads them."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(..., min_length=1, max_length=MAX_QUESTION_CHARS)
    top_k: int | None = Field(
        None, ge=1, le=50, description="Passages to return (default: the configured top_k)."
    )
    critique: CritiqueSource | None = Field(
        None,
        description="The critique source whose relevance read ranks them (default: the "
        "configured one).",
    )
    order: RetrievalOrder = Field(
        "relevance",
        description="relevance: most relevant first by the critique's s_rel, read for each "
        "passage; retriever: the store's order, nothing read (s_rel null).",
    )
    collection: str | None = Field(
        None,
        pattern=COLLECTION_NAME,
        description="The index collection to search (default: the served one).",
    )

    @field_validator("query")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        value = value.strip()
        if not has_visible_text(value):
            raise ValueError(
                "query must contain visible text (not only whitespace, control or "
                "zero-width characters)"
            )
        return value


class RankedPassage(PassageOut):
    """A retrieved passage with the critique's relevance read (s_rel, IsRel = relevant)."""

    s_rel: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="The critique's relevance score; null when the store's order was asked "
        "for (order: retriever).",
    )


class RetrieveResponse(BaseModel):
    """`POST /v1/retrieve`'s body: the passages in the order asked for."""

    passages: list[RankedPassage]
