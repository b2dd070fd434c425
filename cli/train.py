"""`selfrag train`: the reflection heads (optionally with a critic model's support labels,
`--critic`) or the answerability model of the model file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from selfrag.cli.common import CLIError, model_override, settings_from_args
from selfrag.schemas.settings import Settings

if TYPE_CHECKING:
    from selfrag.jobs.evaluation.eval_questions import EvalQuestion
    from selfrag.jobs.training import TrainingPlan
    from selfrag.pipeline.heads import ReflectionHeads
    from selfrag.pipeline.learning.critic_labels import CriticLabeller, CriticMode
    from selfrag.runtime.system import LocalRuntime


def cmd_train(args: argparse.Namespace) -> int:
    from selfrag.infra.models.heads_store import heads_path
    from selfrag.infra.models.model_files import file_sha256
    from selfrag.jobs.evaluation.eval_questions import load_questions
    from selfrag.runtime.system import LocalRuntime

    if args.answerability:
        return train_answerability(args)
    if args.reuse and (args.export_gguf is None or args.critic is not None):
        raise CLIError("--reuse only applies with --export-gguf (and trains nothing: no --critic)")
    if args.passages is not None and args.passages < 10:
        raise CLIError("--passages must be at least 10")
    questions = []
    for path in args.qa:
        questions += load_questions(path, article=args.article if path.suffix == ".json" else None)
    plan = training_plan(args)
    settings = settings_from_args(args)
    protected: list[Path] = []
    if args.export_gguf is not None:
        from selfrag.infra.models.gguf_export import check_export_target, engine_model_files

        # Checked before training: a refusal after it would throw minutes of work away.
        protected = engine_model_files(settings.model, settings.home)
        check_export_target(args.export_gguf, protected)
    with critic_from_args(args, settings, plan) as critic, LocalRuntime(settings) as rag:
        sha = file_sha256(rag.model.path)
        out = args.out or heads_path(settings.home, sha)
        if args.reuse:
            heads = rag.model.heads
            if heads is None:
                raise CLIError(f"no reflection heads for {rag.model.path.name}: train them first")
        else:
            heads = train_and_save(args, rag, questions, plan, critic, out, sha)
        if args.export_gguf is not None:
            from selfrag.infra.models.gguf_export import export_reflection_model

            written = export_reflection_model(rag.model.path, heads, args.export_gguf, protected)
            print(f"wrote {written} (critique 'native': reflection tokens with the learned rows)")
    return 0


def train_and_save(
    args: argparse.Namespace,
    rag: LocalRuntime,
    questions: list[EvalQuestion],
    plan: TrainingPlan,
    critic: CriticLabeller | None,
    out: Path,
    sha: str,
) -> ReflectionHeads:
    """Train the heads of `rag`'s model on its index (indexing `--corpus` first when it lacks
    it) and `questions`, save them to `out` for the model file of digest `sha` and say what was
    trained."""
    from selfrag.infra.models.heads_store import save_heads
    from selfrag.jobs.evaluation.eval_runner import ensure_indexed
    from selfrag.jobs.indexing import corpus_passages
    from selfrag.jobs.training import describe, train

    progress = not args.no_progress
    ensure_indexed(rag, args.corpus, progress=progress)
    passages = None
    if args.corpus:
        retrieval = rag.settings.retrieval
        passages = [p for c in args.corpus for p in corpus_passages(c, retrieval, rag.embedder)]
    data = {
        "qa": [str(p) for p in args.qa],
        "article": args.article,
        "corpus": [str(c) for c in args.corpus or []],
        "command": "selfrag " + " ".join(sys.argv[1:]),
    }
    weights, manifest = train(
        rag, questions, plan, data=data, passages=passages, progress=progress, critic=critic
    )
    heads = save_heads(out, sha, weights, manifest)
    print(describe(manifest, out))
    return heads


def training_plan(args: argparse.Namespace) -> TrainingPlan:
    """The heads' training plan `--seed` and `--passages` ask for."""
    from dataclasses import replace

    from selfrag.jobs.training import TrainingPlan

    plan = TrainingPlan(seed=args.seed)
    if args.passages is None:
        return plan
    n = args.passages
    return replace(
        plan,
        relevance_passages=n,
        support_passages=max(n // 2, 5),
        utility_passages=max(n // 3, 12),
        retrieve_passages=max(n // 3, 12),
    )


def train_answerability(args: argparse.Namespace) -> int:
    """`selfrag train --answerability`: collect (or read) the features, fit, write."""
    from selfrag.infra.models.heads_store import answerability_path, save_answerability
    from selfrag.infra.models.model_files import file_sha256
    from selfrag.jobs.answerability_training import (
        collect_table,
        describe,
        fit_model,
        load_table,
        save_table,
    )
    from selfrag.jobs.evaluation.eval_questions import load_questions
    from selfrag.jobs.evaluation.eval_runner import ensure_indexed
    from selfrag.runtime.system import LocalRuntime

    if args.export_gguf is not None:
        raise CLIError(
            "--export-gguf exports the heads only: the answerability model is not exportable"
        )
    with LocalRuntime(settings_from_args(args), layer_tap=True) as rag:
        sha = file_sha256(rag.model.path)
        if args.features is not None and args.features.is_file():
            table, meta = load_table(args.features)
        else:
            if not args.qa:
                raise CLIError(
                    "--answerability needs labelled questions (--qa, e.g. --article Normans)"
                )
            questions = []
            for path in args.qa:
                questions += load_questions(
                    path, article=args.article if path.suffix == ".json" else None
                )
            ensure_indexed(rag, args.corpus, progress=not args.no_progress)
            d = rag.settings.decoding
            table, meta = collect_table(
                rag,
                questions,
                args.critique,
                top_k=d.top_k,
                max_tokens=d.max_segment_tokens,
                progress=not args.no_progress,
            )
            if args.features is not None:
                save_table(args.features, table, meta)
        data = {
            "qa": [str(p) for p in args.qa],
            "article": args.article,
            "command": "selfrag " + " ".join(sys.argv[1:]),
        }
        model = fit_model(table, meta, sha, data=data)
        out = args.out or answerability_path(rag.settings.home, sha, model.source)
        print(describe(save_answerability(out, model), out))
    return 0


@contextmanager
def critic_labeller(
    settings: Settings, value: str, mode: CriticMode, questions: int, *, progress: bool
) -> Iterator[CriticLabeller]:
    """The labeller of the critic `value` (a preset or a GGUF file; the served model itself
    is allowed), on an engine of its own that closes after training."""
    from tqdm import tqdm

    from selfrag.infra.models.critic_label_cache import CriticLabelFile, critic_cache_path
    from selfrag.infra.models.model_files import ModelFileError
    from selfrag.pipeline.learning.critic_labels import (
        CriticLabeller,
        CriticPlan,
        critic_fingerprint,
    )
    from selfrag.runtime.model_artefacts import model_artefacts, model_id_for

    try:
        override = model_override(value)
    except CLIError as exc:
        raise CLIError(str(exc).replace("--model", "--critic", 1)) from None
    model_settings = settings.model.model_copy(update={**override, "heads": None})
    critic_settings = settings.model_copy(update={"model": model_settings})
    with model_artefacts(critic_settings, layer_tap=False) as model:
        try:
            path = model.path
        except ModelFileError as exc:
            raise CLIError(f"--critic {value}: {exc}") from None
        identity = f"{model_id_for(model_settings, path)} sha256:{model.sha256}"
        fingerprint = critic_fingerprint(identity)
        cache = CriticLabelFile(critic_cache_path(settings.home, fingerprint))
        bars: list[tqdm] = []

        def advance(done: int, total: int) -> None:
            # Made at the first read, so its clock counts the reads, not the training before.
            if not bars:
                bars.append(
                    tqdm(desc="critic labels", unit="ex", file=sys.stderr, disable=not progress)
                )
            bars[0].total = total
            bars[0].n = done
            bars[0].refresh()

        plan = CriticPlan(mode=mode, questions=questions)
        try:
            yield CriticLabeller(
                model.engine, fingerprint, cache, plan, name=path.name, progress=advance
            )
        finally:
            for bar in bars:
                bar.close()


def critic_from_args(
    args: argparse.Namespace, settings: Settings, plan: TrainingPlan
) -> AbstractContextManager[CriticLabeller | None]:
    """The labeller `--critic` and `--critic-mode` ask for (None without `--critic`); as many
    synthetic questions as the plan's support passages."""
    if args.critic is None:
        return nullcontext()
    return critic_labeller(
        settings,
        args.critic,
        args.critic_mode,
        plan.support_passages,
        progress=not args.no_progress,
    )
