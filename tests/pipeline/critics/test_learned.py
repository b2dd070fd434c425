"""The learned critique: heads read on scripted hidden states at the chat layout's positions."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from selfrag.infra.engine.kv_slots import common_prefix
from selfrag.pipeline.critics import (
    NATIVE_CHAT_LAYOUT,
    NATIVE_EARLIER_LAYOUTS,
    NATIVE_TOKENS,
    Branch,
    CritiqueUnavailable,
    LearnedCritic,
    NativeChatCritic,
    NativeCritic,
    make_critic,
    settle_filters,
)
from selfrag.pipeline.critics.likelihood import LikelihoodCritic
from selfrag.pipeline.decoder import ABSTAIN_MESSAGE, BeamDecoder
from selfrag.pipeline.heads import GROUP_LABELS, GroupHead, HeadsError, ReflectionHeads
from selfrag.pipeline.protocols import GenerationRequest, Passage, TokenScoreRequest
from selfrag.schemas.answer import AnswerResponse
from selfrag.schemas.decoding import DecodingConfig
from tests.fakes import ListRetriever, WordModel

CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NATIVE_PIECES = [p for g in NATIVE_TOKENS.values() for p in g.values()]

QUESTION = "Who founded Normandy?"
ROLLO = Passage("p1", "Rollo founded Normandy in 911.", "Normans", 0.9)
PARIS = Passage("p2", "Paris is the capital of France.", "Paris", 0.8)
DRAFT = " A Viking leader founded it."


def hidden(text: str) -> list[float]:
    """The scripted hidden state: [passage word seen, not seen, draft word seen, 1]."""
    rollo = "Rollo" in text
    return [float(rollo), float(not rollo), float("Viking" in text), 1.0]


def row(*values: float) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


# Hand-made heads over `hidden`. Relevance: relevant iff the passage word is in view. Support:
# full when the passage word and the draft word are both in view. Utility: 5 when the draft word
# is in view. Retrieve: yes unless an answer (the draft word) was written.
RELEVANCE = (row(3, -3, 0, 0), row(0, 0, 0, 0))
SUPPORT_FULL_WHEN_GROUNDED = (row(2, 0, 2, -2), row(0, 0, 0, 0), row(0, 2, 0, 0))
SUPPORT_ALWAYS_NONE = (row(0, 0, 0, 0), row(0, 0, 0, 0), row(0, 0, 0, 8))
UTILITY = (row(0, 0, -2, 0), row(0, 0, 0, 0), row(0, 0, 0, 0), row(0, 0, 0, 0), row(0, 0, 2, 0))
RETRIEVE = (row(0, 0, -2, 1), row(0, 0, 2, 0), row(0, 0, 0, -1))


def make_heads(
    support: tuple[tuple[float, ...], ...] = SUPPORT_FULL_WHEN_GROUNDED,
    sha: str = "c" * 64,
) -> ReflectionHeads:
    rows = {"retrieve": RETRIEVE, "relevance": RELEVANCE, "support": support, "utility": UTILITY}
    return ReflectionHeads(
        model_sha256=sha, groups={g: GroupHead(GROUP_LABELS[g], rows[g]) for g in GROUP_LABELS}
    )


class RecordingModel(WordModel):
    """A `WordModel` that keeps the requests it was sent."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.score_requests: list[TokenScoreRequest] = []
        self.generate_requests: list[GenerationRequest] = []

    def next_token_logprobs(self, requests: Sequence[TokenScoreRequest]):  # type: ignore[no-untyped-def]
        self.score_requests.extend(requests)
        return super().next_token_logprobs(requests)

    def generate(self, requests: Sequence[GenerationRequest]):  # type: ignore[no-untyped-def]
        self.generate_requests.extend(requests)
        return super().generate(requests)


def chat_model(**kw: object) -> RecordingModel:
    base: dict[str, object] = {
        "specials": CHAT_SPECIALS,
        "template": CHATML,
        "draft_text": DRAFT,
        "hidden": hidden,
    }
    return RecordingModel(**{**base, **kw})


def softmax(z: Sequence[float]) -> list[float]:
    e = [math.exp(v) for v in z]
    return [v / sum(e) for v in e]


# --- reads ------------------------------------------------------------------------------------


