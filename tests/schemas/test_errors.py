"""schemas/errors.py: each error kind has one HTTP status and says whether a retry can help;
the error body is strict."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from selfrag.schemas.errors import (
    AnswerError,
    Cancelled,
    DeadlineExceeded,
    DependencyDown,
    ErrorBody,
    ErrorKind,
    Misconfigured,
    Overloaded,
    Unprocessable,
)

KINDS = [AnswerError, Unprocessable, Overloaded, DependencyDown, DeadlineExceeded, Cancelled]
KINDS.append(Misconfigured)


def test_every_error_kind_has_a_class_and_each_class_one_kind():
    assert sorted(k.kind for k in KINDS) == sorted(typing.get_args(ErrorKind))


@pytest.mark.parametrize(
    ("error", "status", "retryable"),
    [
        (Unprocessable, 422, False),
        (Overloaded, 503, True),
        (DependencyDown, 503, True),
        (DeadlineExceeded, 504, False),
        (Cancelled, 499, False),
        (Misconfigured, 500, False),
        (AnswerError, 500, False),
    ],
)
def test_status_and_retry_say_what_a_client_can_do(
    error: type[AnswerError], status: int, retryable: bool
):
    raised = error("what went wrong")
    assert (raised.status, raised.retryable) == (status, retryable)
    assert raised.detail == str(raised) == "what went wrong"
    assert isinstance(raised, AnswerError)


def test_only_a_retryable_error_is_a_503():
    assert all((k.status == 503) == k.retryable for k in KINDS)


def test_the_error_body_refuses_unknown_fields_and_keeps_a_structured_detail():
    body = ErrorBody(error="unprocessable", detail=[{"loc": ["question"]}], request_id="r1")
    assert body.model_dump() == {
        "error": "unprocessable",
        "detail": [{"loc": ["question"]}],
        "request_id": "r1",
    }
    with pytest.raises(ValidationError):
        ErrorBody(error="x", detail="y", trace="secret")  # type: ignore[call-arg]
