"""`selfrag eval` logic on fakes: dataset reading, resume from partial output, report shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from selfrag.cli import main
from selfrag.jobs.evaluation.eval_plots import threshold_curve
from selfrag.jobs.evaluation.eval_questions import EvalError, EvalQuestion, load_questions
from selfrag.jobs.evaluation.eval_report import (
    REPORT_COLUMNS,
    build_report,
    read_records,
    render_summary,
)
from selfrag.jobs.evaluation.eval_runner import parse_systems, run_evaluation
from selfrag.pipeline.decoder import BeamDecoder
from selfrag.pipeline.protocols import Passage
from selfrag.runtime.answer_client import LocalAnswerClient, runtime_site
from selfrag.runtime.answering import AnswerPath, CacheIdentity
from selfrag.schemas.answer import AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from tests.fakes import ListRetriever, ScriptedCritic, WordModel

SQUAD = {
    "data": [
        {
            "title": "Normans",
            "paragraphs": [
                {
                    "context": "Rollo founded Normandy in France.",
                    "qas": [
                        {
                            "id": "q1",
                            "question": "Who founded Normandy?",
                            "is_impossible": False,
                            "answers": [{"text": "Rollo", "answer_start": 0}],
                        },
                        {
                            "id": "q2",
                            "question": "Where is Normandy?",
                            "is_impossible": False,
                            "answers": [{"text": "France", "answer_start": 26}],
                        },
                        {
                            "id": "q3",
                            "question": "Who unfounded Normandy?",
                            "is_impossible": True,
                            "answers": [],
                            "plausible_answers": [{"text": "Rollo"}],
                        },
                    ],
                }
            ],
        },
        {
            "title": "Other",
            "paragraphs": [
                {
                    "context": "x",
                    "qas": [
                        {
                            "id": "o1",
                            "question": "?",
                            "is_impossible": False,
                            "answers": [{"text": "x", "answer_start": 0}],
                        }
                    ],
                }
            ],
        },
    ]
}


class FakeRag:
    """What the evaluation uses of `LocalRuntime`: engine, store, critic(), answer_path (its
    critique facts), and what its answer client decodes with (decode, cache_identity)."""

    def __init__(
        self,
        passages: list[Passage] | None = None,
        baseline_answer: str = " Rollo founded it.",
        critic: ScriptedCritic | None = None,
    ) -> None:
        self.engine = WordModel(draft_text=baseline_answer)
        self.store = ListRetriever(
            passages or [Passage("p1", "Rollo founded Normandy in France.", "Normans")]
        )
        self.critic_obj = critic or ScriptedCritic(
            drafts={"p1": (" Rollo founded it.", -1.0, "eos")}
        )
        self.decoder = BeamDecoder(lambda _: self.critic_obj, self.store, "fake")
        self.answer_path = AnswerPath(DecodingConfig(), facts=self)

    def critic(self, source: str) -> ScriptedCritic:
        return self.critic_obj

    def critique_name(self, source: str) -> str:
        return source

    def calibrated_filters(self, name: str) -> dict[str, object]:
        return {}

    def for_collection(self, name: str | None) -> FakeRag:
        return self

    def decode(
        self, question: str, config: DecodingConfig, _deadline: Any, on_step: Any = None
    ) -> AnswerResponse:
        return self.decoder.answer(question, config, on_step)

    def cache_identity(self) -> CacheIdentity:
        return CacheIdentity("v", "fake")


def _client(rag: FakeRag) -> LocalAnswerClient:
    """The evaluation's answer client: in this process, on the fake runtime."""
    return LocalAnswerClient(lambda _collection: runtime_site(rag))  # type: ignore[arg-type]


@pytest.fixture()
def squad_file(tmp_path: Path) -> Path:
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(SQUAD))
    return path


def test_load_squad_and_jsonl(squad_file: Path, tmp_path: Path):
    qs = load_questions(squad_file, article="Normans")
    assert [q.id for q in qs] == ["q1", "q2", "q3"]
    assert qs[2].answerable is False and qs[2].golds == ()  # plausible answers are not gold
    assert qs[0].paragraph_id == "squad:Normans:0"
    assert len(load_questions(squad_file, limit=2)) == 2
    jsonl = tmp_path / "nq.jsonl"
    jsonl.write_text('{"id": "a", "question": "q?", "golden_answers": ["x"]}\n')
    (q,) = load_questions(jsonl)
    assert q.golds == ("x",) and q.answerable
    with pytest.raises(EvalError):
        load_questions(tmp_path / "missing.json")
    with pytest.raises(EvalError):
        load_questions(squad_file, article="Nope")
    with pytest.raises(EvalError):
        parse_systems("closed-book,magic")