def test_relevance_comes_from_the_head_on_the_hidden_state_after_passage_and_question() -> None:
    model = chat_model()
    critic = LearnedCritic(model, make_heads())
    got = critic.relevance([Branch(QUESTION, "", ROLLO), Branch(QUESTION, "", PARIS)])
    assert critic.name == "learned"
    # By hand: Rollo prompt h = [1, 0, 0, 1], logits (3, 0); Paris h = [0, 1, 0, 1], (-3, 0).
    assert [got[0].probs["relevant"], got[0].probs["irrelevant"]] == pytest.approx(softmax([3, 0]))
    assert [got[1].probs["relevant"], got[1].probs["irrelevant"]] == pytest.approx(softmax([-3, 0]))
    requests = model.score_requests
    assert len(requests) == 2
    assert all(r.hidden_state and list(r.candidates) == [] for r in requests)
    # The shared "system + passage" prefix is offered for reuse.
    assert all(0 < r.reusable_prefix < len(r.prompt) for r in requests)
    assert [p.prefill_tokens for p in got] == [len(r.prompt) for r in requests]
    for prompt, passage in zip(model.prompts, (ROLLO, PARIS), strict=True):
        assert passage.text in prompt and f"Question: {QUESTION}" in prompt
        assert prompt.index(passage.text) < prompt.index(QUESTION)
        assert prompt.endswith("<|im_start|>assistant\n")


def test_a_branch_grows_one_sequence_relevance_forks_and_support_and_utility_share_a_read() -> None:
    model = chat_model()
    heads = make_heads()
    critic = LearnedCritic(model, heads)
    branch = Branch(QUESTION, "", ROLLO)
    critic.relevance([branch])
    relevance_request = model.score_requests[-1]
    draft = critic.draft([branch], 16)[0]
    assert draft.text == DRAFT
    draft_request = model.generate_requests[-1]
    drafting = list(draft_request.prompt)
    # Relevance forks from the drafting sequence after passage and question.
    shared = common_prefix(relevance_request.prompt, drafting, len(drafting))
    assert model.detokenize(list(draft_request.prompt[:shared])).rstrip().endswith(QUESTION)
    assert draft_request.reusable_prefix == relevance_request.reusable_prefix > 0

    sup = critic.support([branch], [draft])[0]
    support_request = model.score_requests[-1]
    # The support read extends the drafting sequence by the draft and one short cue.
    assert list(support_request.prompt[: len(drafting)]) == drafting
    cue = model.detokenize(support_request.prompt[len(drafting) :])
    assert cue.startswith(DRAFT) and cue.endswith("<|im_start|>assistant\n")
    assert sup.probs == pytest.approx(heads.groups["support"].probabilities([1, 0, 1, 1]))
    assert max(sup.probs, key=sup.probs.__getitem__) == "full"

    reads = len(model.score_requests)
    use = critic.utility([branch], [draft])[0]
    assert len(model.score_requests) == reads  # the support read's hidden state serves
    assert use.prefill_tokens == 0
    # h = [1, 0, 1, 1]: rating 1 has logit -2, ratings 2-4 zero, rating 5 two.
    expected = softmax([-2, 0, 0, 0, 2])
    assert [use.probs[str(k)] for k in range(1, 6)] == pytest.approx(expected)
    # A second utility read of the same prompt (nothing left to share) asks the engine.
    again = critic.utility([branch], [draft])[0]
    assert len(model.score_requests) == reads + 1
    assert again.probs == pytest.approx(use.probs) and again.prefill_tokens > 0
    assert all(r.hidden_state for r in model.score_requests)


def test_utility_of_a_closed_book_branch_reads_its_own_sequence() -> None:
    model = chat_model()
    critic = LearnedCritic(model, make_heads())
    branch = Branch(QUESTION, "", None)
    draft = critic.draft([branch], 16)[0]
    critic.utility([branch], [draft])
    prompt = model.prompts[-1]
    assert "Passage:" not in prompt and DRAFT in prompt
    assert list(model.score_requests[-1].prompt[: len(model.generate_requests[-1].prompt)]) == list(
        model.generate_requests[-1].prompt
    )


