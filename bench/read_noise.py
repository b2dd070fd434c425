"""Read noise: how far a critique read moves when llama.cpp computes the same prompt in other
decode calls.

The engine splits a prompt into decode calls by what its KV cache already holds: a reused
passage head (the passage KV-state cache) leaves the rest for a later call, and a prompt a
slot already holds whole recomputes only its last token. llama.cpp's CPU results depend on
those splits, so one prompt read twice can read differently. For the first `--questions`
answerable questions of the tuning article and each one's first retrieved passage, this
builds two prompts with the served model's own templates:

* the relevance prompt, read by the learned relevance head (s_rel);
* the verification prompt (`pipeline.critics.verify`) with "The answer is <gold>." as the
  claim, read as p(yes) against p(no) at its first answer token.

It decodes each prompt on a fresh llama.cpp context three ways: in one call; the reusable
head, then the rest (what a passage-state hit or a staged head does); all but the last token,
then the last token (what a prompt held whole does). Reported per read: the final hidden
state's relative change and the read's absolute change against the one-call read (median,
90th percentile, max), and the share of reads that moved by more than 0.05. Last line:
name=value.

    .venv/bin/python -m bench.read_noise --home H [--model qwen2.5-coder-0.5b] [--questions 20]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from selfrag.pipeline.critics.base import LabelTokens

TUNING_ARTICLE = "Normans"
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SPLITS = ("head, then rest", "all but last, then last")


class RawDecoder:
    """A bare llama.cpp context on the model file: decodes one prompt in the calls given and
    returns the last token's final hidden state and logits."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        from selfrag.infra.engine.cpu_builds.llama_cpu_builds import ensure_backend

        ensure_backend(path, n_threads=1)
        llama_cpp.llama_backend_init()
        self._llama = llama_cpp
        self._model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), llama_cpp.llama_model_default_params()
        )
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))

    def last(self, tokens: Sequence[int], cuts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(hidden state, logits) after `tokens`, decoded in calls that end at `cuts`."""
        llama = self._llama
        params = llama.llama_context_default_params()
        params.n_ctx = max(512, len(tokens) + 8)
        params.n_batch = params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = 1
        params.embeddings = True
        params.pooling_type = llama.LLAMA_POOLING_TYPE_NONE
        ctx = llama.llama_init_from_model(self._model, params)
        try:
            bounds = [0, *cuts, len(tokens)]
            for start, end in itertools.pairwise(bounds):
                batch = llama.llama_batch_init(end - start, 0, 1)
                try:
                    for i, token in enumerate(tokens[start:end]):
                        batch.token[i] = token
                        batch.pos[i] = start + i
                        batch.n_seq_id[i] = 1
                        batch.seq_id[i][0] = 0
                        batch.logits[i] = start + i == len(tokens) - 1
                    batch.n_tokens = end - start
                    if llama.llama_decode(ctx, batch) != 0:
                        raise RuntimeError("llama_decode failed")
                finally:
                    llama.llama_batch_free(batch)
            hidden = np.ctypeslib.as_array(
                llama.llama_get_embeddings_ith(ctx, -1), shape=(self.n_embd,)
            ).copy()
            logits = np.ctypeslib.as_array(
                llama.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,)
            ).copy()
        finally:
            llama.llama_free(ctx)
        return hidden, logits


def p_yes(logits: np.ndarray, labels: LabelTokens) -> float:
    """p(yes) / (p(yes) + p(no)) at this position, from the labels' token masses."""
    shifted = logits - logits.max()
    log_total = math.log(float(np.exp(shifted).sum()))
    mass = labels.probabilities([float(shifted[t]) - log_total for t in labels.candidates])
    return mass["yes"] / (mass["yes"] + mass["no"])


def _pct(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, int(q * len(ranked)))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True)
    parser.add_argument("--model", default=None, help="a preset; default: the configured one")
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args(argv)

    from selfrag import SelfRAG
    from selfrag.jobs.evaluation.eval_questions import load_questions
    from selfrag.pipeline.critics import Branch
    from selfrag.pipeline.critics.prompted import first_token_labels
    from selfrag.pipeline.critics.verify import VERIFY_WORDS, VerifyReader
    from selfrag.pipeline.protocols import Generation

    model = {"preset": args.model} if args.model else {}
    questions = [
        q
        for q in load_questions(args.data / "squad_v2_small.json", article=TUNING_ARTICLE)
        if q.answerable
    ][: args.questions]
    prompts: list[tuple[str, list[int], int]] = []
    with SelfRAG.open(args.home, model=model, cache={"query": False}) as rag:
        system = rag.system
        engine = system.model.engine
        critic = system.critic("learned")
        heads = critic.heads.groups["relevance"]  # type: ignore[attr-defined]
        reader = VerifyReader(engine)
        labels = first_token_labels(engine, VERIFY_WORDS)
        for q in questions:
            found = system.store.search(q.question, 1)
            if not found:
                continue
            branch = Branch(q.question, "", found[0])
            tokens, head = critic.relevance_prompt(branch)  # type: ignore[attr-defined]
            prompts.append(("relevance", list(tokens), head))
            claim = Generation([], f"The answer is {q.golds[0]}.", [], "stop", 0)
            tokens, head = reader.prompt(branch, claim)
            prompts.append(("verify", list(tokens), head))
        path = system.model.path
    decoder = RawDecoder(path)

    def read(kind: str, hidden: np.ndarray, logits: np.ndarray) -> float:
        if kind == "relevance":
            return heads.probabilities(hidden.tolist())["relevant"]
        return p_yes(logits, labels)

    moved: dict[tuple[str, str], list[float]] = {}
    drift: dict[tuple[str, str], list[float]] = {}
    for kind, tokens, head in prompts:
        base_h, base_l = decoder.last(tokens, [])
        base = read(kind, base_h, base_l)
        for split, cuts in zip(SPLITS, ([head], [len(tokens) - 1]), strict=True):
            h, logits = decoder.last(tokens, cuts)
            moved.setdefault((kind, split), []).append(abs(read(kind, h, logits) - base))
            drift.setdefault((kind, split), []).append(
                float(np.linalg.norm(h - base_h) / np.linalg.norm(base_h))
            )

    figures: dict[str, object] = {"model": args.model or "default", "prompts": len(prompts)}
    print(f"{len(prompts) // 2} questions of {TUNING_ARTICLE}, first retrieved passage each\n")
    print(
        "| read | split | hidden state change, median | read change: median | p90 | max "
        "| moved > 0.05 |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for (kind, split), changes in moved.items():
        share = sum(c > 0.05 for c in changes) / len(changes)
        print(
            f"| {kind} | {split} | {statistics.median(drift[(kind, split)]):.4f} | "
            f"{statistics.median(changes):.3f} | {_pct(changes, 0.9):.3f} | {max(changes):.3f} | "
            f"{share:.0%} |"
        )
        key = f"{kind}_{'head' if split == SPLITS[0] else 'last'}"
        figures[f"{key}_median"] = f"{statistics.median(changes):.3f}"
        figures[f"{key}_max"] = f"{max(changes):.3f}"
        figures[f"{key}_moved_share"] = f"{share:.2f}"
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