def test_resume_skips_done_records(squad_file: Path, tmp_path: Path):
    rag = FakeRag()
    out = tmp_path / "out"
    qs = load_questions(squad_file, article="Normans")
    systems = ["closed-book", "selfrag-prompted"]
    cfg = DecodingConfig(mode="always", max_segments=1)
    run_evaluation(_client(rag), rag, qs[:2], systems, out, cfg, progress=False)  # type: ignore[arg-type]
    assert len(read_records(out / "records.jsonl")) == 4
    # An interrupted write leaves a torn line; the rerun ignores it and answers only what is new.
    with (out / "records.jsonl").open("a") as f:
        f.write('{"system": "closed-book", "id": "q3", "answ')
    calls, drafts = len(rag.engine.prompts), rag.critic_obj.calls.count("draft:2")
    report = run_evaluation(_client(rag), rag, qs, systems, out, cfg, progress=False)  # type: ignore[arg-type]
    assert len(rag.engine.prompts) == calls + 1  # only q3 for closed-book
    assert rag.critic_obj.calls.count("draft:2") == drafts + 1  # and only q3 for self-RAG
    assert len([r for r in read_records(out / "records.jsonl")]) == 6
    row = report["systems"]["selfrag-prompted"]
    assert set(REPORT_COLUMNS) <= set(row)
    assert row["questions"] == 3 and row["accuracy"] == pytest.approx(0.5)
    assert row["retrieval_rate"] == 1.0 and row["citation_precision"] == 1.0
    assert (out / "report.md").read_text().startswith("| system")


def test_report_has_abstention_scores_and_the_accuracy_coverage_curve(
    squad_file: Path, tmp_path: Path
):
    rag = FakeRag()
    out = tmp_path / "out"
    qs = load_questions(squad_file, article="Normans")  # q1, q2 answerable; q3 not
    systems = ["closed-book", "selfrag-prompted"]
    cfg = DecodingConfig(mode="always", max_segments=1)
    report = run_evaluation(_client(rag), rag, qs, systems, out, cfg, progress=False)  # type: ignore[arg-type]
    records = {(r["system"], r["id"]): r for r in read_records(out / "records.jsonl")}
    # Closed-book: the mean token log-prob of its answer (WordModel: -0.5 per token).
    assert records[("closed-book", "q1")]["abstention_score"] == pytest.approx(-0.5)
    # Self-RAG: the best first-step s_sup x similarity (the scripted critic's uniform IsSup:
    # 0.5; the fake passages carry no similarity).
    assert records[("selfrag-prompted", "q1")]["abstention_score"] == pytest.approx(0.5)
    row = report["systems"]["selfrag-prompted"]
    assert row["coverage"] == 1.0 and row["selective_accuracy"] == pytest.approx(0.5)
    assert row["abstain_rate"] == 0.0
    assert row["abstention_auroc"] == pytest.approx(0.5)  # one score for all: all ties
    assert report["abstention_score"]["selfrag-prompted"].startswith("support")
    assert report["abstention_score"]["closed-book"].startswith("mean token log-prob")
    curve = report["accuracy_coverage"]["selfrag-prompted"]
    assert curve == [
        {
            "threshold": 0.5,
            "coverage": 1.0,
            "selective_accuracy": 0.5,
            "unanswerable_abstain_rate": 0.0,
        }
    ]
    lines = (out / "accuracy_coverage.csv").read_text().splitlines()
    assert lines[0] == "system,threshold,coverage,selective_accuracy,unanswerable_abstain_rate"
    assert "selfrag-prompted,0.5,1,0.5,0" in lines and len(lines) == 3
    assert (out / "accuracy_coverage.png").read_bytes().startswith(b"\x89PNG")
    table = (out / "report.md").read_text()
    assert "| system | abstention score | coverage | selective_accuracy |" in table
    assert "| selfrag-prompted | support" in table and "| 0.500 |" in table
    # What `selfrag eval` prints: the headline columns, narrower than a terminal.
    summary = render_summary(report).splitlines()
    heads = ["system", "n", "accuracy", "abstain", "wrong+sure", "retrieval"]
    assert summary[0].split()[:6] == heads
    assert summary[0].endswith("p50 ms") and len(summary) == 6
    assert summary[2].split()[:3] == ["selfrag-prompted", "3", "50.0%"]
    assert max(len(line) for line in summary) < 80
    # Question by question: both systems answer q1 right and q2 wrong, and neither abstains
    # on q3 (the `FakeRag` retrieves the same passages for each).
    assert report["paired"] == [
        {
            "first": "closed-book",
            "second": "selfrag-prompted",
            "answerable": {
                "questions": 2,
                **{"both": 1, "only_first": 0, "only_second": 0, "neither": 1},
                "p_value": 1.0,
            },
            "unanswerable": {
                "questions": 1,
                **{"both": 0, "only_first": 0, "only_second": 0, "neither": 1},
                "p_value": 1.0,
            },
        }
    ]
    assert summary[4].startswith("right on answerable: first / second")
    assert summary[5].split() == ["closed-book", "/", "selfrag-prompted", "1", "0", "0", "1.000"]
    assert (
        "| closed-book | selfrag-prompted | answerable (right) | 2 | 1 | 0 | 0 | 1 | 1.000 |"
        in table
    )
    # Without unanswerable questions the AUROC is undefined, and the table says why.
    report = run_evaluation(_client(rag), rag, qs[:2], systems, out, cfg, progress=False)  # type: ignore[arg-type]
    assert report["systems"]["closed-book"]["abstention_auroc"] is None
    assert "– (no unanswerable questions)" in (out / "report.md").read_text()


