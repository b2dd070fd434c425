"""A step's branch work when the drafted passages fail the hard filters, or pass them flagged:
the next ones draft; a draft that only repeats the question drafts again past its echo, and one
stuck in a loop counts as drafting nothing."""

from dataclasses import replace

from selfrag.pipeline.branching import expand
from selfrag.pipeline.critics import Branch, settle_filters
from selfrag.pipeline.protocols import Passage
from selfrag.pipeline.ranking import Candidate
from selfrag.schemas.decoding import DecodingConfig
from tests.fakes import ScriptedCritic

PASSAGES = [Passage(f"p{i}", f"Passage {i}.", f"T{i}", 1.0 - i / 10) for i in (1, 2, 3, 4)]
WEAK, STRONG = {"full": 0.1, "none": 0.9}, {"full": 0.9, "none": 0.1}


def step(parents: int = 1) -> list[Candidate]:
    """A retrieval step's candidates: the four passages and the no-evidence branch, per
    hypothesis, in the retriever's order."""
    out = []
    for parent in range(parents):
        for p in [*PASSAGES, None]:
            out.append(Candidate(parent, Branch("q", "", p), True, 0.9))
    return out


def config(**dials) -> DecodingConfig:
    dials = {"min_support_score": 0.5, "retry_drafts": 2, **dials}
    return settle_filters(DecodingConfig(**dials), "scripted")


def drafted_ids(work) -> list[str | None]:
    return [d.citation.passage_id if d.citation else None for d in work.drafted]


def test_the_next_more_relevant_passage_drafts_only_while_the_drafted_ones_fail():
    critic = ScriptedCritic(
        relevance_of={"p1": 0.6, "p2": 0.7, "p3": 0.8, "p4": 0.65},
        support_of={"p1": WEAK, "p2": WEAK, "p3": STRONG, "p4": STRONG},
    )
    work = expand(critic, step(), config())
    # p1 fails; p2 then p3 read more relevant than every failed draft; p3 passes. p4 reads
    # more relevant than p1 but not than p2, and never drafts.
    assert drafted_ids(work) == ["p1", "p2", "p3"]
    assert [c for c in critic.calls if c.startswith("draft")] == ["draft:1"] * 3
    assert work.pruned == 1 and work.filtered == 1  # p4; the no-evidence branch
    # p1 reads relevant enough that no other passage could go before it, so the others are
    # read only once it failed.
    assert [c for c in critic.calls if c.startswith("relevance")] == ["relevance:1", "relevance:3"]

    critic = ScriptedCritic(relevance_of={"p1": 0.6}, support_of={"p1": STRONG})
    assert drafted_ids(expand(critic, step(), config())) == ["p1"]
    assert [c for c in critic.calls if c.startswith("relevance")] == ["relevance:1"]


def test_no_passage_read_as_relevant_as_a_failed_one_drafts_after_it():
    critic = ScriptedCritic(
        relevance_of={"p1": 0.8, "p2": 0.7, "p3": 0.8, "p4": 0.2},
        support_of={p.id: WEAK for p in PASSAGES},
    )
    work = expand(critic, step(), config())
    assert drafted_ids(work) == ["p1"]
    assert work.pruned == 3


def test_retries_stop_at_retry_drafts_and_at_zero_none_happen():
    relevance = {"p1": 0.6, "p2": 0.7, "p3": 0.8, "p4": 0.9}
    for retries, expected in ((0, ["p1"]), (1, ["p1", "p2"]), (5, ["p1", "p2", "p3", "p4"])):
        critic = ScriptedCritic(relevance_of=relevance, support_of={p.id: WEAK for p in PASSAGES})
        work = expand(critic, step(), config(retry_drafts=retries))
        assert drafted_ids(work) == expected, retries
        assert work.pruned == 4 - len(expected)


def test_without_a_hard_filter_a_draft_passes_unless_it_drafted_nothing():
    critic = ScriptedCritic(support_of={p.id: WEAK for p in PASSAGES})
    work = expand(critic, step(), config(min_support_score=0.0))
    assert drafted_ids(work) == ["p1", None]  # the no-evidence branch drafts: it can win
    critic = ScriptedCritic(drafts={"p1": ("  ", -1.0, "eos")})
    work = expand(critic, step(), config(min_support_score=0.0))
    assert drafted_ids(work) == [None, "p2"]


