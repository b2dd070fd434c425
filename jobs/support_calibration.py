"""Calibrate the support threshold on the served corpus, without labels.

For each synthetic pair (`pipeline.learning.synthetic_qa`: a question written from a sampled
passage's
sentence, with its own passage, with a near neighbour lacking its answer, or perturbed into a
trap on its own passage) the system's own
critique does what the decoder does for a first-step evidence branch, `Branch(question, "",
passage)`: relevance, then a draft of `max_segment_tokens`, then support, and s_sup is
`pipeline.scoring.support_score` of that, weighed by the passage's similarity to the question
(`pipeline.scoring.evidence_support`, as the decoder's filter weighs it). The critic is the one
the system serves (`LocalRuntime.critic`: heads, answerability model and all). The threshold is
`choose_threshold` of the two score lists: the highest that abstains on at most
`max_answerable_abstain` of the answerable pairs. An index of several collections (corpus
files) is sampled and thresholded per collection, since the score's scale moves between
collections: answers hold a passage to its collection's own threshold, and passages of a
collection without one to the lowest (`min_support_score`), which keeps the budget in each.

Only the answerable pairs set the thresholds, so only they are read by default; the unanswerable
pairs, which say how well the score separates (AUROC, what the threshold abstains on among
them), are read on request (`report`). The pairs are read in batches of `batch`, each one
multi-sequence engine call per critique step. Cost: the pairs read times three critique calls,
whatever the corpus size (the passages are sampled in one pass over the index).

How many: each corpus file's threshold is the (floor(b*n) + 1)-th lowest of its n answerable
scores (`choose_threshold`, budget b). Whatever the scores' distribution, the share of new pairs
drawn the same way that fall below the r-th lowest of n follows Beta(r, n + 1 - r): mean
r/(n + 1), and P(share > e) = P(Binomial(n, e) < r). With b = 5%, n = 20 is the fewest pairs
for which the threshold is not the single lowest score (the draw's least steady statistic) and
the mean share stays under 10%: 2/21 = 9.5%, more than 20% in 7% of draws
(notes/first-answer.md).
"""

from __future__ import annotations

import itertools
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from selfrag.infra.calibration_files import save_calibration
from selfrag.jobs.threshold_status import describe_calibration
from selfrag.pipeline.branching import read_evidence_branches
from selfrag.pipeline.critics import Branch
from selfrag.pipeline.learning.logistic_fit import auc
from selfrag.pipeline.learning.synthetic_qa import (
    QuestionStyle,
    SyntheticPair,
    ThresholdChoice,
    choose_threshold,
    lowest_threshold,
    question_pairs,
    sample_by_collection,
    summary,
    threshold_effect,
)
from selfrag.pipeline.protocols import COLLECTION, Passage
from selfrag.pipeline.scoring import evidence_support
from selfrag.schemas.calibration import SupportCalibration
from selfrag.schemas.decoding import DecodingConfig

if TYPE_CHECKING:
    from selfrag.runtime.system import LocalRuntime

MIN_ANSWERABLE = 8
"""Fewer answerable pairs than this (a tiny corpus, or a time limit hit early) calibrate
nothing: a quantile of so few scores is noise. A collection with fewer gets no threshold of its
own (its pairs still count in the summary)."""
MIN_QUESTIONS_PER_COLLECTION = 20
"""Questions written per collection at least: the n of the module's bound (a 9.5% mean share of
new answerable pairs below the threshold at the 5% budget)."""


class CalibrationSkipped(ValueError):
    """The corpus gave too few pairs to calibrate on (the message says how many)."""


@dataclass(frozen=True)
class CorpusCalibrationPlan:
    """How many pairs, drawn how, and which are read. The defaults read 20 answerable pairs per
    corpus file, whatever its size (notes/first-answer.md has the measured time)."""

    questions: int = MIN_QUESTIONS_PER_COLLECTION
    """Questions written in all (at least MIN_QUESTIONS_PER_COLLECTION per collection); each
    gives an answerable pair and, mostly, unanswerable ones."""
    seed: int = 0
    style: QuestionStyle = "wh"
    max_answerable_abstain: float = 0.05
    """The share of synthetic answerable pairs the threshold may abstain on. Real questions
    that reuse fewer of the passage's words than the synthetic ones abstain more often than
    this (notes/evaluation.md has the measured gap), so it is kept small: an abstention on an
    answerable question costs a right answer."""
    time_limit_s: float = 900.0
    """Stop reading pairs after this long and calibrate on those read (if enough). A guard
    for a model or machine far slower than expected, not a budget: a threshold read from part
    of the pairs is noisier, so the limit sits well above the unloaded time of the default
    model (notes/evaluation.md has it)."""
    batch: int = 8
    """Pairs per critique call (the engine decodes them together, as the decoder's branches)."""
    report: bool = False
    """Also read the unanswerable pairs: the AUROC and what the threshold abstains on among
    them, which the threshold does not depend on."""


