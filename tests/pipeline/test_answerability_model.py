"""The answerability combiner: features, fitter, JSON, the critique wrapper and its wiring."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from selfrag.infra.models.heads_store import (
    answerability_path,
    find_answerability,
    load_answerability,
    save_answerability,
)
from selfrag.pipeline.answerability_model import (
    AnswerabilityError,
    AnswerabilityModel,
    FeatureTable,
    Linear,
    draft_features,
    fit_answerability,
    fit_linear,
    linear_logits,
    predict,
)
from selfrag.pipeline.critics import (
    READ_LAYOUT,
    AnswerabilityCritic,
    Branch,
    LearnedCritic,
    LikelihoodCritic,
    make_critic,
    read_relevance,
    read_support,
)
from selfrag.pipeline.heads import GROUP_LABELS, GroupHead, ReflectionHeads
from selfrag.pipeline.learning.logistic_fit import auc
from selfrag.pipeline.protocols import (
    ContinuationRequest,
    ContinuationScores,
    Passage,
    TokenScoreRequest,
    TokenScores,
)
from selfrag.pipeline.scoring import support_score
from tests.fakes import WordModel

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "Who founded Normandy?"
ROLLO = Passage("p1", "Rollo founded Normandy in 911.", "Normans", 0.9)
DRAFT = " Rollo founded it."
SHA = "a" * 64


class LayerModel(WordModel):
    """A `WordModel` with 4 blocks whose outputs are scripted, continuation scores, and a
    record of the requests."""

    def __init__(self) -> None:
        super().__init__(
            specials=["<|im_start|>", "<|im_end|>"],
            template=CHATML,
            draft_text=DRAFT,
            hidden=lambda text: [float("Rollo" in text), 1.0],
        )
        self.score_requests: list[TokenScoreRequest] = []
        self.continuations: list[ContinuationRequest] = []

    @property
    def n_layers(self) -> int:
        return 4

    def next_token_logprobs(self, requests: Sequence[TokenScoreRequest]) -> list[TokenScores]:
        self.score_requests.extend(requests)
        out = []
        for r, s in zip(requests, super().next_token_logprobs(requests), strict=True):
            text = self.detokenize(r.prompt)
            states = {b: (float(b), float("Rollo" in text), 1.0) for b in r.hidden_layers}
            out.append(TokenScores(s.logprobs, s.prefill_tokens, s.hidden_state, states))
        return out

    def continuation_logprobs(
        self, requests: Sequence[ContinuationRequest]
    ) -> list[ContinuationScores]:
        self.continuations.extend(requests)
        return [ContinuationScores([-2.0] * len(r.continuation), len(r.prompt)) for r in requests]


def heads() -> ReflectionHeads:
    rows = {
        g: tuple((0.1 * i, 0.0) for i in range(len(labels))) for g, labels in GROUP_LABELS.items()
    }
    return ReflectionHeads(SHA, {g: GroupHead(GROUP_LABELS[g], rows[g]) for g in GROUP_LABELS})


def combiner(source: str = "learned", sha: str = SHA) -> AnswerabilityModel:
    """Weights on copy and on the probe of block 1 (which reads 'Rollo in view')."""
    features = ("s_sup", "s_rel", "copy", "echo", "length", "gain", "probe:1")
    return AnswerabilityModel(
        model_sha256=sha,
        source=source,
        features=features,
        combiner=Linear((0.0,) * 7, (1.0,) * 7, (0.5, 0.2, 1.5, -1.0, 0.1, 0.3, 0.8), -1.0),
        probes={"probe:1": Linear((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (0.0, 2.0, 0.0), -0.5)},
    )


# --- features -------------------------------------------------------------------------------


def test_draft_features_count_content_words_in_passage_and_question() -> None:
    f = draft_features("The Viking Rollo founded it in 911.", 9, ROLLO.text, QUESTION)
    # Content words: viking, rollo, founded, 911 ("the", "it", "in" are function words).
    assert f["copy"] == pytest.approx(3 / 4)  # rollo, founded, 911 are in the passage
    assert f["echo"] == pytest.approx(1 / 4)  # founded is in the question
    assert f["qcover"] == 1.0  # founded, normandy: the question's content words
    assert f["length"] == pytest.approx(math.log(10))
    assert draft_features("the of it", 3, ROLLO.text, QUESTION)["copy"] == 0.0


def test_an_answer_that_echoes_the_question_has_high_echo_and_low_copy() -> None:
    f = draft_features("Who founded Normandy", 3, "Paris is in France.", QUESTION)
    assert f["echo"] == 1.0 and f["copy"] == 0.0
    assert f["qcover"] == 0.0  # the passage names nothing the question asks about


# --- fitting ---------------------------------------------------------------------------------


def test_the_fitter_separates_a_separable_toy_set() -> None:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 3))
    y = (X[:, 0] - 2 * X[:, 2] > 0).astype(float)
    model = fit_linear(X, y, l2=0.01)
    z = linear_logits(model, X)
    assert auc(z.tolist(), y.astype(bool).tolist()) == 1.0
    assert ((z > 0) == (y > 0)).mean() > 0.95
    assert model.weights[0] > 0 and model.weights[2] < 0


def test_the_fitter_refuses_one_class() -> None:
    with pytest.raises(AnswerabilityError, match="one class"):
        fit_linear(np.ones((5, 2)), np.zeros(5))


def test_a_probe_is_fitted_on_block_states_and_predict_matches_probability() -> None:
    rng = np.random.default_rng(1)
    n = 60
    y = np.array([i % 2 for i in range(n)], dtype=float)
    states = rng.normal(size=(n, 5)) + y[:, None] * np.array([2.0, 0, 0, 0, 0])
    table = FeatureTable(
        {"s_sup": rng.normal(size=n), "copy": y + rng.normal(scale=0.1, size=n)},
        {"rprobe:3": states},
        y,
        [f"q{i // 2}" for i in range(n)],
    )
    model = fit_answerability(
        table, ["s_sup", "copy", "rprobe:3"], model_sha256=SHA, source="learned", probe_l2=1.0
    )
    p = predict(model, table)
    assert auc(p.tolist(), y.astype(bool).tolist()) > 0.95
    row = {"s_sup": float(table.values["s_sup"][0]), "copy": float(table.values["copy"][0])}
    assert model.blocks_at("relevance") == (3,) and model.blocks_at("support") == ()
    assert model.probability(row, {"rprobe:3": states[0].tolist()}) == pytest.approx(p[0])


# --- JSON -----------------------------------------------------------------------------------


def test_json_round_trip_and_refusal_for_another_model_or_source(tmp_path: Path) -> None:
    model = combiner()
    back = AnswerabilityModel.from_json(json.loads(json.dumps(model.to_json())))
    values = {"s_sup": 0.4, "s_rel": 0.9, "copy": 1.0, "echo": 0.0, "length": 2.0, "gain": 1.0}
    states = {"probe:1": (1.0, 1.0, 1.0)}
    assert back.probability(values, states) == model.probability(values, states)
    path = save_answerability(answerability_path(tmp_path, SHA, "learned"), model)
    assert path.probability(values, states) == model.probability(values, states)
    assert find_answerability(tmp_path, SHA, "learned") == answerability_path(
        tmp_path, SHA, "learned"
    )
    assert find_answerability(tmp_path, SHA, "likelihood") is None
    model.check(SHA, "learned")
    with pytest.raises(AnswerabilityError, match="sha256:" + "b" * 64):
        back.check("b" * 64, "learned")
    with pytest.raises(AnswerabilityError, match="'likelihood'"):
        back.check(SHA, "likelihood")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**model.to_json(), "features": ["s_sup"]}))
    with pytest.raises(AnswerabilityError, match=r"bad\.json"):
        load_answerability(bad)


# --- the critique wrapper ---------------------------------------------------------------------


def test_the_wrapper_returns_the_combiner_p_as_s_sup_and_leaves_other_groups_alone() -> None:
    model = LayerModel()
    inner = LearnedCritic(model, heads())
    wrapped = make_critic(model, "learned", heads=heads(), answerability=combiner())
    assert isinstance(wrapped, AnswerabilityCritic) and wrapped.name == "learned"
    grounded, closed = Branch(QUESTION, "", ROLLO), Branch(QUESTION, "", None)
    branches = [grounded, closed]
    assert wrapped.retrieval(branches) == inner.retrieval(branches)
    assert wrapped.relevance([grounded]) == inner.relevance([grounded])
    drafts = wrapped.draft(branches, 16)
    assert drafts == inner.draft(branches, 16)
    assert wrapped.utility(branches, drafts) == inner.utility(branches, drafts)

    model.score_requests.clear()
    out = wrapped.support(branches, drafts)
    # The heads' read of the grounded branch asked for block 1 in the same request.
    reads = [r for r in model.score_requests if r.hidden_layers]
    assert len(reads) == 1 and reads[0].hidden_layers == (1,) and reads[0].hidden_state
    (reading, _) = read_support(inner, model, branches, drafts, (1,), [None, None])
    p = combiner().probability(reading.values, reading.states)
    assert reading.states == {"probe:1": (1.0, 1.0, 1.0)}
    assert reading.values["copy"] == pytest.approx(1.0)  # rollo, founded: both in the passage
    assert reading.values["gain"] == pytest.approx(-0.5 + 2.0)  # drafted at −0.5, closed −2
    assert support_score(out[0].probs) == pytest.approx(p)
    assert p != pytest.approx(support_score(inner.support(branches, drafts)[0].probs))
    # Without a passage the source's own support stands.
    assert out[1] == inner.support([closed], [drafts[1]])[0]


def test_a_relevance_probe_is_read_in_the_heads_relevance_request_and_remembered() -> None:
    model = LayerModel()
    fitted = AnswerabilityModel(
        model_sha256=SHA,
        source="learned",
        features=("s_sup", "rprobe:2"),
        combiner=Linear((0.0, 0.0), (1.0, 1.0), (1.0, 1.0), 0.0),
        probes={"rprobe:2": Linear((0.0,) * 3, (1.0,) * 3, (1.0, 0.0, 0.0), 0.0)},
    )
    wrapped = make_critic(model, "learned", heads=heads(), answerability=fitted)
    branch = Branch(QUESTION, "", ROLLO)
    model.score_requests.clear()
    wrapped.relevance([branch])
    assert [r.hidden_layers for r in model.score_requests] == [(2,)]
    drafts = wrapped.draft([branch], 16)
    model.score_requests.clear()
    (out,) = wrapped.support([branch], drafts)
    # The support read is the heads' own, relevance is not read again, and without the gain
    # feature the draft is not scored without its passage.
    assert [(r.hidden_layers, r.hidden_state) for r in model.score_requests] == [((), True)]
    assert model.continuations == []
    s_sup = support_score(LearnedCritic(model, heads()).support([branch], drafts)[0].probs)
    # Block 2's output at the relevance prompt is (2, 1, 1): the probe's logit is 2.
    assert support_score(out.probs) == pytest.approx(1.0 / (1.0 + math.exp(-(s_sup + 2.0))))


def test_the_wrapper_works_on_the_likelihood_source_with_its_own_gain() -> None:
    model = LayerModel()
    fitted = combiner("likelihood")
    wrapped = make_critic(model, "likelihood", answerability=fitted)
    assert isinstance(wrapped, AnswerabilityCritic) and wrapped.name == "likelihood"
    inner = LikelihoodCritic(model)
    branch = Branch(QUESTION, "", ROLLO)
    drafts = inner.draft([branch], 16)
    (s,) = inner.support_signals([branch], drafts)
    (out,) = wrapped.support([branch], drafts)
    (rel,) = read_relevance(inner, model, [branch], (2,))
    assert rel.states == {2: (2.0, 1.0, 1.0)}  # block 2 at the relevance prompt
    (given,) = read_support(inner, model, [branch], drafts, (1,), [rel])
    assert given.states == {"probe:1": (1.0, 1.0, 1.0), "rprobe:2": (2.0, 1.0, 1.0)}
    (reading,) = read_support(inner, model, [branch], drafts, (1,), [None])
    assert reading.values["gain"] == pytest.approx(s.value)
    assert support_score(out.probs) == pytest.approx(
        fitted.probability(reading.values, reading.states)
    )


def test_the_factory_applies_the_model_only_to_the_source_it_was_fitted_on() -> None:
    model = LayerModel()
    plain = make_critic(model, "learned", heads=heads(), answerability=combiner("likelihood"))
    assert isinstance(plain, LearnedCritic) and not isinstance(plain, AnswerabilityCritic)
    assert isinstance(make_critic(model, "likelihood", answerability=combiner()), LikelihoodCritic)
    auto = make_critic(model, "auto", heads=heads(), answerability=combiner("learned"))
    assert isinstance(auto, AnswerabilityCritic) and isinstance(auto.inner, LearnedCritic)


def test_a_model_reading_middle_layers_needs_an_engine_that_returns_them() -> None:
    model = WordModel(template=CHATML, specials=["<|im_start|>", "<|im_end|>"])
    with pytest.raises(ValueError, match="middle layers"):
        make_critic(model, "likelihood", answerability=combiner("likelihood"))


# --- the system's wiring ---------------------------------------------------------------------


def test_the_system_finds_the_model_of_its_model_file_and_refuses_another(tmp_path: Path) -> None:
    from selfrag.infra.models.model_files import file_sha256
    from selfrag.infra.settings_loader import load_settings
    from selfrag.runtime.system import LocalRuntime

    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"not really a model")
    sha = file_sha256(weights)
    home = tmp_path / "home"
    save_answerability(answerability_path(home, sha, "learned"), combiner(sha=sha))

    def system(**model: object) -> LocalRuntime:
        rag = LocalRuntime(load_settings(environ={}, overrides={"home": home, "model": model}))
        rag.model.__dict__["path"] = weights  # no llama.cpp: the file only needs a SHA-256
        return rag

    rag = system(support_read="source")
    fitted = rag.model.answerability("learned")
    assert fitted is not None and fitted.blocks == (1,)
    assert rag.model.answerability("likelihood") is None
    assert rag.model.reads_layers  # the engine installs the layer tap for it
    # While s_sup is the verification read no answerability model is read: no tap.
    assert not system().model.reads_layers
    assert system(answerability=False).model.answerability("learned") is None
    assert not system(answerability=False).model.reads_layers
    save_answerability(
        answerability_path(home, sha, "likelihood"), combiner("likelihood", "b" * 64)
    )
    with pytest.raises(AnswerabilityError, match="not for sha256"):
        rag.model.answerability("likelihood")


@pytest.mark.parametrize(
    ("part", "field", "value", "why"),
    [
        ("combiner", "scale", [0.0] * 7, "scale below"),
        ("combiner", "scale", [-1.0] * 7, "scale below"),
        ("combiner", "bias", 1e308, "beyond"),
        ("combiner", "weights", [float("nan")] * 7, "not finite"),
        ("combiner", "mean", [float("inf")] * 7, "not finite"),
        ("combiner", "weights", [0.0] * 7, "weighs no feature"),
        ("probe:1", "scale", [0.0, 1.0, 1.0], "probe 'probe:1'"),
        ("probe:1", "weights", [1e9, 0.0, 0.0], "beyond"),
    ],
)
def test_a_degenerate_answerability_file_is_refused_naming_the_file(
    tmp_path: Path, part: str, field: str, value: object, why: str
) -> None:
    """A zero scale or a huge bias made support 1.0 for everything (abstention silently off)."""
    doc = combiner().to_json()
    doc["manifest"] = {"layout": READ_LAYOUT}
    target = doc["combiner"] if part == "combiner" else doc["probes"][part]
    target[field] = value
    path = tmp_path / "model.answerability.learned.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(AnswerabilityError, match=why) as err:
        load_answerability(path)
    assert str(path) in str(err.value)
    assert "run `selfrag train --answerability` to fit it again" in str(err.value)


def test_probes_of_another_width_than_the_model_are_refused_naming_the_file(
    tmp_path: Path,
) -> None:
    from selfrag.infra.models.model_files import default_model_path, file_sha256
    from selfrag.infra.settings_loader import load_settings
    from selfrag.runtime.system import LocalRuntime

    model = default_model_path()  # hidden size 576; the probe reads 3 values
    sha = file_sha256(model)
    path = save_answerability(answerability_path(tmp_path, sha, "learned"), combiner(sha=sha))
    rag = LocalRuntime(load_settings(environ={}, overrides={"home": tmp_path}))
    rag.model.__dict__["path"] = model
    with pytest.raises(AnswerabilityError, match=r"width \[3\] for a model of hidden size 576"):
        rag.model.answerability("learned")
    with pytest.raises(AnswerabilityError) as err:
        rag.model.answerability("learned")
    assert str(answerability_path(tmp_path, sha, "learned")) in str(err.value)
    assert path.blocks == (1,)
