"""runtime/assembly.py: a decoder put together from where its parts live answers with the
critique the settled config names, the parts' retriever and ranker, and reports each step."""

from __future__ import annotations

from selfrag.pipeline.critics import settle_filters
from selfrag.pipeline.protocols import Passage
from selfrag.pipeline.ranking import rank_step
from selfrag.runtime.assembly import DecoderParts
from selfrag.schemas.decoding import DecodingConfig
from tests.fakes import ListRetriever, ScriptedCritic

PASSAGES = [
    Passage("p1", "Rollo was the first ruler of Normandy.", "Rollo", 0.9),
    Passage("p2", "Bananas are yellow.", "Banana", 0.5),
]


def _critic() -> ScriptedCritic:
    return ScriptedCritic(
        relevance_of={"p1": 0.9, "p2": 0.1},
        drafts={"p1": (" Rollo ruled first.", -1.0, "eos"), None: (" No idea.", -3.0, "eos")},
        support_of={"p1": {"full": 0.9, "partial": 0.05, "none": 0.05}},
    )


def _config() -> DecodingConfig:
    return settle_filters(DecodingConfig(max_segments=1, top_k=2, critique="learned"), "learned")


def test_the_parts_answer_with_the_critique_the_config_names():
    critic, asked = _critic(), []

    def critique(name: str) -> ScriptedCritic:
        asked.append(name)
        return critic

    retriever = ListRetriever(list(PASSAGES))
    parts = DecoderParts(critique=critique, retriever=retriever, model_id="tiny-model")
    steps = []
    out = parts.decode("Who ruled Normandy first?", _config(), on_step=steps.append)
    assert set(asked) == {"learned"}
    assert retriever.queries and critic.calls
    assert (out.model_id, out.critique) == ("tiny-model", "scripted")
    assert out.answer == "Rollo ruled first."
    assert out.segments[0].citation is not None
    assert out.segments[0].citation.passage_id == "p1"
    assert steps, "each decoding step is reported to the listener"


def test_the_ranker_of_the_parts_ranks_every_step():
    calls = []

    def ranker(*args):  # type: ignore[no-untyped-def]
        calls.append(args)
        return rank_step(*args)

    parts = DecoderParts(
        critique=lambda _: _critic(),
        retriever=ListRetriever(list(PASSAGES)),
        model_id="tiny-model",
        ranker=ranker,
    )
    assert parts.decode("Who ruled Normandy first?", _config()).answer == "Rollo ruled first."
    assert calls
    assert DecoderParts(lambda _: _critic(), ListRetriever([]), "m").ranker is rank_step
