"""The support threshold calibrated on the served corpus without labels: synthetic pairs, the
threshold rule, storage per model file and critique, the resolve order, and
`selfrag index` / `selfrag calibrate` running it."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from selfrag.infra.calibration_files import (
    calibration_path,
    read_calibration,
    save_calibration,
)
from selfrag.pipeline.critics import Branch, LabelProbs
from selfrag.pipeline.critics.filters import settle_filters
from selfrag.pipeline.decoder import BeamDecoder
from selfrag.pipeline.evaluation.qa_metrics import contains_answer
from selfrag.pipeline.learning.synthetic_qa import (
    SyntheticQuestion,
    ThresholdChoice,
    choose_threshold,
    entity_pool,
    lowest_threshold,
    make_question,
    perturbed_questions,
    sample_by_collection,
    synthetic_pairs,
)
from selfrag.pipeline.protocols import Generation, Passage
from selfrag.runtime import calibrated as calibrated_module
from selfrag.runtime.answering import AnswerPath, KnownCritique
from selfrag.runtime.calibrated import CalibratedDefaults
from selfrag.schemas.answer import AnswerResponse
from selfrag.schemas.calibration import SupportCalibration
from selfrag.schemas.decoding import DecodingConfig
from selfrag.schemas.settings import DEFAULT_COLLECTION
from tests.fakes import ListRetriever, ScriptedCritic, echo_or_loop
from tests.fakes import support_calibration as _calibration

TEXTS = [
    "The duchy was founded when the Norse raiders under their leader Rollo, settled in the "
    "north. The treaty with the king was signed in 911 after a long siege of the city.",
    "The cathedral was consecrated by Archbishop Lanfranc, in the presence of the court. "
    "Its nave was rebuilt in 1180 after a fire destroyed the wooden roof completely.",
    "The abbey owned land in many parishes of the region and paid taxes to the crown. "
    "The monks kept bees and sold the wax for candles used during 12 weeks of Lent.",
    "The river flows through the valley and reaches the sea near the old harbour town. "
    "Fishermen landed their catch there until the harbour silted up in 1750 for good.",
]


def _passages() -> list[Passage]:
    return [Passage(f"p{i}", text, f"Title {i}") for i, text in enumerate(TEXTS)]


def _search(passages: list[Passage]):  # type: ignore[no-untyped-def]
    def search(query: str, k: int) -> list[Passage]:
        words = set(query.lower().split())
        ranked = sorted(passages, key=lambda p: -len(words & set(p.text.lower().split())))
        return ranked[:k]

    return search


# --- pairs ------------------------------------------------------------------------------------


def test_questions_ask_for_an_entity_the_question_no_longer_holds() -> None:
    sentence = "They settled in the north under their leader Rollo, who signed a treaty in 1066."
    seen = set()
    for seed in range(20):
        made = make_question(sentence, random.Random(seed), "wh")
        assert made is not None
        question, answer, kind = made
        assert answer in sentence and not contains_answer(question, [answer])
        assert question.endswith("?")
        seen.add((answer, kind))
    assert seen == {("Rollo", "name"), ("1066", "year")}
    cloze = make_question(sentence, random.Random(0), "cloze")
    assert cloze is not None and "___" in cloze[0]
    # No year, count or whole name to ask for: no question.
    assert (
        make_question("the river flows slowly through the quiet green valley.", random.Random(0))
        is None
    )


def test_a_table_row_or_a_log_line_makes_no_question_and_prose_with_code_does() -> None:
    """A technical corpus's tables and logs hold years and counts too, but no one asks about
    "0.389 / 0.279 | 0.757 | in what year"; prose that names an identifier is still asked."""
    for rng_seed in range(10):
        for line in (
            "| Normans | 0.389 / 0.279 | 0.757 | 1473 runs | 0.2142 / 0.1473 | 2019 |",
            "duration_s=604 sent=2606 succeeded=949 rejected=12 started=2026 p50_ms=1457",
            "0.635 13.13 16.36 4.1 1999 0.294 0.311 217.3 88.0 0.727 0.979",
        ):
            assert make_question(line, random.Random(rng_seed)) is None
    prose = "The server `selfrag serve` answered 12 requests after the restart of 2019."
    assert make_question(prose, random.Random(0)) is not None


def test_pairs_answerable_with_their_passage_unanswerable_with_a_neighbour_or_a_trap() -> None:
    passages = _passages()
    pairs = synthetic_pairs(passages, _search(passages), 10, random.Random(3))
    answerable = [p for p in pairs if p.answerable]
    unanswerable = [p for p in pairs if not p.answerable]
    assert len(answerable) == len(passages) and unanswerable
    for pair in answerable:
        assert pair.passage is pair.question.passage and pair.trap is None
        assert contains_answer(pair.passage.text, [pair.question.answer])
    neighbours = [p for p in unanswerable if p.trap == "neighbour"]
    traps = [p for p in unanswerable if p.trap != "neighbour"]
    assert neighbours and traps
    for pair in neighbours:
        assert pair.passage.id != pair.question.passage.id
        assert not contains_answer(pair.passage.text, [pair.question.answer])
    written = {p.question.question for p in answerable}
    for pair in traps:
        # A perturbed question on the question's own passage.
        assert pair.passage is pair.question.passage
        assert pair.question.question not in written
    again = synthetic_pairs(passages, _search(passages), 10, random.Random(3))
    assert [(p.question.question, p.passage.id) for p in again] == [
        (p.question.question, p.passage.id) for p in pairs
    ]
    other = synthetic_pairs(passages, _search(passages), 10, random.Random(4))
    assert [p.question.question for p in other] != [p.question.question for p in pairs]


def test_sampling_is_seeded_and_bounded_per_collection() -> None:
    stream = [Passage(str(i), "x", metadata={"collection": "wiki.jsonl"}) for i in range(100)]
    stream += [Passage(f"s{i}", "x", metadata={"collection": "squad.json"}) for i in range(5)]
    stream += [Passage(f"old{i}", "x") for i in range(30)]  # indexed before collections
    first = sample_by_collection(iter(stream), 10, random.Random(1))
    assert sorted(first) == ["", "squad.json", "wiki.jsonl"]
    assert len(first["wiki.jsonl"]) == 10 and len({p.id for p in first["wiki.jsonl"]}) == 10
    assert len(first["squad.json"]) == 5  # a small collection is not drowned by a large one
    assert all(p.id.startswith("old") for p in first[""]) and len(first[""]) == 10
    again = sample_by_collection(iter(stream), 10, random.Random(1))
    assert {c: [p.id for p in ps] for c, ps in again.items()} == {
        c: [p.id for p in ps] for c, ps in first.items()
    }


def test_the_lowest_collection_threshold_is_kept() -> None:
    choices = {
        "wiki.jsonl": ThresholdChoice(0.51, 0.15, 0.2),
        "squad.json": ThresholdChoice(0.39, 0.1, 0.3),
    }
    assert lowest_threshold(choices) == ("squad.json", choices["squad.json"])
    with pytest.raises(ValueError):
        lowest_threshold({})


# --- the threshold rule -----------------------------------------------------------------------


def test_threshold_abstains_on_at_most_the_allowed_share_of_answerable_pairs() -> None:
    answerable = [0.50 + i / 100 for i in range(20)]  # 0.50 .. 0.69
    unanswerable = [0.40 + i / 100 for i in range(20)]  # 0.40 .. 0.59
    choice = choose_threshold(answerable, unanswerable, 0.15)
    assert choice.threshold == pytest.approx(0.53)  # 3 of 20 answerable below it
    assert choice.answerable_abstain == pytest.approx(0.15)
    assert choice.unanswerable_abstain == pytest.approx(13 / 20)
    assert choose_threshold(answerable, [], 0.0).threshold == pytest.approx(0.50)
    assert choose_threshold(answerable, [], 0.0).unanswerable_abstain is None
    with pytest.raises(ValueError, match="no answerable"):
        choose_threshold([], unanswerable, 0.15)


# --- storage ----------------------------------------------------------------------------------


def test_a_calibration_is_kept_per_model_file_and_critique(tmp_path: Path) -> None:
    path = save_calibration(tmp_path, _calibration())
    assert path == calibration_path(tmp_path, "a" * 64, "learned") and path.is_file()
    assert read_calibration(tmp_path, "a" * 64, "learned") == _calibration()
    assert read_calibration(tmp_path, "b" * 64, "learned") is None  # another model file
    assert read_calibration(tmp_path, "a" * 64, "likelihood") is None  # another source
    defaults = CalibratedDefaults(tmp_path, lambda: "a" * 64, lambda: "model-fp")
    assert defaults.filters("learned") == {
        "min_support_score": 0.52,
        "min_support_score_by_corpus": {},
    }
    other_model = CalibratedDefaults(tmp_path, lambda: "b" * 64, lambda: "model-fp")
    assert other_model.filters("likelihood") == {}
    # Same file, other heads (the fingerprint differs): not used.
    retrained = CalibratedDefaults(tmp_path, lambda: "a" * 64, lambda: "model-fp heads:new")
    assert retrained.filters("learned") == {}


def test_an_unreadable_calibration_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = calibration_path(tmp_path, "a" * 64, "learned")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert read_calibration(tmp_path, "a" * 64, "learned") is None
    assert "unreadable calibration" in caplog.text


# --- resolve order ----------------------------------------------------------------------------


def test_request_value_before_calibrated_before_off() -> None:
    calibrated = {"min_support_score": 0.52}
    assert settle_filters(DecodingConfig(), "learned", calibrated).min_support_score == 0.52
    assert settle_filters(DecodingConfig(), "learned").min_support_score == 0.0
    asked = DecodingConfig(min_support_score=0.1)
    assert settle_filters(asked, "learned", calibrated).min_support_score == 0.1
    # The calibration fits the threshold only; the other filters stay off.
    assert settle_filters(DecodingConfig(), "learned", calibrated).min_relevance == 0.0
    # A source without a constant takes its calibrated threshold too.
    assert settle_filters(DecodingConfig(), "likelihood", calibrated).min_support_score == 0.52


def test_a_missing_calibration_warns_once_per_source(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calibrated_module, "_warned", set())
    defaults = CalibratedDefaults(tmp_path, lambda: "c" * 64, lambda: "fp")
    with caplog.at_level(logging.WARNING):
        assert defaults.filters("learned") == {}
        assert defaults.filters("learned") == {}
        assert defaults.filters("likelihood") == {}
    assert caplog.text.count("no support threshold was calibrated") == 2


def _answer(
    critic: ScriptedCritic, calibrated: dict[str, object], config: DecodingConfig
) -> AnswerResponse:
    """`config` settled by the answer path with `calibrated` for the critic, then decoded."""
    retriever = ListRetriever([Passage("p1", "Rollo led the Normans.", "Normans")])
    facts = KnownCritique(config.critique, critic.name, calibrated)
    settled = AnswerPath(DecodingConfig()).settle(config, facts)
    return BeamDecoder(lambda _: critic, retriever, "fake").answer("Who?", settled)


def test_the_decoder_abstains_by_the_calibrated_threshold_unless_the_request_sets_one() -> None:
    critic = ScriptedCritic(
        name="learned",
        relevance_of={"p1": 0.9},
        drafts={"p1": (" Rollo.", -1.0, "eos")},
        support_of={"p1": {"full": 0.45, "partial": 0.0, "none": 0.55}},  # s_sup 0.45
    )
    config = DecodingConfig(mode="always", top_k=1)
    # No threshold keeps the answer; a calibrated 0.52 abstains; a request's 0.4 rules.
    assert not _answer(critic, {}, config).abstained
    calibrated = _answer(critic, {"min_support_score": 0.52}, config)
    assert calibrated.abstained and calibrated.config.min_support_score == 0.52
    assert calibrated.config.critique == "learned"  # `auto`, settled to the source it ran
    asked = config.model_copy(update={"min_support_score": 0.4})
    assert not _answer(critic, {"min_support_score": 0.52}, asked).abstained


# --- the job, on scripted critique ------------------------------------------------------------


@dataclass
class OverlapCritic(ScriptedCritic):
    """s_sup = the share of the question's words found in the passage: high for the passage a
    question was written from, lower for a neighbour."""

    asked: list[Branch] = field(default_factory=list)

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        out = []
        for b in branches:
            self.asked.append(b)
            words = set(b.question.lower().rstrip("?").split())
            assert b.passage is not None
            share = len(words & set(b.passage.text.lower().split())) / max(len(words), 1)
            out.append(LabelProbs({"full": share, "partial": 0.0, "none": 1 - share}, 5))
        return out


class FakeStore:
    def __init__(self, passages: list[Passage]) -> None:
        self._passages = passages
        self.search = _search(passages)

    def passages(self) -> list[Passage]:
        return list(self._passages)

    def similarities(self, pairs: list[tuple[str, Passage]]) -> list[float]:
        # Neutral: the thresholds these tests check are s_sup's own.
        return [1.0] * len(pairs)

    def count(self) -> int:
        return len(self._passages)

    def index_version(self) -> str:
        return "v7"


def _fake_rag(
    tmp_path: Path,
    passages: list[Passage],
    critic: ScriptedCritic,
    collection: str = DEFAULT_COLLECTION,
) -> Any:
    """A runtime on the index `collection` of the home `tmp_path`, over fakes."""
    from selfrag.infra.models.model_files import file_sha256

    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    rag = SimpleNamespace(
        settings=SimpleNamespace(
            home=tmp_path,
            decoding=DecodingConfig(),
            model=SimpleNamespace(backend="llama_cpp"),
            retrieval=SimpleNamespace(collection=collection),
        ),
        store=FakeStore(passages),
        critic=lambda source: critic,
        critique_name=lambda source: critic.name,
        model=SimpleNamespace(path=model),
        model_fingerprint="fake-fp",
    )
    rag.calibrated = CalibratedDefaults(
        tmp_path, lambda: file_sha256(model), lambda: "fake-fp", collection
    )
    rag.held = []  # the sources a calibration holds first use off for, while it runs
    rag.settled_holding = []  # what was held each time the reads' config was settled

    @contextmanager
    def calibrating(name: str) -> Iterator[None]:
        rag.held.append(name)
        yield
        rag.held.remove(name)

    def calibrated_filters(name: str) -> dict[str, object]:
        rag.settled_holding.append(list(rag.held))
        return {}

    rag.calibrating = calibrating
    facts = SimpleNamespace(
        critique_name=lambda source: source, calibrated_filters=calibrated_filters
    )
    rag.answer_path = AnswerPath(rag.settings.decoding, facts=facts)
    return rag


def _four_copies() -> list[Passage]:
    """Each of TEXTS four times, each copy's "the" spelled apart (distinct passages)."""
    return [
        Passage(f"p{i}-{j}", text.replace("the", f"the{j}" if j else "the"), f"T{i}")
        for j in range(4)
        for i, text in enumerate(TEXTS)
    ]


