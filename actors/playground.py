"""The playground: one self-contained HTML page at `GET /` that asks `/v1/answer/stream`.

The page has no external assets (inline CSS and JS), so it works offline; it needs no API key
itself, the API calls it makes do.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE = "playground.html"


@cache
def page() -> str:
    """The page's HTML, read once from the package data."""
    return files("selfrag.actors").joinpath(PAGE).read_text(encoding="utf-8")


def add_playground(app: FastAPI) -> None:
    """Register `GET /` (left out of the OpenAPI schema, like `/docs`)."""
    html = page()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse(html)
