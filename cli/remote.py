"""Commands through a running `selfrag serve` (the way the ollama CLI talks to its server):
while another process holds the embedded store of the home a command names, `selfrag ask` and
`selfrag docs` go through the HTTP API at serve.host:serve.port (`SelfRAG.connect`) — once that
server says it serves this home and collection, and with every request naming them, so a server
of another home refuses the request before doing anything. The key: SELFRAG_API_KEY, else the
first of SELFRAG_API_KEYS."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from selfrag.cli.common import CLIError
from selfrag.schemas.settings import Settings

if TYPE_CHECKING:
    from selfrag.api import SelfRAG
    from selfrag.infra.store.qdrant_store import StoreHeld


def server_url(settings: Settings) -> str:
    """The base URL of this home's server: serve.host (a wildcard bind means this machine's
    loopback) and serve.port."""
    host = settings.serve.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a name
    return f"http://{host}:{settings.serve.port}"


@contextmanager
def open_home(settings: Settings) -> Iterator[SelfRAG]:
    """The home of `settings` in this process; while another process holds its store, the
    server that serves this home and collection (`through_server`). Closed on leaving."""
    from selfrag.api import SelfRAG

    with SelfRAG(settings) as rag:
        held = held_store(rag)
        if held is None:
            yield rag
            return
    with through_server(settings, held) as remote:
        yield remote


def held_store(rag: SelfRAG) -> StoreHeld | None:
    """Open `rag`'s store; the StoreHeld error when another process (a server) holds it."""
    from selfrag.infra.store.qdrant_store import StoreHeld

    try:
        rag.system.store  # noqa: B018  (opens it)
    except StoreHeld as exc:
        return exc
    return None


@contextmanager
def through_server(settings: Settings, held: StoreHeld) -> Iterator[SelfRAG]:
    """`SelfRAG.connect` to the server at `server_url`, once its `/readyz` says it serves the
    home and collection of `settings`; a CLIError naming the store's holder when no server
    answers there, and refusing when it serves another home or collection (nothing is sent
    to it then). What the server refuses later is a CLIError with its reason."""
    from selfrag.api import SelfRAG
    from selfrag.infra.home_identity import home_id
    from selfrag.runtime.http_client import ServerRefused
    from selfrag.schemas.errors import DependencyDown
    from selfrag.schemas.health import ServedIndex

    url = server_url(settings)
    collection = settings.retrieval.collection
    expected = ServedIndex(home_id=home_id(settings.home), collection=collection)
    with SelfRAG.connect(url, home=settings.home, collection=collection) as remote:
        try:
            served = remote.health().served
        except (DependencyDown, ServerRefused):
            raise CLIError(f"{held} (no selfrag server answers at {url})") from None
        if served is None:
            raise CLIError(f"the selfrag server at {url} cannot say which home it serves yet")
        if served != expected:
            who = f" by {held.holder}" if held.holder else " by another process"
            raise CLIError(
                f"the index of {settings.home} (collection {collection!r}) is held{who}, and "
                f"the selfrag server at {url} serves another home or collection (collection "
                f"{served.collection!r} of the home with id {served.home_id}): nothing was sent "
                "to it. Stop the process holding the index, or point this command at the "
                "server of this home (serve.port, SELFRAG_SERVE__PORT)"
            )
        try:
            yield remote
        except ServerRefused as exc:
            raise CLIError(
                f"the selfrag server at {url} answered {exc.status}: {exc.detail}"
            ) from None
