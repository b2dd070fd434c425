"""Baselines for evaluation, over the same protocols as Self-RAG: closed-book and vanilla RAG.

Vanilla RAG is the usual pipeline: retrieve the top-k passages once, concatenate them into one
prompt, generate one answer. Its long-form variant asks for every part of the question, each
sentence followed by the numbers of the passages it uses ("[2]"), so its citations can be
judged like Self-RAG's segments (`longform_metrics.marker_units`). Every baseline may abstain
by replying "I don't know", which the prompt offers, so abstention is measured the same way for
every system.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from selfrag.pipeline.critics.base import RESERVED_PIECES
from selfrag.pipeline.evaluation.longform_metrics import marker_units
from selfrag.pipeline.evaluation.qa_metrics import normalize_answer
from selfrag.pipeline.prompts import (
    Part,
    PromptBuilder,
    Trusted,
    Untrusted,
    chat_glue,
    passage_part,
    system_head,
)
from selfrag.pipeline.protocols import (
    GenerationRequest,
    LanguageModel,
    Passage,
    PassageSearch,
)
from selfrag.pipeline.timings import timed
from selfrag.schemas.answer import AnswerResponse, PassageOut, SegmentOut, Usage
from selfrag.schemas.decoding import DecodingConfig

ABSTAIN_REPLY = "I don't know"
_TASK_CLOSED = (
    "Answer the question in one or two sentences. If you do not know the answer, reply "
    f"exactly: {ABSTAIN_REPLY}."
)
_TASK_RAG = (
    "Answer the question in one or two sentences using the passages above. If they do not "
    f"contain the answer, reply exactly: {ABSTAIN_REPLY}."
)
# No instruction to decline: with one, the small models reply "I don't know." to a question of
# several parts as soon as one part is missing from the passages (notes/long-answers.md); a
# part they cannot answer they decline or get wrong on their own.
_TASK_RAG_LONG = (
    "Answer every part of the question using the passages above, one sentence for each part. "
    "End each sentence with the passages it uses, as [1], [2] and so on."
)
# "I'm not sure" is how SmolLM2 usually declines, despite the instruction.
_ABSTAIN_MARKERS = (
    "i dont know",
    "i do not know",
    "im not sure",
    "i am not sure",
    "passages do not contain",
)


def is_abstention(answer: str) -> bool:
    """True when a baseline's reply declines to answer."""
    norm = normalize_answer(answer)
    return not norm or any(marker in norm for marker in _ABSTAIN_MARKERS)


def declines_every_part(answer: str) -> bool:
    """True when every sentence of a long answer declines (`is_abstention`): one that answers
    some parts and declines others is an answer."""
    return all(is_abstention(u.text) for u in marker_units(answer, ()))


class BaselineAnswerer:
    """Answers with one generation call: no passages (closed-book) or the top-k concatenated."""

    def __init__(
        self,
        model: LanguageModel,
        retriever: PassageSearch | None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._model = model
        self._retriever = retriever
        self._glue = chat_glue(model.chat_template)
        self._builder = PromptBuilder(model, reserved=RESERVED_PIECES)
        self._clock = clock

    def prompt(
        self, question: str, passages: list[Passage], *, long_form: bool = False
    ) -> list[int]:
        g = self._glue
        parts: list[Part] = system_head(g)
        for i, p in enumerate(passages, 1):
            parts += passage_part(p, f"Passage [{i}]", len(passages))
        task = (_TASK_RAG_LONG if long_form else _TASK_RAG) if passages else _TASK_CLOSED
        parts += [
            Trusted("Question: "),
            Untrusted(question),
            Trusted("\n\n" + task),
            Trusted(g.assistant_start),
        ]
        return self._builder.build(parts)

    def answer(
        self, question: str, config: DecodingConfig, *, retrieve: bool, long_form: bool = False
    ) -> AnswerResponse:
        """One answer within `config.answer_budget` tokens (Self-RAG's budget); `retrieve`
        picks vanilla RAG (top `config.top_k`) over closed-book, and `long_form` its long-form
        prompt (the passages numbered [1]..[k] are `AnswerResponse.passages` in order; the
        answer keeps its `[n]` markers)."""
        if long_form and not retrieve:
            raise ValueError("a long-form baseline answer cites passages: it needs retrieval")
        started = self._clock()
        timings: dict[str, float] = {}
        passages: list[Passage] = []
        if retrieve:
            if self._retriever is None:
                raise ValueError("vanilla RAG needs a retriever")
            with timed(timings, "retrieve", self._clock):
                passages = self._retriever.search(question, config.top_k)
        budget = config.answer_budget
        with timed(timings, "draft", self._clock):
            prompt = self.prompt(question, passages, long_form=long_form)
            request = GenerationRequest(prompt, budget, stop_at_sentence_end=False)
            (gen,) = self._model.generate([request])
        text = gen.text.strip()
        abstained = declines_every_part(text) if long_form else is_abstention(text)
        segment = SegmentOut(
            text=text,
            retrieved=retrieve,
            logprob=gen.logprob,
            n_tokens=len(gen.tokens),
            score=gen.logprob,
        )
        timings["total"] = (self._clock() - started) * 1e3
        return AnswerResponse(
            question=question,
            answer=text,
            abstained=abstained,
            segments=[segment] if text else [],
            passages=[PassageOut.model_validate(p.shown()) for p in passages],
            usage=Usage(
                prefill_tokens=gen.prefill_tokens,
                decode_tokens=len(gen.tokens),
                retrievals=int(retrieve),
                steps=1,
            ),
            timings_ms={k: round(v, 2) for k, v in timings.items()},
            model_id=self._model.model_id,
            critique="none",
            config=config,
        )
