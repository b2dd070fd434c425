"""The support threshold is fitted and applied per index collection: where each collection's
calibration is kept, that a home's existing files still serve the default collection, that
the answer path settles a request on collection C with C's threshold, and
`selfrag calibrate --collection` on the real model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from selfrag.infra.calibration_files import (
    calibration_path,
    read_calibration,
    save_calibration,
)
from selfrag.runtime.calibrated import CalibratedDefaults
from selfrag.runtime.system import LocalRuntime
from selfrag.schemas.calibration import SupportCalibration
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.settings import DEFAULT_COLLECTION, Settings
from tests.fakes import support_calibration

SHA = "a" * 64


def _calibration(threshold: float, collection: str | None, sha: str = SHA) -> SupportCalibration:
    return support_calibration(sha, min_support_score=threshold, index_collection=collection)


def _write_legacy(home: Path, threshold: float) -> Path:
    """A calibration as the code before collections wrote it: no `index_collection` field, at
    `calibration/<sha>/<critique>.json`."""
    path = home / "calibration" / SHA / "learned.json"
    path.parent.mkdir(parents=True)
    doc = _calibration(threshold, None).model_dump(mode="json", exclude={"index_collection"})
    path.write_text(json.dumps(doc, indent=2))
    return path


def test_an_existing_homes_calibration_still_serves_the_default_collection(tmp_path: Path):
    legacy = _write_legacy(tmp_path, 0.52)
    assert calibration_path(tmp_path, SHA, "learned") == legacy
    assert read_calibration(tmp_path, SHA, "learned", DEFAULT_COLLECTION) is not None
    default = CalibratedDefaults(tmp_path, lambda: SHA, lambda: "model-fp")
    assert default.filters("learned")["min_support_score"] == 0.52
    # Another collection does not take the default one's threshold.
    assert read_calibration(tmp_path, SHA, "learned", "docs") is None
    assert default.for_collection("docs").filters("learned") == {}


def test_each_collection_keeps_its_own_calibration(tmp_path: Path):
    save_calibration(tmp_path, _calibration(0.52, DEFAULT_COLLECTION))
    docs_path = save_calibration(tmp_path, _calibration(0.31, "docs"))
    # A collection may be called like a critique's file: its folder cannot collide with one.
    odd_path = save_calibration(tmp_path, _calibration(0.44, "learned.json"))
    assert docs_path == tmp_path / "calibration" / SHA / "collections" / "docs" / "learned.json"
    assert docs_path == calibration_path(tmp_path, SHA, "learned", "docs")
    assert odd_path.parent.name == "learned.json" and odd_path.is_file()
    thresholds = {
        c: CalibratedDefaults(tmp_path, lambda: SHA, lambda: "model-fp", c)
        .filters("learned")
        .get("min_support_score")
        for c in (DEFAULT_COLLECTION, "docs", "learned.json", "other")
    }
    assert thresholds == {
        DEFAULT_COLLECTION: 0.52,
        "docs": 0.31,
        "learned.json": 0.44,
        "other": None,
    }
    default = read_calibration(tmp_path, SHA, "learned")
    assert default is not None and default.index_collection == DEFAULT_COLLECTION
    docs = read_calibration(tmp_path, SHA, "learned", "docs")
    assert docs is not None and docs.min_support_score == 0.31


def test_a_calibration_moved_to_another_collections_folder_is_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    docs_path = save_calibration(tmp_path, _calibration(0.31, "docs"))
    moved = calibration_path(tmp_path, SHA, "learned", "wiki")
    moved.parent.mkdir(parents=True)
    shutil.copy(docs_path, moved)
    with caplog.at_level("WARNING"):
        assert read_calibration(tmp_path, SHA, "learned", "wiki") is None
    assert "another model file, critique or collection" in caplog.text


def _runtime(home: Path) -> LocalRuntime:
    """A runtime whose model file is a stand-in: nothing here loads it."""
    rt = LocalRuntime(Settings(home=home))
    model = home / "m.gguf"
    model.write_bytes(b"weights")
    rt.model.__dict__.update(path=model, fingerprint="model-fp")
    return rt


def test_the_answer_path_settles_a_request_with_its_collections_threshold(tmp_path: Path):
    from selfrag.infra.models.model_files import file_sha256

    with _runtime(tmp_path) as rt:
        sha = file_sha256(rt.model.path)
        save_calibration(tmp_path, _calibration(0.52, DEFAULT_COLLECTION, sha))
        save_calibration(tmp_path, _calibration(0.31, "docs", sha))
        asked = DecodingConfig(critique="learned")

        def settled(collection: str | None) -> float | None:
            path = rt.for_collection(collection).answer_path
            return path.settle(asked).min_support_score

        assert (settled(None), settled("docs"), settled("empty")) == (0.52, 0.31, 0.0)
        # A threshold the request sets wins over every collection's.
        mine = DecodingConfig(critique="learned", min_support_score=0.9)
        assert rt.for_collection("docs").answer_path.settle(mine).min_support_score == 0.9
        # A new calibration of one collection is read at its next answer, not the other's.
        save_calibration(tmp_path, _calibration(0.2, "docs", sha))
        rt.for_collection("docs").calibrated.forget()
        assert (settled(None), settled("docs")) == (0.52, 0.2)


def test_selfrag_calibrate_and_ask_on_another_collection_with_the_real_model(
    normans_api_home: Path, normans_squad: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from selfrag.cli import main

    home = tmp_path / "home"
    shutil.copytree(normans_api_home, home)
    flags = ["--home", str(home)]
    other = ["--collection", "normans2"]
    index = [*flags, "index", "--no-progress", "--no-calibrate", *other, str(normans_squad)]
    assert main(index) == 0
    assert main([*flags, "calibrate", "--no-progress", "--questions", "10", *other]) == 0
    assert "collection normans2" in capsys.readouterr().out
    [path] = (home / "calibration").glob("*/collections/normans2/learned.json")
    cal = SupportCalibration.model_validate_json(path.read_text())
    assert cal.index_collection == "normans2" and cal.questions == 10
    assert not list((home / "calibration").glob("*/learned.json"))  # the default one: none

    def status(*more: str) -> dict[str, Any]:
        assert main([*flags, "status", "--json", *more]) == 0
        return json.loads(capsys.readouterr().out)["support_threshold"]

    assert status(*other)["min_support_score"] == cal.min_support_score
    assert status()["calibrated"] is False
    ask = [*flags, "ask", "--json", "--mode", "always", *other, "Who led the Normans?"]
    assert main(ask) == 0
    response = json.loads(capsys.readouterr().out)
    assert response["config"]["min_support_score"] == cal.min_support_score


BAD_NUMBERS = ["NaN", "Infinity", "-Infinity", "-1.0", "1.5"]


def _corrupt(path: Path, field: str, value: str) -> None:
    """`field` (a dotted path) of the calibration at `path` set to the JSON text `value`, as a
    hand edit or a damaged disk leaves it (NaN and Infinity are what Python's json writes)."""
    doc = json.loads(path.read_text())
    *parents, last = field.split(".")
    target = doc
    for key in parents:
        target = target[key]
    target[last] = "@@"
    path.write_text(json.dumps(doc, indent=2).replace('"@@"', value))


@pytest.mark.parametrize("value", BAD_NUMBERS)
@pytest.mark.parametrize("field", ["min_support_score", "collections.squad.json.threshold"])
def test_a_corrupt_threshold_is_not_used_and_the_warning_names_the_file_and_what_to_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, value: str
):
    """A per-corpus threshold of NaN, ±Infinity or -1.0 was accepted: `status` still showed the
    old value, and every answer failed on a raw pydantic error about `support_threshold`."""
    own = {"squad.json": {"threshold": 0.4, "answerable_abstain": 0.05}}
    cal = support_calibration(SHA, index_collection=DEFAULT_COLLECTION, collections=own)
    path = save_calibration(tmp_path, cal)
    if field.startswith("collections."):
        doc = json.loads(path.read_text())
        doc["collections"]["squad.json"]["threshold"] = "@@"
        path.write_text(json.dumps(doc).replace('"@@"', value))
    else:
        _corrupt(path, field, value)
    with caplog.at_level("WARNING"):
        assert read_calibration(tmp_path, SHA, "learned") is None
        assert (
            CalibratedDefaults(tmp_path, lambda: SHA, lambda: "model-fp").filters("learned") == {}
        )
    assert str(path) in caplog.text and "selfrag calibrate" in caplog.text
    assert "threshold" in caplog.text or "min_support_score" in caplog.text
    assert "errors.pydantic.dev" not in caplog.text and "validation error" not in caplog.text


