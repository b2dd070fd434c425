"""Per-request decoding configuration: every Self-RAG dial, with its bounds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo

RetrievalMode = Literal["adaptive", "always", "never"]
CritiqueSource = Literal["auto", "native", "learned", "prompted", "likelihood"]
CRITIQUE_SOURCES: tuple[str, ...] = tuple(s for s in get_args(CritiqueSource) if s != "auto")
"""The concrete critique sources (all but `auto`, which stands for one of them)."""
SupportLevel = Literal["none", "partial", "full"]
UnsupportedPolicy = Literal["abstain", "no_retrieval"]
SegmentRetrieval = Literal["answer", "part", "missing", "static"]

# A bound on the work one request may ask for: minutes of prefill on a small machine, far above
# any answer the other bounds allow (K ≤ 50, B ≤ 8, 32 segments).
MAX_PREFILL_TOKENS = 2_000_000
MAX_SEGMENTS = 32
MAX_SEGMENT_TOKENS = 512
MAX_ANSWER_TOKENS = MAX_SEGMENTS * MAX_SEGMENT_TOKENS
"""The longest answer any request can get (`max_segments` × `max_segment_tokens` at their
bounds): a larger budget (`max_answer_tokens`, `max_tokens`) would change nothing, so it is
refused."""
MAX_INSTRUCTIONS_CHARS = 4_000
MAX_SEED = 2**63 - 1
SupportScore = Annotated[float, Field(ge=0.0, le=1.0)]


class DecodingConfig(BaseModel):
    """How one question is answered. All fields are per request; none needs retraining."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: RetrievalMode = Field(
        "adaptive", description="adaptive: retrieve when p_ret > threshold; always; never."
    )
    # Low, by measurement on the Normans questions with the embedded SmolLM2
    # (notes/evaluation.md): retrieval is almost always needed there, and the prompted
    # critique's p_ret stays well below 0.5, so δ = 0.5 never retrieved.
    threshold: float = Field(0.1, ge=0.0, le=1.0, description="δ for adaptive retrieval.")
    top_k: int = Field(3, ge=1, le=50, description="Passages retrieved per step (K).")
    beam: int = Field(1, ge=1, le=8, description="Segment-level beam width (B).")
    # Defaults below marked "measured" won on the Normans questions (notes/evaluation.md).
    max_segments: int = Field(
        10,
        ge=1,
        le=MAX_SEGMENTS,
        description="Segments per answer at most, within max_answer_tokens (measured on long "
        "answers; a question asking one thing takes one, or two when the first was cut "
        "mid-sentence).",
    )
    max_segment_tokens: int = Field(48, ge=4, le=MAX_SEGMENT_TOKENS)
    # 240: the budget long answers were measured at (notes/long-answers.md), five segments'
    # worth, which the baselines get too.
    max_answer_tokens: int = Field(
        240,
        ge=4,
        le=MAX_ANSWER_TOKENS,
        description="Tokens of answer at most, over all its segments: the last segment is cut "
        "where the answer reaches it. The baselines generate within the same budget "
        "(OpenAI's max_tokens lowers it).",
    )
    # 3, by measurement on the biographies' tuning half (notes/long-answers.md).
    segments_per_step: int = Field(
        3,
        ge=1,
        le=50,
        description="Segments one step of an open account ('Tell me about X') may add: its "
        "passages draft (at least this many, past max_drafts), and each draft that passes "
        "the hard filters and says something new is kept as a segment of its own, best "
        "first. Other questions add one segment a step. 1: one in every step.",
    )
    w_rel: float = Field(2.0, ge=0.0, le=100.0, description="Weight of s_rel in S (measured).")
    w_sup: float = Field(1.0, ge=0.0, le=100.0, description="Weight of s_sup in S.")
    w_use: float = Field(0.5, ge=0.0, le=100.0, description="Weight of s_use in S.")
    length_normalize: bool = Field(
        True,
        description="Use the mean token log-probability in S instead of the sum (measured: "
        "the sum drowns the critique terms and favours the shortest draft).",
    )
    min_relevance: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Branches with s_rel below this are pruned before drafting. None: "
        "calibrated on the served corpus for the model and critique source, else 0 (off).",
    )
    relevance_margin: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Evidence branches whose s_rel is more than this below the best of their "
        "hypothesis are pruned before drafting (0: only the best drafts). None: calibrated on "
        "the served corpus for the model and critique source, else 1 (off).",
    )
    # 1, by measurement (notes/benchmarks.md, "A draft budget"): on Normans about as accurate as
    # no budget while decoding fewer tokens; on held-out text, where s_rel keeps most passages,
    # it is what brings Self-RAG to vanilla RAG's price (notes/evaluation.md has what it costs
    # there).
    max_drafts: int = Field(
        1,
        ge=1,
        le=50,
        description="Evidence branches drafted per hypothesis and step, in the order "
        "draft_order_margin gives, after min_relevance and relevance_margin; 50, top_k's "
        "bound: every branch they keep. Each draft fewer is a sequence fewer in every decode "
        "step (notes/benchmarks.md).",
    )
    # 1, by measurement on the tuning sets (notes/evaluation.md, "One retry by default"): it
    # gives back most answerable abstentions for a few unanswerable ones; a second retry gives
    # back more unanswerable abstentions than it gains right answers.
    retry_drafts: int = Field(
        1,
        ge=0,
        le=50,
        description="When no drafted evidence branch of a hypothesis passes the hard filters "
        "(or every one drafted nothing, or, with retry_flagged, every one that passes is "
        "flagged), up to this many more of its passages draft, one at a "
        "time in the draft order, until one passes; only a passage whose s_rel is above that "
        "of every one that failed. A passage past max_drafts costs only where the ones before "
        "it failed (notes/evaluation.md). 0: never.",
    )
    # Off, by measurement (notes/evaluation.md, "A flagged draft tries the next passage"): on,
    # it gains a right answer on some sets and none held out, and its extra drafts cost more
    # than Self-RAG's margin over vanilla RAG's price.
    retry_flagged: bool = Field(
        False,
        description="Retry (retry_drafts) also when every drafted evidence branch of a "
        "hypothesis that passes the hard filters is flagged (low support, or numbers or names "
        "its passage lacks); the drafts then compete in the ranking. False: retry only when "
        "none passes.",
    )
    # The retriever's order transfers across corpora and models where a reading of s_rel on
    # its own scale does not: the critique reorders it only on a clear call.
    draft_order_margin: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Under max_drafts, branches draft in the retriever's order, except that "
        "one whose s_rel is more than this above that of the retriever's first passage drafts "
        "before it (the most relevant first). 0: by s_rel alone; 1: the retriever's order. "
        "Without a relevance filter, the other passages are read for relevance only when the "
        "first reads under 1 minus this (notes/evaluation.md).",
    )
    min_support: SupportLevel | None = Field(
        None,
        description="Hard filter: the most likely IsSup label must reach this level. None: "
        "calibrated on the served corpus for the model and critique source, else 'none' (off).",
    )
    min_support_score: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Hard filter: a grounded branch's s_sup, times its passage's similarity to "
        "the query when the retriever gives one, must reach this. None: calibrated "
        "on the served corpus for the model and critique source (`selfrag calibrate`, or the "
        "first `selfrag ask`), else 0 (off).",
    )
    min_support_score_by_corpus: dict[str, SupportScore] | None = Field(
        None,
        description="Hard filter per corpus (the file or folder the index recorded a passage "
        "from, as `selfrag calibrate` names it): a branch citing a passage of a corpus named "
        "here must reach its score instead of min_support_score. None: each corpus's own "
        "calibrated threshold when min_support_score is unset too, else none. On the command "
        "line, NAME=SCORE, repeated.",
    )
    require_relevant: bool = Field(
        False, description="Hard filter: the most likely IsRel label must be 'relevant'."
    )
    keep_unsupported_segments: bool = Field(
        False,
        description="Keep a segment after the first that cites nothing while the answer "
        "retrieved, or states numbers or names its passage lacks; by default such a segment is "
        "dropped and the answer goes on without it (the first segment is flagged instead).",
    )
    segment_retrieval: SegmentRetrieval = Field(
        "part",
        description="What each step of a question that lists several parts searches for: "
        "part (the part it answers, with the question's topic), missing (every part not "
        "answered yet), answer (the question and the answer so far), static (nothing new: "
        "the first step's passages, each step choosing among them). A question asking one "
        "thing searches the question (and the answer so far past its first step).",
    )
    diverse_passages: bool = Field(
        True,
        description="A later step's search ranks the passages the answer's steps already "
        "drafted on (kept or not) below the others, so each segment can draw on evidence of "
        "its own.",
    )
    w_new: float = Field(
        1.0,
        ge=0.0,
        le=100.0,
        description="Weight in S of a later segment's novelty: the share of its content words "
        "that neither the question nor the answer so far holds.",
    )
    min_novelty: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="A segment after the first whose novelty is under this is dropped: it "
        "restates the question or the answer so far. 0: never.",
    )
    on_unsupported: UnsupportedPolicy = Field(
        "abstain",
        description="When every branch of a retrieval step is filtered out: abstain, or keep "
        "the no-retrieval draft.",
    )
    critique: CritiqueSource = Field(
        "auto",
        description="auto picks native when the model has reflection tokens, else learned "
        "when reflection heads exist for the model file, else likelihood.",
    )
    max_retrievals: int = Field(8, ge=0, le=64, description="Retrieval steps allowed per question.")
    max_prefill_tokens: int = Field(
        200_000,
        ge=1,
        le=MAX_PREFILL_TOKENS,
        description="Stop opening new steps once this many prompt tokens were computed.",
    )
    timeout_s: float = Field(
        120.0, gt=0.0, le=3600.0, description="Wall-clock budget per question."
    )
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=2.0,
        description="Sampling temperature of the drafts (0: greedy). The critique's reads "
        "are deterministic whatever it is.",
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Nucleus sampling of the drafts (with temperature > 0)."
    )
    seed: int | None = Field(
        None,
        ge=0,
        le=MAX_SEED,
        description="Seed of the drafts' sampling: the same seed, question and config give "
        "the same answer. None: a fresh draw each time (with temperature > 0).",
    )
    instructions: str | None = Field(
        None,
        max_length=MAX_INSTRUCTIONS_CHARS,
        description="Instructions the drafts follow (an OpenAI system message), such as the "
        "answer's language or tone. Retrieval searches the question alone.",
    )

    def support_threshold(self, corpus: str | None) -> float:
        """The `min_support_score` a branch citing a passage of `corpus` (its
        `pipeline.protocols.COLLECTION`) must reach: the corpus's own
        (`min_support_score_by_corpus`), else the one for all."""
        own = (self.min_support_score_by_corpus or {}).get(corpus or "")
        return own if own is not None else self.min_support_score or 0.0

    @property
    def answer_budget(self) -> int:
        """The most tokens an answer can hold: `max_answer_tokens`, or fewer when
        `max_segments` segments of `max_segment_tokens` hold fewer."""
        return min(self.max_answer_tokens, self.max_segments * self.max_segment_tokens)

    @property
    def repeatable(self) -> bool:
        """Whether the same request gets the same answer: greedy, or sampled with a seed."""
        return self.temperature == 0 or self.seed is not None

    def within_tokens(self, max_tokens: int) -> DecodingConfig:
        """This config with an answer of at most `max_tokens` tokens: a smaller budget, and
        segments no longer than it."""
        return self.model_copy(
            update={
                "max_segment_tokens": min(self.max_segment_tokens, max_tokens),
                "max_answer_tokens": min(self.max_answer_tokens, max_tokens),
            }
        )