def _record(system: str, qid: str, answerable: bool, answer: str) -> dict[str, Any]:
    return {
        "system": system,
        "id": qid,
        "answerable": answerable,
        "golds": ["Rollo"] if answerable else [],
        "answer": answer,
        "abstained": answer == "",
        "retrieved": True,
        "latency_ms": 1.0,
        "prefill_tokens": 1,
    }


def test_paired_comparison_matches_questions_by_id_and_skips_the_unshared():
    questions = [
        EvalQuestion(id=f"a{i}", question="Who?", golds=("Rollo",), answerable=True)
        for i in range(4)
    ] + [EvalQuestion(id="u0", question="Who?", golds=(), answerable=False)]
    records = [
        # Written in another order for each system: pairs are made by question id.
        *(_record("A", f"a{i}", True, a) for i, a in enumerate(["Rollo", "Rollo", "Odo", "Odo"])),
        *(_record("B", f"a{i}", True, a) for i, a in [(3, "Rollo"), (1, "Odo"), (0, "Rollo")]),
        _record("A", "u0", False, "Odo"),
        _record("B", "u0", False, ""),
        _record("C", "a0", True, "Rollo"),
    ]
    report = build_report(records, questions, ["A", "B", "C"])
    ab, ac, bc = report["paired"]
    # a2 has no record of B, so it is left out of A / B.
    assert ab["answerable"] == {
        "questions": 3,
        **{"both": 1, "only_first": 1, "only_second": 1, "neither": 0},
        "p_value": 1.0,
    }
    assert ab["unanswerable"]["only_second"] == 1  # B abstained where A answered
    assert ac["answerable"]["questions"] == 1 and "unanswerable" not in ac
    assert (bc["first"], bc["second"]) == ("B", "C") and bc["answerable"]["both"] == 1
    assert build_report(records, questions, ["A"])["paired"] == []


def test_threshold_curve_uses_closed_book_where_retrieval_is_skipped():
    own = [
        {
            "id": "a",
            "answerable": True,
            "golds": ["x"],
            "answer": "x",
            "abstained": False,
            "retrieved": True,
            "p_ret": 0.8,
            "latency_ms": 1,
            "prefill_tokens": 1,
        },
        {
            "id": "b",
            "answerable": True,
            "golds": ["y"],
            "answer": "y",
            "abstained": False,
            "retrieved": True,
            "p_ret": 0.2,
            "latency_ms": 1,
            "prefill_tokens": 1,
        },
    ]
    closed = {
        i: {**r, "answer": "no", "retrieved": False} for i, r in (("a", own[0]), ("b", own[1]))
    }
    pts = dict(threshold_curve(own, closed, [0.0, 0.5, 0.9]))
    assert pts == {0.0: 1.0, 0.5: 0.5, 0.9: 0.0}
    assert threshold_curve(own, {}, [0.5]) == []  # unknown closed-book outcome: left out


