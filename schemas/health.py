"""What a server (or any answer client) says of itself: whether it can answer now, and which
home and collection it answers from."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

HOME_HEADER = "X-Selfrag-Home"
"""A request header naming the home id a client means to reach; a server serving another home
refuses the request (409) before it does anything."""
COLLECTION_HEADER = "X-Selfrag-Collection"
"""A request header naming the collection a client means to reach (409 from a server of
another)."""


class ServedIndex(BaseModel):
    """The index a client answers from: its home's id (`HOME/home_id`, written once when the
    home is first used) and its collection. Two homes never share an id, so a command that
    names a home can tell whether a server serves it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    home_id: str
    collection: str


class Health(BaseModel):
    """`GET /readyz`'s body: ready only when every dependency answers (`checks`: model, store,
    cache, and any start-up self-test), and what is served."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ready: bool
    checks: dict[str, bool] = Field(description="Each dependency, and whether it answers now.")
    served: ServedIndex | None = Field(
        None, description="The home and collection answered from; null while unknown."
    )

    @classmethod
    def of(cls, checks: Mapping[str, bool], served: ServedIndex | None) -> Health:
        return cls(ready=all(checks.values()), checks=dict(checks), served=served)
