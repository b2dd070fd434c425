"""jobs/first_use.py and the runtime's first-use hook: a support threshold is calibrated once,
where a request is first settled for a critique source without one, in whichever way the
request came in (the calibration job replaced by a recorder)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from selfrag.jobs.first_use import calibrate_before_serving, calibrate_on_first_use
from selfrag.runtime.answering import AnswerPath
from selfrag.runtime.system import LocalRuntime
from selfrag.schemas.answer import AnswerRequest
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.settings import Settings


class Calibrated:
    def __init__(self, has: bool) -> None:
        self.has = has

    def calibration(self, name: str) -> object | None:
        return object() if self.has else None


def _rag(
    tmp_path: Path, *, has: bool, count: int = 5, source: str = "learned", **model: Any
) -> Any:
    settings = Settings(home=tmp_path, model=model)
    return SimpleNamespace(
        settings=settings,
        calibrated=Calibrated(has),
        critique_name=lambda critique: source,
        model=SimpleNamespace(path=tmp_path / "m.gguf"),
        store=SimpleNamespace(count=lambda: count),
    )


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import selfrag.jobs.support_calibration as job
    import selfrag.jobs.threshold_status as status

    calls: list[str] = []

    def fake(rag: Any, plan: Any, *, critique: str, progress: bool) -> tuple[Any, Path]:
        calls.append(critique)
        return SimpleNamespace(), Path("cal.json")

    monkeypatch.setattr(job, "calibrate_support", fake)
    monkeypatch.setattr(status, "describe_calibration", lambda cal, path: f"wrote {path}")
    return calls


def test_runs_when_the_model_has_no_threshold(tmp_path: Path, runs: list[str], capsys):
    assert calibrate_on_first_use(_rag(tmp_path, has=False), "auto") is True
    assert runs == ["auto"]
    assert "calibrating it once now" in capsys.readouterr().err


def test_not_when_calibrated_turned_off_or_empty(tmp_path: Path, runs: list[str]):
    assert calibrate_on_first_use(_rag(tmp_path, has=True), "auto") is False
    off = _rag(tmp_path, has=False, calibrate_on_first_use=False)
    assert calibrate_on_first_use(off, "auto") is False
    assert calibrate_on_first_use(_rag(tmp_path, has=False, count=0), "auto") is False
    assert runs == []
    # Every source without a threshold gets one: no source has a constant to fall back on.
    assert calibrate_on_first_use(_rag(tmp_path, has=False, source="likelihood"), "x") is True
    assert runs == ["x"]


# --- the runtime's hook: where every request is settled ----------------------------------------


class Model:
    """The model artefacts' calibrated filters: those written so far."""

    def __init__(self) -> None:
        self.written: dict[str, float] = {}
        self.asked: list[str] = []  # where the real one warns that there is none

    def calibrated_filters(self, calibrated: object, critique: str) -> dict[str, object]:
        self.asked.append(critique)
        if critique in self.written:
            return {"min_support_score": self.written[critique]}
        return {}


def _runtime(tmp_path: Path, first_use: Any) -> LocalRuntime:
    rt = LocalRuntime(Settings(home=tmp_path), first_use=first_use)
    rt.__dict__["model"] = Model()  # no model file: the facts are the fake's
    rt.__dict__["answer_path"] = AnswerPath(DecodingConfig(critique="learned"), facts=rt)
    return rt


def test_a_request_settled_without_a_threshold_calibrates_it_once_then_holds_to_it(
    tmp_path: Path,
) -> None:
    calls: list[str] = []
    inside: list[float | None] = []

    def first_use(rt: LocalRuntime, critique: str) -> bool:
        calls.append(critique)
        # The calibration settles its own reads as every answer is: it finds none yet.
        inside.append(rt.answer_path.settle(DecodingConfig(critique=critique)).min_support_score)
        rt.model.written[critique] = 0.42  # type: ignore[attr-defined]
        return True

    rt = _runtime(tmp_path, first_use)
    request = AnswerRequest(question="Who founded Normandy?")
    assert rt.answer_path.config(request).min_support_score == 0.42
    assert rt.answer_path.config(request).min_support_score == 0.42
    assert calls == ["learned"]
    # Another source is its own first use; another collection its own too.
    likelihood = AnswerRequest(question="q", config={"critique": "likelihood"})
    assert rt.answer_path.config(likelihood).min_support_score == 0.42
    assert calls == ["learned", "likelihood"] and inside == [0.0, 0.0]
    rt.for_collection("other").calibrated_filters("learned")
    assert calls == ["learned", "likelihood", "learned"]


def test_requests_settled_while_it_calibrates_wait_for_it(tmp_path: Path) -> None:
    started = threading.Event()

    def first_use(rt: LocalRuntime, critique: str) -> bool:
        started.set()
        time.sleep(0.3)
        rt.model.written[critique] = 0.3  # type: ignore[attr-defined]
        return True

    rt = _runtime(tmp_path, first_use)
    request = AnswerRequest(question="q")
    seen: list[float | None] = []
    first = threading.Thread(
        target=lambda: seen.append(rt.answer_path.config(request).min_support_score)
    )
    first.start()
    assert started.wait(5)
    assert rt.answer_path.config(request).min_support_score == 0.3  # not the filter off
    first.join(5)
    assert seen == [0.3]


def test_a_failed_calibration_is_tried_again_by_the_next_request(tmp_path: Path) -> None:
    calls: list[str] = []

    def first_use(rt: LocalRuntime, critique: str) -> bool:
        calls.append(critique)
        if len(calls) == 1:
            raise RuntimeError("the engine failed")
        return False

    rt = _runtime(tmp_path, first_use)
    with pytest.raises(RuntimeError):
        rt.calibrated_filters("learned")
    assert rt.calibrated_filters("learned") == {} and calls == ["learned", "learned"]
    assert rt.calibrated_filters("learned") == {} and len(calls) == 2


