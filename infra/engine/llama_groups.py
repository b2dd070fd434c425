"""A llama.cpp context's batching parts (slot planner, batch decoder, prefix stager) and the
groups of KV jobs run on them: the jobs planned into groups that fit, each job brought into a
slot (its prefix restored from the state store, shared with the group, or left from an earlier
call) and the rest decoded, its logits reported; or greedily generated from, all sequences
advancing by one `llama_decode` per step. `LlamaEngine` validates requests, builds the jobs and
holds the lock; this plans and runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import llama_cpp
import numpy as np
import numpy.typing as npt

from selfrag.infra.cache.kv_cache import ContextLayout, PrefixStateStore
from selfrag.infra.engine.engine_stats import EngineStats
from selfrag.infra.engine.kv_slots import KVJob, Plan, Slot, SlotPlanner
from selfrag.infra.engine.kv_staging import PrefixStager
from selfrag.infra.engine.llama_batch import BatchDecoder, EngineError, Feed, greedy_logprob
from selfrag.infra.engine.llama_context import LlamaMemory
from selfrag.infra.engine.llama_layers import LayerTap
from selfrag.infra.engine.llama_threads import ThreadChooser
from selfrag.infra.engine.llama_vocab import LlamaVocab
from selfrag.infra.engine.token_choice import TokenChooser
from selfrag.pipeline.protocols import FinishReason, Generation, GenerationRequest
from selfrag.pipeline.segmenting import ends_sentence


class GroupRunner:
    """The slot planner, batch decoder and prefix stager of one context, and the running of
    the groups of jobs the planner sizes to fit: prefill and greedy generation."""

    def __init__(
        self,
        ctx: llama_cpp.llama_context_p,
        ctx_params: llama_cpp.llama_context_params,
        *,
        vocab: LlamaVocab,
        n_embd: int,
        tap: LayerTap | None,
        threads: ThreadChooser,
        prefix_cache: bool,
        share_prefix: bool,
        model_sha256: str | None,
        prefix_min_tokens: int,
    ) -> None:
        self.n_ctx = int(llama_cpp.llama_n_ctx(ctx))
        n_seq_max = int(ctx_params.n_seq_max)
        self.planner = SlotPlanner(
            LlamaMemory(llama_cpp.llama_get_memory(ctx)),
            n_ctx=self.n_ctx,
            n_seq_max=n_seq_max,
            prefix_cache=prefix_cache,
            share_prefix=share_prefix,
        )
        self.stats = EngineStats()
        self.layout = ContextLayout(
            n_ctx=self.n_ctx,
            n_seq_max=n_seq_max,
            kv_unified=bool(ctx_params.kv_unified),
            type_k=int(ctx_params.type_k),
            type_v=int(ctx_params.type_v),
            llama_cpp_version=llama_cpp.__version__,
        )
        self.decoder = BatchDecoder(
            ctx,
            n_batch=int(llama_cpp.llama_n_batch(ctx)),
            n_vocab=vocab.n_tokens,
            n_embd=n_embd,
            planner=self.planner,
            stats=self.stats,
            tap=tap,
            threads=threads,
        )
        self._stager = PrefixStager(
            ctx, planner=self.planner, decoder=self.decoder, stats=self.stats, layout=self.layout
        )
        self._vocab = vocab
        self.prefix_store: PrefixStateStore | None = None
        """Where reusable prefixes' states are restored from and saved to (None: nowhere)."""
        self.model_sha256 = model_sha256
        self.prefix_min_tokens = max(prefix_min_tokens, 1)

    def plan(self, jobs: list[KVJob], indices: list[int]) -> list[list[int]]:
        """The jobs at `indices` in groups that fit the context (`SlotPlanner.groups`); a
        ValueError first for a job that cannot fit even alone."""
        self._check_fits([jobs[i] for i in indices])
        return self.planner.groups(indices, jobs)

    def generate(
        self, jobs: list[KVJob], group: list[int], requests: Sequence[GenerationRequest]
    ) -> list[Generation]:
        """Generation for the jobs of `group` (greedy, or sampled as a request says): one
        decode call per step for all."""
        tokens: dict[int, list[int]] = {i: [] for i in group}
        logprobs: dict[int, list[float]] = {i: [] for i in group}
        finish: dict[int, tuple[FinishReason, int | None]] = {}
        pending: dict[int, tuple[int, float]] = {}
        choosers = {i: TokenChooser(requests[i].sampling, requests[i].prompt) for i in group}

        def choose(job: int, pos: int, batch_index: int) -> None:
            logits = self.decoder.logits_view(batch_index)
            if len(tokens[job]) < requests[job].min_tokens:
                # Chosen among the others; its log-probability stays the model's own.
                token, _ = choosers[job].choose(self._without_ends(logits, requests[job]))
                pending[job] = (token, greedy_logprob(logits, token))
            else:
                pending[job] = choosers[job].choose(logits)

        self.prefill(jobs, group, choose)
        while True:
            live: list[int] = []
            for i in group:
                if i in finish:
                    continue
                token, logprob = pending.pop(i)
                ended = self._take(token, logprob, requests[i], tokens[i], logprobs[i])
                if ended is None:
                    live.append(i)
                else:
                    finish[i] = ended
            if not live:
                break
            feeds = [
                Feed(
                    slot=self._slot_of(jobs[i]),
                    tokens=[tokens[i][-1]],
                    out_from=len(self._slot_of(jobs[i]).tokens),
                    on_logits=(lambda pos, bi, job=i: choose(job, pos, bi)),
                )
                for i in live
            ]
            self.stats.decode_steps += 1
            self.decoder.decode(feeds)
        return [
            Generation(
                tokens=tokens[i],
                text=self._vocab.detokenize(tokens[i]),
                logprobs=logprobs[i],
                finish_reason=finish[i][0],
                prefill_tokens=jobs[i].prefill,
                stop_token=finish[i][1],
            )
            for i in group
        ]

    def _without_ends(
        self, logits: npt.NDArray[np.float32], req: GenerationRequest
    ) -> npt.NDArray[np.float32]:
        """`logits` with every end-of-generation and stop token ruled out (`min_tokens`)."""
        out = np.array(logits, copy=True)
        out[self._vocab.eog_tokens] = -np.inf
        out[sorted(req.stop_token_ids)] = -np.inf
        return out

    def _take(
        self,
        token: int,
        logprob: float,
        req: GenerationRequest,
        tokens: list[int],
        logprobs: list[float],
    ) -> tuple[FinishReason, int | None] | None:
        """Take one chosen token of a sequence (appended unless it is a stop or end token):
        why the sequence ends here, with the stop token, or None when it goes on."""
        self.stats.generated_tokens += 1
        if token in req.stop_token_ids:
            return ("stop_token", token)
        if self._vocab.is_eog(token):
            return ("eos", None)
        tokens.append(token)
        logprobs.append(logprob)
        if req.stop_at_sentence_end and ends_sentence(self._vocab.detokenize(tokens)):
            return ("sentence", None)
        if len(tokens) >= req.max_tokens:
            return ("length", None)
        return None

    def _check_fits(self, jobs: Sequence[KVJob]) -> None:
        """A ValueError for a job that cannot fit the context even alone."""
        for job in jobs:
            need = len(job.tokens) + job.reserve
            if need > self.n_ctx:
                extra = f" plus {job.reserve} tokens to generate" if job.reserve else ""
                raise ValueError(
                    f"a prompt of {len(job.tokens)} tokens{extra} needs {need} KV cells, "
                    f"more than the context holds (n_ctx={self.n_ctx})"
                )

    def prefill(
        self, jobs: list[KVJob], group: list[int], on_logits: Callable[[int, int, int], None]
    ) -> None:
        """Bring every job of `group` into a slot, decode what is missing, report its logits."""
        self.planner.tick()
        if not self.planner.prefix_cache:
            self.planner.clear()
        group_jobs = [jobs[i] for i in group]
        if self.prefix_store is not None and self.planner.prefix_cache:
            assert self.model_sha256 is not None
            self._stager.stage(
                group_jobs, self.prefix_store, self.model_sha256, self.prefix_min_tokens
            )
        shared = self.planner.shared_prefix(group_jobs)
        plan = self.planner.place(group_jobs, shared)
        if plan is None:
            # Cached prefixes held in cells of their own can leave too little room; an empty
            # cache always fits, as `_groups` sized the group for it.
            self.planner.clear()
            plan = self.planner.place(group_jobs, shared)
            if plan is None:
                raise EngineError(
                    f"{len(group_jobs)} sequences do not fit the KV cache (n_ctx={self.n_ctx})"
                )
        # Staged tokens were counted as restored or prefilled already.
        self.stats.cached_tokens += sum(
            c - min(c, j.staged) for c, j in zip(plan.cached, group_jobs, strict=True)
        )

        if plan.root >= 0:
            self._share_prefix(group_jobs, plan, shared)

        feeds: list[Feed] = []
        tails: list[Feed] = []
        for k, (i, job) in enumerate(zip(group, group_jobs, strict=True)):
            suffix = job.tokens[plan.starts[k] :]
            job.prefill += len(suffix)
            self.stats.prefill_tokens += len(suffix)
            feed = Feed(
                slot=self._slot_of(job),
                tokens=suffix,
                out_from=job.out_from,
                on_logits=(lambda pos, bi, job_index=i: on_logits(job_index, pos, bi)),
                hidden=job.hidden,
                layers=job.layers,
            )
            if job.last_alone and len(suffix) > 1:
                # With hidden states on, llama.cpp outputs every token of a decode call: only
                # the last token, whose output is read, goes into that call.
                feeds.append(Feed(feed.slot, suffix[:-1], job.out_from, None))
                feed.tokens = suffix[-1:]
                tails.append(feed)
            else:
                feeds.append(feed)
        self.decoder.decode(feeds)
        if tails:
            self.decoder.decode(tails)

    def _share_prefix(self, group_jobs: list[KVJob], plan: Plan, shared: int) -> None:
        """Decode the shared prefix once, in the root job's slot, then copy it to the slots
        of `plan.copies`."""
        root_job = group_jobs[plan.root]
        root_slot = self._slot_of(root_job)
        if plan.cached[plan.root] < shared:
            missing = root_job.tokens[plan.cached[plan.root] : shared]
            root_job.prefill += len(missing)
            self.stats.prefill_tokens += len(missing)
            self.decoder.decode([Feed(root_slot, missing, shared, None)])
        for k in plan.copies:
            self.planner.copy_prefix(root_slot, self._slot_of(group_jobs[k]), shared)
            self.stats.shared_tokens += shared

    def _slot_of(self, job: KVJob) -> Slot:
        assert job.slot is not None
        return job.slot
