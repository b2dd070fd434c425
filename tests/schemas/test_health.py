"""schemas/health.py: readiness is every check passing; what is served compares as a value."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from selfrag.schemas.health import Health, ServedIndex


def test_ready_only_when_every_check_passes() -> None:
    served = ServedIndex(home_id="a" * 32, collection="passages")
    assert Health.of({"model": True, "store": True}, served).ready
    down = Health.of({"model": True, "store": False}, None)
    assert not down.ready and down.served is None
    assert Health.model_validate(down.model_dump(mode="json")) == down


def test_what_is_served_compares_by_home_and_collection() -> None:
    a = ServedIndex(home_id="a" * 32, collection="passages")
    assert a == ServedIndex(home_id="a" * 32, collection="passages")
    assert a != ServedIndex(home_id="a" * 32, collection="docs")
    with pytest.raises(ValidationError):
        ServedIndex(home_id="a" * 32, collection="passages", path="/x")  # type: ignore[call-arg]
