"""Every way in decides one question alike: the CLI (`selfrag ask`, in process and through a
server), the Python API (`SelfRAG`, in process and `SelfRAG.open(url=...)`), the HTTP API and
its OpenAI route, `selfrag batch` and `selfrag eval` get the same decision (answer or abstain),
the same support score, the same settled config and, greedy on one thread each, the same text.

For real: SmolLM2 through llama.cpp, embedded Qdrant, Ray Data, Ray Serve (`selfrag serve`).
One home, a copy of the session's Normans home, first without a support calibration for the
model (the filter settles off everywhere), then with one (its threshold settles everywhere,
the Serve replicas' included). Without a calibration the HTTP routes are the app in this
process over the Python API's client; with one, a real `selfrag serve`, which is costly to
start, so it runs once, and `selfrag batch` as a command of its own: what these two write to
stderr, start to stop, is quiet (`tests/quiet_logs.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from selfrag.cli import main
from tests.cli.test_serving_restart import STOP_GRACE_S, Server
from tests.fakes import support_calibration
from tests.quiet_logs import assert_quiet
from tests.redis_proc import free_port
from tests.suite import SUITE_ENV

QUESTION = "Who was the Norse leader who founded Normandy?"
# Small, greedy, and the same everywhere: one segment of 16 tokens from two passages.
DIALS: dict[str, Any] = {"mode": "always", "top_k": 2, "max_segments": 1, "max_segment_tokens": 16}
FLAGS = ["--mode", "always", "--top-k", "2", "--max-segments", "1", "--max-segment-tokens", "16"]
THRESHOLD = 0.99
"""The calibrated support threshold: above any support this question gets, so the calibrated
answer abstains where the uncalibrated one answers (the decision is the filter's)."""


@dataclass(frozen=True)
class Outcome:
    """What must agree: the decision, the support score, the settled config, the text."""

    abstained: bool
    support: float | None
    config: dict[str, Any]
    answer: str

    @classmethod
    def of(cls, response: Any) -> Outcome:
        r = response if isinstance(response, dict) else response.model_dump(mode="json")
        return cls(r["abstained"], r["support"], r["config"], r["answer"])


@pytest.fixture(scope="module")
def home(normans_api_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the session's Normans home: this module writes a calibration into it."""
    home = tmp_path_factory.mktemp("agree") / "home"
    shutil.copytree(normans_api_home, home)
    return home


@pytest.fixture
def environment(home: Path, monkeypatch: pytest.MonkeyPatch, ray_local: None) -> None:
    """Every entry point on `home`, one llama.cpp thread each (one summation order)."""
    for name, value in SUITE_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SELFRAG_HOME", str(home))
    monkeypatch.setenv("SELFRAG_MODEL__N_THREADS", "1")
    monkeypatch.delenv("SELFRAG_API_KEYS", raising=False)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Outcome:
    assert main(["ask", "--json", *FLAGS, *argv, QUESTION]) == 0
    return Outcome.of(json.loads(capsys.readouterr().out))


def _python() -> Outcome:
    from selfrag import SelfRAG

    with SelfRAG.open() as rag:
        return Outcome.of(rag.answer(QUESTION, **DIALS))


def _batch_args(tmp_path: Path) -> list[str]:
    """`batch` of the question, one actor, into tmp_path/answers.jsonl (`_batch_outcome`)."""
    questions, out = tmp_path / "questions.jsonl", tmp_path / "answers.jsonl"
    questions.write_text(json.dumps({"id": "q", "question": QUESTION, "config": DIALS}) + "\n")
    return ["batch", str(questions), "--out", str(out), "--actors", "1", "--no-progress"]


def _batch_outcome(tmp_path: Path) -> Outcome:
    [record] = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert record["status"] == "ok", record
    return Outcome.of(record["response"])


def _batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Outcome:
    """`selfrag batch` in this process, on the module's Ray instance."""
    assert main(_batch_args(tmp_path)) == 0
    capsys.readouterr()
    return _batch_outcome(tmp_path)


def _batch_command(tmp_path: Path) -> Outcome:
    """`selfrag batch` as a user runs it: a command of its own, which starts its own Ray
    instance; what it writes to stderr is quiet (`assert_quiet`)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-m", "selfrag", *_batch_args(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "answered=1 failed=0" in done.stdout, done.stdout
    assert_quiet(done.stderr)
    return _batch_outcome(tmp_path)


def _eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Outcome:
    dataset, out = tmp_path / "eval.jsonl", tmp_path / "eval"
    dataset.write_text(json.dumps({"question": QUESTION, "golden_answers": ["Rollo"]}) + "\n")
    argv = ["eval", str(dataset), "--systems", "selfrag-learned", "--out", str(out)]
    assert main([*argv, "--no-progress", *FLAGS]) == 0
    capsys.readouterr()
    [record] = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return Outcome(record["abstained"], record["support"], record["config"], record["answer"])


def _over_http(http: httpx.Client) -> dict[str, Outcome]:
    """The native route and the OpenAI route's `selfrag` extension."""
    native = http.post("/v1/answer", json={"question": QUESTION, "config": DIALS})
    assert native.status_code == 200, native.text
    chat = http.post(
        "/v1/chat/completions",
        json={"model": "selfrag", "messages": [{"role": "user", "content": QUESTION}]}
        | {"selfrag": DIALS},
    )
    assert chat.status_code == 200, chat.text
    return {
        "http": Outcome.of(native.json()),
        "openai": Outcome.of(chat.json()["choices"][0]["selfrag"]),
    }


def _agree(outcomes: dict[str, Outcome]) -> Outcome:
    """The one outcome every entry point got; the first difference otherwise."""
    first_name, first = next(iter(outcomes.items()))
    for name, outcome in outcomes.items():
        for field in ("abstained", "support", "config", "answer"):
            assert getattr(outcome, field) == getattr(first, field), (
                f"{name} and {first_name} differ in {field}: "
                f"{getattr(outcome, field)!r} != {getattr(first, field)!r}"
            )
    return first


@pytest.fixture
def server(
    home: Path, tmp_path: Path, environment: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Server]:
    """`selfrag serve` on `home`, on a private Ray instance of its own."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # not this module's instance
    port = free_port()
    started = Server(home, port, tmp_path / "serve.log")
    try:
        started.wait_ready()
        yield started
    finally:
        if started.proc.poll() is None:
            started.stop()


def test_without_a_calibration_every_way_in_answers_with_the_filter_off(
    home: Path, tmp_path: Path, environment: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from fastapi.testclient import TestClient

    from selfrag import SelfRAG
    from selfrag.actors.http.routes import build_local_http_app

    outcomes = {"python": _python(), "cli": _cli(capsys)}
    with SelfRAG.open() as rag, TestClient(build_local_http_app(rag.client)) as http:
        outcomes |= _over_http(http)
    outcomes |= {"eval": _eval(tmp_path, capsys), "batch": _batch(tmp_path, capsys)}
    agreed = _agree(outcomes)
    assert agreed.config["critique"] == "learned"  # `auto`, settled to the source it ran
    assert agreed.config["min_support_score"] == 0.0 and not agreed.abstained


def test_with_a_calibration_every_way_in_holds_the_answer_to_it(
    home: Path,
    tmp_path: Path,
    environment: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    from selfrag import SelfRAG
    from selfrag.infra.calibration_files import save_calibration
    from selfrag.infra.settings_loader import load_settings
    from selfrag.runtime.system import LocalRuntime

    with LocalRuntime(load_settings()) as rt:  # the model file's identity; no engine loaded
        model = rt.model
        cal = support_calibration(
            sha=model.sha256,
            model_file=model.path.name,
            fingerprint=model.fingerprint,
            min_support_score=THRESHOLD,
            index_version=rt.store.index_version(),
        )
    save_calibration(home, cal)
    # As a user runs it: a missing threshold would be calibrated on first use (here none is).
    monkeypatch.setenv("SELFRAG_MODEL__CALIBRATE_ON_FIRST_USE", "true")

    outcomes = {
        "python": _python(),
        "cli": _cli(capsys),
        "eval": _eval(tmp_path, capsys),
        "batch": _batch_command(tmp_path),
    }
    served: Server = request.getfixturevalue("server")
    with httpx.Client(base_url=served.url, timeout=300) as http:
        outcomes |= _over_http(http)
    with SelfRAG.open(url=served.url, home=home) as remote:  # checks it serves this home
        assert remote.health().ready
        outcomes["python-remote"] = Outcome.of(remote.answer(QUESTION, **DIALS))
    # The server holds the store: `selfrag ask` goes through it.
    monkeypatch.setenv("SELFRAG_SERVE__PORT", served.url.rsplit(":", 1)[1])
    outcomes["cli-remote"] = _cli(capsys)
    agreed = _agree(outcomes)
    assert agreed.config["min_support_score"] == THRESHOLD and agreed.abstained

    # The server's start, its answers and its stop wrote nothing a user should not see, and
    # it said once where its API, playground and API docs are.
    assert served.stop() < STOP_GRACE_S and served.proc.returncode == 0
    log = served.log.read_text()
    assert_quiet(log)
    (start,) = [line for line in log.splitlines() if "serving at" in line]
    assert f"{served.url}/v1" in start and f"playground {served.url}/" in start
    assert f"{served.url}/openapi.json" in start