def test_the_job_reads_each_pair_as_a_first_step_branch_and_saves_the_threshold(
    tmp_path: Path,
) -> None:
    from selfrag.infra.models.model_files import file_sha256
    from selfrag.jobs.support_calibration import CorpusCalibrationPlan, calibrate_support

    critic = OverlapCritic(name="learned")
    rag = _fake_rag(tmp_path, _four_copies(), critic)
    cal, path = calibrate_support(rag, CorpusCalibrationPlan(questions=12), progress=False)
    assert path == calibration_path(tmp_path, file_sha256(rag.model.path), "learned")
    assert json.loads(path.read_text())["min_support_score"] == cal.min_support_score
    assert cal.critique == "learned" and cal.fingerprint == "fake-fp"
    assert cal.questions == 12 and cal.answerable["n"] == 12
    # Its reads were settled with first use held off: no second calibration from inside.
    assert rag.settled_holding == [["learned"]] and rag.held == []
    assert cal.answerable_abstain <= 0.05
    assert cal.corpus_passages == {"": 16}
    # Every read is a first-step branch: the question, nothing written yet, one passage.
    assert critic.asked and all(b.prefix == "" and b.passage is not None for b in critic.asked)
    # Only the pairs that set the threshold are read: each question with its own passage.
    assert len(critic.asked) == 12
    assert all(b.passage is not None and b.passage.id in _own(b.question) for b in critic.asked)
    assert cal.unanswerable == {"n": 0} and cal.auroc is None and cal.unanswerable_abstain is None
    # Answers through this system now take it.
    assert rag.calibrated.filters("learned") == {
        "min_support_score": cal.min_support_score,
        "min_support_score_by_corpus": {"": cal.min_support_score},  # one, unnamed
    }


