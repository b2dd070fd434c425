"""The playground page at `GET /` (actors/http/playground.py): served, self-contained, open without
a key; and driven in a real headless Chromium against the HTTP app over the scripted service."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from selfrag.actors.http.metrics import Metrics
from selfrag.actors.http.playground import PAGE
from selfrag.actors.http.routes import build_http_app, parse_api_keys
from selfrag.schemas.answer import AnswerResponse, Evidence
from selfrag.schemas.decoding import DecodingConfig
from tests.browser import CHROMIUM, NO_CHROMIUM, SHOWN, Page, ask_in_playground, chromium
from tests.http_fakes import FakeService, live_server, scripted_response
from tests.paths import ROOT
from tests.real import real

QUESTION = "Who founded Normandy?"


def test_the_page_is_served_at_the_root_without_a_key():
    app = build_http_app(FakeService(), Metrics(), api_keys=parse_api_keys("k1"))
    c = TestClient(app)
    r = c.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "/answer/stream" in r.text and 'id="question"' in r.text
    # Only the page is open: the API calls it makes still need the key.
    assert c.post("/v1/answer/stream", json={"question": "q"}).status_code == 401
    assert "/" not in c.get("/openapi.json").json()["paths"]


def test_the_page_has_no_external_assets_and_no_inner_html():
    html = TestClient(build_http_app(FakeService(), Metrics())).get("/").text
    # Works offline: no other origin at all, so no CDN script, stylesheet or web font.
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", html, re.IGNORECASE)
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=|@import|url\(", html, re.IGNORECASE)
    # Server text (passages are untrusted) is only ever set as textContent.
    assert "innerHTML" not in html and "insertAdjacentHTML" not in html


def _hash(block: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(block.encode()).digest()).decode() + "'"


def test_the_page_is_sent_with_a_policy_that_allows_only_its_own_script_and_style():
    r = TestClient(build_http_app(FakeService(), Metrics())).get("/")
    directives = (d.partition(" ") for d in r.headers["content-security-policy"].split("; "))
    policy = {name: value for name, _, value in directives}
    (script,) = re.findall(r"<script>(.*?)</script>", r.text, re.DOTALL)
    (style,) = re.findall(r"<style>(.*?)</style>", r.text, re.DOTALL)
    assert policy["default-src"] == "'none'"
    assert policy["script-src"] == _hash(script) and policy["style-src"] == _hash(style)
    assert policy["connect-src"] == "'self'" and policy["frame-ancestors"] == "'none'"
    assert policy["form-action"] == "'none'" and policy["base-uri"] == "'none'"
    assert "unsafe" not in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"


def test_no_page_of_this_origin_loads_a_cdn():
    """Swagger UI (/docs) and ReDoc (/redoc) load their scripts from a CDN, on the origin
    where the playground keeps the API key: only the OpenAPI document is served."""
    c = TestClient(build_http_app(FakeService(), Metrics()))
    assert c.get("/docs").status_code == 404 and c.get("/redoc").status_code == 404
    assert c.get("/docs/oauth2-redirect").status_code == 404
    assert "/v1/answer" in c.get("/openapi.json").json()["paths"]


def test_the_page_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert PAGE in data["package-data"]["selfrag.actors.http"]
    assert (ROOT / "actors" / "http" / PAGE).is_file()


# --- in a real browser --------------------------------------------------------------------------

HOSTILE = '<img src=x onerror="window.pwned = 1"> Rollo founded Normandy.'


def hostile_passage_response(question: str, config: DecodingConfig) -> AnswerResponse:
    """The scripted answer, its passage's text HTML that must show as text."""
    r = scripted_response(question, config)
    r.passages[0].text = HOSTILE
    return r


@pytest.fixture(scope="module")
@real
def page() -> Iterator[Page]:
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    with chromium() as p:
        yield p


