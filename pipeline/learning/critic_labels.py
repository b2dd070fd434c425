"""Support labels from a critic model, for training the reflection heads of another.

The critic is a second model (typically the larger preset), read only: for each support
example (a passage, a question, a segment) it answers the critique's own verification question
(`pipeline.critics.verify.verified_support`: p(yes) that the passage states the segment,
times the share of the segment's numbers and names its passage or question holds). That
verified s_sup becomes the label by fixed bands (`SupportBands`): `full` from 2/3, `none` up to
1/3, `partial` between — thirds of the probability scale, so that full and none, the pair the
head's s_sup contrasts, go to examples the critic judges clearly one way.

Which examples (`CriticPlan.mode`):

* `replace`: every support example is labelled by the critic — the constructed ones
  (`reflection_data.support_examples`: sentence, swap, blend) and the target model's own
  drafts on label-free question/passage pairs of the corpus (`synthetic_qa.synthetic_pairs`:
  answerable pairs and their traps), which no construction can label, since whether a draft is
  right is unknown, and which look like what the critique reads at inference;
* `add`: the constructed examples keep their construction labels; the drafts are added with
  the critic's.

Each verified s_sup is kept in a `LabelCache` under a key of the critic's fingerprint and the
example's text, so that a rerun with the same critic reads only examples it has not seen.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from selfrag.pipeline.branching import StepWork, draft_past_echoes, drafted_something
from selfrag.pipeline.critics.base import Branch, Critic
from selfrag.pipeline.critics.verify import VerifyReader, verified_support, verified_support_id
from selfrag.pipeline.learning.reflection_data import Example
from selfrag.pipeline.learning.synthetic_qa import SyntheticPair, synthetic_pairs
from selfrag.pipeline.protocols import Generation, LanguageModel, Passage
from selfrag.pipeline.scoring import support_score

CriticMode = Literal["replace", "add"]
CRITIC_MODES: tuple[str, ...] = ("replace", "add")
DRAFT_SOURCE = "critic-draft"
"""The source prefix of the drafted examples (`critic-draft-answerable`, `critic-draft-entity`…)."""


@dataclass(frozen=True)
class SupportBands:
    """The IsSup label of a verified s_sup: full at or above `full_at`, none at or below
    `none_at`, partial between."""

    full_at: float = 2 / 3
    none_at: float = 1 / 3

    def __post_init__(self) -> None:
        if not 0.0 <= self.none_at < self.full_at <= 1.0:
            raise ValueError(f"bands need 0 <= none_at < full_at <= 1, got {self}")

    def label(self, s_sup: float) -> str:
        if s_sup >= self.full_at:
            return "full"
        if s_sup <= self.none_at:
            return "none"
        return "partial"


@dataclass(frozen=True)
class CriticPlan:
    """What the critic labels, and how its reads are batched."""

    mode: CriticMode = "replace"
    questions: int = 30
    """Synthetic questions whose pairs (answerable and traps) the target model drafts on."""
    draft_tokens: int = 48
    batch: int = 8
    bands: SupportBands = SupportBands()


class LabelCache(Protocol):
    """Verified s_sup values by example key, kept between runs."""

    def get(self, key: str) -> float | None: ...

    def put(self, values: dict[str, float]) -> None: ...


def critic_fingerprint(model_identity: str) -> str:
    """The identity the cache keys a critic's reads by: the model file's identity and the
    verification question with its grounding rule (`verified_support_id`: either changed
    reads differently)."""
    return f"{model_identity} verify:{verified_support_id()}"


def example_key(fingerprint: str, ex: Example) -> str:
    """The cache key of a support example read by the critic of `fingerprint`."""
    p = ex.branch.passage
    parts = [fingerprint, ex.branch.question, p.title or "", p.text] if p else [fingerprint]
    return hashlib.sha256("\0".join([*parts, ex.answer]).encode()).hexdigest()


def draft_examples(
    drafter: Critic, pairs: Sequence[SyntheticPair], plan: CriticPlan
) -> list[Example]:
    """The target model's drafts on `pairs`, as support examples without a label yet (the
    empty label), drafted as the decoder drafts: past an echo of the question, and an empty
    draft or a loop dropped, as the decoder drops such a branch."""
    out: list[Example] = []
    for start in range(0, len(pairs), plan.batch):
        chunk = pairs[start : start + plan.batch]
        branches = [Branch(p.question.question, "", p.passage) for p in chunk]
        # Training keeps no token counts.
        drafts = draft_past_echoes(drafter, branches, plan.draft_tokens, StepWork())
        for pair, b, d in zip(chunk, branches, drafts, strict=True):
            if drafted_something(d):
                source = f"{DRAFT_SOURCE}-{pair.trap or 'answerable'}"
                out.append(
                    Example("support", "", b, d.text.strip(), source, pair.question.passage.id)
                )
    return out


class CriticLabeller:
    """Labels support examples with a critic model's verified s_sup (see the module's
    docstring); called by training with the examples it built and the target's critic."""

    def __init__(
        self,
        model: LanguageModel,
        fingerprint: str,
        cache: LabelCache,
        plan: CriticPlan = CriticPlan(),
        *,
        name: str = "",
        progress: Callable[[int, int], None] = lambda done, total: None,
    ) -> None:
        """`fingerprint`: `critic_fingerprint` of the critic model; `name`: how the heads'
        manifest names it; `progress(done, total)`: called after each batch of reads."""
        self._model = model
        self._reader = VerifyReader(model)
        self.fingerprint = fingerprint
        self._cache = cache
        self.plan = plan
        self.name = name or model.model_id
        self._progress = progress
        self.reads = 0
        self.read_seconds = 0.0

    def scores(self, examples: Sequence[Example]) -> list[float]:
        """The critic's verified s_sup of each support example: cached, else read (in
        batches, examples of one passage together, so the engine reuses its head)."""
        keys = [example_key(self.fingerprint, ex) for ex in examples]
        known = {k: v for k in dict.fromkeys(keys) if (v := self._cache.get(k)) is not None}
        todo = sorted(
            {k: ex for k, ex in zip(keys, examples, strict=True) if k not in known}.items(),
            key=lambda item: _passage_text(item[1]),
        )
        self._progress(0, len(todo))
        started = time.monotonic()
        for start in range(0, len(todo), self.plan.batch):
            chunk = todo[start : start + self.plan.batch]
            branches = [ex.branch for _, ex in chunk]
            drafts = [self._generation(ex.answer) for _, ex in chunk]
            read = {
                k: support_score(s.probs)
                for (k, _), s in zip(
                    chunk, verified_support(self._reader, branches, drafts), strict=True
                )
            }
            self._cache.put(read)
            known.update(read)
            self._progress(start + len(chunk), len(todo))
        self.reads += len(todo)
        self.read_seconds += time.monotonic() - started
        return [known[k] for k in keys]

    def _generation(self, text: str) -> Generation:
        tokens = self._model.tokenize(text, special=False)
        return Generation(tokens, text, [0.0] * len(tokens), "stop", 0)

    def __call__(
        self,
        examples: Sequence[Example],
        drafter: Critic,
        passages: Sequence[Passage],
        search: Callable[[str, int], list[Passage]],
        seed: int,
    ) -> tuple[list[Example], dict[str, Any]]:
        """`examples` with the critic's support labels (by the plan's mode) and the target's
        drafts on synthetic pairs of `passages` added; and what the manifest records."""
        pairs = synthetic_pairs(passages, search, self.plan.questions, random.Random(seed))
        drafted = draft_examples(drafter, pairs, self.plan)
        constructed = [i for i, ex in enumerate(examples) if ex.group == "support"]
        chosen = constructed if self.plan.mode == "replace" else []
        to_read = [examples[i] for i in chosen] + drafted
        values = self.scores(to_read)
        labels = [self.plan.bands.label(v) for v in values]
        out = list(examples)
        agree = 0
        for i, label in zip(chosen, labels[: len(chosen)], strict=True):
            agree += examples[i].label == label
            out[i] = replace(examples[i], label=label)
        drafted_labelled = [
            replace(ex, label=label)
            for ex, label in zip(drafted, labels[len(chosen) :], strict=True)
        ]
        return out + drafted_labelled, self.describe(
            values, labels, chosen, drafted_labelled, agree
        )

    def describe(
        self,
        values: Sequence[float],
        labels: Sequence[str],
        relabelled: Sequence[int],
        drafted: Sequence[Example],
        agree: int,
    ) -> dict[str, Any]:
        """The manifest's record of the labelling."""
        by_source: dict[str, dict[str, int]] = {}
        for ex in drafted:
            counts = by_source.setdefault(ex.source, {})
            counts[ex.label] = counts.get(ex.label, 0) + 1
        return {
            "model": self.name,
            "fingerprint": self.fingerprint,
            "mode": self.plan.mode,
            "bands": {"full_at": self.plan.bands.full_at, "none_at": self.plan.bands.none_at},
            "labelled": len(values),
            "read": self.reads,
            "cached": len(values) - min(self.reads, len(values)),
            "read_seconds": round(self.read_seconds, 1),
            "labels": {b: labels.count(b) for b in ("full", "partial", "none")},
            "relabelled_constructed": len(relabelled),
            "agreement_with_construction": round(agree / len(relabelled), 3)
            if relabelled
            else None,
            "drafted": by_source,
        }


def _passage_text(ex: Example) -> str:
    return ex.branch.passage.text if ex.branch.passage is not None else ""