def _own(question: str) -> set[str]:
    """The passages (of _four_copies) a synthetic question may have been written from: those
    holding all its words but the wh-phrase."""
    words = set(question.lower().rstrip("?").split()) - {"who", "what", "year", "how", "many"}
    return {p.id for p in _four_copies() if words <= set(p.text.lower().replace(".", "").split())}


def test_the_report_reads_the_unanswerable_pairs_too_and_the_threshold_stays(
    tmp_path: Path,
) -> None:
    from selfrag.jobs.support_calibration import CorpusCalibrationPlan, calibrate_support

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain_critic, report_critic = OverlapCritic(name="learned"), OverlapCritic(name="learned")
    plain, _ = calibrate_support(
        _fake_rag(tmp_path / "a", _four_copies(), plain_critic),
        CorpusCalibrationPlan(questions=12),
        progress=False,
    )
    report, _ = calibrate_support(
        _fake_rag(tmp_path / "b", _four_copies(), report_critic),
        CorpusCalibrationPlan(questions=12, report=True),
        progress=False,
    )
    # The same seed asks the same questions; the report reads their traps as well.
    asked = [(b.question, b.passage.id) for b in plain_critic.asked if b.passage is not None]
    assert set(asked) < {(b.question, b.passage.id) for b in report_critic.asked if b.passage}
    assert len(report_critic.asked) > 2 * len(plain_critic.asked)
    assert report.min_support_score == plain.min_support_score
    assert report.answerable == plain.answerable
    assert report.unanswerable["n"] > 0 and report.auroc is not None and report.auroc > 0.5
    assert report.unanswerable_abstain is not None