def test_cli_rejects_bad_input(squad_file: Path, tmp_path: Path, capsys):
    assert (
        main(
            [
                "--home",
                str(tmp_path),
                "eval",
                str(tmp_path / "no.json"),
                "--corpus",
                str(squad_file),
            ]
        )
        == 2
    )
    assert "dataset not found" in capsys.readouterr().err
    assert (
        main(
            [
                "--home",
                str(tmp_path),
                "eval",
                str(squad_file),
                "--corpus",
                str(squad_file),
                "--systems",
                "closed-book,oracle",
            ]
        )
        == 2
    )
    assert "unknown system" in capsys.readouterr().err


def test_baselines_put_passages_in_one_prompt_and_detect_abstention():
    from selfrag.pipeline.evaluation.baselines import BaselineAnswerer, is_abstention

    model = WordModel(draft_text=" I'm not sure.")
    passages = [Passage("a", "Rollo founded Normandy.", "N"), Passage("b", "Bees.", "B")]
    answerer = BaselineAnswerer(model, ListRetriever(passages))
    r = answerer.answer("Who founded Normandy?", DecodingConfig(top_k=2), retrieve=True)
    assert r.abstained and r.usage.retrievals == 1 and [p.id for p in r.passages] == ["a", "b"]
    assert "Rollo founded Normandy." in model.prompts[-1] and "Bees." in model.prompts[-1]
    closed = answerer.answer("Who founded Normandy?", DecodingConfig(), retrieve=False)
    assert closed.passages == [] and "Rollo" not in model.prompts[-1]
    assert is_abstention("I don't know.") and is_abstention("")
    assert not is_abstention("Rollo founded it.")


LONGFORM = [
    {
        "id": "lf-1",
        "split": "tune",
        "question": "Who founded Normandy, and where is it?",
        "golden_answers": ["Rollo", "France"],
        "facts": [
            {"id": "a", "part": "founder", "answers": ["Rollo"], "passage_id": "p1"},
            {"id": "b", "part": "where", "answers": ["France", "French"], "passage_id": "p2"},
        ],
        "how": "by hand",
    },
    {
        "id": "lf-2",
        "split": "report",
        "question": "Who founded Normandy?",
        "facts": [{"id": "a", "answers": ["Rollo"]}],
    },
]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_long_form_records_load_with_facts_split_and_default_systems(tmp_path: Path):
    path = _jsonl(tmp_path / "long.jsonl", LONGFORM)
    q1, q2 = load_questions(path)
    assert [f.id for f in q1.facts] == ["a", "b"] and q1.facts[1].answers == ("France", "French")
    assert q1.facts[0].part == "founder" and q1.split == "tune"
    assert q2.golds == ("Rollo",) and q2.answerable  # golds default to each fact's answers[0]
    assert [q.id for q in load_questions(path, split="report")] == ["lf-2"]
    assert parse_systems(None, [q1]) == [
        "closed-book",
        "vanilla-rag-long",
        "selfrag-likelihood",
        "selfrag-learned",
    ]
    assert "vanilla-rag" in parse_systems(None, [])
    bad = [
        ({**LONGFORM[0], "facts": [{"id": "a", "answers": []}]}, "non-empty list"),
        ({**LONGFORM[0], "facts": [{"id": "a", "answers": ["x"]}] * 2}, "unique"),
        ({**LONGFORM[0], "facts": {"a": "x"}}, "must be a list"),
    ]
    for row, message in bad:
        with pytest.raises(EvalError, match=message):
            load_questions(_jsonl(tmp_path / "bad.jsonl", [row]))
    with pytest.raises(EvalError, match="used twice"):
        load_questions(_jsonl(tmp_path / "twice.jsonl", [LONGFORM[0], LONGFORM[0]]))
    with pytest.raises(EvalError, match="no question of split"):
        load_questions(_jsonl(tmp_path / "one.jsonl", LONGFORM[:1]), split="report")


