"""`selfrag index`, `eval`, `calibrate` and `batch`: the jobs over files (`train`: `cli.train`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from selfrag.cli.common import EXIT_PARTIAL, CLIError, question_limit, settings_from_args
from selfrag.schemas.decoding import DecodingOverrides

if TYPE_CHECKING:
    from selfrag.api import SelfRAG
    from selfrag.jobs.indexing import IndexReport
    from selfrag.runtime.system import LocalRuntime

SHOWN_ERRORS = 20
"""Error records `selfrag batch` lists on stderr; the rest are counted."""


def cmd_index(args: argparse.Namespace) -> int:
    from selfrag.api import SelfRAG

    if not args.paths and not args.precompute_kv:
        raise CLIError("name at least one file or folder to index (or --precompute-kv)")
    for path in args.paths:
        if not path.exists():
            raise CLIError(f"no such file or folder: {path}")
    settings = settings_from_args(args)
    failed = 0
    changed = False
    with SelfRAG(settings) as rag:
        for path in args.paths:
            # Each skipped record is logged (WARNING) once by the indexing job itself.
            report = _index_path(args, rag, path)
            failed += len(report.errors)
            changed |= report.changed
            print(index_line(path, report))
        print(f"index: {rag.count()} passages in {settings.home}")
        if args.paths and not args.no_calibrate and rag.count() > 0:
            print(_calibrate_after_indexing(rag.system, changed, progress=not args.no_progress))
        if args.precompute_kv:
            try:
                kv = rag.precompute_kv(progress=not args.no_progress)
            except ValueError as exc:
                raise CLIError(str(exc)) from exc
            print(
                f"kv: {kv.computed} passage states computed, {kv.passages - kv.computed} "
                f"already saved; {kv.disk_bytes / 2**20:,.0f} MiB in {settings.home / 'kv'} "
                f"({kv.seconds:.0f} s)"
            )
    return EXIT_PARTIAL if failed else 0


def _index_path(args: argparse.Namespace, rag: SelfRAG, path: Path) -> IndexReport:
    """Index one file or folder, in this process or with its embedding on Ray (`--ray`)."""
    if not args.ray:
        [report] = rag.index(path, progress=not args.no_progress, follow_links=args.follow_links)
        return report
    from selfrag.jobs.ray_indexing import index_corpus_ray

    return index_corpus_ray(
        path,
        rag.system.store,
        retrieval=rag.settings.retrieval,
        actors=args.actors,
        address=args.address,
        follow_links=args.follow_links,
        progress=not args.no_progress,
    )


def index_line(path: Path, report: IndexReport) -> str:
    """The line `selfrag index` prints for one file or folder."""
    removed = (
        f", {report.removed} removed ({report.removed_passages} passages: gone from it since "
        "it was last indexed)"
        if report.removed
        else ""
    )
    return (
        f"{path}: {report.documents} documents, {report.passages} passages indexed"
        + (f", {report.unchanged} unchanged" if report.unchanged else "")
        + (f", {len(report.errors)} skipped" if report.errors else "")
        + removed
    )


def _calibrate_after_indexing(system: LocalRuntime, changed: bool, progress: bool) -> str:
    """The support threshold fitted on the index just written, unless it changed too little
    to move it (`jobs.support_calibration.calibrate_after_indexing`); what to print."""
    from selfrag.jobs.support_calibration import calibrate_after_indexing, corpus_plan

    return calibrate_after_indexing(system, changed, corpus_plan(), progress=progress)


def cmd_eval(args: argparse.Namespace) -> int:
    from selfrag.jobs.evaluation.eval_plots import write_plots
    from selfrag.jobs.evaluation.eval_questions import load_questions
    from selfrag.jobs.evaluation.eval_report import render_summary, render_table
    from selfrag.jobs.evaluation.eval_runner import ensure_indexed, parse_systems, run_evaluation
    from selfrag.jobs.first_use import answering_runtime
    from selfrag.runtime.answer_client import LocalAnswerClient

    questions = load_questions(
        args.dataset, article=args.article, split=args.split, limit=question_limit(args)
    )
    systems = parse_systems(args.systems, questions)
    chosen = {n: getattr(args, n) for n in DecodingOverrides.model_fields}
    overrides = DecodingOverrides.model_validate({n: v for n, v in chosen.items() if v is not None})
    settings = settings_from_args(args)
    # Answers as a user's would be: each Self-RAG system's config is settled by its client,
    # which calibrates its critique source's missing threshold on first use.
    with answering_runtime(settings) as rag:
        ensure_indexed(rag, args.corpus, progress=not args.no_progress)
        config = rag.answer_path.dials(overrides)  # the command's dials, not settled
        if args.ray:
            import ray.data  # noqa: F401  (sets up its loggers when imported: before quiet_ray)

            from selfrag.jobs.evaluation.ray_eval import run_eval_systems
            from selfrag.runtime.ray_logs import quiet_ray

            quiet_ray(args.verbose)

            # The actors' retriever needs the embedded store folder: release it meanwhile.
            rag.close()
            run_eval_systems(
                settings,
                questions,
                systems,
                args.out,
                config,
                actors=args.actors,
                progress=not args.no_progress,
            )
        report = run_evaluation(
            LocalAnswerClient.for_runtime(rag),
            rag,
            questions,
            systems,
            args.out,
            config,
            progress=not args.no_progress,
            probe_p_ret=args.plot,
        )
    print(render_table(report) if args.table else render_summary(report))
    if args.plot:
        for path in write_plots(args.out, questions, systems):
            print(f"wrote {path}")
    print(
        f"wrote {args.out / 'report.json'}, {args.out / 'report.md'} and the accuracy-coverage "
        f"curve {args.out / 'accuracy_coverage.png'} (.csv)"
    )
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from selfrag.jobs.calibrate import (
        collect_samples,
        dataset_label,
        describe,
        fit_samples,
        write_calibration,
    )
    from selfrag.jobs.evaluation.eval_questions import load_questions
    from selfrag.jobs.evaluation.eval_runner import ensure_indexed
    from selfrag.runtime.answering import AnswerPath
    from selfrag.runtime.system import LocalRuntime

    if args.dataset is None:
        return _calibrate_corpus(args)
    questions = load_questions(args.dataset, article=args.article, limit=question_limit(args))
    if all(q.context is None for q in questions):
        raise CLIError(
            "calibrate needs SQuAD-format questions (their gold paragraphs label the samples)"
        )
    settings = settings_from_args(args)
    # The command's dials over the decoding settings, as an answer's are.
    dials = AnswerPath(settings.decoding).dials(
        DecodingOverrides.model_validate(
            {"top_k": args.top_k, "max_segment_tokens": args.max_segment_tokens}
        )
    )
    with LocalRuntime(settings) as rag:
        ensure_indexed(rag, args.corpus, progress=not args.no_progress)
        samples = collect_samples(
            rag, questions, dials.top_k, dials.max_segment_tokens, progress=not args.no_progress
        )
    if args.samples is not None:
        args.samples.write_text("".join(json.dumps(s) + "\n" for s in samples))
    cal, stats = fit_samples(samples, dataset_label(args.dataset, args.article, len(questions)))
    print(describe(stats, cal))
    if not args.dry_run:
        print(f"wrote {write_calibration(settings.home, cal)}")
    return 0


def _calibrate_corpus(args: argparse.Namespace) -> int:
    """`selfrag calibrate` without a dataset: the support threshold, fitted on the index."""
    from selfrag.jobs.evaluation.eval_runner import ensure_indexed
    from selfrag.jobs.support_calibration import corpus_plan, run_calibration
    from selfrag.runtime.system import LocalRuntime

    plan = corpus_plan(
        questions=args.questions,
        seed=args.seed,
        max_answerable_abstain=args.max_answerable_abstain,
        time_limit_s=args.time_limit,
        report=args.report or None,
    )
    with LocalRuntime(settings_from_args(args)) as rag:
        ensure_indexed(rag, args.corpus, progress=not args.no_progress)
        if rag.store.count() == 0:
            raise CLIError(f"the index in {rag.settings.home} is empty: run `selfrag index` first")
        done, message = run_calibration(rag, plan, progress=not args.no_progress)
    print(message)
    return 0 if done else EXIT_PARTIAL


def cmd_batch(args: argparse.Namespace) -> int:
    import ray.data  # noqa: F401  (sets up its loggers when imported: before quiet_ray)

    from selfrag.jobs.batch.batch_driver import run_batch
    from selfrag.jobs.batch.batch_inputs import parse_shard
    from selfrag.runtime.ray_logs import quiet_ray

    quiet_ray(args.verbose)

    if args.actors is not None and args.actors < 1:
        raise CLIError("--actors must be at least 1")
    if args.per_actor < 1:
        raise CLIError("--per-actor must be at least 1")
    if args.actor_cpus is not None and args.actor_cpus <= 0:
        raise CLIError("--actor-cpus must be above 0")
    settings = settings_from_args(args)
    if settings.model.backend == "llama_cpp":
        from selfrag.infra.models.model_presets import recheck_model

        recheck_model(settings.model, settings.home)  # its bytes, not its remembered hash
    summary = run_batch(
        settings,
        args.questions,
        args.out,
        actors=args.actors,
        per_actor=args.per_actor,
        limit=question_limit(args),
        shard=parse_shard(args.shard),
        address=args.address,
        progress=not args.no_progress,
        retry_failed=args.retry_failed,
        actor_cpus=args.actor_cpus,
    )
    print(summary.line())
    # Every row got its record (an error is a record too): the run did its job.
    for ident, kind, message in summary.errors[:SHOWN_ERRORS]:
        print(f"error record {ident} ({kind}): {message}", file=sys.stderr)
    if len(summary.errors) > SHOWN_ERRORS:
        print(
            f"... and {len(summary.errors) - SHOWN_ERRORS} more error records in {args.out}",
            file=sys.stderr,
        )
    return 0