def test_the_calibration_says_how_long_it_will_take_after_its_first_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from selfrag.jobs.support_calibration import CorpusCalibrationPlan, draw_pairs, score_pairs

    rag = _fake_rag(tmp_path, _four_copies(), OverlapCritic(name="learned"))
    plan = CorpusCalibrationPlan(questions=12, batch=4)
    pairs = [p for p in draw_pairs(rag, plan) if p.answerable]
    ticks = iter([0.0, 0.0, 6.0, 12.0])  # the first batch "takes" 6 s
    score_pairs(rag, "learned", pairs, plan, progress=False, clock=lambda: next(ticks))
    err = capsys.readouterr().err
    assert err.count("calibrate:") == 1  # once, after the first batch
    assert "12 pairs, about 18 s in all (4 read in 6.0 s)" in err


def test_the_calibration_says_before_reading_how_long_at_the_last_ones_pace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from selfrag.jobs.support_calibration import CorpusCalibrationPlan, calibrate_support

    rag = _fake_rag(tmp_path, _four_copies(), OverlapCritic(name="learned"))
    plan = CorpusCalibrationPlan(questions=12)
    calibrate_support(rag, plan)
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("calibrate: reading 12 question/passage pairs")
    assert "follows the first batch" in first  # nothing to go by yet
    path = calibrate_support(rag, plan)[1]
    saved = json.loads(path.read_text())
    saved["seconds"] = 60.0  # the last calibration "took" 60 s for its 12 pairs
    path.write_text(json.dumps(saved))
    rag.calibrated.forget()
    capsys.readouterr()
    calibrate_support(rag, CorpusCalibrationPlan(questions=12, report=True))
    announced = capsys.readouterr().err.splitlines()[0]
    assert "at the last calibration's pace (60 s for 12)" in announced
    pairs = int(announced.split("reading ")[1].split()[0])
    assert pairs > 12 and f"about {5 * pairs} s" in announced  # the traps too, 5 s a pair


def test_the_threshold_is_fitted_on_s_sup_weighed_by_the_pairs_similarity(
    tmp_path: Path,
) -> None:
    from selfrag.jobs.support_calibration import CorpusCalibrationPlan, calibrate_support

    plan = CorpusCalibrationPlan(questions=12)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    neutral, _ = calibrate_support(
        _fake_rag(tmp_path / "a", _four_copies(), OverlapCritic(name="learned")),
        plan,
        progress=False,
    )
    far = _fake_rag(tmp_path / "b", _four_copies(), OverlapCritic(name="learned"))
    far.store.similarities = lambda pairs: [0.5] * len(pairs)
    halved, _ = calibrate_support(far, plan, progress=False)
    # The decoder compares s_sup x similarity with the threshold: so does the calibration.
    assert halved.min_support_score == pytest.approx(neutral.min_support_score / 2, abs=1e-6)
    assert halved.answerable["p50"] == pytest.approx(neutral.answerable["p50"] / 2, abs=1e-4)