def test_a_calibration_running_here_settles_with_none_and_starts_none(tmp_path: Path) -> None:
    """`selfrag index` calibrates in a runtime that calibrates on first use: the reads it
    settles must neither start a second calibration of the same source nor warn that there is
    none; other sources, and the source once its calibration is written, settle as before."""
    calls: list[str] = []

    def first_use(rt: LocalRuntime, critique: str) -> bool:
        calls.append(critique)
        return False

    rt = _runtime(tmp_path, first_use)
    written = rt.model.written  # type: ignore[attr-defined]
    rt.__dict__["calibrated"] = SimpleNamespace(calibration=written.get)
    asked = rt.model.asked  # type: ignore[attr-defined]
    with rt.calibrating("learned"):
        assert rt.calibrated_filters("learned") == {}
        assert calls == [] and asked == []
        rt.calibrated_filters("likelihood")
        assert calls == ["likelihood"]
        written["learned"] = 0.4  # a recalibration: the old threshold's filters
        assert rt.calibrated_filters("learned") == {"min_support_score": 0.4}
        del written["learned"]
    rt.calibrated_filters("learned")  # it wrote none: the next request's first use tries
    assert calls == ["likelihood", "learned"]


def test_a_runtime_without_first_use_only_reads(tmp_path: Path) -> None:
    rt = LocalRuntime(Settings(home=tmp_path))
    rt.__dict__["model"] = Model()
    assert rt.calibrated_filters("learned") == {}


# --- a server settles its default request before it serves --------------------------------------

OPENED: list[Runtime] = []


class Runtime:
    """What `calibrate_before_serving` opens: a store of `count` passages, settling its
    default request with its first use."""

    def __init__(self, settings: Settings, count: int, runs: list[str]) -> None:
        self.settings = settings
        self.store = SimpleNamespace(count=lambda: count)
        self.checked: list[str] = []
        self.model = SimpleNamespace(
            path=settings.home / "m.gguf", check_critique=self.checked.append
        )
        self.closed = False
        self.answer_path = SimpleNamespace(settle=lambda config: runs.append(config.critique))
        OPENED.append(self)

    def critique_name(self, critique: str) -> str:
        return critique

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True


def test_the_python_api_settles_with_first_use_calibration_as_the_cli_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It did not: on a home without a threshold the CLI calibrated on first use, while
    `SelfRAG.answer` answered with every filter off. Its client settles on a runtime that
    calibrates, for each source (`likelihood`: settled without loading the model)."""
    import selfrag.jobs.first_use as first_use
    from selfrag import SelfRAG

    class Calibrating(Exception):
        pass

    def calibrating(rt: LocalRuntime, critique: str) -> bool:
        raise Calibrating(critique)

    monkeypatch.setattr(first_use, "calibrate_on_first_use", calibrating)
    with SelfRAG.open(home=tmp_path) as rag, pytest.raises(Calibrating, match="likelihood"):
        rag.client.config(AnswerRequest(question="q", config={"critique": "likelihood"}))


def test_a_server_settles_its_default_request_before_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import selfrag.jobs.first_use as first_use

    OPENED.clear()
    settled: list[str] = []
    count = 5
    monkeypatch.setattr(
        first_use, "answering_runtime", lambda settings: Runtime(settings, count, settled)
    )
    settings = Settings(home=tmp_path, decoding={"critique": "learned"})
    calibrate_before_serving(settings)
    assert settled == ["learned"] and OPENED[-1].closed  # the store is free again
    count = 0  # an empty collection: nothing to calibrate on
    calibrate_before_serving(settings)
    assert settled == ["learned"]
    off = Settings(home=tmp_path, model={"calibrate_on_first_use": False})
    calibrate_before_serving(off)
    assert len(OPENED) == 2  # turned off: no runtime opened at all


@pytest.mark.parametrize("calibrate", [True, False])
def test_serve_checks_the_model_and_calibrates_in_one_runtime_that_it_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, calibrate: bool
):
    import selfrag.cli.serving as serving
    import selfrag.infra.models.model_presets as presets
    import selfrag.jobs.first_use as first_use

    OPENED.clear()
    settled: list[str] = []
    checked: list[Path] = []
    monkeypatch.setattr(
        first_use, "answering_runtime", lambda settings: Runtime(settings, 5, settled)
    )
    monkeypatch.setattr(presets, "recheck_model", lambda model, home: None)
    monkeypatch.setattr(serving, "_check_model_runs", lambda path, n: checked.append(path))
    settings = Settings(
        home=tmp_path,
        decoding={"critique": "learned"},
        model={"calibrate_on_first_use": calibrate},
    )
    serving._ready_model(settings)
    assert len(OPENED) == 1 and OPENED[0].closed  # the store is free before Ray starts
    assert checked == [tmp_path / "m.gguf"] and OPENED[0].checked == ["learned"]
    assert settled == (["learned"] if calibrate else [])


def test_the_serve_app_of_ray_app_settles_before_it_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import selfrag.ray_app as ray_app

    order: list[str] = []
    monkeypatch.setattr(ray_app, "calibrate_before_serving", lambda s: order.append("settle"))
    monkeypatch.setattr(ray_app, "build_app", lambda s: order.append("build"))
    ray_app.served_app(Settings(home=tmp_path))
    assert order == ["settle", "build"]
