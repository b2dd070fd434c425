"""pipeline/protocols.py: what engines and retrievers offer the algorithm. Every engine and
retriever of the product (and the tests' fakes) provides each member of its protocol, so the
decoder can take any of them; a generation's log-probability is its tokens' sum."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import pytest

from selfrag.infra.engine.llama_engine import LlamaEngine
from selfrag.infra.engine.vllm_engine import VLLMEngine
from selfrag.infra.store.qdrant_store import QdrantStore
from selfrag.pipeline.protocols import (
    Generation,
    LanguageModel,
    Passage,
    PassageSearch,
    Sampling,
    TokenScoreRequest,
)
from selfrag.runtime.remote_retriever import RemoteRetriever
from tests.fakes import ListRetriever, WordModel


def _members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


@pytest.mark.parametrize("engine", [LlamaEngine, VLLMEngine, WordModel])
def test_every_engine_offers_every_member_of_the_language_model_protocol(engine: type):
    members = _members(LanguageModel)
    assert {"tokenize", "next_token_logprobs", "generate", "continuation_logprobs"} <= members
    missing = sorted(m for m in members if not hasattr(engine, m))
    assert not missing, f"{engine.__name__} lacks {missing}"
    for name in members:
        declared = inspect.getattr_static(LanguageModel, name)
        offered = inspect.getattr_static(engine, name)
        if isinstance(declared, property):
            assert isinstance(offered, property | functools.cached_property), name
        else:
            assert callable(offered), name


def test_a_fake_engine_passes_the_runtime_check():
    assert isinstance(WordModel(), LanguageModel)
    assert not isinstance(object(), LanguageModel)


@pytest.mark.parametrize("search", [QdrantStore, RemoteRetriever, ListRetriever])
def test_every_retriever_searches_one_query_and_a_steps_queries(search: type):
    assert _members(PassageSearch) == {"search", "search_many"}
    assert all(callable(getattr(search, m, None)) for m in _members(PassageSearch))


def test_a_generations_logprob_is_the_sum_of_its_tokens():
    generation = Generation([1, 2, 3], "abc", [-0.5, -1.0, -0.25], "eos", prefill_tokens=4)
    assert generation.logprob == -1.75
    assert Generation([], "", [], "length", 0).logprob == 0.0


def test_requests_and_passages_are_values():
    request = TokenScoreRequest(prompt=[1, 2], candidates=[3])
    assert (request.reusable_prefix, request.hidden_state, request.hidden_layers) == (0, False, ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.reusable_prefix = 1  # type: ignore[misc]
    assert Sampling(0.7) == Sampling(0.7, top_p=1.0, seed=None)
    passage = Passage("p", "text")
    assert (passage.title, passage.score, passage.metadata) == (None, 0.0, {})
    assert Passage("q", "t").metadata is not passage.metadata
