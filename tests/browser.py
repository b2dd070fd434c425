"""A small Chrome DevTools Protocol client for the browser tests: a headless Chromium of its
own (its own process group, its own profile folder), one page, `evaluate`, real mouse and key
input, and screenshots. Every wait is bounded; the process group is killed on exit.

Also the steps of the playground page (actors/http/playground.html) that the tests share.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

CHROMIUM = shutil.which("chromium")
"""Debian's `chromium` (apt-get install chromium); None when it is not installed."""
NO_CHROMIUM = "chromium is not installed (apt-get install chromium; .ci/run installs it)"

_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class BrowserError(RuntimeError):
    """A DevTools command failed, or a page expression threw."""


class Page:
    """One page target, over the browser's DevTools websocket (a flattened session)."""

    def __init__(self, ws: ClientConnection, session_id: str, timeout_s: float) -> None:
        self._ws = ws
        self._session = session_id
        self._ids = itertools.count(1)
        self.timeout_s = timeout_s

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """One command; its result. Events that arrive meanwhile are dropped."""
        return _command(self._ws, next(self._ids), method, params, self._session, self.timeout_s)

    def evaluate(self, expression: str) -> Any:
        """The expression's value (promises awaited), as JSON."""
        reply = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"{expression[:80]!r} threw: {text}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float, what: str) -> Any:
        """Poll `expression` until it is truthy; its value. Fails after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s} s")
            time.sleep(0.1)

    def goto(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})
        self.wait_for(
            f"location.href === {json.dumps(url)} && document.readyState === 'complete'",
            self.timeout_s,
            f"{url} loaded",
        )

    def type_into(self, selector: str, text: str) -> None:
        """Set an input's value and fire `input`, as typing would."""
        self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            f" e.focus(); e.value = {json.dumps(text)};"
            " e.dispatchEvent(new Event('input', {bubbles: true})); })()"
        )

    def click(self, selector: str) -> None:
        """A real mouse click (press and release) at the element's centre."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.send(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1},
            )

    def press_enter(self) -> None:
        """Enter, as a keyboard sends it, to the focused element."""
        key = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13}
        self.send("Input.dispatchKeyEvent", {"type": "keyDown", "text": "\r", **key})
        self.send("Input.dispatchKeyEvent", {"type": "keyUp", **key})

    def screenshot(self, path: Path) -> Path:
        """The whole page (not only the viewport) as a PNG."""
        size = self.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self.send(
            "Page.captureScreenshot",
            {"format": "png", "clip": clip, "captureBeyondViewport": True},
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


def _command(
    ws: ClientConnection,
    message_id: int,
    method: str,
    params: dict[str, Any] | None,
    session_id: str | None,
    timeout_s: float,
) -> dict[str, Any]:
    message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
    if session_id is not None:
        message["sessionId"] = session_id
    ws.send(json.dumps(message))
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{method}: no reply within {timeout_s} s")
        reply = json.loads(ws.recv(timeout=left))
        if reply.get("id") != message_id or reply.get("sessionId") != session_id:
            continue  # an event (commands go one at a time, so no other reply is pending)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))


def _read_lines(stream: Any, lines: queue.Queue[str]) -> None:
    """Drain Chromium's stderr (a full pipe would stall it), handing each line on."""
    for raw in iter(stream.readline, b""):
        lines.put(raw.decode("utf-8", "replace"))


@contextmanager
def chromium(timeout_s: float = 20.0, width: int = 1100, height: int = 900) -> Iterator[Page]:
    """A fresh headless Chromium with one blank page; killed (its whole process group) and its
    profile removed on exit. `timeout_s` bounds the start and every command."""
    if CHROMIUM is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="selfrag-chromium-") as profile:
        proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless=new",
                "--no-sandbox",  # root in a container has no usable sandbox
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: its helpers die with it
        )
        try:
            lines: queue.Queue[str] = queue.Queue()
            threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True).start()
            url = _devtools_url(proc, lines, timeout_s)
            with connect(url, max_size=None, proxy=None, open_timeout=timeout_s) as ws:
                ids = itertools.count(1)

                def browser(method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
                    return _command(ws, next(ids), method, params, None, timeout_s)

                targets = browser("Target.getTargets")["targetInfos"]
                target = next(t["targetId"] for t in targets if t["type"] == "page")
                session = browser("Target.attachToTarget", {"targetId": target, "flatten": True})
                page = Page(ws, session["sessionId"], timeout_s)
                page.send(
                    "Emulation.setDeviceMetricsOverride",
                    {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
                )
                yield page
        finally:
            _kill_group(proc)


def _devtools_url(proc: subprocess.Popen[bytes], lines: queue.Queue[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if match := _LISTENING.search(line):
            return match.group(1)
    tail = "".join(seen[-20:])
    raise RuntimeError(f"chromium gave no DevTools URL within {timeout_s} s:\n{tail}")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to Chromium's own process group, SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    if proc.stderr is not None:
        proc.stderr.close()


# --- the playground page ------------------------------------------------------------------------

ANSWER_SHOWN = "document.getElementById('usage').textContent !== ''"
"""True once the final `answer` event was rendered (an abstention too)."""

SHOWN = """(() => ({
  segments: [...document.querySelectorAll('#answer .segment .text')].map(e => e.textContent),
  citations: [...document.querySelectorAll('#answer .citation')].map(e => ({
    id: e.dataset.passageId, text: e.textContent, href: e.getAttribute('href')})),
  passages: [...document.querySelectorAll('#passages li')].map(e => ({
    id: e.dataset.passageId, anchor: e.id, text: e.querySelector('.text').textContent})),
  usage: document.getElementById('usage').textContent,
  error: document.getElementById('error').textContent,
  abstained: !document.getElementById('abstained').hidden,
  status: document.getElementById('status').textContent,
}))()"""
"""What the page shows, as JSON."""


def ask_in_playground(
    page: Page, base_url: str, question: str, dials: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """Open the playground, set `dials` (input id → value), type `question`, click Ask and
    wait until the answer or an error is shown; what the page shows (`SHOWN`)."""
    page.goto(base_url.rstrip("/") + "/")
    for name, value in dials.items():
        page.type_into(f"#{name}", value)
    page.type_into("#question", question)
    page.click("#ask")
    page.wait_for(
        f"({ANSWER_SHOWN}) || document.getElementById('error').textContent !== ''",
        timeout_s,
        "an answer or an error on the playground",
    )
    return dict(page.evaluate(SHOWN))