def test_the_page_streams_an_answer_with_citations(page: Page, tmp_path: Path):
    service = FakeService(script=hostile_passage_response)
    with live_server(build_http_app(service, Metrics())) as url:
        shown = ask_in_playground(
            page, url, QUESTION, {"mode": "always", "top_k": "5", "min_support": ""}, 20.0
        )
        assert shown["error"] == "" and not shown["abstained"], shown
        assert shown["segments"] == ["Rollo founded it.", "In 911."]
        (citation,) = shown["citations"]
        assert citation["id"] == "p1" and citation["text"] == "[T (p1)]"
        assert citation["href"] == "#passage-p1"
        assert [(p["id"], p["anchor"], p["text"]) for p in shown["passages"]] == [
            ("p1", "passage-p1", HOSTILE)
        ]
        assert page.evaluate("document.querySelectorAll('#passages img').length") == 0
        assert page.evaluate("window.pwned === undefined")
        for part in ("5 opened, 1 pruned, 1 filtered", "1 retrievals", "2 steps", "12 ms"):
            assert part in shown["usage"]
        assert "critique prompted" in shown["usage"] and "model fake" in shown["usage"]
        # Scores as bars, a missing one as n/a.
        first, second = page.evaluate(
            "[...document.querySelectorAll('#answer .segment .meta')].map(e => e.textContent)"
        )
        assert "rel 0.90" in first and "sup 0.75" in first and "IsSup full" in first
        assert "rel n/a" in second and "no passage" in second
        # Only the dials that were set went out; blank ones are the server's defaults.
        (seen,) = service.seen
        assert seen.question == QUESTION
        assert seen.config.model_dump(exclude_none=True) == {"mode": "always", "top_k": 5}
        page.click("#answer .citation")
        page.wait_for(
            "document.getElementById('passage-p1').classList.contains('flash')",
            5.0,
            "the cited passage highlighted",
        )
        shot = page.screenshot(tmp_path / "playground.png")
        # The page ran under its Content-Security-Policy: its stylesheet applies (60rem wide),
        # while a script injected into it does not run.
        assert page.evaluate("getComputedStyle(document.body).maxWidth") == "960px"
        injected = (
            "(() => { const s = document.createElement('script');"
            " s.textContent = 'window.injected = 1'; document.body.append(s);"
            " return window.injected === undefined; })()"
        )
        assert page.evaluate(injected) is True
        # A `segment` event with index i replaces every segment shown at i and after.
        replace = (
            "(i => { handleEvent('segment', {index: i, hypothesis_score: 0, segment: {text: ' X.',"
            " citation: null, s_rel: null, s_sup: null, s_use: null, is_sup: null}});"
            " return [...document.querySelectorAll('#answer .segment .text')]"
            ".map(e => e.textContent); })"
        )
        assert page.evaluate(f"{replace}(1)") == ["Rollo founded it.", "X."]
        assert page.evaluate(f"{replace}(0)") == ["X."]
        # A segment's flags show as warnings, the terms its source lacks on hover.
        flagged = (
            "(() => { handleEvent('segment', {index: 1, hypothesis_score: 0, segment: {text:"
            " ' In 932.', citation: null, s_rel: null, s_sup: null, s_use: null, is_sup: null,"
            " flags: ['uncited', 'unsupported_terms'], unsupported_terms: ['932']}});"
            " return [...document.querySelectorAll('#answer .segment [data-testid=flag]')]"
            ".map(e => [e.textContent, e.title]); })()"
        )
        assert page.evaluate(flagged) == [
            ["⚠ cites no source", ""],
            ["⚠ not in the source", "932"],
        ]
    assert shot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def _with_evidence(question: str, config: DecodingConfig) -> AnswerResponse:
    """The scripted answer, its passage's text hostile HTML, the first segment's evidence the
    passage's plain sentence."""
    r = scripted_response(question, config)
    r.passages[0].text = HOSTILE
    start = HOSTILE.index("Rollo")
    evidence = Evidence(start=start, end=len(HOSTILE), text=HOSTILE[start:])
    citation = r.segments[0].citation
    assert citation is not None
    r.segments[0].citation = citation.model_copy(update={"evidence": evidence})
    return r


def test_the_evidence_span_is_marked_in_the_passage(page: Page, tmp_path: Path):
    with live_server(build_http_app(FakeService(script=_with_evidence), Metrics())) as url:
        shown = ask_in_playground(page, url, QUESTION, {}, 20.0)
        assert shown["error"] == "" and shown["passages"][0]["text"] == HOSTILE, shown
        marks = page.evaluate(
            "[...document.querySelectorAll('#passages mark')]"
            ".map(m => [m.textContent, m.dataset.segment, m.title])"
        )
        assert marks == [["Rollo founded Normandy.", "0", "supports segment 1"]]
        assert page.evaluate("document.querySelectorAll('#passages img').length") == 0
        assert page.evaluate("window.pwned === undefined")
        # The citation leads to the segment's own span.
        page.click("#answer .citation")
        page.wait_for(
            "document.querySelector('#passages mark').classList.contains('flash')",
            5.0,
            "the evidence span highlighted",
        )
        shot = page.screenshot(tmp_path / "evidence.png")
        # Offsets count code points (as Python's do); a span whose text does not match the
        # offsets, or that runs past the passage, is not marked.
        marked = (
            "((text, ev) => passageText({id: 'p', text}, [{citation: {passage_id: 'p',"
            " evidence: ev}}]).filter(n => typeof n !== 'string').map(n => n.textContent))"
        )
        text = json.dumps("\U0001f600 ab. Rollo x.")
        assert page.evaluate(f'{marked}({text}, {{start: 6, end: 14, text: "Rollo x."}})') == [
            "Rollo x."
        ]
        assert page.evaluate(f'{marked}({text}, {{start: 6, end: 14, text: "Rollo y."}})') == []
        assert page.evaluate(f'{marked}({text}, {{start: 6, end: 99, text: "Rollo x."}})') == []
    assert shot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_the_page_shows_errors_and_sends_the_api_key(page: Page):
    service = FakeService()
    with live_server(build_http_app(service, Metrics(), api_keys=parse_api_keys("k1"))) as url:
        shown = ask_in_playground(page, url, QUESTION, {}, 20.0)
        assert shown["error"] == "401 unauthorized: missing or invalid API key", shown
        assert service.seen == []

        # A 422 names the field; Enter in the question box asks again.
        page.type_into("#api_key", "k1")
        page.type_into("#top_k", "0")
        page.type_into("#question", QUESTION)
        page.press_enter()
        error = page.wait_for(
            "(t => !t.startsWith('401') && t)(document.getElementById('error').textContent)",
            20.0,
            "the next error shown",
        )
        assert error.startswith("422 invalid_request: config.top_k: "), error

        page.type_into("#top_k", "")
        page.click("#ask")
        page.wait_for(
            "document.querySelectorAll('#answer .citation').length > 0"
            " && document.getElementById('usage').textContent !== ''",
            20.0,
            "the answer with the key",
        )
        assert page.evaluate(SHOWN)["error"] == ""
        assert len(service.seen) == 1 and service.seen[0].config.top_k is None
        # The key stays in this tab's sessionStorage only.
        assert page.evaluate("sessionStorage.getItem('selfrag.apiKey')") == "k1"
        assert page.evaluate("localStorage.length") == 0
