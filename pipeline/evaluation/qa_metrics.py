"""QA evaluation metrics as pure functions: SQuAD normalisation, accuracy, token F1, aggregates."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from selfrag.pipeline.learning.logistic_fit import auc

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def contains_answer(text: str, golds: Sequence[str]) -> bool:
    """True when some non-empty normalised gold answer occurs in the normalised text, on word
    boundaries (so "1066" is not found in "10666")."""
    hay = f" {normalize_answer(text)} "
    for gold in golds:
        g = normalize_answer(gold)
        if g and f" {g} " in hay:
            return True
    return False


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 between one prediction and one gold answer."""
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = Counter(pred) & Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred)
    recall = overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, golds: Sequence[str]) -> float:
    """The best token F1 over the gold answers (0 without any)."""
    return max((token_f1(prediction, g) for g in golds), default=0.0)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0–100) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean_or_none(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Outcome:
    """One system's answer to one question, reduced to what the metrics need.

    `s_sup` is the mean support score of the answer's grounded segments (None when the system
    has no support score or the answer has no grounded segment); `cited_has_answer` holds one
    flag per cited passage (does it contain a gold answer).
    """

    answerable: bool
    golds: tuple[str, ...]
    answer: str
    abstained: bool
    retrieved: bool
    s_sup: float | None
    cited_has_answer: tuple[bool, ...]
    latency_ms: float
    prefill_tokens: int
    evidence_branches: int = 0
    branches_pruned: int = 0
    abstention_score: float | None = None
    """Higher means answer: the quantity the system's abstention decision thresholds (per
    system, `jobs.evaluation.abstention.abstention_score`); None ranks below every number."""

    @property
    def correct(self) -> bool:
        """Answerable: a gold answer appears in the (non-abstained) answer. Unanswerable: the
        system abstained."""
        if not self.answerable:
            return self.abstained
        return not self.abstained and contains_answer(self.answer, self.golds)

    @property
    def f1(self) -> float:
        return 0.0 if self.abstained else best_f1(self.answer, self.golds)

    @property
    def confident(self) -> bool:
        """An answer given without a low support score (s_sup ≥ 0.5, or no score at all)."""
        return not self.abstained and (self.s_sup is None or self.s_sup >= 0.5)


@dataclass(frozen=True)
class CoveragePoint:
    """One threshold of the accuracy–coverage curve (rates None where undefined)."""

    threshold: float | None
    """Answer when the abstention score is at least this; None: every answer the system gave,
    those without a score included."""
    coverage: float | None
    """Answerable questions answered, over the answerable questions."""
    selective_accuracy: float | None
    """Right answers over the answerable questions answered."""
    unanswerable_abstain_rate: float | None
    """Unanswerable questions not answered, over the unanswerable questions."""


def _score(o: Outcome) -> float:
    return o.abstention_score if o.abstention_score is not None else -math.inf


def abstention_auroc(outcomes: Sequence[Outcome]) -> tuple[float | None, str | None]:
    """How well the abstention score ranks answerable above unanswerable questions: the AUROC
    (ties count half, an outcome without a score ranks below every score), or None and why."""
    if not any(o.answerable for o in outcomes):
        return None, "no answerable questions"
    if all(o.answerable for o in outcomes):
        return None, "no unanswerable questions"
    if all(o.abstention_score is None for o in outcomes):
        return None, "no question has an abstention score"
    return auc([_score(o) for o in outcomes], [o.answerable for o in outcomes]), None


def accuracy_coverage(outcomes: Sequence[Outcome]) -> list[CoveragePoint]:
    """The accuracy–coverage curve, highest threshold first.

    At a threshold t (each distinct abstention score of an answer) the system keeps the answers
    it gave whose score is at least t and abstains on the rest. Its own abstentions stay
    abstentions at every t (their answers are unknown), so coverage never falls from one point
    to the next, and the last point is the system's own decision (threshold None when some
    answer has no score, as that answer is kept only there).
    """
    n_ans = sum(o.answerable for o in outcomes)
    n_un = len(outcomes) - n_ans
    answers = sorted((o for o in outcomes if not o.abstained), key=_score, reverse=True)
    points: list[CoveragePoint] = []
    kept = right = kept_un = 0

    def point(threshold: float | None) -> CoveragePoint:
        return CoveragePoint(
            threshold=threshold,
            coverage=kept / n_ans if n_ans else None,
            selective_accuracy=right / kept if kept else None,
            unanswerable_abstain_rate=1 - kept_un / n_un if n_un else None,
        )

    for i, o in enumerate(answers):
        if o.answerable:
            kept += 1
            right += o.correct
        else:
            kept_un += 1
        nxt = answers[i + 1].abstention_score if i + 1 < len(answers) else math.nan
        if o.abstention_score is not None and nxt != o.abstention_score:
            points.append(point(o.abstention_score))
    if not answers or answers[-1].abstention_score is None:
        points.append(point(None))
    return points


def summarize(outcomes: Sequence[Outcome]) -> dict[str, float | int | str | None]:
    """The report row of one system. Rates are fractions in [0, 1]; None where undefined.

    accuracy, f1: over answerable questions; abstain_rate and wrong_confident_rate: over
    unanswerable questions (any answer to one is wrong; confident = s_sup ≥ 0.5 or no score);
    overall: answerable answered right plus unanswerable abstained, over all questions;
    citation_precision: over all passages cited by answers to answerable questions;
    s_sup_correct / s_sup_wrong: mean s_sup of right / wrong answers to answerable questions;
    s_sup_auc: how well s_sup ranks right answers (answerable, correct) above wrong ones (any
    other answer given, unanswerable included); pruned_rate: evidence branches pruned by
    `min_relevance` before drafting, over all evidence branches opened; coverage: answerable
    questions answered (not abstained); selective_accuracy: right answers over the answerable
    questions answered; abstention_auroc: `abstention_auroc` (None, with
    abstention_auroc_reason saying why, when it is undefined).
    """
    answerable = [o for o in outcomes if o.answerable]
    impossible = [o for o in outcomes if not o.answerable]
    cited = [flag for o in answerable if not o.abstained for flag in o.cited_has_answer]
    latencies = [o.latency_ms for o in outcomes]
    sup_right = [o.s_sup for o in answerable if o.correct and o.s_sup is not None]
    sup_wrong = [
        o.s_sup for o in answerable if not o.correct and not o.abstained and o.s_sup is not None
    ]
    answered = [o for o in outcomes if not o.abstained and o.s_sup is not None]
    evidence = sum(o.evidence_branches for o in outcomes)
    auroc, auroc_reason = abstention_auroc(outcomes)
    return {
        "questions": len(outcomes),
        "answerable": len(answerable),
        "unanswerable": len(impossible),
        "accuracy": mean_or_none([float(o.correct) for o in answerable]),
        "f1": mean_or_none([o.f1 for o in answerable]),
        "abstain_rate": mean_or_none([float(o.abstained) for o in impossible]),
        "wrong_confident_rate": mean_or_none([float(o.confident) for o in impossible]),
        "answerable_abstain_rate": mean_or_none([float(o.abstained) for o in answerable]),
        "coverage": mean_or_none([float(not o.abstained) for o in answerable]),
        "selective_accuracy": mean_or_none(
            [float(o.correct) for o in answerable if not o.abstained]
        ),
        "abstention_auroc": auroc,
        "abstention_auroc_reason": auroc_reason,
        "overall": mean_or_none([float(o.correct) for o in outcomes]),
        "retrieval_rate": mean_or_none([float(o.retrieved) for o in outcomes]),
        "citation_precision": mean_or_none([float(f) for f in cited]),
        "s_sup_correct": mean_or_none(sup_right),
        "s_sup_wrong": mean_or_none(sup_wrong),
        "s_sup_auc": auc(
            [o.s_sup for o in answered], [o.answerable and o.correct for o in answered]
        ),
        "pruned_rate": (sum(o.branches_pruned for o in outcomes) / evidence if evidence else None),
        "p50_ms": percentile(latencies, 50),
        "p95_ms": percentile(latencies, 95),
        "prefill_tokens": mean_or_none([float(o.prefill_tokens) for o in outcomes]),
    }


@dataclass(frozen=True)
class PairedCounts:
    """Two systems judged on the same items (`Outcome.correct` of each question, or any other
    judgement, `paired_flags`): how many both, only the first, only the second and neither got
    right."""

    both: int
    only_first: int
    only_second: int
    neither: int

    @property
    def questions(self) -> int:
        return self.both + self.only_first + self.only_second + self.neither

    @property
    def p_value(self) -> float:
        """The exact two-sided McNemar test: how likely a split of the discordant questions
        (right for one system only) at least this uneven is when either system is as likely
        to be the one right. 1.0 without a discordant question."""
        n = self.only_first + self.only_second
        k = min(self.only_first, self.only_second)
        tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
        return min(1.0, 2 * tail)


def paired_counts(pairs: Sequence[tuple[Outcome, Outcome]]) -> PairedCounts:
    """`PairedCounts` of `pairs`: each question's outcome under the first and second system."""
    return paired_flags([(first.correct, second.correct) for first, second in pairs])


def paired_flags(pairs: Iterable[tuple[bool, bool]]) -> PairedCounts:
    """`PairedCounts` of any paired judgement: each item (a question, a fact) right or not
    under the first and the second system."""
    counts = Counter(pairs)
    return PairedCounts(
        both=counts[True, True],
        only_first=counts[True, False],
        only_second=counts[False, True],
        neither=counts[False, False],
    )
