"""`selfrag ask` calibrates the support threshold once when the model has none: which cases
run it, with the calibration job replaced by a recorder."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from selfrag.cli.first_use import (
    calibrate_before_answering,
    calibrate_eval_systems,
    calibrate_on_first_use,
)
from selfrag.schemas.settings import Settings


class Calibrated:
    def __init__(self, has: bool) -> None:
        self.has = has

    def calibration(self, name: str) -> object | None:
        return object() if self.has else None


def _rag(tmp_path: Path, *, has: bool, source: str = "learned", **model: Any) -> Any:
    settings = Settings(home=tmp_path, model=model)
    return SimpleNamespace(
        settings=settings,
        calibrated=Calibrated(has),
        critique_name=lambda critique: source,
        model=SimpleNamespace(path=tmp_path / "m.gguf"),
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


def test_runs_once_when_the_model_has_no_threshold(tmp_path: Path, runs: list[str], capsys):
    assert calibrate_on_first_use(_rag(tmp_path, has=False), "auto") is True
    assert runs == ["auto"]
    assert "calibrating it once now" in capsys.readouterr().err


def test_not_when_calibrated_or_turned_off(tmp_path: Path, runs: list[str]):
    assert calibrate_on_first_use(_rag(tmp_path, has=True), "auto") is False
    off = _rag(tmp_path, has=False, calibrate_on_first_use=False)
    assert calibrate_on_first_use(off, "auto") is False
    assert runs == []
    # Every source without a threshold gets one: no source has a constant to fall back on.
    assert calibrate_on_first_use(_rag(tmp_path, has=False, source="likelihood"), "x") is True
    assert runs == ["x"]


def test_an_evaluation_calibrates_each_self_rag_system_s_source(tmp_path: Path, runs: list[str]):
    rag = _rag(tmp_path, has=False)
    rag.store = SimpleNamespace(count=lambda: 5)
    systems = ["vanilla-rag", "selfrag-learned", "closed-book", "selfrag-likelihood"]
    assert calibrate_eval_systems(rag, systems, progress=False) == ["learned", "likelihood"]
    assert runs == ["learned", "likelihood"]
    rag.store = SimpleNamespace(count=lambda: 0)  # an empty collection: nothing to calibrate on
    assert calibrate_eval_systems(rag, systems, progress=False) == []
    calibrated = _rag(tmp_path, has=True)
    calibrated.store = SimpleNamespace(count=lambda: 5)
    assert calibrate_eval_systems(calibrated, ["selfrag-learned"], progress=False) == []
    assert runs == ["learned", "likelihood"]


OPENED: list[Runtime] = []


class Runtime:
    """What `calibrate_before_answering` opens: a store of `count` passages."""

    def __init__(self, settings: Settings, count: int) -> None:
        self.settings = settings
        self.store = SimpleNamespace(count=lambda: count)
        self.calibrated = Calibrated(False)
        self.critique_name = lambda critique: "learned"
        self.model = SimpleNamespace(path=settings.home / "m.gguf")
        self.closed = False
        OPENED.append(self)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True


def test_a_server_or_batch_calibrates_its_collection_before_answering(
    tmp_path: Path, runs: list[str], monkeypatch: pytest.MonkeyPatch
):
    import selfrag.runtime.system as system

    OPENED.clear()
    count = 5
    monkeypatch.setattr(system, "LocalRuntime", lambda settings: Runtime(settings, count))
    settings = Settings(home=tmp_path, decoding={"critique": "learned"})
    assert calibrate_before_answering(settings) is True
    assert runs == ["learned"] and OPENED[-1].closed  # the store is free again
    count = 0  # an empty collection: nothing to calibrate on
    assert calibrate_before_answering(settings) is False and runs == ["learned"]
    off = Settings(home=tmp_path, model={"calibrate_on_first_use": False})
    assert calibrate_before_answering(off) is False and len(OPENED) == 2


@pytest.mark.parametrize("calibrate", [True, False])
def test_serve_checks_the_model_and_calibrates_in_one_runtime_that_it_closes(
    tmp_path: Path, runs: list[str], monkeypatch: pytest.MonkeyPatch, calibrate: bool
):
    import selfrag.cli.serving as serving
    import selfrag.infra.models.model_presets as presets
    import selfrag.runtime.system as system

    OPENED.clear()
    checked: list[Path] = []
    monkeypatch.setattr(system, "LocalRuntime", lambda settings: Runtime(settings, 5))
    monkeypatch.setattr(presets, "recheck_model", lambda model, home: None)
    monkeypatch.setattr(serving, "_check_model_runs", lambda path, n: checked.append(path))
    settings = Settings(
        home=tmp_path,
        decoding={"critique": "learned"},
        model={"calibrate_on_first_use": calibrate},
    )
    serving._ready_model(settings)
    assert len(OPENED) == 1 and OPENED[0].closed  # the store is free before Ray starts
    assert checked == [tmp_path / "m.gguf"]
    assert runs == (["learned"] if calibrate else [])