def test_a_flagged_draft_that_passes_the_filters_has_the_next_more_relevant_passage_draft():
    # No support threshold: p1's draft passes, but reads low support; p2 reads no more
    # relevant than p1, p3 does; p3's draft is clean, so p4 never drafts.
    relevance = {"p1": 0.6, "p2": 0.5, "p3": 0.8, "p4": 0.9}
    support = {"p1": WEAK, "p2": STRONG, "p3": STRONG, "p4": STRONG}
    critic = ScriptedCritic(relevance_of=relevance, support_of=support)
    work = expand(critic, step(), config(min_support_score=0.0, retry_flagged=True))
    assert drafted_ids(work) == ["p1", None, "p3"]
    assert [c for c in critic.calls if c.startswith("draft")] == ["draft:2", "draft:1"]
    # Off (the default), the flagged draft is the step's: nothing more drafts.
    critic = ScriptedCritic(relevance_of=relevance, support_of=support)
    work = expand(critic, step(), config(min_support_score=0.0))
    assert drafted_ids(work) == ["p1", None]
    # On, a clean first draft costs nothing more.
    critic = ScriptedCritic(relevance_of=relevance, support_of={"p1": STRONG})
    work = expand(critic, step(), config(min_support_score=0.0, retry_flagged=True))
    assert drafted_ids(work) == ["p1", None]


def test_a_draft_naming_what_its_passage_lacks_counts_as_flagged():
    # Fully supported by the read, but "Rollo" is in neither passage 1's title nor text.
    relevance = {"p1": 0.6, "p2": 0.8}
    drafts = {"p1": (" It was Rollo.", -1.0, "eos"), "p2": (" It was passage 2.", -1.0, "eos")}
    critic = ScriptedCritic(
        relevance_of=relevance, drafts=drafts, support_of={p.id: STRONG for p in PASSAGES}
    )
    work = expand(critic, step(), config(retry_flagged=True))
    assert drafted_ids(work) == ["p1", "p2"]
    assert [d.unsupported_terms for d in work.drafted] == [("Rollo",), ()]


def test_retries_follow_the_draft_order_past_the_relevance_filter_per_hypothesis():
    # Under a relevance filter every passage is read at once, and p2 is pruned: it never
    # drafts, however the others fail. p4 is not promoted past p1 (by draft_order_margin).
    critic = ScriptedCritic(
        relevance_of={"p1": 0.6, "p2": 0.05, "p3": 0.7, "p4": 0.9},
        support_of={p.id: WEAK for p in PASSAGES},
    )
    work = expand(critic, step(), config(min_relevance=0.1, retry_drafts=50))
    assert drafted_ids(work) == ["p1", "p3", "p4"]
    assert work.pruned == 1
    assert [c for c in critic.calls if c.startswith("relevance")] == ["relevance:4"]
    # Two hypotheses: each drafts its own next passage, in one call per round.
    critic = ScriptedCritic(
        relevance_of={"p1": 0.6, "p2": 0.7}, support_of={"p1": WEAK, "p2": STRONG}
    )
    work = expand(critic, step(parents=2), config())
    assert [(d.parent, d.citation.passage_id) for d in work.drafted] == [
        (0, "p1"),
        (1, "p1"),
        (0, "p2"),
        (1, "p2"),
    ]
    assert [c for c in critic.calls if c.startswith("draft")] == ["draft:2", "draft:2"]


class EchoingCritic(ScriptedCritic):
    """Drafts the question back, labelled, unless the answer so far already repeated it."""

    def draft(self, branches, max_tokens):
        out = super().draft(branches, max_tokens)
        return [
            g if b.prefix else replace(g, text=f"Question: {b.question}", tokens=[0, 1, 2])
            for b, g in zip(branches, out, strict=True)
        ]


def test_a_draft_that_only_repeats_the_question_drafts_again_past_its_echo():
    critic = EchoingCritic(support_of={"p1": STRONG})
    candidates = step()
    for c in candidates:
        c.branch = replace(c.branch, question="Which port is the default?")
    work = expand(critic, candidates, config(min_support_score=0.0))
    first = work.drafted[0]
    assert first.citation is not None and first.citation.passage_id == "p1"
    assert first.text == " An answer."
    # Both draft calls' prompts and the echo's tokens are paid for (beside p1's relevance read,
    # its support read and both utility reads).
    assert [c for c in critic.calls if c.startswith("draft")] == ["draft:2", "draft:2"]
    assert work.decode_tokens == 2 * (3 + 2)
    assert work.prefill_tokens == 4 * 30 + 20 + 5 + 2 * 5


def test_a_draft_stuck_in_a_loop_counts_as_drafting_nothing():
    loop = ("The answer is: " * 8, -1.0, "length")
    critic = ScriptedCritic(drafts={"p1": loop}, support_of={"p2": STRONG})
    work = expand(critic, step(), config())
    # p1's loop is not critiqued and does not stand; the next passage drafts in its place.
    assert drafted_ids(work) == ["p2"]
    assert [c for c in critic.calls if c.startswith("support")] == ["support:0", "support:1"]
