"""pipeline/learning/critic_labels.py: a critic model's verification read labels support."""

from __future__ import annotations

import pytest

from selfrag.pipeline.critics import Branch
from selfrag.pipeline.learning.critic_labels import (
    DRAFT_SOURCE,
    CriticLabeller,
    CriticPlan,
    SupportBands,
    critic_fingerprint,
    draft_examples,
    example_key,
)
from selfrag.pipeline.learning.reflection_data import Example
from selfrag.pipeline.learning.synthetic_qa import SyntheticPair, SyntheticQuestion
from selfrag.pipeline.protocols import Passage
from tests.fakes import ListRetriever, ScriptedCritic, WordModel, echo_or_loop

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROLLO = Passage("p1", "Rollo founded Normandy in 911.", "Normans", 0.9)
PASSAGES = [
    Passage(
        f"w{i}",
        f"The town of Alder{i} was founded by Bertram Vale in 1{i}05. It grew slowly after "
        f"the war with the king. Its market opened when Harold Stone arrived in 1{i}21.",
        f"Alder{i}",
    )
    for i in range(6)
]


def judge(prompt: str, pieces: list[str]) -> dict[str, float]:
    """Yes (0.9) when the claim names Rollo or is the town's founder, 0.5 when it names only
    Normandy, else 0.1."""
    if "Does the passage state" not in prompt:
        return {}
    claim = prompt.rsplit('is "', 1)[1].split('"', 1)[0]
    yes = 0.9 if "Rollo" in claim or "Bertram" in claim else 0.5 if "Normandy" in claim else 0.1
    return {"yes": yes, "no": 1.0 - yes}


def critic_model() -> WordModel:
    return WordModel(specials=["<|im_start|>", "<|im_end|>"], template=CHATML, script=judge)


class DictCache:
    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.puts = 0

    def get(self, key: str) -> float | None:
        return self.values.get(key)

    def put(self, values: dict[str, float]) -> None:
        self.puts += 1
        self.values.update(values)


def support(label: str, answer: str, passage: Passage = ROLLO) -> Example:
    return Example("support", label, Branch("Who founded it?", "", passage), answer, "x", "k")


def test_bands_cut_the_scale_in_thirds():
    bands = SupportBands()
    assert [bands.label(s) for s in (0.0, 1 / 3, 0.34, 0.5, 0.66, 2 / 3, 1.0)] == [
        "none",
        "none",
        "partial",
        "partial",
        "partial",
        "full",
        "full",
    ]
    assert SupportBands(0.5, 0.5 - 1e-9).label(0.5) == "full"
    with pytest.raises(ValueError, match="bands"):
        SupportBands(full_at=0.3, none_at=0.6)


def test_the_key_changes_with_the_critic_and_the_text():
    fp = critic_fingerprint("m sha256:ab")
    assert fp.startswith("m sha256:ab verify:")
    ex = support("full", "Rollo.")
    assert example_key(fp, ex) == example_key(fp, support("none", "Rollo."))  # label not keyed
    assert example_key(fp, ex) != example_key(critic_fingerprint("other"), ex)
    assert example_key(fp, ex) != example_key(fp, support("full", "Hastein."))


def test_scores_are_the_verified_support_and_are_read_once():
    model, cache = critic_model(), DictCache()
    seen: list[tuple[int, int]] = []
    labeller = CriticLabeller(
        model, "fp", cache, CriticPlan(batch=2), progress=lambda d, t: seen.append((d, t))
    )
    examples = [
        support("full", "Rollo."),
        support("none", "It was in 911."),
        support("x", "In 876."),
    ]
    first = labeller.scores(examples)
    # The third names a number its passage lacks: grounding zeroes it, as in the critique.
    assert first == pytest.approx([0.9, 0.1, 0.0])
    assert seen[0] == (0, 3) and seen[-1] == (3, 3) and labeller.reads == 3
    reads = len(model.prompts)
    again = CriticLabeller(model, "fp", cache).scores([*examples, support("y", "Rollo did.")])
    assert again[:3] == first and len(model.prompts) == reads + 1


def labelled(mode: str) -> tuple[list[Example], dict]:
    constructed = [
        support("full", "Rollo founded Normandy."),  # the critic agrees
        support("full", "Normandy was founded."),  # the critic hesitates: partial
        support("none", "Hastein founded Normandy."),  # agrees
        Example("relevance", "relevant", Branch("q", "", ROLLO), source="ict", key="p1"),
    ]
    drafter = ScriptedCritic(
        drafts={
            "w0": (" Bertram Vale.", -1.0, "eos"),
            "w1": (" Nobody.", -1.0, "eos"),
            "w2": ("  ", -1.0, "eos"),  # empty: dropped
        }
    )
    labeller = CriticLabeller(
        critic_model(), "fp", DictCache(), CriticPlan(mode=mode, questions=3), name="critic.gguf"
    )
    return labeller(constructed, drafter, PASSAGES, ListRetriever(PASSAGES).search, 0)


def test_replace_labels_every_support_example_and_adds_the_drafts():
    out, info = labelled("replace")
    assert [ex.label for ex in out[:4]] == ["full", "partial", "none", "relevant"]
    drafted = [ex for ex in out if ex.source.startswith(DRAFT_SOURCE)]
    assert drafted and all(ex.group == "support" and ex.answer.strip() for ex in drafted)
    assert {ex.label for ex in drafted} <= {"full", "partial", "none"}
    assert len(out) == 4 + len(drafted)
    assert info["model"] == "critic.gguf" and info["mode"] == "replace"
    assert info["relabelled_constructed"] == 3 and info["agreement_with_construction"] == 0.667
    assert info["labelled"] == 3 + len(drafted) == info["read"]
    assert sum(info["labels"].values()) == info["labelled"]
    assert sum(sum(c.values()) for c in info["drafted"].values()) == len(drafted)


def test_add_keeps_the_construction_labels_and_labels_the_drafts():
    out, info = labelled("add")
    assert [ex.label for ex in out[:4]] == ["full", "full", "none", "relevant"]
    assert info["relabelled_constructed"] == 0 and info["agreement_with_construction"] is None
    drafted = [ex for ex in out if ex.source.startswith(DRAFT_SOURCE)]
    assert info["labelled"] == len(drafted) > 0
    assert all(ex.label for ex in drafted)


class EchoingLoopingDrafter(ScriptedCritic):
    """Loops on w0, echoes the question once on w1, answers on the others."""

    def draft(self, branches, max_tokens):  # type: ignore[no-untyped-def]
        drafts = super().draft(branches, max_tokens)
        return echo_or_loop(branches, drafts, loop_on="w0", echo_on="w1")


def test_the_drafts_to_label_are_drafted_as_the_decoder_drafts() -> None:
    """An echo of the question drafts again past it, and a loop is no draft to label."""
    pairs = [
        SyntheticPair(SyntheticQuestion("Who founded it?", "Bertram Vale", "name", p), p, True)
        for p in PASSAGES[:3]
    ]
    drafted = draft_examples(EchoingLoopingDrafter(), pairs, CriticPlan())
    assert [ex.branch.passage.id for ex in drafted if ex.branch.passage] == ["w1", "w2"]
    assert [ex.answer for ex in drafted] == ["An answer.", "An answer."]