def test_long_form_report_judges_citations_alike_for_self_rag_and_vanilla_rag(tmp_path: Path):
    passages = [
        Passage("p1", "Rollo founded Normandy.", "Normandy"),
        Passage("p2", "Normandy lies in the north of France.", "Normandy"),
    ]
    critic = ScriptedCritic(
        relevance_of={"p1": 0.9, "p2": 0.1},
        drafts={"p1": (" Rollo founded it.", -1.0, "eos"), "p2": (" It is big.", -1.0, "eos")},
    )
    rag = FakeRag(
        passages,
        # Two sentences, each citing the passage that states it; a third cites a number
        # naming no passage.
        baseline_answer=" Rollo founded it [1]. It lies in France. [2] The end [3].",
        critic=critic,
    )
    out = tmp_path / "out"
    qs = load_questions(_jsonl(tmp_path / "long.jsonl", LONGFORM[:1]))
    systems = ["vanilla-rag-long", "selfrag-prompted"]
    cfg = DecodingConfig(mode="always", max_segments=1, top_k=2)
    report = run_evaluation(_client(rag), rag, qs, systems, out, cfg, progress=False)  # type: ignore[arg-type]
    # The long-form prompt numbers the passages and asks for a citation after each sentence,
    # within Self-RAG's budget (one segment of 48 tokens here).
    prompt = rag.engine.prompts[-1]
    assert "Passage [1]" in prompt and "Passage [2]" in prompt
    assert "Answer every part of the question" in prompt and "[1], [2]" in prompt
    vanilla, selfrag = (
        report["longform"]["vanilla-rag-long"],
        report["longform"]["selfrag-prompted"],
    )
    # Vanilla: both facts stated, each in a sentence citing the passage holding it; the third
    # sentence states no fact and cites [3], which names no passage: an unsupported filler.
    assert vanilla["fact_recall"] == 1.0 and vanilla["fully_covered"] == 1.0
    assert vanilla["citation_recall"] == 1.0
    assert vanilla["citation_precision"] == pytest.approx(2 / 3)
    assert vanilla["citation_precision_facts"] == 1.0
    assert vanilla["filler_units"] == 1 and vanilla["filler_precision"] == 0.0
    assert vanilla["units_per_answer"] == 3.0 and vanilla["abstain_rate"] == 0.0
    assert vanilla["decode_tokens"] > 0 and vanilla["prefill_tokens"] > 0
    # Self-RAG: one segment, drafted on p1, stating Rollo and citing p1.
    assert selfrag["fact_recall"] == 0.5 and selfrag["fully_covered"] == 0.0
    assert selfrag["citation_recall"] == 1.0 and selfrag["citation_precision"] == 1.0
    assert selfrag["facts_retrieved"] == 1.0 and selfrag["units_per_answer"] == 1.0
    # Short-form summaries leave the long-form questions out.
    assert report["systems"]["selfrag-prompted"]["questions"] == 0
    assert report["longform_questions"] == 1
    (pair,) = report["paired"]
    assert "answerable" not in pair
    assert pair["fully_covered"] == {
        "questions": 1,
        **{"both": 0, "only_first": 1, "only_second": 0, "neither": 0},
        "p_value": 1.0,
    }
    assert pair["facts_stated"] == {
        "facts": 2,
        **{"both": 1, "only_first": 1, "only_second": 0, "neither": 0},
        "p_value": 1.0,
    }
    # The records keep what the judgement needs; the answers file shows it unit by unit.
    records = {r["system"]: r for r in read_records(out / "records.jsonl")}
    assert records["vanilla-rag-long"]["units"][1] == {
        "text": "It lies in France.",
        "cited": ["p2"],
    }
    assert [p["id"] for p in records["selfrag-prompted"]["passages"]] == ["p1", "p2"]
    answers = {
        r["system"]: r
        for r in map(json.loads, (out / "longform_answers.jsonl").read_text().splitlines())
    }
    assert answers["vanilla-rag-long"]["stated"] == ["a", "b"]
    assert [u["supported"] for u in answers["vanilla-rag-long"]["units"]] == [True, True, False]
    # report.json has every answer's own rates, units, tokens and time, without the texts.
    one = {a["system"]: a for a in report["longform_answers"]}
    assert one["vanilla-rag-long"]["citation_precision"] == pytest.approx(2 / 3)
    assert one["vanilla-rag-long"]["units"][2] == {
        "cited": ["[3]"],
        "states": [],
        "supported": False,
    }
    assert one["selfrag-prompted"]["fact_recall"] == 0.5
    assert one["selfrag-prompted"]["latency_ms"] == answers["selfrag-prompted"]["latency_ms"]
    assert "answer" not in one["selfrag-prompted"]
    table = (out / "report.md").read_text()
    assert table.startswith("| system | n | facts | fact_recall |")
    assert "| vanilla-rag-long | 1 | 2 | 100.0% | 100.0% |" in table
    assert (
        "| vanilla-rag-long | selfrag-prompted | facts (stated) | 2 | 1 | 1 | 0 | 0 | 1.000 |"
        in table
    )
    assert (
        "| lf-1 | vanilla-rag-long | 2/2 | 2/2 | 100.0% | 100.0% | 66.7% | 3 | a+ b+ ·- |" in table
    )
    assert "| lf-1 | selfrag-prompted | 1/2 | 1/2 | 50.0% | 100.0% | 100.0% | 1 | a+ |" in table
    summary = render_summary(report).splitlines()
    assert summary[0].split() == [
        "system",
        "n",
        "facts",
        "covered",
        "cite",
        "prec",
        "cite",
        "rec",
        "p50",
        "ms",
    ]
    assert "facts stated: first / second" in summary[4]
    assert max(len(line) for line in summary) < 80
    # Short records are written without the long-form fields.
    short = load_questions(
        _jsonl(
            tmp_path / "short.jsonl", [{"id": "s", "question": "Who?", "golden_answers": ["Rollo"]}]
        )
    )
    run_evaluation(
        _client(rag), rag, short, ["selfrag-prompted"], tmp_path / "short", cfg, progress=False
    )  # type: ignore[arg-type]
    (record,) = read_records(tmp_path / "short" / "records.jsonl")
    assert "units" not in record and "passages" not in record