def test_retrieval_reads_after_the_question_and_the_answer_so_far() -> None:
    model = chat_model()
    heads = make_heads()
    critic = LearnedCritic(model, heads)
    fresh, written = critic.retrieval(
        [Branch(QUESTION, "", None), Branch(QUESTION, "A Viking chief.", None)]
    )
    first, second = model.prompts[-2:]
    assert QUESTION in first and "Answer so far" not in first
    assert QUESTION in second and "A Viking chief." in second
    assert fresh.probs == pytest.approx(heads.groups["retrieve"].probabilities([0, 1, 0, 1]))
    assert written.probs == pytest.approx(heads.groups["retrieve"].probabilities([0, 1, 1, 1]))
    assert fresh.probs["yes"] > fresh.probs["no"]
    assert written.probs["no"] > written.probs["yes"]
    assert all(r.hidden_state and r.reusable_prefix == 0 for r in model.score_requests)


def test_an_engine_that_drops_the_hidden_state_is_an_error() -> None:
    class Forgetful(RecordingModel):
        def next_token_logprobs(self, requests):  # type: ignore[no-untyped-def]
            from dataclasses import replace

            return [replace(r, hidden_state=None) for r in super().next_token_logprobs(requests)]

    critic = LearnedCritic(Forgetful(specials=CHAT_SPECIALS, hidden=hidden), make_heads())
    with pytest.raises(RuntimeError, match="no hidden state"):
        critic.relevance([Branch(QUESTION, "", ROLLO)])


# --- choosing the source ------------------------------------------------------------------------


def test_auto_picks_learned_when_heads_are_given_and_the_model_has_hidden_states() -> None:
    heads = make_heads()
    assert isinstance(make_critic(chat_model(), "auto", heads=heads), LearnedCritic)
    assert isinstance(make_critic(chat_model(), "learned", heads=heads), LearnedCritic)
    assert isinstance(make_critic(chat_model(), "auto", heads=None), LikelihoodCritic)
    # Heads but an engine without hidden states: auto falls back to likelihood.
    assert isinstance(make_critic(chat_model(hidden=None), "auto", heads=heads), LikelihoodCritic)


def test_auto_prefers_the_native_reflection_tokens_over_heads() -> None:
    heads = make_heads()
    native = chat_model(specials=[*CHAT_SPECIALS, *NATIVE_PIECES])
    critic = make_critic(native, "auto", heads=heads)
    assert isinstance(critic, NativeCritic)
    chat_native = chat_model(specials=[*CHAT_SPECIALS, *NATIVE_PIECES, NATIVE_CHAT_LAYOUT])
    assert isinstance(make_critic(chat_native, "auto", heads=heads), NativeChatCritic)
    assert isinstance(make_critic(chat_native, "native"), NativeChatCritic)


def test_an_export_for_the_read_positions_of_an_earlier_selfrag_is_refused() -> None:
    earlier = chat_model(specials=[*CHAT_SPECIALS, *NATIVE_PIECES, *NATIVE_EARLIER_LAYOUTS])
    with pytest.raises(CritiqueUnavailable, match="export it again"):
        make_critic(earlier, "auto", heads=make_heads())


def test_native_chat_reads_reflection_tokens_in_the_chat_layout() -> None:
    def script(prompt: str, pieces: list[str]) -> dict[str, float]:
        return {"[Relevant]": 0.6, "[Irrelevant]": 0.2}

    model = chat_model(
        specials=[*CHAT_SPECIALS, *NATIVE_PIECES, NATIVE_CHAT_LAYOUT], script=script, hidden=None
    )
    critic = make_critic(model, "native")
    rel = critic.relevance([Branch(QUESTION, "", ROLLO)])[0]
    assert rel.probs == pytest.approx({"relevant": 0.6, "irrelevant": 0.2})
    request = model.score_requests[-1]
    assert not request.hidden_state
    assert sorted(model.pieces[c] for c in request.candidates) == ["[Irrelevant]", "[Relevant]"]
    prompt = model.prompts[-1]
    assert prompt.startswith("<|im_start|>system\n") and "Passage: " in prompt
    # Drafting stops at any reflection token, as the exported model emits them.
    critic.draft([Branch(QUESTION, "", ROLLO)], 8)
    stops = model.generate_requests[-1].stop_token_ids
    assert {model.pieces[t] for t in stops} == set(NATIVE_PIECES)


def test_learned_without_heads_says_to_train_them() -> None:
    with pytest.raises(ValueError, match="selfrag train"):
        make_critic(chat_model(), "learned")