@dataclass(frozen=True)
class PairScore:
    """One pair as the critique read it."""

    pair: SyntheticPair
    s_rel: float
    s_sup: float | None
    """None when the draft was empty or a loop (the decoder drops such a branch)."""
    similarity: float
    """The retriever's similarity of the pair's passage to its question."""
    pruned: bool
    """Whether the source's default relevance filter would prune it before drafting."""

    @property
    def score(self) -> float | None:
        """What the support threshold is compared with (`evidence_support`)."""
        return None if self.s_sup is None else evidence_support(self.s_sup, self.similarity)


def score_pairs(
    rag: LocalRuntime,
    critique: str,
    pairs: list[SyntheticPair],
    plan: CorpusCalibrationPlan,
    *,
    progress: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> list[PairScore]:
    """Relevance, draft and support of each pair's first-step branch, by the system's
    critique `critique` (a source name or `auto`), `plan.batch` pairs per engine call, until
    `plan.time_limit_s` passes on `clock`. Once the first batch is read, how long the whole
    read will take is printed (stderr)."""
    from tqdm import tqdm

    critic = rag.critic(critique)
    # The filters an answer with the default request would use, save the threshold itself
    # (settled as every answer is; `calibrate_support` holds off a first-use calibration).
    cfg = rag.answer_path.settle(rag.settings.decoding.model_copy(update={"critique": critic.name}))
    started = clock()
    out: list[PairScore] = []
    bar = tqdm(
        total=len(pairs), desc="calibrate", unit="pair", file=sys.stderr, disable=not progress
    )
    for start in range(0, len(pairs), plan.batch):
        elapsed = clock() - started
        if elapsed > plan.time_limit_s:
            bar.write(
                f"calibrate: time limit {plan.time_limit_s:g} s reached after {len(out)} pairs",
                file=sys.stderr,
            )
            break
        if start == plan.batch:  # the first batch read
            bar.write(estimate_line(len(pairs), start, elapsed), file=sys.stderr)
        chunk = pairs[start : start + plan.batch]
        branches = [Branch(p.question.question, "", p.passage) for p in chunk]
        reads = read_evidence_branches(critic, branches, cfg.max_segment_tokens)
        similarities = rag.store.similarities([(p.question.question, p.passage) for p in chunk])
        for pair, read, similarity in zip(chunk, reads, similarities, strict=True):
            pruned = read.s_rel < (cfg.min_relevance or 0.0)
            out.append(PairScore(pair, read.s_rel, read.s_sup, similarity, pruned))
        bar.update(len(chunk))
    bar.close()
    return out


def estimate_line(pairs: int, read: int, seconds: float) -> str:
    """How long reading `pairs` will take, from the first `read` of them taking `seconds`."""
    total = seconds * pairs / read
    return f"calibrate: {pairs} pairs, about {total:.0f} s in all ({read} read in {seconds:.1f} s)"


def announce_line(pairs: int, previous: SupportCalibration | None) -> str:
    """What a calibration of `pairs` pairs says before it reads any: how long it will take at
    the pace of the `previous` calibration of the same model and critique, or that the time
    follows the first batch."""
    read = 0
    if previous is not None:
        read = int(previous.answerable.get("n", 0) + previous.unanswerable.get("n", 0))
    if previous is None or not read:
        return (
            f"calibrate: reading {pairs} question/passage pairs (relevance, a draft and "
            "support each); how long it takes follows the first batch"
        )
    seconds = previous.seconds / read * pairs
    return (
        f"calibrate: reading {pairs} question/passage pairs, about {seconds:.0f} s at the "
        f"last calibration's pace ({previous.seconds:.0f} s for {read})"
    )


def pairs_to_read(pairs: list[SyntheticPair], plan: CorpusCalibrationPlan) -> list[SyntheticPair]:
    """The pairs the plan reads: the answerable ones, which set the thresholds, and with
    `plan.report` the unanswerable ones as well."""
    return pairs if plan.report else [p for p in pairs if p.answerable]


def calibrate_support(
    rag: LocalRuntime,
    plan: CorpusCalibrationPlan,
    *,
    critique: str | None = None,
    progress: bool = True,
) -> tuple[SupportCalibration, Path]:
    """Draw the pairs from the index (`rag`'s collection), read them with the served critique
    (`critique`, default the configured one), choose the threshold and save it for this model
    file, collection and source.
    `CalibrationSkipped` when the corpus gives fewer than MIN_ANSWERABLE answerable pairs."""
    from selfrag.infra.models.model_files import file_sha256

    started = time.monotonic()
    source = critique or rag.settings.decoding.critique
    # Drawn whole, the unanswerable pairs too: the same seed asks the same questions either way.
    pairs = draw_pairs(rag, plan)
    _enough(sum(1 for p in pairs if p.answerable))  # before any model work
    to_read = pairs_to_read(pairs, plan)
    concrete = rag.critique_name(source)
    if progress:
        previous = rag.calibrated.calibration(concrete)
        print(announce_line(len(to_read), previous), file=sys.stderr)
    with rag.calibrating(concrete):
        scores = score_pairs(rag, source, to_read, plan, progress=progress)
    answerable = [s.score for s in scores if s.pair.answerable and s.score is not None]
    unanswerable = [s.score for s in scores if not s.pair.answerable and s.score is not None]
    _enough(len(answerable))
    name = rag.critic(source).name
    per_collection = _collection_choices(scores, plan.max_answerable_abstain)
    if per_collection:
        lowest, picked = lowest_threshold(per_collection)
        choice = _applied_effect(scores, per_collection, picked.threshold)
    else:  # no collection gave enough pairs alone: all of them as one
        lowest, choice = (
            None,
            choose_threshold(answerable, unanswerable, plan.max_answerable_abstain),
        )
    cal = SupportCalibration(
        model_sha256=file_sha256(rag.model.path),
        model_file=rag.model.path.name,
        critique=name,
        index_collection=rag.settings.retrieval.collection,
        fingerprint=rag.model_fingerprint,
        min_support_score=round(choice.threshold, 6),
        max_answerable_abstain=plan.max_answerable_abstain,
        answerable_abstain=round(choice.answerable_abstain, 4),
        unanswerable_abstain=_rounded(choice.unanswerable_abstain),
        **_score_summary(scores, answerable, unanswerable),
        collections=_collection_thresholds(per_collection),
        threshold_collection=lowest,
        style=plan.style,
        seed=plan.seed,
        index_version=rag.store.index_version(),
        passages=rag.store.count(),
        corpus_passages=collection_sizes(rag.store.passages()),
        seconds=round(time.monotonic() - started, 1),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    path = save_calibration(rag.settings.home, cal)
    rag.calibrated.forget()
    return cal, path


def _score_summary(
    scores: list[PairScore], answerable: list[float], unanswerable: list[float]
) -> dict[str, object]:
    """The calibration's figures about the scores: AUROC overall and per trap, counts, pruning."""
    return {
        "auroc": _auroc(answerable, unanswerable),
        "auroc_by_trap": {
            trap: _auroc(
                answerable,
                [s.score for s in scores if s.pair.trap == trap and s.score is not None],
            )
            for trap in sorted({s.pair.trap for s in scores if s.pair.trap is not None})
        },
        "questions": sum(1 for s in scores if s.pair.answerable),
        "answerable": summary(answerable),
        "unanswerable": summary(unanswerable),
        "pruned": {
            "answerable": sum(1 for s in scores if s.pair.answerable and s.pruned),
            "unanswerable": sum(1 for s in scores if not s.pair.answerable and s.pruned),
        },
    }


def _collection_thresholds(
    per_collection: dict[str, ThresholdChoice],
) -> dict[str, dict[str, object]]:
    """Each collection's own threshold and abstain rates, rounded as saved."""
    return {
        c: {
            "threshold": round(t.threshold, 6),
            "answerable_abstain": round(t.answerable_abstain, 4),
            "unanswerable_abstain": _rounded(t.unanswerable_abstain),
        }
        for c, t in per_collection.items()
    }


def draw_pairs(rag: LocalRuntime, plan: CorpusCalibrationPlan) -> list[SyntheticPair]:
    """The calibration's question/passage pairs, drawn per collection of the index:
    `plan.questions` questions, and when the index has several collections, an equal share of
    them each, at least MIN_QUESTIONS_PER_COLLECTION. The questions a small collection cannot
    give (a README beside a folder of docs) are drawn from the others, one each in turn, so the
    sample their thresholds are read from does not shrink. The collections' questions come out
    interleaved, so a time limit cuts every collection alike."""
    rng = random.Random(plan.seed)
    groups = sample_by_collection(rag.store.passages(), 4 * plan.questions, rng)
    per = plan.questions
    if len(groups) > 1:
        per = max(MIN_QUESTIONS_PER_COLLECTION, math.ceil(plan.questions / len(groups)))
    # Sorted, so the draw does not depend on the order the store lists its points in.
    streams = [
        question_pairs(sorted(groups[c], key=lambda p: p.id), rag.store.search, rng, plan.style)
        for c in sorted(groups)
    ]
    drawn = [list(itertools.islice(stream, per)) for stream in streams]
    missing = per * len(drawn) - sum(len(d) for d in drawn)
    with_more = [i for i, d in enumerate(drawn) if len(d) == per]
    while missing and with_more:
        for i in list(with_more):
            group = next(streams[i], None)
            if group is None:
                with_more.remove(i)
                continue
            drawn[i].append(group)
            missing -= 1
            if not missing:
                break
    return [
        pair
        for turn in itertools.zip_longest(*drawn)
        for question in turn
        if question is not None
        for pair in question
    ]


RECALIBRATE_SHARE = 0.05
"""How much of a collection may change before indexing fits its threshold again: the share of
its passages, as a question samples them, that differs since the calibration (1 - unchanged /
max(passages then, passages now): new, rewritten and removed ones). Questions are drawn from
a collection's passages alike, so one changed by d moves the share of its answerable pairs that
fall below its threshold by at most d (counted among the passages that give a question),
whatever the changed passages score: 5 points, under the draw's own spread (a standard
deviation of 6 points at 20 pairs, Beta(2, 19))."""


def collection_sizes(passages: Iterable[Passage]) -> dict[str, int]:
    """Passages per collection (corpus file; "" for those without one)."""
    return dict(Counter(p.metadata.get(COLLECTION, "") for p in passages))


def recalibration_due(cal: SupportCalibration, passages: Iterable[Passage]) -> tuple[bool, str]:
    """Whether the index (`passages`, all of it) changed enough since `cal` to fit the
    thresholds again, and what changed. Due when a collection that has or could have a
    threshold of its own (MIN_ANSWERABLE passages at least) is new, or changed by more than
    RECALIBRATE_SHARE (passages indexed after `cal` are new or rewritten; the rest unchanged).
    A smaller collection cannot have one (a passage gives one question at most): its passages
    are held to the lowest threshold, whatever they score."""
    if not cal.corpus_passages:
        return True, "the calibration predates recording its corpus files' sizes"
    fitted = datetime.fromisoformat(cal.created)
    now: Counter[str] = Counter()
    unchanged: Counter[str] = Counter()
    for p in passages:
        name = p.metadata.get(COLLECTION, "")
        now[name] += 1
        unchanged[name] += _indexed_before(p.metadata.get("indexed_at"), fitted)
    kept = []
    for name in sorted(set(now) | set(cal.corpus_passages)):
        before = cal.corpus_passages.get(name, 0)
        changed = 1 - unchanged[name] / max(before, now[name], 1)
        if not changed:
            continue
        label = name or "(unnamed)"
        what = f"{label} changed by {changed:.1%} ({before} passages then, {now[name]} now)"
        if name not in cal.collections and max(now[name], before) < MIN_ANSWERABLE:
            kept.append(f"{what}: too small for a threshold of its own, held to the lowest")
        elif not before:
            return True, f"{label} is new, with {now[name]} passages"
        elif changed > RECALIBRATE_SHARE + 1e-9:
            return True, what
        else:
            kept.append(what)
    return False, "; ".join(kept) or "no passage changed"


def _indexed_before(stamp: object, fitted: datetime) -> bool:
    """Whether a passage's `indexed_at` is no later than `fitted` (unknown: not before)."""
    try:
        return isinstance(stamp, str) and datetime.fromisoformat(stamp) <= fitted
    except (ValueError, TypeError):
        return False


def calibrate_after_indexing(
    rag: LocalRuntime, changed: bool, plan: CorpusCalibrationPlan, *, progress: bool = True
) -> str:
    """The support threshold after `selfrag index` wrote to `rag`'s index: fitted when there
    is none for the default critique or the index changed enough (`recalibration_due`), else
    kept, saying why; what to print."""
    critique = rag.critique_name(rag.settings.decoding.critique)
    cal = rag.calibrated.calibration(critique)
    if cal is not None:
        if not changed:
            return "support threshold: kept (the index did not change)"
        due, what = recalibration_due(cal, rag.store.passages())
        if not due:
            return (
                f"support threshold: kept, the index changed too little to move it ({what}; "
                f"more than {RECALIBRATE_SHARE:.0%} of a corpus file fits it again, as "
                "`selfrag calibrate` does)"
            )
        print(f"support threshold: fitting it again: {what}", file=sys.stderr)
    return run_calibration(rag, plan, progress=progress)[1]


def _rounded(share: float | None) -> float | None:
    return None if share is None else round(share, 4)


def _collection_choices(
    scores: list[PairScore], max_answerable_abstain: float
) -> dict[str, ThresholdChoice]:
    """Each collection's own threshold, for those with at least MIN_ANSWERABLE answerable
    pairs read."""
    out: dict[str, ThresholdChoice] = {}
    names = sorted({_collection(s) for s in scores})
    for name in names:
        mine = [s for s in scores if _collection(s) == name and s.score is not None]
        ans = [s.score for s in mine if s.pair.answerable and s.score is not None]
        unans = [s.score for s in mine if not s.pair.answerable and s.score is not None]
        if len(ans) >= MIN_ANSWERABLE:
            out[name] = choose_threshold(ans, unans, max_answerable_abstain)
    return out


def _applied_effect(
    scores: list[PairScore], per_collection: dict[str, ThresholdChoice], lowest: float
) -> ThresholdChoice:
    """What the thresholds abstain on together, as answers apply them
    (`DecodingConfig.support_threshold`): a pair's score is held to its passage's collection's
    own threshold, else to `lowest`; counted on each score's margin over its threshold."""
    held = DecodingConfig(
        min_support_score=lowest,
        min_support_score_by_corpus={c: t.threshold for c, t in per_collection.items()},
    )

    def margins(answerable: bool) -> list[float]:
        return [
            s.score - held.support_threshold(s.pair.passage.metadata.get(COLLECTION))
            for s in scores
            if s.pair.answerable == answerable and s.score is not None
        ]

    return replace(threshold_effect(0.0, margins(True), margins(False)), threshold=lowest)


def _collection(s: PairScore) -> str:
    """The collection a pair's question was drawn from (its unanswerable pair's passage may
    lie in another)."""
    return s.pair.question.passage.metadata.get(COLLECTION, "")


def _enough(answerable: int) -> None:
    if answerable < MIN_ANSWERABLE:
        raise CalibrationSkipped(
            f"the index gave {answerable} answerable question/passage pairs, fewer than the "
            f"{MIN_ANSWERABLE} a threshold needs (too few passages with a sentence holding a "
            "year, a count or a name?): the support threshold stays the critique's default"
        )


def _auroc(answerable: list[float], unanswerable: list[float]) -> float | None:
    value = auc(answerable + unanswerable, [True] * len(answerable) + [False] * len(unanswerable))
    return round(value, 4) if value is not None else None


def corpus_plan(**overrides: object) -> CorpusCalibrationPlan:
    """The default plan with the `overrides` that are not None (command-line flags)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    plan = replace(CorpusCalibrationPlan(), **given)  # type: ignore[arg-type]
    if plan.questions < 1:
        raise ValueError("--questions must be at least 1")
    if not 0.0 <= plan.max_answerable_abstain < 1.0:
        raise ValueError("--max-answerable-abstain must be in [0, 1)")
    if plan.time_limit_s <= 0:
        raise ValueError("--time-limit must be positive")
    return plan


def run_calibration(
    rag: LocalRuntime, plan: CorpusCalibrationPlan, *, progress: bool = True
) -> tuple[bool, str]:
    """`calibrate_support` for a command: (whether a threshold was written, what to print).
    A corpus too small to calibrate on, or the vLLM backend (no model file to key it by),
    is reported, not raised."""
    if rag.settings.model.backend == "vllm":
        return False, "support threshold: not calibrated (the vLLM backend has no model file)"
    try:
        cal, path = calibrate_support(rag, plan, progress=progress)
    except CalibrationSkipped as exc:
        return False, f"support threshold: not calibrated: {exc}"
    return True, describe_calibration(cal, path)
