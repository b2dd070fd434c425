"""The engine's three batched calls as KV jobs: each request checked and turned into a `KVJob`
for the slot planner, and the jobs run in the groups the planner sizes, their logits read back
into the protocol's results. `infra.engine.llama_engine.LlamaEngine` builds the jobs and runs
them under its lock."""

from __future__ import annotations

from collections.abc import Sequence

from selfrag.infra.engine.kv_slots import KVJob
from selfrag.infra.engine.llama_groups import GroupRunner
from selfrag.infra.engine.llama_vocab import LlamaVocab
from selfrag.pipeline.protocols import (
    ContinuationRequest,
    ContinuationScores,
    Generation,
    GenerationRequest,
    TokenScoreRequest,
    TokenScores,
)


def check_layers(layers: Sequence[int], what: str, n_layers: int | None) -> None:
    """ValueError unless every block of `layers` is a middle block of a model of `n_layers`
    (None: an engine without a layer tap, which reads no block)."""
    if not layers:
        return
    if n_layers is None:
        raise ValueError(f"{what}: this engine was created without layer_tap")
    bad = [layer for layer in layers if not 0 <= layer < n_layers - 1]
    if bad:
        raise ValueError(
            f"{what}: blocks {bad} out of range; a middle block is 0..{n_layers - 2} "
            "(the last block's output is the hidden state)"
        )


def token_score_jobs(
    vocab: LlamaVocab, requests: Sequence[TokenScoreRequest], n_layers: int | None
) -> list[KVJob]:
    """A job per request scoring the token after its prompt (its hidden state and the
    `hidden_layers` blocks' outputs read there on request)."""
    jobs: list[KVJob] = []
    for i, req in enumerate(requests):
        prompt = vocab.check_prompt(req.prompt, f"requests[{i}].prompt")
        vocab.check_tokens(req.candidates, f"requests[{i}].candidates")
        check_layers(req.hidden_layers, f"requests[{i}].hidden_layers", n_layers)
        n = len(prompt)
        jobs.append(
            KVJob(
                tokens=prompt,
                reuse_limit=n - 1,
                out_from=n - 1,
                reusable=min(req.reusable_prefix, n - 1),
                hidden=req.hidden_state,
                last_alone=req.hidden_state,
                layers=tuple(req.hidden_layers),
            )
        )
    return jobs


def next_token_scores(
    groups: GroupRunner, jobs: list[KVJob], requests: Sequence[TokenScoreRequest]
) -> list[TokenScores]:
    """Run the jobs of `token_score_jobs`: each request's candidates' log-probabilities."""
    decoder = groups.decoder
    results: list[list[float]] = [[] for _ in requests]
    hidden: list[tuple[float, ...] | None] = [None] * len(requests)
    layer_states: list[dict[int, tuple[float, ...]]] = [{} for _ in requests]

    def on_logits(job: int, pos: int, batch_index: int) -> None:
        logprobs = decoder.log_softmax(batch_index)
        results[job] = [float(logprobs[c]) for c in requests[job].candidates]
        if jobs[job].hidden:
            hidden[job] = tuple(decoder.hidden_view(batch_index).tolist())
        for layer in jobs[job].layers:
            layer_states[job][layer] = tuple(decoder.layer_rows[layer][batch_index].tolist())

    for group in groups.plan(jobs, list(range(len(jobs)))):
        groups.prefill(jobs, group, on_logits)
    return [
        TokenScores(
            logprobs=results[i],
            prefill_tokens=jobs[i].prefill,
            hidden_state=hidden[i],
            layer_states=layer_states[i],
        )
        for i in range(len(jobs))
    ]


def continuation_jobs(
    vocab: LlamaVocab, requests: Sequence[ContinuationRequest]
) -> tuple[list[KVJob], list[int]]:
    """A job per request scoring its continuation, and the requests with one to score."""
    jobs: list[KVJob] = []
    active: list[int] = []
    for i, req in enumerate(requests):
        prompt = vocab.check_prompt(req.prompt, f"requests[{i}].prompt")
        continuation = vocab.check_tokens(req.continuation, f"requests[{i}].continuation")
        n = len(prompt)
        # The last continuation token is only a target: it needs no KV entry of its own.
        jobs.append(
            KVJob(
                tokens=prompt + continuation[:-1],
                reuse_limit=n - 1,
                out_from=n - 1,
                reusable=min(req.reusable_prefix, n - 1),
            )
        )
        if continuation:
            active.append(i)
    return jobs, active


def continuation_scores(
    groups: GroupRunner,
    jobs: list[KVJob],
    active: list[int],
    requests: Sequence[ContinuationRequest],
) -> list[ContinuationScores]:
    """Run the jobs of `continuation_jobs`: every continuation token's log-probability."""
    results: list[list[float]] = [[0.0] * len(r.continuation) for r in requests]

    def on_logits(job: int, pos: int, batch_index: int) -> None:
        logprobs = groups.decoder.log_softmax(batch_index)
        offset = pos - jobs[job].out_from
        target = requests[job].continuation[offset]
        results[job][offset] = float(logprobs[target])

    for group in groups.plan(jobs, active):
        groups.prefill(jobs, group, on_logits)
    return [
        ContinuationScores(logprobs=results[i], prefill_tokens=jobs[i].prefill)
        for i in range(len(jobs))
    ]


def generation_jobs(
    vocab: LlamaVocab, requests: Sequence[GenerationRequest]
) -> tuple[list[KVJob], list[int]]:
    """A job per request generating after its prompt, and the requests with tokens to
    generate (`max_tokens` above 0)."""
    jobs: list[KVJob] = []
    active: list[int] = []
    for i, req in enumerate(requests):
        prompt = vocab.check_prompt(req.prompt, f"requests[{i}].prompt")
        if req.max_tokens < 0:
            raise ValueError(f"requests[{i}].max_tokens must not be negative")
        vocab.check_tokens(sorted(req.stop_token_ids), f"requests[{i}].stop_token_ids")
        n = len(prompt)
        # A job holds at most max_tokens - 1 generated tokens in the KV cache: the last
        # chosen token is never decoded.
        reserve = max(req.max_tokens - 1, 0)
        jobs.append(
            KVJob(
                tokens=prompt,
                reuse_limit=n - 1,
                out_from=n - 1,
                reserve=reserve,
                reusable=min(req.reusable_prefix, n - 1),
            )
        )
        if req.max_tokens > 0:
            active.append(i)
    return jobs, active


def generations(
    groups: GroupRunner,
    jobs: list[KVJob],
    active: list[int],
    requests: Sequence[GenerationRequest],
) -> list[Generation]:
    """Run the jobs of `generation_jobs`: each request's generation (empty for none)."""
    outputs: list[Generation | None] = [None] * len(requests)
    for i, req in enumerate(requests):
        if req.max_tokens == 0:
            outputs[i] = Generation(
                tokens=[], text="", logprobs=[], finish_reason="length", prefill_tokens=0
            )
    for group in groups.plan(jobs, active):
        for i, gen in zip(group, groups.generate(jobs, group, requests), strict=True):
            outputs[i] = gen
    return [g for g in outputs if g is not None]
