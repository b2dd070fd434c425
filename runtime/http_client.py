"""`AnswerClient` over the HTTP API of a running `selfrag serve` (or any selfrag HTTP app): the
same requests, results and errors as in this process, through the server's routes.

Every request says which home and collection it means (`X-Selfrag-Home`, `X-Selfrag-Collection`)
when the client was given them, and a server of another refuses it before doing anything
(`WrongServer`): a command meant for one home never reads or changes another. An API key comes
from the caller, else `SELFRAG_API_KEY`, else the first of `SELFRAG_API_KEYS` (the server's own
list, for a client on the server's machine).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import httpx

from selfrag.infra.settings_loader import API_KEYS_ENV
from selfrag.pipeline.decoder import StepListener
from selfrag.pipeline.ranking import Hypothesis
from selfrag.runtime.answer_client import AnswerClientBase
from selfrag.runtime.answering import Answer
from selfrag.schemas.answer import AnswerRequest, AnswerResponse, SegmentOut
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.documents import DocumentInfo, Removal
from selfrag.schemas.errors import AnswerError, DependencyDown, error_of_kind
from selfrag.schemas.events import SegmentEvent
from selfrag.schemas.health import COLLECTION_HEADER, HOME_HEADER, Health, ServedIndex
from selfrag.schemas.retrieval import RankedPassage, RetrieveRequest, RetrieveResponse

API_KEY_ENV = "SELFRAG_API_KEY"
TIMEOUT_S = 600.0
"""How long one request may take (an answer's own `timeout_s` ends it sooner on the server)."""


class ServerRefused(Exception):
    """The server refused a request for a reason that is not an answer's (a missing key,
    removals without keys, an unknown document, an invalid body): `status`, `kind` (the error
    body's slug) and `detail` as it said them."""

    def __init__(self, status: int, kind: str, detail: str) -> None:
        super().__init__(f"{status} {kind}: {detail}")
        self.status = status
        self.kind = kind
        self.detail = detail


class WrongServer(ServerRefused):
    """The server serves another home or collection than the client names (409): it did
    nothing."""


def api_key_from(environ: Mapping[str, str]) -> str | None:
    """`SELFRAG_API_KEY`, else the first key of `SELFRAG_API_KEYS`; None without either."""
    key = environ.get(API_KEY_ENV, "").strip()
    if key:
        return key
    keys = [k.strip() for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    return keys[0] if keys else None


class HTTPAnswerClient(AnswerClientBase):
    """An answer client whose server is at `url`. `home_id` and `collection`: the home (its
    id, `infra.home_identity.home_id`) and collection every request must reach, when given.
    Failures raise what a client in this process raises (`schemas.errors`), `ServerRefused`
    (or `WrongServer`) otherwise; a server that does not answer is `DependencyDown`."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        home_id: str | None = None,
        collection: str | None = None,
        timeout_s: float = TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`api_key`: default `api_key_from(os.environ)`. `transport`: httpx's (tests)."""
        self.url = url.rstrip("/")
        self.expected = (
            ServedIndex(home_id=home_id or "", collection=collection or "")
            if home_id or collection
            else None
        )
        key = api_key if api_key is not None else api_key_from(os.environ)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        if home_id:
            self._headers[HOME_HEADER] = home_id
        if collection:
            self._headers[COLLECTION_HEADER] = collection
        self._timeout_s = timeout_s
        self._transport = transport

    # --- the protocol ------------------------------------------------------------------------

    async def aconfig(self, request: AnswerRequest) -> DecodingConfig:
        return DecodingConfig.model_validate(await self._call("POST", "/v1/config", _body(request)))

    async def aanswer(
        self,
        request: AnswerRequest,
        on_step: StepListener | None = None,
        config: DecodingConfig | None = None,
    ) -> Answer:
        """`POST /v1/answer`, or the stream when `on_step` listens. `config` is the server's
        to settle again: the same request settles to the same config there."""
        if on_step is None:
            async with self._client() as client:
                r = await self._send(client, "POST", "/v1/answer", _body(request))
            cache = r.headers.get("x-cache", "off")
            return Answer(AnswerResponse.model_validate(r.json()), cache)  # type: ignore[arg-type]
        return Answer(await self._stream(request, on_step), "off")

    async def aretrieve(self, request: RetrieveRequest) -> list[RankedPassage]:
        body = request.model_dump(mode="json", exclude_none=True)
        return RetrieveResponse.model_validate(
            await self._call("POST", "/v1/retrieve", body)
        ).passages

    async def health(self) -> Health:
        """`GET /readyz`: ready or not, with what the server serves (503 says not ready)."""
        async with self._client() as client:
            try:
                r = await client.get("/readyz")
            except httpx.HTTPError as exc:
                raise self._unreachable(exc) from None
        body = _json(r)
        if isinstance(body, dict) and "checks" in body:
            return Health.model_validate(body)
        self._raise_for(r)
        raise ServerRefused(r.status_code, "not_selfrag", f"{self.url} is not a selfrag server")

    # --- the indexed documents ---------------------------------------------------------------

    async def documents(self, collection: str | None = None) -> list[DocumentInfo]:
        """`GET /v1/documents`: the documents of the served collection (`collection`, when
        given, must be it)."""
        found = await self._call("GET", "/v1/documents", collection=collection)
        return [DocumentInfo.model_validate(d) for d in found]

    async def remove(self, refs: list[str], collection: str | None = None) -> Removal:
        """One `DELETE /v1/documents/{ref}` per ref; a ref that names no document is
        unmatched. `collection`, when given, must be the served one."""
        ids: list[str] = []
        passages = 0
        unmatched: list[str] = []
        for ref in refs:
            try:
                done = await self._call(
                    "DELETE", "/v1/documents/" + quote(ref, safe=""), collection=collection
                )
            except ServerRefused as exc:
                if exc.status != 404:
                    raise
                unmatched.append(ref)
                continue
            removal = Removal.model_validate(done)
            ids += removal.documents
            passages += removal.passages
        return Removal(documents=ids, passages=passages, unmatched=unmatched)

    # --- the wire ----------------------------------------------------------------------------

    def _client(self, collection: str | None = None) -> httpx.AsyncClient:
        """A client for one call (the blocking twins run each call on an event loop of its
        own, and a client's connections belong to the loop that opened them); `collection`
        names the collection this call means, instead of the client's."""
        headers = dict(self._headers)
        if collection:
            headers[COLLECTION_HEADER] = collection
        return httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=self._timeout_s, transport=self._transport
        )

    async def _call(
        self, method: str, path: str, body: Any = None, *, collection: str | None = None
    ) -> Any:
        async with self._client(collection) as client:
            return (await self._send(client, method, path, body)).json()

    async def _send(
        self, client: httpx.AsyncClient, method: str, path: str, body: Any
    ) -> httpx.Response:
        try:
            r = await client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        self._raise_for(r)
        return r

    async def _stream(self, request: AnswerRequest, on_step: StepListener) -> AnswerResponse:
        """`POST /v1/answer/stream`: each `segment` event to `on_step` as the leader it makes,
        the `answer` returned, an `error` raised."""
        segments: list[SegmentOut] = []
        async with self._events(request) as events:
            async for kind, data in events:
                if kind == "segment":
                    event = SegmentEvent.model_validate(data)
                    segments[event.index :] = [event.segment]
                    on_step(Hypothesis(segments=tuple(segments), score=event.hypothesis_score))
                elif kind == "answer":
                    return AnswerResponse.model_validate(data)
                elif kind == "error":
                    raise _error(int(data.get("status", 500)), data)
        raise DependencyDown(f"the stream from {self.url} ended without an answer")

    @asynccontextmanager
    async def _events(
        self, request: AnswerRequest
    ) -> AsyncIterator[AsyncIterator[tuple[str, Any]]]:
        async with self._client() as client:
            try:
                async with client.stream("POST", "/v1/answer/stream", json=_body(request)) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        self._raise_for(r)
                    yield _server_sent(r.aiter_lines())
            except httpx.HTTPError as exc:
                raise self._unreachable(exc) from None

    def _raise_for(self, r: httpx.Response) -> None:
        if r.status_code >= 400:
            raise _error(r.status_code, _json(r))

    def _unreachable(self, exc: httpx.HTTPError) -> DependencyDown:
        return DependencyDown(f"the selfrag server at {self.url} does not answer: {exc}")


async def _server_sent(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, Any]]:
    """(event, data) of each server-sent event; comments (keep-alives) skipped."""
    kind, data = "message", ""
    async for line in lines:
        if not line:
            if data:
                yield kind, json.loads(data)
            kind, data = "message", ""
        elif line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()


def _body(request: AnswerRequest) -> dict[str, Any]:
    return request.model_dump(mode="json", exclude_none=True)


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _error(status: int, body: Any) -> AnswerError | ServerRefused:
    """What an error response (or a stream's error event) stands for."""
    kind = body.get("error") if isinstance(body, dict) else None
    detail = body.get("detail") if isinstance(body, dict) else None
    detail = detail if isinstance(detail, str) else json.dumps(detail) if detail else ""
    if status != 422 or kind != "invalid_request":
        known = error_of_kind(kind, detail)
        if known is not None:
            return known
    if status == 409:
        return WrongServer(status, str(kind), detail)
    return ServerRefused(status, str(kind or "http_error"), detail)
