"""runtime/relevance.py: retrieval without drafting ranks the store's passages by the critique's
s_rel (ties in the store's order) and reports each passage with its read, or keeps the store's
order reading nothing; a ranked passage comes back as the pipeline's passage."""

from __future__ import annotations

from selfrag.pipeline.protocols import Passage
from selfrag.runtime.relevance import as_passage, ranked_passages
from tests.fakes import ListRetriever, ScriptedCritic


def _passages() -> list[Passage]:
    return [
        Passage("a", "Alpha text.", title="A", score=0.9, metadata={"url": "https://a.example"}),
        Passage("b", "Beta text.", title="B", score=0.8),
        Passage("c", "Gamma text.", title="C", score=0.7),
        Passage("d", "Delta text.", title="D", score=0.6),
    ]


def test_passages_come_most_relevant_first_with_their_read_and_store_fields():
    search = ListRetriever(_passages())
    critic = ScriptedCritic(relevance_of={"a": 0.2, "b": 0.9, "c": 0.6, "d": 0.95})
    ranked = ranked_passages("Who?", search, 3, critic.relevance)
    assert search.queries == ["Who?"]
    assert [(p.id, p.s_rel) for p in ranked] == [("b", 0.9), ("c", 0.6), ("a", 0.2)]
    top, last = ranked[0], ranked[-1]
    assert (top.title, top.text, top.score, top.url) == ("B", "Beta text.", 0.8, None)
    assert last.url == "https://a.example"
    assert critic.calls == ["relevance:3"]


def test_equal_reads_keep_the_stores_order():
    critic = ScriptedCritic(relevance_of={"a": 0.5, "b": 0.5, "c": 0.5, "d": 0.5})
    ranked = ranked_passages("Q?", ListRetriever(_passages()), 4, critic.relevance)
    assert [p.id for p in ranked] == ["a", "b", "c", "d"]


def test_no_passage_found_asks_the_critic_nothing():
    critic = ScriptedCritic()
    assert ranked_passages("Q?", ListRetriever([]), 5, critic.relevance) == []
    assert critic.calls == []


def test_the_stores_order_reads_nothing_and_a_passage_comes_back_whole():
    search = ListRetriever(_passages())
    ranked = ranked_passages("Who?", search, 2, None)
    assert [(p.id, p.s_rel) for p in ranked] == [("a", None), ("b", None)]
    first = _passages()[0]
    passage = Passage(
        first.id, first.text, first.title, first.score, {**first.metadata, "collection": "w"}, 0.7
    )
    again = as_passage(ranked_passages("Who?", ListRetriever([passage]), 1, None)[0])
    assert again == passage
    assert again.shown() == passage.shown()
