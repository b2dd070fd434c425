"""infra/lifecycle.py: `Closeable` closes what a `with` block opened, on error too."""

from __future__ import annotations

import pytest

from selfrag.infra.lifecycle import Closeable


class Resource(Closeable):
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_with_block_gives_the_object_and_closes_it_once():
    resource = Resource()
    with resource as inside:
        assert inside is resource and resource.closed == 0
    assert resource.closed == 1


def test_an_error_in_the_block_closes_it_and_still_propagates():
    resource = Resource()
    with pytest.raises(RuntimeError, match="boom"), resource:
        raise RuntimeError("boom")
    assert resource.closed == 1


def test_a_class_that_defines_no_close_cannot_be_used_silently():
    with pytest.raises(NotImplementedError), Closeable():
        pass