def test_a_corrupt_calibration_leaves_answers_unfiltered_not_failing(tmp_path: Path):
    with _runtime(tmp_path) as rt:
        from selfrag.infra.models.model_files import file_sha256

        own = {"squad.json": {"threshold": 0.4}}
        cal = _calibration(0.52, DEFAULT_COLLECTION, file_sha256(rt.model.path))
        path = save_calibration(tmp_path, cal.model_copy(update={"collections": own}))
        path.write_text(path.read_text().replace('"threshold": 0.4', '"threshold": NaN'))
        settled = rt.answer_path.settle(DecodingConfig(critique="learned"))
        assert settled.min_support_score == 0.0 and settled.min_support_score_by_corpus == {}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("auroc", "NaN"),
        ("auroc", "1.5"),
        ("answerable_abstain", "-0.1"),
        ("unanswerable_abstain", "Infinity"),
        ("auroc_by_trap.entity", "NaN"),
        ("answerable.p50", "NaN"),
    ],
)
def test_every_number_of_a_calibration_is_checked_on_load(field: str, value: str, tmp_path: Path):
    path = save_calibration(tmp_path, support_calibration(SHA, auroc_by_trap={"entity": 0.6}))
    _corrupt(path, field, value)
    with pytest.raises(ValidationError):
        SupportCalibration.model_validate(json.loads(path.read_text()))
