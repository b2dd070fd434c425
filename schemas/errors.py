"""Why an answer failed: the error kinds every entry point reports, and the error body.

The answer path raises these; the HTTP layer sends `status` and an `ErrorBody`, the CLI prints
the message and exits non-zero, and batch and evaluation write the kind into the question's
error record.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

ErrorKind = Literal[
    "unprocessable",
    "overloaded",
    "dependency_unavailable",
    "deadline_exceeded",
    "cancelled",
    "misconfigured",
    "internal_error",
]


class AnswerError(Exception):
    """A failure to answer with a known meaning; `detail` is safe to show to the client."""

    kind: ClassVar[ErrorKind] = "internal_error"
    status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Unprocessable(AnswerError):
    """Well-formed, but it cannot be answered as configured (e.g. `native` critique on a model
    without reflection tokens, or a `timeout_s` above the server's maximum)."""

    kind = "unprocessable"
    status = 422


class Overloaded(AnswerError):
    """Too many answers in progress, or a deployment's queue is full: retry later."""

    kind = "overloaded"
    status = 503
    retryable = True


class DependencyDown(AnswerError):
    """A component (store, model replica, server) does not answer now: retry later."""

    kind = "dependency_unavailable"
    status = 503
    retryable = True


class DeadlineExceeded(AnswerError):
    """No answer within the request's `timeout_s`."""

    kind = "deadline_exceeded"
    status = 504


class Cancelled(AnswerError):
    """The caller went away; the answer stops at its next wait."""

    kind = "cancelled"
    status = 499  # nginx's "client closed request": only logs and metrics see it


class Misconfigured(AnswerError):
    """A permanent fault of the deployment (e.g. the index does not match the embedder):
    retrying cannot help; an operator must fix it."""

    kind = "misconfigured"
    status = 500


def error_of_kind(kind: object, detail: object) -> AnswerError | None:
    """The `AnswerError` an error body or record of `kind` stands for (its detail as text),
    or None when `kind` is not one of `ErrorKind` (an HTTP-level refusal)."""
    kinds: tuple[type[AnswerError], ...] = (
        Unprocessable,
        Overloaded,
        DependencyDown,
        DeadlineExceeded,
        Cancelled,
        Misconfigured,
        AnswerError,
    )
    for error in kinds:
        if error.kind == kind:
            return error(detail if isinstance(detail, str) else str(detail))
    return None


class ErrorBody(BaseModel):
    """The JSON body of every HTTP error, and the `error` of a failed batch or eval record."""

    model_config = ConfigDict(extra="forbid")

    error: str = Field(description="the error kind (`ErrorKind`, or an HTTP-level one)")
    detail: object = Field(description="what went wrong, safe to show")
    request_id: str | None = None
