"""Which hidden-state features and which head separate relevant from irrelevant passages on
held-out questions.

Pairs, each in the learned critique's relevance prompt (system, passage, question, the
relevance task), on the derived F16 weights of the embedded model:

* test: held-out Computational_complexity_theory questions (`--test-questions`), the gold
  paragraph against 2 other paragraphs of the article (IsRel), and answerable against
  unanswerable questions on their gold paragraph (answerability);
* A: Normans questions, gold paragraph (relevant when answerable) against 2 other paragraphs;
* B: inverse cloze on the 1,000 Wikipedia passages (a sentence as the query, the rest of its
  passage relevant, another passage irrelevant);
* C: inverse cloze on the Computational_complexity_theory paragraphs: the served corpus's own
  text, no questions and no labels.

Features are the final hidden states (llama.cpp, embeddings on, pooling none) at: the last
prompt token (what `learned` reads), the passage's last token, the mean over the question and
task tokens, the mean over all tokens, and last + question mean. Heads: logistic regression on
standardised features with a bias (C = 1 and 0.05), the product's bias-free softmax
(`jobs.head_fitting.fit_softmax`, L2 0.1), and a one-hidden-layer MLP (64 units). Reported: AUC
on the test pairs for every training set, position and head. About 17 minutes on 2 cores.

    .venv/bin/python -m bench.head_features [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from selfrag.infra.engine.cpu_builds.llama_cpu_builds import ensure_backend
from selfrag.infra.models.model_files import default_model_path, derive_weights
from selfrag.jobs.head_fitting import fit_softmax
from selfrag.pipeline.critics import PromptedQuestions
from selfrag.pipeline.learning.logistic_fit import auc
from selfrag.pipeline.prompts import SYSTEM_PROMPT

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
POSITIONS = ("last", "passage_end", "question_mean", "mean")
Pair = tuple[str, str, int, str]  # question, passage, label, kind


def squad_pairs(article: dict, n: int, negatives: int, rng: random.Random) -> list[Pair]:
    paras = [p["context"] for p in article["paragraphs"]]
    qs = [(i, q) for i, p in enumerate(article["paragraphs"]) for q in p["qas"]]
    rng.shuffle(qs)
    out: list[Pair] = []
    for i, q in qs[:n]:
        answerable = not q.get("is_impossible")
        kind = "gold-answerable" if answerable else "gold-unanswerable"
        out.append((q["question"], paras[i], int(answerable), kind))
        for j in rng.sample([j for j in range(len(paras)) if j != i], negatives):
            out.append((q["question"], paras[j], 0, "other"))
    return out


def inverse_cloze(texts: Sequence[str], n: int, rng: random.Random) -> list[Pair]:
    out: list[Pair] = []
    for i in rng.sample(range(len(texts)), min(n, len(texts))):
        sentences = re.split(r"(?<=[.!?])\s+", texts[i])
        if len(sentences) < 3:
            continue
        j = rng.randrange(len(sentences))
        rest = " ".join(sentences[:j] + sentences[j + 1 :])
        out.append((sentences[j], rest, 1, "ict-own"))
        k = rng.choice([x for x in range(len(texts)) if x != i])
        out.append((sentences[j], texts[k], 0, "ict-other"))
    return out


def features(llm: object, pairs: Sequence[Pair], task: str) -> dict[str, np.ndarray]:
    """Hidden states at each position of `POSITIONS` for every pair's prompt."""
    out: dict[str, list[np.ndarray]] = {k: [] for k in POSITIONS}
    for question, passage, _, _ in pairs:
        head = (
            f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
            f"Passage: {passage}\n\n"
        )
        prompt = head + f"Question: {question}\n\n{task}<|im_end|>\n<|im_start|>assistant\n"
        states = np.array(llm.embed(prompt, normalize=False), dtype=np.float32)  # type: ignore[attr-defined]
        n_head = len(llm.tokenize(head.encode(), special=True))  # type: ignore[attr-defined]
        out["last"].append(states[-1])
        out["passage_end"].append(states[n_head - 1])
        out["question_mean"].append(states[n_head:].mean(0))
        out["mean"].append(states.mean(0))
    return {k: np.stack(v) for k, v in out.items()}


Fit = Callable[[np.ndarray, np.ndarray], Callable[[np.ndarray], np.ndarray]]


