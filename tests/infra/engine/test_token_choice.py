"""Sampled drafts (temperature, top_p, seed): the token choice, the decoder's branches, and the
real engine's generation."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from selfrag.infra.engine.token_choice import TokenChooser
from selfrag.pipeline.critics import Branch, settle_filters
from selfrag.pipeline.decoder import BeamDecoder, asked_question, draft_sampling
from selfrag.pipeline.protocols import GenerationRequest, Passage, Sampling
from selfrag.schemas.decoding import DecodingConfig
from tests.fakes import ListRetriever, ScriptedCritic
from tests.real import real

LOGITS = np.log(np.array([0.6, 0.3, 0.1], dtype=np.float32))


def _draws(chooser: TokenChooser, n: int) -> list[int]:
    return [chooser.choose(LOGITS)[0] for _ in range(n)]


def test_no_sampling_or_temperature_zero_is_greedy():
    for sampling in (None, Sampling(0.0, seed=3)):
        chooser = TokenChooser(sampling, [1, 2, 3])
        token, logprob = chooser.choose(LOGITS)
        assert token == 0
        assert logprob == pytest.approx(math.log(0.6), abs=1e-6)


def test_a_seed_repeats_its_draws_and_follows_the_distribution():
    first = _draws(TokenChooser(Sampling(1.0, seed=7), [5, 6]), 3000)
    again = _draws(TokenChooser(Sampling(1.0, seed=7), [5, 6]), 3000)
    assert first == again
    assert first != _draws(TokenChooser(Sampling(1.0, seed=8), [5, 6]), 3000)
    # The same seed on another prompt is another stream of draws.
    assert first != _draws(TokenChooser(Sampling(1.0, seed=7), [5, 7]), 3000)
    freq = Counter(first)
    assert [freq[t] / 3000 for t in range(3)] == pytest.approx([0.6, 0.3, 0.1], abs=0.03)


def test_top_p_keeps_the_smallest_nucleus_and_logprobs_are_the_models():
    chooser = TokenChooser(Sampling(1.0, top_p=0.5, seed=1), [1])
    assert set(_draws(chooser, 200)) == {0}
    chooser = TokenChooser(Sampling(1.0, top_p=0.85, seed=1), [1])
    assert set(_draws(chooser, 400)) == {0, 1}
    # A high temperature flattens the draws, not the reported log-probability.
    hot = TokenChooser(Sampling(2.0, seed=2), [1])
    for _ in range(50):
        token, logprob = hot.choose(LOGITS)
        assert logprob == pytest.approx(float(LOGITS[token]), abs=1e-5)


def test_unseeded_sampling_differs_between_choosers():
    a = _draws(TokenChooser(Sampling(1.0), [1]), 200)
    b = _draws(TokenChooser(Sampling(1.0), [1]), 200)
    assert a != b


@dataclass
class RecordingCritic(ScriptedCritic):
    drafted: list[Branch] = field(default_factory=list)

    def draft(self, branches, max_tokens):  # type: ignore[no-untyped-def]
        self.drafted += branches
        return super().draft(branches, max_tokens)


def test_the_decoder_drafts_with_the_configs_sampling_and_instructions():
    critic = RecordingCritic()
    retriever = ListRetriever([Passage("p1", "Rollo founded Normandy.")])
    decoder = BeamDecoder(lambda _: critic, retriever, "m")
    config = DecodingConfig(
        mode="always", temperature=0.7, top_p=0.9, seed=5, instructions="Answer in French."
    )
    response = decoder.answer("Who founded Normandy?", settle_filters(config, critic.name))
    assert response.question == "Who founded Normandy?"
    assert critic.drafted
    assert {b.sampling for b in critic.drafted} == {Sampling(0.7, 0.9, 5)}
    assert {b.question for b in critic.drafted} == {"Who founded Normandy?\n\nAnswer in French."}
    # Retrieval searches the question alone.
    assert all("French" not in q for q in retriever.queries)


def test_greedy_by_default_and_blank_instructions_change_nothing():
    assert draft_sampling(DecodingConfig()) is None
    assert asked_question("Q?", DecodingConfig(instructions="  ")) == "Q?"
    assert not DecodingConfig(temperature=0.5).repeatable
    assert DecodingConfig(temperature=0.5, seed=1).repeatable


# --- the real engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
@real
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from selfrag.infra.engine.llama_engine import LlamaEngine
    from selfrag.infra.models.model_files import default_model_path, derive_weights

    home: Path = tmp_path_factory.mktemp("selfrag-home")
    weights = derive_weights(default_model_path(), "auto", home)
    with LlamaEngine(
        weights, n_ctx=1024, n_seq_max=4, n_threads=1, n_batch=512, model_id="smollm2"
    ) as eng:
        yield eng


def test_the_engine_samples_reproducibly_with_a_seed(engine):  # type: ignore[no-untyped-def]
    prompt = engine.tokenize("Once upon a time, in a small village,")
    other = engine.tokenize("The three most common colours are")

    def run(sampling: Sampling | None, with_other: bool = False) -> list[int]:
        requests = [GenerationRequest(prompt, 12, stop_at_sentence_end=False, sampling=sampling)]
        if with_other:
            requests.append(GenerationRequest(other, 12, sampling=sampling))
        return engine.generate(requests)[0].tokens

    greedy = run(None)
    assert run(Sampling(0.0, seed=1)) == greedy
    seeded = run(Sampling(1.2, top_p=0.95, seed=1))
    # The same seed draws the same tokens, whatever else shares the batch.
    assert run(Sampling(1.2, top_p=0.95, seed=1), with_other=True) == seeded
    draws = {tuple(run(Sampling(1.2, top_p=0.95, seed=s))) for s in range(4)}
    assert len(draws) > 1
    generated = engine.generate([GenerationRequest(prompt, 8, sampling=Sampling(1.0, seed=2))])[0]
    assert all(math.isfinite(lp) and lp <= 0 for lp in generated.logprobs)
