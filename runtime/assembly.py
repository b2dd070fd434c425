"""The one assembly of a decoder, from where its parts live.

Every entry point answers through `AnswerPath.run` with a decode step that builds its decoder
here: this process's engine and store (`LocalRuntime.parts`: the CLI, the Python API,
evaluation), a batch actor's merged engine calls and the store actor (`BatchAnswerer`), or the
Serve deployments behind the ingress (`ServeAnswerService`). Only where each part is differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from selfrag.pipeline.branching import BranchWorker
from selfrag.pipeline.critics import Critic
from selfrag.pipeline.decoder import BeamDecoder, Ranker, StepListener
from selfrag.pipeline.protocols import PassageSearch
from selfrag.pipeline.ranking import rank_step
from selfrag.schemas.answer import AnswerResponse
from selfrag.schemas.decoding import DecodingConfig


@dataclass(frozen=True)
class DecoderParts:
    """Where one answer's decoder finds its parts."""

    critique: Callable[[str], Critic | BranchWorker]
    """The critique a settled config names (`learned`, `likelihood`, ...): a `Critic` of this
    process, or a `BranchWorker` that runs a step's critique work elsewhere."""
    retriever: PassageSearch
    model_id: str
    ranker: Ranker = rank_step

    def decoder(self) -> BeamDecoder:
        return BeamDecoder(self.critique, self.retriever, self.model_id, ranker=self.ranker)

    def decode(
        self, question: str, config: DecodingConfig, on_step: StepListener | None = None
    ) -> AnswerResponse:
        """Answer `question` with a decoder on these parts: `config` is settled (the answer
        path's); the decoder keeps to its `timeout_s`."""
        return self.decoder().answer(question, config, on_step)