def logistic(c: float) -> Fit:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    def fit(X: np.ndarray, y: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        scaler = StandardScaler().fit(X)
        model = LogisticRegression(C=c, max_iter=3000, class_weight="balanced")
        model.fit(scaler.transform(X), y)
        return lambda Z: model.decision_function(scaler.transform(Z))

    return fit


def bias_free_at(l2: float, constant: float | None = None) -> Fit:
    """The product's fit at L2 `l2`; with `constant`, a constant feature (i.e. a bias)."""

    def fit(X: np.ndarray, y: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        def widen(Z: np.ndarray) -> np.ndarray:
            return Z if constant is None else np.hstack([Z, np.full((len(Z), 1), constant)])

        counts = {v: (y == v).sum() for v in set(y.tolist())}
        weights = np.array([1.0 / counts[v] for v in y.tolist()])
        W = fit_softmax(widen(X), 1 - y, 2, l2, weights)  # label 0 = relevant
        return lambda Z: (widen(Z) @ W.T)[:, 0] - (widen(Z) @ W.T)[:, 1]

    return fit


bias_free = bias_free_at(0.1)


def mlp(X: np.ndarray, y: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    from sklearn.neural_network import MLPClassifier
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(X)
    model = MLPClassifier((64,), alpha=1.0, max_iter=2000, random_state=0)
    model.fit(scaler.transform(X), y)
    return lambda Z: model.predict_proba(scaler.transform(Z))[:, 1]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--test-questions", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from llama_cpp import LLAMA_POOLING_TYPE_NONE, Llama

    rng = random.Random(args.seed)
    squad = {a["title"]: a for a in json.loads((DATA / "squad_v2_small.json").read_text())["data"]}
    wiki = [json.loads(line) for line in (DATA / "wiki_sample_1000.jsonl").open()]
    held_out = squad["Computational_complexity_theory"]
    sets = {
        "test": squad_pairs(held_out, args.test_questions, 2, rng),
        "A": squad_pairs(squad["Normans"], 90, 2, rng),
        "B": inverse_cloze([w["contents"].split("\n", 1)[-1] for w in wiki], 160, rng),
        "C": [],
    }
    own = [p["context"] for p in held_out["paragraphs"]]
    sets["C"] = inverse_cloze(own, 40, rng) + inverse_cloze(own, 40, rng)

    home = Path.home() / ".local" / "share" / "selfrag"
    model = derive_weights(default_model_path(), "f16", home)
    ensure_backend(model, n_threads=args.threads)
    llm = Llama(
        str(model),
        embedding=True,
        pooling_type=LLAMA_POOLING_TYPE_NONE,
        n_ctx=2048,
        n_batch=2048,
        n_ubatch=2048,
        n_threads=args.threads,
        verbose=False,
    )
    task = PromptedQuestions().relevance
    feats: dict[str, dict[str, np.ndarray]] = {}
    for name, pairs in sets.items():
        started = time.monotonic()
        feats[name] = features(llm, pairs, task)
        print(f"{name}: {len(pairs)} pairs in {time.monotonic() - started:.0f} s", flush=True)

    kinds = [k for _, _, _, k in sets["test"]]
    rel = [i for i, k in enumerate(kinds) if k in ("gold-answerable", "other")]
    ans = [i for i, k in enumerate(kinds) if k.startswith("gold-")]
    heads: dict[str, Fit] = {
        "lr": logistic(1.0),
        "lr_c0.05": logistic(0.05),
        "bias_free": bias_free,
        "mlp": mlp,
    }
    figures: dict[str, str] = {}
    for position in (*POSITIONS, "last+question_mean"):

        def at(name: str, position: str = position) -> np.ndarray:
            if position == "last+question_mean":
                return np.hstack([feats[name]["last"], feats[name]["question_mean"]])
            return feats[name][position]

        for combo in ("A", "B", "C", "A+B", "A+C", "A+B+C"):
            parts = combo.split("+")
            X = np.vstack([at(n) for n in parts])
            y = np.concatenate([np.array([lab for _, _, lab, _ in sets[n]]) for n in parts])
            row = []
            for head, fit in heads.items():
                s = fit(X, y)(at("test")).tolist()
                a_rel = auc([s[i] for i in rel], [kinds[i] == "gold-answerable" for i in rel])
                a_ans = auc([s[i] for i in ans], [kinds[i] == "gold-answerable" for i in ans])
                row.append(f"{head} {a_rel:.2f}/{a_ans:.2f}")
                if position == "last":
                    figures[f"isrel_{combo}_{head}"] = f"{a_rel:.3f}"
            print(f"{position:<19} {combo:<6} " + "  ".join(row), flush=True)
    print("bias-free head on the last token, by L2 (without / with a constant feature):")
    for combo in ("A+B", "A+B+C", "A+C"):
        parts = combo.split("+")
        X = np.vstack([feats[n]["last"] for n in parts])
        y = np.concatenate([np.array([lab for _, _, lab, _ in sets[n]]) for n in parts])
        row = []
        for l2 in (0.001, 0.01, 0.1, 1.0, 3.0):
            pair = []
            for constant in (None, 30.0):
                s = bias_free_at(l2, constant)(X, y)(feats["test"]["last"]).tolist()
                pair.append(auc([s[i] for i in rel], [kinds[i] == "gold-answerable" for i in rel]))
            row.append(f"l2={l2:g} {pair[0]:.3f}/{pair[1]:.3f}")
        print(f"  {combo:<6} " + "  ".join(row), flush=True)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
