"""What the index holds, document by document, and what a removal took out."""

from __future__ import annotations

from pydantic import BaseModel, Field


class DocumentInfo(BaseModel):
    """One indexed document (`selfrag docs list`, `GET /v1/documents`)."""

    id: str
    source: str | None = Field(None, description="The file it was indexed from.")
    title: str | None = None
    url: str | None = None
    passages: int = Field(ge=0, description="Passages of it in the index.")
    indexed_at: str | None = Field(None, description="When it was last indexed (UTC, ISO 8601).")
    digest: str | None = Field(
        None,
        description="A digest of its passages as indexed (their text and the embedding model): "
        "a document read again with the same digest is not embedded again.",
    )


class Removal(BaseModel):
    """What `selfrag docs rm` (`DELETE /v1/documents/...`) took out of the index."""

    documents: list[str] = Field(description="Ids of the documents removed.")
    passages: int = Field(ge=0, description="Their passages, now out of every search.")
    unmatched: list[str] = Field(
        default_factory=list, description="Ids or paths given that matched no document."
    )
