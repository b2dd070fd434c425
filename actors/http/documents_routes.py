"""`GET /v1/documents` and `DELETE /v1/documents/{ref}`: the indexed documents over HTTP."""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI, HTTPException

from selfrag.schemas.documents import DocumentInfo, Removal


class DocumentService(Protocol):
    """What the routes need: the index's documents, and removing some."""

    async def documents(self) -> list[DocumentInfo]: ...

    async def remove(self, refs: list[str]) -> Removal: ...


def add_document_routes(
    app: FastAPI, service: DocumentService, authed: list[Any], keys_set: bool
) -> None:
    """The routes, behind the API key like every `/v1/*` route. A removal changes the index:
    without API keys configured it is refused (403), so no request without a credential can
    take documents out."""

    @app.get("/v1/documents", response_model=list[DocumentInfo], dependencies=authed)
    async def documents() -> list[DocumentInfo]:
        """Every indexed document: id, source, title, url, passages, when indexed."""
        return await service.documents()

    @app.delete("/v1/documents/{ref:path}", response_model=Removal, dependencies=authed)
    async def remove(ref: str) -> Removal:
        """Remove the document `ref` names (its id, URL-encoded, or the file or folder it was
        indexed from): its passages leave every search, and no cached answer citing it is
        served again. 404 when it names no document."""
        if not keys_set:
            raise HTTPException(
                403,
                "removing documents over HTTP needs an API key: restart the server with "
                "SELFRAG_API_KEYS set and send one of them (`selfrag docs rm` sends "
                "SELFRAG_API_KEY, else the first of SELFRAG_API_KEYS), or stop the server and "
                "run `selfrag docs rm` on its home, which then opens the index itself",
            )
        removal = await service.remove([ref])
        if removal.unmatched:
            raise HTTPException(404, f"no indexed document is {ref!r}")
        return removal