class _Overrides(BaseModel):
    """What `DecodingOverrides` adds to the fields it takes from `DecodingConfig`."""

    model_config = ConfigDict(extra="forbid")

    def apply_to(self, base: DecodingConfig) -> DecodingConfig:
        """`base` with the fields this request set (validated again as a whole)."""
        changes = self.model_dump(exclude_none=True)
        return DecodingConfig.model_validate({**base.model_dump(), **changes})


def _optional_fields(model: type[BaseModel]) -> dict[str, Any]:
    """Each field of `model` as `create_model` takes it: its type or None, default None, with
    its bounds and description (so the JSON schema and the CLI help show them)."""
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        optional = FieldInfo.merge_field_infos(info, default=None, default_factory=None)
        fields[name] = (info.annotation | None, optional)
    return fields


if TYPE_CHECKING:
    # What type checkers see: the fields are made at import time below, so they are not
    # spelled out here (that would restate them); a field reads as `Any`.
    class DecodingOverrides(_Overrides):
        """A partial `DecodingConfig`: only the fields a request wants to change."""

        def __getattr__(self, name: str) -> Any: ...

else:
    DecodingOverrides = create_model(
        "DecodingOverrides",
        __base__=_Overrides,
        __module__=__name__,
        __doc__="A partial `DecodingConfig`: only the fields a request wants to change.",
        **_optional_fields(DecodingConfig),
    )