def test_the_time_limit_stops_reading_at_a_batch_and_keeps_what_was_read(
    tmp_path: Path,
) -> None:
    from selfrag.jobs.support_calibration import CorpusCalibrationPlan, draw_pairs, score_pairs

    rag = _fake_rag(tmp_path, _four_copies(), OverlapCritic(name="learned"))
    plan = CorpusCalibrationPlan(questions=12, batch=4, time_limit_s=250.0)
    pairs = draw_pairs(rag, plan)
    assert len(pairs) > 12
    ticks = iter(range(0, 10_000, 100))  # each batch "takes" 100 s
    read = score_pairs(rag, "learned", pairs, plan, progress=False, clock=lambda: next(ticks))
    # Batches start at 100, 200 and 300 s past the start: the third is past 250 s.
    assert [s.pair for s in read] == pairs[:8]
    # The default limit is a guard, far above the few minutes the default model takes.
    assert CorpusCalibrationPlan().time_limit_s >= 900


def test_selfrag_calibrate_help_states_the_plans_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The CLI states the plan's defaults as text (importing the job to read them would slow
    every command's start): a default changed in one place only is caught here."""
    from selfrag.cli.parser import build_parser
    from selfrag.jobs.support_calibration import CorpusCalibrationPlan

    with pytest.raises(SystemExit):
        build_parser().parse_args(["calibrate", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    plan = CorpusCalibrationPlan()
    for flag, value in (
        ("--questions", plan.questions),
        ("--seed", plan.seed),
        ("--max-answerable-abstain", plan.max_answerable_abstain),
        ("--time-limit", plan.time_limit_s),
    ):
        assert f"(default {value:g})" in shown, flag


def test_the_job_saves_under_the_index_collection_it_ran_on(tmp_path: Path) -> None:
    from selfrag.infra.models.model_files import file_sha256
    from selfrag.jobs.support_calibration import CorpusCalibrationPlan, calibrate_support

    rag = _fake_rag(tmp_path, _four_copies(), OverlapCritic(name="learned"), collection="docs")
    cal, path = calibrate_support(rag, CorpusCalibrationPlan(questions=12), progress=False)
    sha = file_sha256(rag.model.path)
    assert cal.index_collection == "docs"
    assert path == calibration_path(tmp_path, sha, "learned", "docs")
    assert read_calibration(tmp_path, sha, "learned") is None  # the default collection's
    assert rag.calibrated.filters("learned") == {
        "min_support_score": cal.min_support_score,
        "min_support_score_by_corpus": {"": cal.min_support_score},  # one, unnamed
    }


def _collection_copies(collection: str, copies: int) -> list[Passage]:
    """`copies` of each of TEXTS in `collection`, each copy's "the" spelled apart."""
    return [
        Passage(
            f"{collection}{i}-{j}",
            text.replace("the", f"the{j}" if j else "the"),
            f"T{i}",
            metadata={"collection": collection},
        )
        for j in range(copies)
        for i, text in enumerate(TEXTS)
    ]


@dataclass
class ScaledCritic(OverlapCritic):
    """OverlapCritic with s_sup scaled per collection of the question's own passage: two
    corpora whose s_sup scales differ, as the Wikipedia and SQuAD passages do."""

    scale: dict[str, float] = field(default_factory=dict)

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        out = []
        for b, probs in zip(branches, super().support(branches, drafts), strict=True):
            assert b.passage is not None
            s = probs.probs["full"] * self.scale[b.passage.metadata["collection"]]
            out.append(LabelProbs({"full": s, "partial": 0.0, "none": 1 - s}, 5))
        return out


def test_each_collection_gets_its_own_threshold_and_the_lowest_holds_others(
    tmp_path: Path,
) -> None:
    from selfrag.jobs.support_calibration import CorpusCalibrationPlan, calibrate_support

    passages = _collection_copies("low", 4) + _collection_copies("high", 4)
    critic = ScaledCritic(name="learned", scale={"low": 0.5, "high": 1.0})
    rag = _fake_rag(tmp_path, passages, critic)
    cal, _ = calibrate_support(rag, CorpusCalibrationPlan(questions=24), progress=False)
    assert set(cal.collections) == {"low", "high"}
    assert cal.threshold_collection == "low"
    assert cal.min_support_score == cal.collections["low"]["threshold"]
    assert cal.collections["low"]["threshold"] < cal.collections["high"]["threshold"]
    # Each collection's own answerable pairs abstain within the budget at its own threshold,
    # and so do all of them as answers apply the thresholds.
    assert cal.collections["low"]["answerable_abstain"] <= 0.05
    assert cal.collections["high"]["answerable_abstain"] <= 0.05
    assert cal.answerable_abstain <= 0.05
    assert cal.corpus_thresholds() == {
        "low": cal.collections["low"]["threshold"],
        "high": cal.collections["high"]["threshold"],
    }
    # Answers that leave min_support_score unset hold each collection to its own.
    filters = rag.calibrated.filters("learned")
    assert filters["min_support_score_by_corpus"] == cal.corpus_thresholds()
    assert filters["min_support_score"] == cal.min_support_score
    # Questions are drawn from both, however many passages each has.
    drawn = {b.passage.metadata["collection"] for b in critic.asked}
    assert drawn == {"low", "high"}


def test_a_small_collection_leaves_its_questions_to_the_others(tmp_path: Path) -> None:
    """A README beside a folder of docs: the README gives what it can, and the questions it
    cannot give are drawn from the folder, so the folder's own threshold is read from the whole
    sample and not from a share of it."""
    from selfrag.jobs.support_calibration import (
        MIN_QUESTIONS_PER_COLLECTION,
        CorpusCalibrationPlan,
        draw_pairs,
    )

    small = _collection_copies("README.md", 1)[:2]
    rag = _fake_rag(tmp_path, _collection_copies("docs", 12) + small, OverlapCritic())
    plan = CorpusCalibrationPlan(questions=40)
    pairs = draw_pairs(rag, plan)
    asked = [p.question.passage.metadata["collection"] for p in pairs if p.answerable]
    assert asked.count("README.md") == 2 and len(asked) == 40
    # The collections take turns while both have questions: a time limit cuts both alike.
    assert asked[:4] == ["README.md", "docs", "README.md", "docs"]
    # Several collections with room: each gets at least its minimum, past `questions`.
    (tmp_path / "b").mkdir()
    rag = _fake_rag(
        tmp_path / "b", _collection_copies("a", 8) + _collection_copies("b", 8), OverlapCritic()
    )
    asked = [
        p.question.passage.metadata["collection"]
        for p in draw_pairs(rag, CorpusCalibrationPlan(questions=30))
        if p.answerable
    ]
    assert asked.count("a") == asked.count("b") == MIN_QUESTIONS_PER_COLLECTION


def test_too_small_a_corpus_calibrates_nothing_before_any_model_work(tmp_path: Path) -> None:
    from selfrag.jobs.support_calibration import CorpusCalibrationPlan, run_calibration

    critic = OverlapCritic(name="learned")
    rag = _fake_rag(tmp_path, _passages()[:2], critic)
    done, message = run_calibration(rag, CorpusCalibrationPlan(), progress=False)
    assert not done and "not calibrated" in message and critic.calls == []
    assert not (tmp_path / "calibration").exists()


# --- when to fit again -----------------------------------------------------------------------

FITTED = "2026-12-07T10:00:00+00:00"


def _indexed(collection: str, n: int, at: str, start: int = 0) -> list[Passage]:
    return [
        Passage(f"{collection}{i}", "text", metadata={"collection": collection, "indexed_at": at})
        for i in range(start, start + n)
    ]


def _fitted_on(sizes: dict[str, int], own: tuple[str, ...]) -> SupportCalibration:
    collections = {c: {"threshold": 0.2, "answerable_abstain": 0.05} for c in own}
    return _calibration(created=FITTED, corpus_passages=sizes, collections=collections)


def test_a_change_under_the_share_keeps_the_thresholds_and_says_what_changed() -> None:
    from selfrag.jobs.support_calibration import RECALIBRATE_SHARE, recalibration_due

    cal = _fitted_on({"wiki.jsonl": 1000, "squad.json": 97}, own=("wiki.jsonl", "squad.json"))
    before = "2026-12-07T09:59:00+00:00"
    after = "2026-12-07T10:05:00+00:00"
    old = _indexed("wiki.jsonl", 1000, before) + _indexed("squad.json", 97, before)
    # One new record in a file of its own: too small for a threshold of its own.
    due, what = recalibration_due(cal, [*old, *_indexed("new.jsonl", 1, after)])
    assert not due and "new.jsonl" in what and "held to the lowest" in what
    # 5% of the wiki file rewritten: kept; one passage more than that: fitted again.
    share = int(RECALIBRATE_SHARE * 1000)
    rewritten = _indexed("wiki.jsonl", 1000 - share, before) + _indexed(
        "wiki.jsonl", share, after, start=1000 - share
    )
    due, what = recalibration_due(cal, [*rewritten, *_indexed("squad.json", 97, before)])
    assert not due and "wiki.jsonl changed by 5.0% (1000 passages then, 1000 now)" in what
    grown = [*rewritten, *_indexed("wiki.jsonl", 1, after, start=1000)]
    due, what = recalibration_due(cal, [*grown, *_indexed("squad.json", 97, before)])
    assert due and "wiki.jsonl changed by 5.1% (1000 passages then, 1001 now)" in what
    # Passages gone count as changed; a file gone entirely, all of it.
    due, what = recalibration_due(cal, _indexed("wiki.jsonl", 1000, before))
    assert due and "squad.json changed by 100.0% (97 passages then, 0 now)" in what
    # Nothing indexed since: kept.
    assert recalibration_due(cal, old) == (False, "no passage changed")


def test_a_new_file_large_enough_for_its_own_threshold_fits_again() -> None:
    from selfrag.jobs.support_calibration import MIN_ANSWERABLE, recalibration_due

    cal = _fitted_on({"wiki.jsonl": 1000}, own=("wiki.jsonl",))
    old = _indexed("wiki.jsonl", 1000, "2026-12-07T09:59:00+00:00")
    later = "2026-12-07T10:01:00+00:00"
    assert not recalibration_due(cal, [*old, *_indexed("docs", MIN_ANSWERABLE - 1, later)])[0]
    due, what = recalibration_due(cal, [*old, *_indexed("docs", MIN_ANSWERABLE, later)])
    assert due and what == f"docs is new, with {MIN_ANSWERABLE} passages"
    # A calibration written before the sizes were recorded: any change fits again.
    assert recalibration_due(_calibration(created=FITTED), old)[0]
    # A passage without a readable time counts as changed.
    unknown = [Passage("x", "t", metadata={"collection": "wiki.jsonl", "indexed_at": "?"})]
    assert recalibration_due(cal, old[:-60] + unknown * 60)[0]


def test_indexing_keeps_the_threshold_when_the_change_is_small_and_says_so(
    tmp_path: Path, recorded_calibrations: list[Any]
) -> None:
    from selfrag.jobs.support_calibration import (
        CorpusCalibrationPlan,
        calibrate_after_indexing,
        calibrate_support,
    )

    passages = _collection_copies("wiki.jsonl", 4)
    rag = _fake_rag(tmp_path, passages, OverlapCritic(name="learned"))
    rag.critique_name = lambda source: "learned"
    plan = CorpusCalibrationPlan(questions=12)
    assert calibrate_after_indexing(rag, True, plan, progress=False) == (
        "support threshold: recorded"  # none yet: fitted
    )
    cal, _ = calibrate_support(rag, plan, progress=False)
    assert cal.corpus_passages == {"wiki.jsonl": 16}
    assert calibrate_after_indexing(rag, False, plan, progress=False).startswith(
        "support threshold: kept (the index did not change)"
    )
    # A one-passage file indexed since (its passages stamped after the calibration).
    late = "2999-01-01T00:00:00+00:00"
    for p in passages:
        p.metadata["indexed_at"] = "2000-01-01T00:00:00+00:00"
    rag.store._passages.append(
        Passage("n0", "new", metadata={"collection": "new.jsonl", "indexed_at": late})
    )
    message = calibrate_after_indexing(rag, True, plan, progress=False)
    assert message.startswith("support threshold: kept, the index changed too little")
    assert "new.jsonl" in message and len(recorded_calibrations) == 1
    # A quarter of the file rewritten: fitted again.
    for p in passages[:4]:
        p.metadata["indexed_at"] = late
    assert calibrate_after_indexing(rag, True, plan, progress=False) == (
        "support threshold: recorded"
    )
    assert len(recorded_calibrations) == 2


# --- the commands -----------------------------------------------------------------------------


@pytest.fixture
def recorded_calibrations(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    from selfrag.jobs import support_calibration

    calls: list[Any] = []

    def run(rag: Any, plan: Any, *, progress: bool = True) -> tuple[bool, str]:
        calls.append((rag, plan))
        return True, "support threshold: recorded"

    monkeypatch.setattr(support_calibration, "run_calibration", run)
    return calls


def test_selfrag_index_calibrates_at_its_end_unless_told_not_to(
    llama_model: Path,
    tmp_path: Path,
    recorded_calibrations: list[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from selfrag.cli import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS))
    )
    home = tmp_path / "home"
    assert main(["--home", str(home), "index", "--no-progress", str(corpus)]) == 0
    assert len(recorded_calibrations) == 1
    assert "support threshold: recorded" in capsys.readouterr().out
    assert main(["--home", str(home), "index", "--no-progress", "--no-calibrate", str(corpus)]) == 0
    assert len(recorded_calibrations) == 1
    assert "support threshold" not in capsys.readouterr().out
    # Another collection's index calibrates that collection.
    docs = ["--home", str(home), "index", "--no-progress", "--collection", "docs", str(corpus)]
    assert main(docs) == 0
    [_, (rag, _)] = recorded_calibrations
    assert rag.settings.retrieval.collection == "docs"


def test_selfrag_index_on_a_fresh_home_calibrates_once_and_quietly(
    llama_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It calibrated twice, and warned midway that there was no threshold: the calibration's
    own settling of its reads started a first-use calibration of the same source. The one
    calibration reads the answerable pairs alone, and an answer applies its threshold."""
    from selfrag.cli import main
    from selfrag.jobs import support_calibration

    calls: list[str | None] = []
    calibrate = support_calibration.calibrate_support

    def counted(rag: Any, plan: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("critique"))
        return calibrate(rag, plan, **kwargs)

    monkeypatch.setattr(support_calibration, "calibrate_support", counted)
    # The suite turns first use off; a user's `selfrag index` has it on.
    monkeypatch.setenv("SELFRAG_MODEL__CALIBRATE_ON_FIRST_USE", "true")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": p.id, "text": p.text}) + "\n" for p in _four_copies())
    )
    home = tmp_path / "home"
    with caplog.at_level(logging.WARNING):
        assert main(["--home", str(home), "index", "--no-progress", str(corpus)]) == 0
    assert len(calls) == 1
    assert "support threshold (learned" in capsys.readouterr().out
    assert "no support threshold" not in caplog.text
    assert len(list((home / "calibration").glob("*/*.json"))) == 1
    [path] = (home / "calibration").glob("*/learned.json")
    cal = SupportCalibration.model_validate_json(path.read_text())
    assert cal.answerable["n"] >= 8
    assert cal.unanswerable == {"n": 0}  # read only with --report
    ask = ["--home", str(home), "ask", "--json", "--mode", "always", "Who led the Norse raiders?"]
    assert main(ask) == 0
    response = json.loads(capsys.readouterr().out)
    # The response shows the threshold that applied: the calibrated one.
    assert response["config"]["min_support_score"] == cal.min_support_score


def test_serve_decodes_with_the_pools_calibrated_threshold() -> None:
    import asyncio

    from selfrag.schemas.answer import AnswerRequest
    from tests.serve_fakes import Pool, make_service

    critic = ScriptedCritic(
        name="learned",
        relevance_of={"p1": 0.9},
        support_of={"p1": {"full": 0.45, "partial": 0.0, "none": 0.55}},  # s_sup 0.45
    )
    request = AnswerRequest(question="Who founded Normandy?", config={"mode": "always"})
    plain = make_service(pool=Pool(critic))
    assert not asyncio.run(plain.service.aanswer(request)).response.abstained
    pool = Pool(critic)
    pool.calibrated = {"min_support_score": 0.52}
    response = asyncio.run(make_service(pool=pool).service.aanswer(request)).response
    assert response.abstained and response.config.min_support_score == 0.52


def test_a_deeply_nested_calibration_is_ignored_naming_the_file_and_read_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It raised RecursionError: the CLI blamed the question, and the server, reading it again
    for every answer, answered 500 to all while /readyz said ready. Now it is one unreadable
    file: the constant applies, with a warning naming the file, and it is not read again."""
    path = calibration_path(tmp_path, "a" * 64, "learned")
    path.parent.mkdir(parents=True)
    path.write_text("[" * 200_000 + "]" * 200_000)
    with caplog.at_level(logging.WARNING):
        assert read_calibration(tmp_path, "a" * 64, "learned") is None
    assert "unreadable calibration" in caplog.text and str(path) in caplog.text
    reads = []
    real = calibrated_module.read_calibration
    monkeypatch.setattr(
        calibrated_module, "read_calibration", lambda *a: reads.append(a) or real(*a)
    )
    defaults = CalibratedDefaults(tmp_path, lambda: "a" * 64, lambda: "model-fp")
    assert defaults.filters("learned") == {} and defaults.filters("learned") == {}
    assert len(reads) == 1


def test_traps_swap_a_name_or_number_for_one_the_passage_lacks_negate_or_invert() -> None:
    p = Passage("p", "The Normans under Rollo settled in 1011 after the siege of Paris.")
    q = SyntheticQuestion(
        "Who led the Normans that settled in 1011 after the siege?", "Rollo", "name", p
    )
    pool = {"name": ["Hastein", "Normans", "Paris"], "year": ["1045", "1011"]}
    traps = dict(perturbed_questions(q, pool, random.Random(0)))
    assert traps["entity"] == "Who led the Hastein that settled in 1011 after the siege?"
    assert traps["number"] == "Who led the Normans that settled in 1045 after the siege?"
    assert traps["antonym"] == "Who led the Normans that settled in 1011 before the siege?"
    negated = perturbed_questions(
        replace(q, question="Who was the leader of the Normans?"), pool, random.Random(0)
    )
    assert ("negation", "Who was not the leader of the Normans?") in negated


def test_an_entity_pool_holds_the_corpus_names_and_numbers_by_kind() -> None:
    pool = entity_pool(
        [
            Passage("a", "Rollo came in 1011 with 300 ships."),
            Passage("b", "It fell to Paris Hilton."),
        ]
    )
    assert pool == {"year": ["1011"], "number": ["300"], "name": ["Paris Hilton"]}


@dataclass
class EchoingLoopingCritic(OverlapCritic):
    """Loops on the passages of TEXTS[0], echoes the question once on those of TEXTS[1]."""

    drafted: list[str] = field(default_factory=list)

    def draft(self, branches: Sequence[Branch], max_tokens: int) -> list[Generation]:
        drafts = super().draft(branches, max_tokens)
        return echo_or_loop(branches, drafts, loop_on="p0-", echo_on="p1-")

    def support(self, branches: Sequence[Branch], drafts: Sequence[Generation]) -> list[LabelProbs]:
        self.drafted += [d.text for d in drafts]
        return super().support(branches, drafts)


def test_the_calibration_drafts_as_the_decoder_does_past_echoes_and_without_loops(
    tmp_path: Path,
) -> None:
    from selfrag.jobs.support_calibration import (
        CorpusCalibrationPlan,
        draw_pairs,
        score_pairs,
    )

    critic = EchoingLoopingCritic(name="learned")
    rag = _fake_rag(tmp_path, _four_copies(), critic)
    plan = CorpusCalibrationPlan(questions=12)
    scores = score_pairs(rag, "learned", draw_pairs(rag, plan), plan, progress=False)
    looped = [s for s in scores if s.pair.passage.id.startswith("p0-")]
    assert looped and all(s.s_sup is None for s in looped)
    assert critic.asked and not any(b.passage.id.startswith("p0-") for b in critic.asked)
    assert any(b.passage.id.startswith("p1-") for b in critic.asked)
    assert critic.drafted and not any(t.startswith("Question:") for t in critic.drafted)
