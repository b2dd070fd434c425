"""The events of a streamed answer (`/v1/answer/stream`, server-sent events).

`segment` after each decoding step, then `answer` (an `AnswerResponse`) or `error`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from selfrag.schemas.answer import SegmentOut


class SegmentEvent(BaseModel):
    """A segment of the leading hypothesis. Index i replaces any segment with index ≥ i sent
    before: the beam's leader can change between steps."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    segment: SegmentOut
    hypothesis_score: float


class ErrorEvent(BaseModel):
    """The stream's last event when the answer failed after the stream began."""

    model_config = ConfigDict(extra="forbid")

    error: str
    detail: object
    status: int
    request_id: str | None = None
