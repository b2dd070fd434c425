"""The settled config: the answer path turns a request into the config that is keyed and
decoded (critique source resolved, unset filters filled) once; the decoder, the batch driver
and its resume take it as it is."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gguf
import pytest

import selfrag.jobs.batch.batch_driver as batch_module
from selfrag.infra.calibration_files import save_calibration
from selfrag.infra.models.model_files import file_sha256
from selfrag.infra.settings_loader import load_settings
from selfrag.jobs.batch.batch_driver import run_batch
from selfrag.pipeline.critics import RESERVED_PIECES, CritiqueUnavailable, settle_filters
from selfrag.pipeline.critics.filters import unsettled_filters
from selfrag.pipeline.decoder import BeamDecoder
from selfrag.pipeline.protocols import Passage
from selfrag.runtime.answering import AnswerPath, KnownCritique
from selfrag.runtime.system import LocalRuntime
from selfrag.schemas.answer import AnswerRequest
from selfrag.schemas.calibration import SupportCalibration
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.errors import Unprocessable
from selfrag.schemas.settings import Settings
from tests.fakes import ListRetriever, ScriptedCritic

# --- settle_filters --------------------------------------------------------------------------


def test_unset_filters_take_the_calibrated_value_else_off() -> None:
    settled = settle_filters(DecodingConfig(), "learned", {"min_support_score": 0.52})
    assert settled.critique == "learned"
    assert settled.min_support_score == 0.52  # calibrated
    assert settled.min_relevance == 0.0  # nothing calibrated: off
    assert (settled.relevance_margin, settled.min_support) == (1.0, "none")  # off
    assert settle_filters(DecodingConfig(), "learned").min_support_score == 0.0
    plain = settle_filters(DecodingConfig(), "likelihood", {"min_support_score": 0.4})
    assert (plain.min_relevance, plain.relevance_margin, plain.min_support) == (0.0, 1.0, "none")
    assert plain.min_support_score == 0.4
    assert unsettled_filters(DecodingConfig()) and not unsettled_filters(settled)


def test_a_requests_own_filter_values_are_never_replaced() -> None:
    asked = DecodingConfig(min_relevance=0.1, relevance_margin=0.3, min_support_score=0.2)
    settled = settle_filters(asked, "learned", {"min_support_score": 0.52})
    assert (settled.min_relevance, settled.relevance_margin) == (0.1, 0.3)
    assert settled.min_support_score == 0.2 and settled.min_support == "none"
    # Settling is idempotent: a settled config settles to itself.
    assert settle_filters(settled, "learned", {"min_support_score": 0.9}) == settled


def test_the_answer_path_resolves_auto_and_keys_the_settled_config() -> None:
    path = AnswerPath(DecodingConfig(top_k=2))
    request = AnswerRequest(question="Who founded Normandy?")
    facts = KnownCritique("auto", "learned", {"min_support_score": 0.52})
    settled = path.config(request, facts)
    assert settled.critique == "learned" and settled.top_k == 2
    assert settled.min_support_score == 0.52
    # A new calibration is a new settled config, hence a new key: the model's identity alone
    # names the rest.
    recalibrated = path.config(
        request, KnownCritique("auto", "learned", {"min_support_score": 0.6})
    )
    assert path.key(request.question, settled, _identity()) != path.key(
        request.question, recalibrated, _identity()
    )
    assert path.settle(settled, facts) == settled


def test_a_source_the_model_cannot_run_is_unprocessable_when_settled() -> None:
    class NoNative:
        def critique_name(self, source: str) -> str:
            raise CritiqueUnavailable("critique 'native' needs a Self-RAG checkpoint")

        def calibrated_filters(self, name: str) -> dict[str, object]:
            return {}

    path = AnswerPath(DecodingConfig(), facts=NoNative())
    with pytest.raises(Unprocessable, match="Self-RAG checkpoint"):
        path.config(AnswerRequest(question="q", config={"critique": "native"}))


def test_the_decoder_refuses_an_unsettled_config_and_answers_with_the_settled_one() -> None:
    critic = ScriptedCritic(relevance_of={"p1": 0.9}, drafts={"p1": (" Rollo.", -1.0, "eos")})
    decoder = BeamDecoder(lambda _: critic, ListRetriever([Passage("p1", "Rollo.")]), "m")
    with pytest.raises(ValueError, match=r"config\.min_relevance is unset"):
        decoder.answer("Who?", DecodingConfig(mode="always"))
    settled = settle_filters(DecodingConfig(mode="always", min_relevance=0.2), "scripted")
    # The response carries the config as decoded: what batch resume keys an earlier answer by.
    assert decoder.answer("Who?", settled).config == settled


def _identity() -> Any:
    from selfrag.runtime.answering import CacheIdentity

    return CacheIdentity("index-v1", "model sha256:00")


# --- a local deployment's facts, from its model files -----------------------------------------


def tiny_model(path: Path, special: Sequence[str] = ()) -> Path:
    """A GGUF file with a vocabulary and no weights: enough for the header reads."""
    tokens = ["a", "b", "<|im_end|>", *special]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_token_list(tokens)
    writer.add_token_types([1, 1, 3, *[3] * len(special)])  # 3: control tokens
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _settings(home: Path, model_file: Path, **model: object) -> Settings:
    fields = {"path": str(model_file), "weights": "original", **model}
    return load_settings(environ={}, overrides={"home": str(home), "model": fields})


def test_auto_is_resolved_from_the_model_files_without_loading_the_engine(tmp_path: Path) -> None:
    plain = tiny_model(tmp_path / "plain.gguf")
    native = tiny_model(tmp_path / "native.gguf", RESERVED_PIECES)
    heads = tmp_path / "heads.json"
    heads.write_text("{}")  # only its presence counts here
    cases = [
        (_settings(tmp_path / "h1", plain), "likelihood"),
        (_settings(tmp_path / "h2", plain, heads=str(heads)), "learned"),
        (_settings(tmp_path / "h3", native, heads=str(heads)), "native"),
    ]
    for settings, expected in cases:
        with LocalRuntime(settings) as rag:
            assert rag.critique_name("auto") == expected
            assert rag.critique_name("prompted") == "prompted"
            assert "engine" not in rag.model.__dict__  # llama.cpp never loaded


# --- batch resume with a calibration present ---------------------------------------------------


class _Killed(Exception):
    pass


def _calibrate(settings: Settings, threshold: float) -> str:
    """Save a calibration of the settings' model as `selfrag calibrate` would; the source
    `auto` stands for."""
    with LocalRuntime(settings) as rag:
        name = rag.critique_name("auto")
        cal = SupportCalibration.model_validate(
            {
                "model_sha256": file_sha256(rag.model.path),
                "model_file": rag.model.path.name,
                "critique": name,
                "fingerprint": rag.model_fingerprint,
                "min_support_score": threshold,
                "max_answerable_abstain": 0.15,
                "answerable_abstain": 0.15,
                "unanswerable_abstain": 0.4,
                "auroc": 0.7,
                "questions": 40,
                "answerable": {"n": 40},
                "unanswerable": {"n": 40},
                "pruned": {"answerable": 0, "unanswerable": 0},
                "style": "wh",
                "seed": 0,
                "index_version": "v1",
                "passages": 100,
                "seconds": 1.0,
                "created": "2026-12-04T00:00:00+00:00",
            }
        )
    save_calibration(settings.home, cal)
    return name


def test_a_resumed_batch_with_a_calibration_decodes_no_duplicate_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings(tmp_path / "home", tiny_model(tmp_path / "m.gguf"))
    source = _calibrate(settings, 0.47)
    decoded: list[str] = []

    def fake_answers(settings: Settings, jobs: Sequence[Any], **_: Any) -> Iterator[Any]:
        """The actors' outcome: the decoder answers with the settled config it is handed."""
        for job in jobs:
            decoded.append(job.question)
            response = {"answer": f"answer to {job.question}", "critique": job.config.critique}
            response["config"] = job.config.model_dump(mode="json")
            yield job, {"status": "ok", "cache": "miss", "response": response}

    monkeypatch.setattr(batch_module, "stream_answers", fake_answers)
    monkeypatch.setattr(batch_module, "ensure_ray", lambda address: False)
    rows = [
        {"id": "q0", "question": "Who founded Normandy?"},
        {"id": "q1", "question": "Where is Normandy?"},
        {"id": "dup", "question": "WHO founded   Normandy?"},
    ]
    src, out = tmp_path / "q.jsonl", tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def kill_after_first(record: dict[str, Any]) -> None:
        raise _Killed

    with pytest.raises(_Killed):  # killed after q0's record, before its duplicate's
        run_batch(settings, src, out, progress=False, on_record=kill_after_first)
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in first] == ["q0"]
    config = first[0]["response"]["config"]
    # Settled before the key: the concrete source and the calibrated threshold.
    assert config["critique"] == source and config["min_support_score"] == 0.47

    summary = run_batch(settings, src, out, progress=False)
    assert decoded == ["Who founded Normandy?", "Where is Normandy?"]  # each once, in all
    assert (summary.answered, summary.duplicates, summary.skipped) == (2, 1, 1)
    by_id = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert by_id["dup"]["duplicate_of"] == "q0"
    assert by_id["dup"]["response"] == by_id["q0"]["response"]


# --- the streamed OpenAI route --------------------------------------------------------------------


def test_the_streamed_openai_route_hands_run_the_config_it_checked() -> None:
    """The route reads the beam of the config before streaming; the service is handed that
    config instead of working it out again."""
    import httpx

    from selfrag.actors.http.metrics import Metrics
    from selfrag.actors.http.routes import build_http_app, parse_api_keys
    from tests.http_fakes import FakeService, live_server

    service = FakeService()
    app = build_http_app(service, Metrics(), api_keys=parse_api_keys("sk-k"), retry_after_s=3)
    body = {"model": "selfrag", "messages": [{"role": "user", "content": "q"}], "stream": True}
    with (
        live_server(app) as base,
        httpx.stream(
            "POST",
            base + "/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer sk-k"},
        ) as r,
    ):
        assert r.status_code == 200
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    [given] = service.configs_given
    assert given is not None and given == service.config(service.seen[0])
