"""Which answerability features discriminate? Grouped 5-fold cross-validated AUROC on Normans.

Reads the features `selfrag train --answerability --features CACHE.npz` collected (or collects
them first, through the same job: retrieved top-3 branches, the critique source's drafts, every
candidate block's output at the support prompt), then, with folds grouped by question:

  (a) each named feature alone, (b) a linear probe of each collected block alone,
  (c) combiners of them,

each as AUROC per branch (label: answerable question and a gold answer in the passage) and per
question (max over the question's branches, as abstention uses it: answerable vs not).

    OMP_WAIT_POLICY=PASSIVE SELFRAG_MODEL__N_THREADS=1 .venv/bin/python -m bench.answerability \
        --features /tmp/smol.npz [--model qwen2.5-coder-0.5b] [--home HOME] [--limit N]

Ends with one line of name=value pairs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from selfrag.pipeline.answerability_model import (
    FEATURES,
    FeatureTable,
    fit_answerability,
    group_folds,
    predict,
    probe_site,
)
from selfrag.pipeline.learning.logistic_fit import auc

SQUAD = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad_v2_small.json"
PROBE_L2 = (30.0, 300.0)


def collect(path: Path, model: str | None, home: Path | None, limit: int | None) -> None:
    """Collect the Normans features with the product's job and write them to `path`
    (`limit`: that many questions, evenly spaced over the article)."""
    from selfrag.infra.settings_loader import load_settings
    from selfrag.jobs.answerability_training import collect_table, save_table
    from selfrag.jobs.evaluation.eval_questions import load_questions
    from selfrag.runtime.system import LocalRuntime

    overrides: dict[str, object] = {"model": {"preset": model}} if model else {}
    if home is not None:
        overrides["home"] = home
    settings = load_settings(overrides=overrides)
    questions = load_questions(SQUAD, article="Normans")
    if limit is not None and limit < len(questions):
        questions = questions[:: len(questions) // limit][:limit]
    with LocalRuntime(settings, layer_tap=True) as rag:
        table, meta = collect_table(rag, questions, "auto")
    save_table(path, table, meta)


def cross_validated(
    table: FeatureTable, features: Sequence[str], probe_l2: float, k: int = 5
) -> np.ndarray:
    """Out-of-fold p of the combiner over `features`, folds grouped by question."""
    folds = group_folds(table.groups, k, seed=1)
    out = np.zeros(len(table.labels))
    for f in range(k):
        test = folds == f
        model = fit_answerability(
            table.subset(~test), features, model_sha256="cv", source="cv", probe_l2=probe_l2
        )
        out[test] = predict(model, table.subset(test))
    return out


def scores(table: FeatureTable, answerable: dict[str, bool], p: np.ndarray) -> tuple[float, float]:
    """(AUROC per branch, AUROC per question of the max over its branches)."""
    branch = auc(p.tolist(), table.labels.astype(bool).tolist())
    best: dict[str, float] = {}
    for g, v in zip(table.groups, p.tolist(), strict=True):
        best[g] = max(best.get(g, -1.0), v)
    question = auc([best[g] for g in best], [answerable[g] for g in best])
    return float(branch or 0.0), float(question or 0.0)


def abstentions(
    table: FeatureTable, answerable: dict[str, bool], p: np.ndarray, threshold: float
) -> tuple[float, float]:
    """(share of unanswerable, share of answerable questions) whose best branch is below
    `threshold`: what `min_support_score` = threshold abstains on."""
    best: dict[str, float] = {}
    for g, v in zip(table.groups, p.tolist(), strict=True):
        best[g] = max(best.get(g, -1.0), v)
    un = [best[g] < threshold for g in best if not answerable[g]]
    an = [best[g] < threshold for g in best if answerable[g]]
    return sum(un) / max(len(un), 1), sum(an) / max(len(an), 1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--features", type=Path, required=True, help="Cache (.npz).")
    parser.add_argument("--model", help="Model preset to collect with (default: the settings').")
    parser.add_argument("--home", type=Path)
    parser.add_argument("--limit", type=int, help="Collect this many Normans questions only.")
    args = parser.parse_args(argv)

    from selfrag.jobs.answerability_training import SHIPPED_PROBE_L2, default_features, load_table

    if not args.features.is_file():
        collect(args.features, args.model, args.home, args.limit)
    table, meta = load_table(args.features)
    answerable = {g: bool(a) for g, a in zip(table.groups, meta["answerable"], strict=True)}
    n_q = len(answerable)
    print(
        f"source={meta['source']} layers={meta['n_layers']} branches={len(table.labels)} "
        f"positives={int(table.labels.sum())} questions={n_q} "
        f"answerable={sum(answerable.values())} collected_in={meta['seconds']}s"
    )
    rows: list[tuple[str, str, float, float]] = []

    last_p: list[np.ndarray] = []

    def run(kind: str, name: str, features: Sequence[str], probe_l2: float = 300.0) -> float:
        p = cross_validated(table, features, probe_l2)
        last_p[:] = [p]
        b, q = scores(table, answerable, p)
        rows.append((kind, name, b, q))
        print(f"| {kind} | {name} | {b:.3f} | {q:.3f} |", flush=True)
        return b

    print("| kind | features | AUROC per branch | AUROC per question (max) |")
    print("|---|---|---:|---:|")
    named = [f for f in FEATURES if f in table.values]  # older tables lack newer features
    for f in named:
        run("feature", f, [f])
    probe_auc: dict[tuple[str, float], float] = {}
    last = int(meta["n_layers"]) - 1
    for name in sorted(table.states, key=lambda n: probe_site(n) or ("", 0)):
        site, block = probe_site(name) or ("", 0)
        for l2 in PROBE_L2:
            where = f"{site} prompt, layer {block + 1}{' (last)' if block == last else ''}"
            probe_auc[(name, l2)] = run("probe", f"{where}, L2 {l2:g}", [name], l2)
    ranked = sorted(probe_auc, key=lambda k: -probe_auc[k])
    best_at = {
        site: next((k for k in ranked if (probe_site(k[0]) or ("",))[0] == site), None)
        for site in ("support", "relevance")
    }
    heads = ["s_sup", "s_rel"]
    draft = [f for f in named if f not in heads]
    default = [
        f for f in default_features(int(meta["n_layers"])) if f in named or f in table.states
    ]
    combos: dict[str, tuple[list[str], float]] = {
        "s_sup + s_rel": (heads, 300.0),
        " + ".join(draft): (draft, 300.0),
        "all named": (named, 300.0),
    }
    found = [k for k in best_at.values() if k is not None]
    for name, l2 in found:
        combos[f"all named + {name}"] = ([*named, name], l2)
    if len(found) == 2:
        names = [k[0] for k in found]
        combos["all named + " + " + ".join(names)] = ([*named, *names], found[1][1])
        combos["s_rel + " + names[1]] = (["s_rel", names[1]], found[1][1])
    combos["shipped default: " + ", ".join(default)] = (default, SHIPPED_PROBE_L2)
    for name, (feats, l2) in combos.items():
        run("combiner", name, feats, l2)
    chosen = rows[-1]
    print("\nshipped default, cross-validated p as s_sup: abstentions per min_support_score")
    print("| threshold | unanswerable abstained | answerable abstained |")
    print("|---:|---:|---:|")
    for t in (0.2, 0.3, 0.36, 0.4, 0.5):
        un, an = abstentions(table, answerable, last_p[0], t)
        print(f"| {t:.2f} | {un:.0%} | {an:.0%} |")
    un36, an36 = abstentions(table, answerable, last_p[0], 0.36)
    base = next(r for r in rows if r[1] == "s_sup")
    best = max((r for r in rows if r[0] == "combiner"), key=lambda r: r[3])
    print(
        f"source={meta['source']} branches={len(table.labels)} questions={n_q} "
        f"s_sup_branch={base[2]:.3f} s_sup_question={base[3]:.3f} "
        f"best_probe={ranked[0][0]} best_probe_l2={ranked[0][1]:g} "
        f"best_probe_branch={probe_auc[ranked[0]]:.3f} "
        f"best_combiner_question={best[3]:.3f} "
        f"shipped_branch={chosen[2]:.3f} shipped_question={chosen[3]:.3f} "
        f"abstain_unanswerable_036={un36:.2f} abstain_answerable_036={an36:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