def test_long_form_baseline_abstains_only_when_every_sentence_declines():
    from selfrag.pipeline.evaluation.baselines import BaselineAnswerer, declines_every_part

    assert declines_every_part("I don't know.") and declines_every_part("")
    assert declines_every_part("I don't know [1]. The passages do not contain it.")
    assert not declines_every_part("Rollo founded it [1]. I don't know where it is.")
    budgets: list[int] = []

    class BudgetModel(WordModel):
        def generate(self, requests):  # type: ignore[no-untyped-def]
            budgets.extend(r.max_tokens for r in requests)
            return super().generate(requests)

    model = BudgetModel(draft_text=" I don't know.")
    answerer = BaselineAnswerer(model, ListRetriever([Passage("a", "Rollo.", "N")]))
    cfg = DecodingConfig(max_segments=3, max_segment_tokens=10)
    r = answerer.answer("Who?", cfg, retrieve=True, long_form=True)
    assert r.abstained
    assert budgets == [30]  # Self-RAG's budget: max_segments x max_segment_tokens
    with pytest.raises(ValueError, match="needs retrieval"):
        answerer.answer("Who?", cfg, retrieve=False, long_form=True)


def test_vanilla_rag_reads_the_passages_its_answer_client_retrieves():
    """The baselines' passages come through the answer client (`retrieve`, in the store's
    order), not from a store of the evaluation's own."""
    from selfrag.jobs.evaluation.eval_runner import runner_for
    from selfrag.schemas.retrieval import RetrieveRequest
    from tests.http_fakes import FakeService

    rag, client = FakeRag(), FakeService()
    q = EvalQuestion(id="q1", question="Who founded Normandy?", golds=("Rollo",), answerable=True)
    config = DecodingConfig(top_k=2)
    response, p_ret, extra = runner_for(client, rag, "vanilla-rag", config, False)(q)  # type: ignore[arg-type]
    assert client.retrieved == [RetrieveRequest(query=q.question, top_k=2, order="retriever")]
    assert [p.text for p in response.passages] == ["Rollo founded Normandy."]  # the client's
    assert "Rollo founded Normandy." in rag.engine.prompts[-1] and client.seen == []
    assert (p_ret, extra) == (None, 0)
    runner_for(client, rag, "closed-book", config, False)(q)  # type: ignore[arg-type]
    assert len(client.retrieved) == 1 and "Rollo" not in rag.engine.prompts[-1]
