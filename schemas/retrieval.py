"""A passage retrieved and read for relevance, without an answer drafted."""

from __future__ import annotations

from pydantic import Field

from selfrag.schemas.answer import PassageOut


class RankedPassage(PassageOut):
    """A retrieved passage with the critique's relevance read (s_rel, IsRel = relevant)."""

    s_rel: float = Field(ge=0.0, le=1.0, description="The critique's relevance score.")
