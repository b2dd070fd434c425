"""Commands through a running `selfrag serve` (the way the ollama CLI talks to its server):
while the server holds the embedded store, `selfrag ask` and `selfrag docs` send their work to
its HTTP API at serve.host:serve.port, with the first key of SELFRAG_API_KEYS when keys are
set."""

from __future__ import annotations

import ipaddress
import os
from typing import TYPE_CHECKING, Any

import httpx

from selfrag.cli.common import CLIError
from selfrag.infra.settings_loader import API_KEYS_ENV
from selfrag.schemas.settings import Settings

if TYPE_CHECKING:
    from selfrag.infra.store.qdrant_store import StoreHeld

_TIMEOUT_S = 600.0


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


def _headers() -> dict[str, str]:
    keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def server_ready(settings: Settings) -> bool:
    """Whether a selfrag server answers `/readyz` with 200 at `server_url`."""
    try:
        r = httpx.get(server_url(settings) + "/readyz", timeout=5.0)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and isinstance(r.json(), dict) and "checks" in r.json()


def call(settings: Settings, method: str, path: str, body: Any = None) -> Any:
    """`method path` on the server; its JSON body, or a CLIError with the server's reason."""
    url = server_url(settings) + path
    try:
        r = httpx.request(method, url, json=body, headers=_headers(), timeout=_TIMEOUT_S)
    except httpx.HTTPError as exc:
        where = server_url(settings)
        raise CLIError(f"the selfrag server at {where} did not answer: {exc}") from None
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail") or r.text
        except ValueError:
            detail = r.text
        raise CLIError(
            f"the selfrag server at {server_url(settings)} answered {r.status_code}: {detail}"
        )
    return r.json()


def held_store(rag: Any) -> StoreHeld | None:
    """Open `rag`'s store; the StoreHeld error when another process (a server) holds it."""
    from selfrag.infra.store.qdrant_store import StoreHeld

    try:
        rag.system.store  # noqa: B018  (opens it)
    except StoreHeld as exc:
        return exc
    return None


def via_server(
    settings: Settings, held: StoreHeld, method: str, path: str, body: Any = None
) -> Any:
    """`call` on the server that holds the store; without one answering at `server_url`, the
    store's own error (which names the holder)."""
    if not server_ready(settings):
        raise CLIError(f"{held} (no selfrag server answers at {server_url(settings)})")
    return call(settings, method, path, body)