def test_learned_needs_an_engine_with_hidden_states() -> None:
    with pytest.raises(ValueError, match="hidden states"):
        LearnedCritic(chat_model(hidden=None), make_heads())
    with pytest.raises(ValueError, match="hidden states"):
        make_critic(chat_model(hidden=None), "learned", heads=make_heads())


def test_learned_refuses_heads_of_another_hidden_size() -> None:
    model = chat_model(hidden=lambda text: [0.0] * 7)
    with pytest.raises(HeadsError, match="hidden size 4 for a model of hidden size 7"):
        LearnedCritic(model, make_heads())


# --- end to end through the decoder ---------------------------------------------------------------


def decode(heads: ReflectionHeads, **config: object) -> tuple[AnswerResponse, RecordingModel]:
    model = chat_model()
    critic = LearnedCritic(model, heads)
    decoder = BeamDecoder(lambda _: critic, ListRetriever([ROLLO, PARIS]), "word-model")
    cfg = DecodingConfig(**{"mode": "always", "top_k": 2, "max_segments": 1, **config})
    return decoder.answer(QUESTION, settle_filters(cfg, "learned")), model


def test_min_relevance_prunes_the_passage_the_head_calls_irrelevant() -> None:
    out, model = decode(make_heads(), min_relevance=0.5, min_support_score=0.3)
    assert out.critique == "learned"
    assert out.usage.branches_opened == 3
    assert out.usage.branches_pruned == 1
    drafted = [model.detokenize(r.prompt) for r in model.generate_requests]
    # Rollo's branch only: the no-evidence branch cannot pass min_support_score.
    assert len(drafted) == 1
    assert not any(PARIS.text in p for p in drafted)
    assert any(ROLLO.text in p for p in drafted)
    assert not out.abstained
    seg = out.segments[0]
    assert seg.citation is not None and seg.citation.passage_id == ROLLO.id
    assert seg.s_rel == pytest.approx(softmax([3, 0])[0])
    assert seg.is_sup == "full"

    # Without the threshold and the margin both passages are drafted.
    unpruned, model = decode(
        make_heads(), min_relevance=0.0, relevance_margin=1.0, max_drafts=50, min_support_score=0.3
    )
    assert unpruned.usage.branches_pruned == 0
    assert len(model.generate_requests) == 2
    # A margin alone prunes Paris too: it is far below Rollo.
    margin, _ = decode(make_heads(), min_relevance=0.0, relevance_margin=0.2)
    assert margin.usage.branches_pruned == 1


def test_min_support_abstains_when_the_support_head_says_none_for_every_branch() -> None:
    out, _ = decode(
        make_heads(support=SUPPORT_ALWAYS_NONE),
        min_support="partial",
        min_relevance=0.0,
        relevance_margin=1.0,
        max_drafts=50,
    )
    assert out.abstained
    assert out.answer == ABSTAIN_MESSAGE
    # Both evidence branches fail the filter, and so does the no-evidence branch of the step.
    assert out.usage.branches_filtered == 3

    # The same heads without the filter answer; grounded support heads pass the filter.
    unfiltered, _ = decode(
        make_heads(support=SUPPORT_ALWAYS_NONE), min_support="none", min_support_score=0.0
    )
    assert not unfiltered.abstained and unfiltered.answer == DRAFT.strip()
    grounded, _ = decode(make_heads(), min_support="partial")
    assert not grounded.abstained
    assert grounded.segments[0].citation is not None
    assert grounded.segments[0].citation.passage_id == ROLLO.id


def test_unset_filters_are_off_without_a_calibration() -> None:
    out, _ = decode(make_heads())
    assert (out.config.min_relevance, out.config.relevance_margin) == (0.0, 1.0)
    assert (out.config.min_support, out.config.min_support_score) == ("none", 0.0)
    # A request's own values win, and other critiques keep filters off by default.
    assert settle_filters(DecodingConfig(min_support_score=0.1), "learned").min_support_score == 0.1
    plain = settle_filters(DecodingConfig(), "likelihood")
    assert (plain.min_relevance, plain.min_support, plain.min_support_score) == (0.0, "none", 0.0)


def test_min_support_score_filters_grounded_branches_by_s_sup() -> None:
    out, _ = decode(make_heads(support=SUPPORT_ALWAYS_NONE), min_support_score=0.3)
    assert out.abstained
    passed, _ = decode(make_heads(), min_support_score=0.3)
    assert not passed.abstained and passed.segments[0].s_sup >= 0.3
