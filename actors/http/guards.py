"""What keeps a web page, a rebound DNS name, a flood of probes or a command meant for another
home from using the HTTP API: the JSON content type on every POST, the Host check of a loopback
server, the readiness check shared by every caller within a second, and the check that a
request naming a home reaches a server of that home.

A browser sends a cross-site POST without asking first (no CORS preflight) only when its
Content-Type is `text/plain`, `multipart/form-data` or `application/x-www-form-urlencoded`;
requiring `application/json` makes every cross-site POST need a preflight, which this server
never grants. A page on another origin whose DNS name is rebound to 127.0.0.1 reaches a
loopback server under its own name in `Host`: the check refuses any name but the server's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable

from fastapi import Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from selfrag.infra.settings_loader import is_loopback
from selfrag.schemas.errors import DependencyDown
from selfrag.schemas.health import COLLECTION_HEADER, HOME_HEADER, Health

JSON_MEDIA_TYPE = "application/json"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
READINESS_TTL_S = 1.0
"""How long one readiness result answers every `/readyz`."""


def _shown(value: str) -> str:
    """A client's header value as an error message shows it: short, quoted."""
    return repr(value[:64] + ("…" if len(value) > 64 else ""))


def require_json(request: Request) -> None:
    """A FastAPI dependency of every POST route: the body must be declared
    `application/json` (any parameters, e.g. `charset=utf-8`); 415 otherwise."""
    given = request.headers.get("content-type", "")
    if given.split(";", 1)[0].strip().lower() != JSON_MEDIA_TYPE:
        had = f"got {_shown(given)}" if given else "the request has none"
        raise StarletteHTTPException(415, f"Content-Type must be {JSON_MEDIA_TYPE}; {had}")


def host_name(header: str) -> str:
    """The name in a Host header, without its port, brackets or trailing dot, lower-case."""
    value = header.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1:].split("]", 1)[0]
    if value.count(":") == 1:  # name:port (a bare IPv6 address has more colons)
        value = value.split(":", 1)[0]
    return value.rstrip(".")


class HostCheck:
    """The Host names a server bound to a loopback address answers: loopback's own names,
    the bind address, and the configured extra ones (`serve.allowed_hosts`; `*` accepts any).
    A request without Host (HTTP/1.0) passes: browsers always send one."""

    def __init__(self, bind_host: str, extra: Iterable[str] = ()) -> None:
        self.names = frozenset(
            host_name(n) for n in (*LOOPBACK_NAMES, bind_host, *extra) if n.strip()
        )

    @classmethod
    def for_bind(cls, bind_host: str | None, extra: Iterable[str] = ()) -> HostCheck | None:
        """The check for a server bound to `bind_host`; None (no check) when that is not a
        loopback address, or unknown, or `*` is among the extra names."""
        extra = list(extra)
        if bind_host is None or not is_loopback(bind_host) or "*" in extra:
            return None
        return cls(bind_host, extra)

    def refusal(self, header: bytes | None) -> str | None:
        """Why a request with this Host header is refused; None when it is accepted."""
        if header is None:
            return None
        text = header.decode("latin-1")
        if host_name(text) in self.names:
            return None
        return (
            f"Host {_shown(text)} is not a name of this server, which binds a loopback "
            "address; add the name to serve.allowed_hosts to accept it"
        )


class ReadinessFailed(Exception):
    """The shared readiness check raised (the cause is chained); every caller that shares
    that run gets one of these."""


class SharedReadiness:
    """A readiness check whose result answers every caller for `ttl_s` seconds, callers
    that arrive while it runs waiting for that same run: a flood of `/readyz` costs one
    fan-out to the dependencies per `ttl_s`. A failed check is shared the same way."""

    def __init__(
        self, check: Callable[[], Awaitable[Health]], ttl_s: float = READINESS_TTL_S
    ) -> None:
        self._check = check
        self._ttl_s = ttl_s
        self._running: asyncio.Task[Health] | None = None
        # (time.monotonic() when it ended, its result or its exception)
        self._last: tuple[float, Health | BaseException] | None = None
        self.runs = 0
        """Checks run so far."""

    async def __call__(self) -> Health:
        if self._last is not None and time.monotonic() - self._last[0] < self._ttl_s:
            outcome = self._last[1]
        else:
            outcome = await self._shared_run()
        if isinstance(outcome, BaseException):
            # A new exception each time: re-raising one object would grow its traceback.
            raise ReadinessFailed("the readiness check failed") from outcome
        return outcome  # frozen: shared as it is

    async def _shared_run(self) -> Health | BaseException:
        loop = asyncio.get_running_loop()
        task = self._running
        if task is None or task.get_loop() is not loop:  # a test client's loop may be gone
            task = self._running = loop.create_task(self._check())
            self.runs += 1
            task.add_done_callback(self._finished)
        # Shielded: a caller that goes away does not cancel the others' check.
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the check itself was cancelled, not this caller
                return ReadinessFailed("the readiness check was cancelled")
            raise
        except Exception as exc:
            return exc

    def _finished(self, task: asyncio.Task[Health]) -> None:
        if self._running is task:
            self._running = None
        if task.cancelled():
            return
        exc = task.exception()
        self._last = (time.monotonic(), exc if exc is not None else task.result())


def served_check(readiness: SharedReadiness) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency: a request that names a home (`X-Selfrag-Home`, its id) or a
    collection (`X-Selfrag-Collection`) this server does not serve is refused (409) before
    anything is done for it, so a command meant for one home never reads or changes another;
    503 while the server cannot tell what it serves. A request naming neither passes."""

    async def require_served(request: Request) -> None:
        home = request.headers.get(HOME_HEADER)
        collection = request.headers.get(COLLECTION_HEADER)
        if not home and not collection:
            return
        try:
            served = (await readiness()).served
        except ReadinessFailed:
            served = None
        if served is None:
            raise DependencyDown("this server cannot tell which home it serves now; retry later")
        if (home and home != served.home_id) or (collection and collection != served.collection):
            named = ", ".join(
                f"{what} {_shown(value)}"
                for what, value in (("home id", home), ("collection", collection))
                if value
            )
            raise StarletteHTTPException(
                409,
                f"this server serves the collection {served.collection!r} of the home with id "
                f"{served.home_id}, not the request's ({named}): nothing was done",
            )

    return require_served
