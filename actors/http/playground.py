"""The playground: one self-contained HTML page at `GET /` that asks `/v1/answer/stream`.

The page has no external assets (inline CSS and JS), so it works offline; it needs no API key
itself, the API calls it makes do. It is sent with a Content-Security-Policy that allows its
own inline script and stylesheet by their SHA-256 and nothing else (no other script, no
frame, no form target, requests to this origin only), and may not be framed.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cache
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE = "playground.html"


@cache
def page() -> str:
    """The page's HTML, read once from the package data."""
    return files("selfrag.actors.http").joinpath(PAGE).read_text(encoding="utf-8")


def _hashes(html: str, tag: str) -> str:
    """CSP sources allowing each inline `<tag>` element of `html`, by its content's SHA-256."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
    digests = (base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() for b in blocks)
    return " ".join(f"'sha256-{d}'" for d in digests) or "'none'"


def security_headers(html: str) -> dict[str, str]:
    """The page's headers: its CSP (the inline script and style by hash), no framing, no
    referrer. (`X-Content-Type-Options: nosniff` is on every response: actors/http/routes.py.)"""
    policy = "; ".join(
        (
            "default-src 'none'",
            f"script-src {_hashes(html, 'script')}",
            f"style-src {_hashes(html, 'style')}",
            "connect-src 'self'",
            "img-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )
    return {
        "Content-Security-Policy": policy,
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
    }


def add_playground(app: FastAPI) -> None:
    """Register `GET /` (left out of the OpenAPI schema)."""
    html = page()
    headers = security_headers(html)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)
