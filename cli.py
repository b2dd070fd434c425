"""The `selfrag` command line: index, ask, serve, status, config, eval, calibrate, batch, train.

One logging setup for every command (`cli_logging`): selfrag's records go to stderr at INFO,
DEBUG with `-v`, WARNING with `-q`; each skipped input record is logged once, by the job that
skipped it, and never printed again here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import textwrap
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from selfrag.schemas.decoding import DecodingOverrides
from selfrag.schemas.errors import AnswerError
from selfrag.schemas.settings import Settings

if TYPE_CHECKING:  # for `ask` only: `config`, `status` and `--help` start without them
    from selfrag.schemas.answer import AnswerRequest, AnswerResponse, SegmentOut

EXIT_USAGE = 2
EXIT_PARTIAL = 1
EXIT_FAILED = 1


class CLIError(Exception):
    """A problem the user can fix; printed without a traceback."""


def _decoding_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `DecodingOverrides` field, so the CLI and the API share their dials."""
    group = parser.add_argument_group("decoding (per request; defaults from `selfrag config`)")
    for name, field in DecodingOverrides.model_fields.items():
        flag = "--" + name.replace("_", "-")
        inner = [a for a in typing.get_args(field.annotation) if a is not type(None)]
        kind = inner[0] if inner else field.annotation
        help_text = field.description or _DESCRIPTIONS.get(name, "")
        if kind is bool:
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif typing.get_origin(kind) is typing.Literal:
            group.add_argument(flag, choices=typing.get_args(kind), default=None, help=help_text)
        elif kind in (int, float):
            group.add_argument(flag, type=kind, default=None, help=help_text)
        else:  # pragma: no cover - guards new field types
            raise TypeError(f"no CLI flag type for {name}: {kind}")


def _field_docs() -> dict[str, str]:
    from selfrag.schemas.decoding import DecodingConfig

    return {n: f.description or "" for n, f in DecodingConfig.model_fields.items()}


_DESCRIPTIONS = _field_docs()


class _Version(argparse.Action):
    """`--version`: `version_text()` as it is, two lines (argparse's own action rewraps it)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selfrag",
        description="Self-RAG: retrieval-augmented answers with per-segment citations and "
        "critique scores.",
    )
    parser.add_argument("--config", type=Path, help="TOML settings file.")
    parser.add_argument("--home", type=Path, help="Data folder (default: $SELFRAG_HOME).")
    parser.add_argument(
        "--version",
        action=_Version,
        help="Print the versions of selfrag, llama-cpp-python and Ray, and exit.",
    )
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument(
        "-v", "--verbose", action="store_true", help="Log selfrag's DEBUG records too."
    )
    loudness.add_argument(
        "-q", "--quiet", action="store_true", help="Log only warnings and errors (no INFO)."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p_index = sub.add_parser("index", help="Index JSONL, SQuAD JSON, or a folder of .txt/.md.")
    p_index.add_argument("paths", nargs="*", type=Path)
    p_index.add_argument("--no-progress", action="store_true")
    p_index.add_argument(
        "--precompute-kv",
        action="store_true",
        help="Then save every indexed passage's KV state to the disk tier (HOME/kv), so "
        "answers start warm, also after a restart; prints the disk it will take.",
    )
    p_index.add_argument(
        "--no-calibrate",
        action="store_true",
        help="Skip fitting the support threshold on the index afterwards (`selfrag calibrate` "
        "does it alone; about 2 min with the default model, whatever the corpus size).",
    )

    p_ask = sub.add_parser("ask", help="Answer a question from the index.")
    p_ask.add_argument("question")
    p_ask.add_argument("--json", action="store_true", help="Print the full response as JSON.")
    _model_flag(p_ask)
    _decoding_flags(p_ask)

    p_serve = sub.add_parser("serve", help="Run the HTTP API (Ray Serve) in the foreground.")
    p_serve.add_argument("--host", help="Bind address (default: serve.host, 127.0.0.1).")
    p_serve.add_argument("--port", type=int, help="Port (default: serve.port, 8000).")
    p_serve.add_argument(
        "--address", help="Join this Ray cluster instead of starting a local Ray instance."
    )
    _model_flag(p_serve)

    p_config = sub.add_parser("config", help="Print the effective settings.")
    p_config.add_argument("--json", action="store_true")

    p_status = sub.add_parser(
        "status",
        help="Show the index (passages, embedder, store, version), the model and reflection "
        "heads in use and the critique `auto` resolves to, without loading the model.",
    )
    p_status.add_argument("--json", action="store_true")
    _model_flag(p_status)

    p_models = sub.add_parser(
        "models",
        help="List the model presets and what is installed: file, size, SHA-256, whether "
        "reflection heads exist for the file, which one is configured.",
    )
    p_models.add_argument("--json", action="store_true")

    _eval_parsers(sub)
    _batch_parser(sub)
    return parser


def _batch_parser(sub: Any) -> None:
    p = sub.add_parser("batch", help="Answer a file of questions on Ray Data (resumable).")
    p.add_argument("questions", type=Path, help="JSONL {id?, question, config?}, CSV or Parquet.")
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="Answers, one JSON line per id; a rerun answers only the missing ids. One run per "
        "file: a second run on the same --out is refused while the first holds OUT.lock.",
    )
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="Also answer again the ids whose last record is an error (the new record replaces "
        "it; the last record of an id counts).",
    )
    p.add_argument(
        "--actors",
        type=int,
        help="Engine actors (default: one per free CPU of each node; they must fit the nodes).",
    )
    p.add_argument(
        "--actor-cpus",
        type=float,
        help="CPUs each engine actor reserves (default: the largest share that fits the nodes).",
    )
    p.add_argument(
        "--per-actor",
        type=int,
        default=8,
        help="Questions an actor decodes together (one merged engine batch).",
    )
    p.add_argument("--limit", type=int, help="Keep the first N input rows (after --shard).")
    p.add_argument("--shard", help="i/n: keep every n-th input row from the i-th (0-based).")
    p.add_argument("--address", help="Ray cluster address (default: a private local instance).")
    p.add_argument("--no-progress", action="store_true")


def _dataset_args(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument(
        "dataset",
        type=Path,
        nargs="?" if optional else None,
        help="SQuAD-format JSON or JSONL {question, golden_answers}.",
    )
    p.add_argument(
        "--corpus",
        type=Path,
        nargs="+",
        help="Corpus files or folders; indexed first when the index lacks them "
        "(default: use the existing index as it is).",
    )
    p.add_argument("--article", help="Keep one SQuAD article (e.g. Normans).")
    p.add_argument("--limit", type=int, help="Keep the first N questions.")
    p.add_argument("--no-progress", action="store_true")


def _eval_parsers(sub: Any) -> None:
    from selfrag.schemas.records import DEFAULT_SYSTEMS, SYSTEMS  # not jobs.evaluation: --help

    p_eval = sub.add_parser("eval", help="Run QA systems on a dataset and write a report.")
    _dataset_args(p_eval)
    _model_flag(p_eval)
    p_eval.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"Comma-separated, from: {', '.join(SYSTEMS)}.",
    )
    p_eval.add_argument(
        "--out",
        type=Path,
        default=Path("eval-out"),
        help="Report folder; a rerun resumes from its records.jsonl.",
    )
    p_eval.add_argument(
        "--plot", action="store_true", help="Also write accuracy-vs-δ and s_sup reliability PNGs."
    )
    p_eval.add_argument(
        "--ray",
        action="store_true",
        help="Answer the selfrag-* systems through the `selfrag batch` path.",
    )
    p_eval.add_argument("--actors", type=int, help="With --ray: engine actors.")
    _decoding_flags(p_eval)

    p_cal = sub.add_parser(
        "calibrate",
        help="Without a dataset: fit the support threshold (min_support_score) on the index, "
        "no labels needed (HOME/calibration/<model sha256>/<critique>.json). With a labelled "
        "SQuAD dev set: fit the likelihood critique's calibration (HOME/calibration.toml).",
    )
    _dataset_args(p_cal, optional=True)
    p_cal.add_argument(
        "--questions",
        type=int,
        help="Without a dataset: synthetic questions drawn from the index (default 40).",
    )
    p_cal.add_argument("--seed", type=int, help="Without a dataset: the draw's seed (default 0).")
    p_cal.add_argument(
        "--max-answerable-abstain",
        type=float,
        help="Without a dataset: the share of synthetic answerable pairs the threshold may "
        "abstain on (default 0.15).",
    )
    p_cal.add_argument(
        "--time-limit",
        type=float,
        help="Without a dataset: seconds of critique before calibrating on the pairs read "
        "(default 300).",
    )
    _model_flag(p_cal)
    p_cal.add_argument("--top-k", type=int, default=5, help="Retrieved passages per question.")
    p_cal.add_argument(
        "--max-segment-tokens",
        type=int,
        default=None,
        help="Draft length (default: the decoding setting).",
    )
    p_cal.add_argument("--samples", type=Path, help="Also write the raw samples (JSONL) here.")
    p_cal.add_argument("--dry-run", action="store_true", help="Fit and print; write nothing.")

    p_train = sub.add_parser(
        "train",
        help="Fit the reflection heads of the model file (the learned critique) on the index, "
        "and optionally labelled questions; write HOME/heads/<model sha256>.json.",
    )
    p_train.add_argument(
        "--qa",
        type=Path,
        nargs="+",
        default=[],
        help="Labelled questions: SQuAD v2 JSON or FlashRAG JSONL {question, golden_answers}.",
    )
    p_train.add_argument("--article", help="Keep one SQuAD article of --qa (e.g. Normans).")
    p_train.add_argument(
        "--corpus",
        type=Path,
        nargs="+",
        help="Corpus files or folders, indexed first when the index lacks them; the "
        "self-supervised examples come from their passages (default: the whole index). Train on "
        "the corpus you serve: the heads adapt to its text without any labels.",
    )
    p_train.add_argument("--seed", type=int, default=0)
    _model_flag(p_train)
    p_train.add_argument(
        "--passages",
        type=int,
        help="Passages drawn for the self-supervised relevance examples (default 120; the "
        "other groups scale with it).",
    )
    p_train.add_argument("--out", type=Path, help="Heads file (default: HOME/heads/<sha>.json).")
    p_train.add_argument(
        "--export-gguf",
        type=Path,
        metavar="OUT.gguf",
        help="Also write a copy of the model whose vocabulary carries the reflection tokens "
        "with the learned rows in its output matrix (critique 'native').",
    )
    p_train.add_argument(
        "--reuse",
        action="store_true",
        help="With --export-gguf: export the heads this model already has instead of training.",
    )
    p_train.add_argument(
        "--answerability",
        action="store_true",
        help="Fit the answerability model (s_sup from middle layers and the draft's grounding) "
        "of the model file and --critique on --qa instead of the heads; write "
        "HOME/answerability/<sha>.<source>.json (or --out).",
    )
    p_train.add_argument(
        "--critique", default="auto", help="With --answerability: the source it wraps."
    )
    p_train.add_argument(
        "--features",
        type=Path,
        metavar="CACHE.npz",
        help="With --answerability: read the collected features from this file when it exists, "
        "else collect them and write it.",
    )
    p_train.add_argument("--no-progress", action="store_true")


def _model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="PRESET|PATH",
        help="The model for this command: a preset (`selfrag models` lists them) or a GGUF file; "
        "default: the model.preset / model.path settings.",
    )


def _model_override(value: str) -> dict[str, Any]:
    """The `model` settings `--model VALUE` means: a preset by name, else a GGUF path or URL."""
    from selfrag.infra.model_presets import PRESETS

    if value in PRESETS:
        return {"preset": value, "path": None}
    if value.startswith(("http://", "https://")) or Path(value).expanduser().exists():
        return {"path": value}
    raise CLIError(
        f"--model {value}: neither a model preset ({', '.join(PRESETS)}) nor an existing file"
    )


def _settings(args: argparse.Namespace) -> Settings:
    from selfrag.infra.settings import load_settings

    overrides: dict[str, Any] = {}
    if args.home is not None:
        overrides["home"] = str(args.home)
    if getattr(args, "model", None) is not None:
        overrides["model"] = _model_override(args.model)
    return load_settings(config_path=args.config, overrides=overrides)


def cmd_config(args: argparse.Namespace) -> int:
    settings = _settings(args)
    data = settings.model_dump(mode="json")
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    for section, values in data.items():
        if isinstance(values, dict):
            print(f"[{section}]")
            for key, value in values.items():
                print(f"{key} = {json.dumps(value)}")
            print()
        else:
            print(f"{section} = {json.dumps(values)}")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from selfrag.api import SelfRAG

    if not args.paths and not args.precompute_kv:
        raise CLIError("name at least one file or folder to index (or --precompute-kv)")
    for path in args.paths:
        if not path.exists():
            raise CLIError(f"no such file or folder: {path}")
    settings = _settings(args)
    failed = 0
    with SelfRAG(settings) as rag:
        for path in args.paths:
            # Each skipped record is logged (WARNING) once by the indexing job itself.
            [report] = rag.index(path, progress=not args.no_progress)
            failed += len(report.errors)
            print(
                f"{path}: {report.documents} documents, {report.passages} passages indexed"
                + (f", {len(report.errors)} skipped" if report.errors else "")
            )
        print(f"index: {rag.count()} passages in {settings.home}")
        if args.paths and not args.no_calibrate and rag.count() > 0:
            from selfrag.jobs.support_calibration import corpus_plan, run_calibration

            _, message = run_calibration(rag.system, corpus_plan(), progress=not args.no_progress)
            print(message)
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


def _request_from_args(args: argparse.Namespace) -> AnswerRequest:
    from selfrag.schemas.answer import AnswerRequest

    overrides = {
        name: getattr(args, name)
        for name in DecodingOverrides.model_fields
        if getattr(args, name, None) is not None
    }
    return AnswerRequest.model_validate({"question": args.question, "config": overrides})


def cmd_ask(args: argparse.Namespace) -> int:
    from selfrag.api import SelfRAG

    request = _request_from_args(args)  # refused before the model loads
    settings = _settings(args)
    with SelfRAG(settings) as rag:
        if rag.count() == 0:
            raise CLIError(f"the index in {settings.home} is empty: run `selfrag index PATH` first")
        dials = request.config.model_dump(exclude_none=True)
        response = rag.answer(request.question, **dials)
    if args.json:
        print(response.model_dump_json(indent=2))
    else:
        print(render_answer(response))
    return 0


def render_answer(r: AnswerResponse) -> str:
    """The answer with numbered citations, a per-segment score table and the sources, each
    with the sentence that supports each segment citing it (its evidence span)."""
    numbers: dict[str, int] = {}
    body = []
    for seg in r.segments:
        text = seg.text.strip()
        if seg.citation is not None:
            n = numbers.setdefault(seg.citation.passage_id, len(numbers) + 1)
            text += f" [{n}]"
        body.append(text)
    lines = [" ".join(body) if body else r.answer]
    if r.abstained and body:
        lines.append(r.answer)
    weak = [
        i
        for i, seg in enumerate(r.segments, 1)
        if seg.citation is not None and seg.is_sup is not None and seg.is_sup != "full"
    ]
    if weak:
        which = ", ".join(str(i) for i in weak)
        lines.append(
            f"Low support: the cited evidence does not fully support segment(s) {which} "
            "(IsSup below); check the source before relying on it."
        )
    lines.append("")
    if r.segments:
        header = f"{'#':>2}  {'cite':>4}  {'p_ret':>5}  {'s_rel':>5}  {'s_sup':>5}  {'IsSup':>7}"
        header += f"  {'s_use':>6}"
        header += f"  {'logp':>7}  {'S':>7}  segment"
        lines.append(header)
        for i, seg in enumerate(r.segments, 1):
            cite = str(numbers[seg.citation.passage_id]) if seg.citation else "-"
            text = seg.text.strip()
            lines.append(
                f"{i:>2}  {cite:>4}  {_fmt(seg.p_ret):>5}  {_fmt(seg.s_rel):>5}  "
                f"{_fmt(seg.s_sup):>5}  {seg.is_sup or '-':>7}  {_fmt(seg.s_use, signed=True):>6}  "
                f"{seg.logprob:>7.2f}  "
                f"{seg.score:>7.2f}  {text[:60] + ('…' if len(text) > 60 else '')}"
            )
        lines.append("")
    if numbers:
        by_id = {p.id: p for p in r.passages}
        for pid, n in numbers.items():
            p = by_id.get(pid)
            title = p.title if p is not None and p.title else pid
            lines.append(f"[{n}] {title} ({pid})")
            lines.extend(_evidence_lines(r.segments, pid))
        lines.append("")
    u = r.usage
    lines.append(
        f"critique={r.critique} retrievals={u.retrievals} branches={u.branches_opened} "
        f"pruned={u.branches_pruned} filtered={u.branches_filtered} "
        f"prefill={u.prefill_tokens} decode={u.decode_tokens} "
        f"time={r.timings_ms.get('total', 0.0) / 1000:.1f}s"
        + (f" stopped_by={u.stopped_by}" if u.stopped_by else "")
    )
    return "\n".join(lines)


def _evidence_lines(segments: Sequence[SegmentOut], passage_id: str) -> list[str]:
    """Under a source: for each segment citing it, the passage's sentence that best supports
    that segment (its evidence span), quoted and wrapped."""
    lines = []
    for i, seg in enumerate(segments, 1):
        evidence = seg.citation.evidence if seg.citation is not None else None
        if seg.citation is None or seg.citation.passage_id != passage_id or evidence is None:
            continue
        head = f"    {i}: "
        lines.append(
            textwrap.fill(
                f"“{' '.join(evidence.text.split())}”",
                width=100,
                initial_indent=head,
                subsequent_indent=" " * len(head),
            )
        )
    return lines


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" if signed else f"{value:.2f}"


def _check_model_runs(model: Path, n_threads: int) -> None:
    """Probe `model` on this machine's llama.cpp CPU backends (in child processes);
    `BackendError` with the reason when none runs it."""
    from selfrag.infra.llama_backend import check_backend

    check_backend(model, n_threads=n_threads or os.cpu_count() or 1)


def cmd_serve(args: argparse.Namespace) -> int:
    """Start the Serve application and block until SIGINT/SIGTERM, then shut it down (and
    the local Ray instance when this command started it)."""
    import signal
    import threading

    settings = _settings(args)
    host = args.host or settings.serve.host
    port = args.port or settings.serve.port
    from selfrag.actors.app import warn_if_open

    # Loud and early, before the model check and Ray: an open port without keys answers anyone.
    warn_if_open(host)
    if settings.model.backend == "llama_cpp":
        from selfrag.runtime.system import SelfRAGSystem

        # Fail here, naming the file, before Ray starts: a missing or corrupt model, or one no
        # CPU backend can run, would otherwise surface as a replica that keeps failing to start.
        _check_model_runs(SelfRAGSystem(settings).model_path, settings.model.n_threads)
    from ray import serve

    from selfrag.actors.app import APP_NAME, build_app, serve_logging
    from selfrag.runtime.ray_cluster import (
        PORT_WAIT_S,
        init_ray,
        shutdown_private_ray,
        starts_private,
        wait_for_port,
    )

    if starts_private(args.address):
        # Serve's proxy binds with SO_REUSEPORT: on a port a stale proxy still holds (a server
        # stopped a moment ago), both would take connections. Wait for it instead.
        def waiting(holder: str) -> None:
            print(
                f"selfrag: port {port} is held by {holder}; waiting up to {PORT_WAIT_S:.0f} s",
                file=sys.stderr,
                flush=True,
            )

        wait_for_port(host, port, PORT_WAIT_S, waiting)
    local = init_ray(args.address, log_to_driver=True)  # True: a private instance, ours
    stop = threading.Event()
    # Installed after ray.init, which sets handlers of its own.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stopped = False
    try:
        serve.start(
            http_options={"host": host, "port": port}, logging_config=serve_logging(settings)
        )
        serve.run(build_app(settings), name=APP_NAME, route_prefix="/", blocking=False)
        print(
            f"selfrag: serving on http://{host}:{port} (API at /openapi.json); Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(1.0):
            pass
        print("selfrag: shutting down", file=sys.stderr, flush=True)
        stopped = True
    finally:
        if local:
            # Every process of the instance, the proxy and the replicas included: Ray's workers
            # are in process groups of their own, out of reach of a signal to ours.
            shutdown_private_ray(tidy=not stopped)
        else:
            serve.delete(APP_NAME)
    if local:
        # Ray's exit hooks would wait on the GCS and raylet just killed (5 to 13 s measured),
        # past a supervisor's grace period; nothing of this process is left to run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    status = collect_status(_settings(args))
    print(json.dumps(status, indent=2) if args.json else render_status(status))
    return 0


def collect_status(settings: Settings) -> dict[str, Any]:
    """What `selfrag status` shows: the home, the index, the model and heads in use and the
    critique the configured one resolves to. Opens the store, resolves (and, the first time,
    derives) the model file; never loads the language model."""
    from selfrag.api import SelfRAG
    from selfrag.infra.qdrant_store import StoreError, StoreMisconfigured, StoreUnavailable

    r = settings.retrieval
    with SelfRAG(settings) as rag:
        system = rag.system
        try:
            store = system.store
            index = {
                "passages": store.count(),
                "version": store.index_version(),
                "store": "embedded" if r.qdrant_url is None else "server",
                "where": store.where,
                "collection": r.collection,
                "hybrid": r.hybrid,
                "embedder": system.embedder.model_id,
                "embedding_model": r.embedding_model,
            }
        except (StoreMisconfigured, StoreUnavailable):
            raise  # their messages say what is wrong and what to do
        except StoreError as exc:
            if r.qdrant_url is not None:
                raise
            raise CLIError(
                f"the index in {settings.home} is in use by another process (embedded Qdrant "
                "allows one client per folder): stop the `selfrag serve` or other command "
                "using it, or use a Qdrant server (retrieval.qdrant_url)"
            ) from exc
        model, heads, critique = _model_status(settings, system)
        threshold = None
        if settings.model.backend != "vllm":
            from selfrag.infra.model_files import file_sha256
            from selfrag.jobs.support_calibration import threshold_status

            sha = file_sha256(system.model_path)
            threshold = threshold_status(settings.home, sha, critique["resolved"], index["version"])
    return {
        "selfrag": _selfrag_version(),
        "home": str(settings.home),
        "index": index,
        "model": model,
        "heads": heads,
        "critique": critique,
        "support_threshold": threshold,
    }


def _model_status(
    settings: Settings, system: Any
) -> tuple[dict[str, Any], str | None, dict[str, Any]]:
    """(the model, its heads file, the critique configured and what it resolves to)."""
    from selfrag.pipeline.critics.factory import auto_source

    m = settings.model
    configured = settings.decoding.critique
    if m.backend == "vllm":
        model = {"backend": "vllm", "url": m.vllm_url, "id": m.vllm_model, "path": None}
        resolved = configured if configured != "auto" else None  # the served model decides
        return model, None, {"configured": configured, "resolved": resolved, "usable": True}
    from selfrag.infra.engine_threads import describe as describe_threads
    from selfrag.infra.model_files import gguf_special_tokens
    from selfrag.pipeline.critics.base import RESERVED_PIECES
    from selfrag.runtime.system import missing_heads_message, model_id_for

    path = system.model_path
    heads = system.heads_file
    native = set(RESERVED_PIECES) <= gguf_special_tokens(path)
    usable = {"native": native, "learned": heads is not None}.get(configured, True)
    resolved = auto_source(native=native, learned=heads is not None)
    model = {
        "backend": m.backend,
        "path": str(path),
        "id": model_id_for(m, path),
        "weights": m.weights,
        # What each engine process runs with (the Serve replicas and batch actors too).
        "threads": describe_threads(m),
    }
    critique = {
        "configured": configured,
        "resolved": resolved if configured == "auto" else configured,
        "usable": usable,
    }
    if configured == "auto" and resolved == "likelihood":
        critique["warning"] = missing_heads_message(path)
    return model, str(heads) if heads is not None else None, critique


def render_status(s: dict[str, Any]) -> str:
    """`selfrag status` as text, one aligned line per fact."""
    index, model, critique = s["index"], s["model"], s["critique"]
    resolved = critique["resolved"] or "decided by the model the vLLM server runs"
    if critique["configured"] != "auto":
        shown = critique["configured"] + ("" if critique["usable"] else " (not usable here)")
    else:
        shown = f"auto -> {resolved}"
    if critique.get("warning"):
        shown += f" (warning: {critique['warning']})"
    rows = [
        ("selfrag", s["selfrag"]),
        ("home", s["home"]),
        ("passages", str(index["passages"])),
        ("index version", index["version"]),
        ("store", f"{index['store']} {index['where']}"),
        ("collection", index["collection"]),
        ("embedder", index["embedder"] + ("" if index["embedding_model"] else " (default)")),
        ("hybrid", "on" if index["hybrid"] else "off"),
        ("model", model["id"] or "?"),
        ("model file", model["path"] or f"vLLM server {model['url']}"),
        *_thread_rows(model.get("threads")),
        ("heads", s["heads"] or "none"),
        ("critique", shown),
    ]
    if s.get("support_threshold") is not None:
        from selfrag.jobs.support_calibration import describe_threshold

        rows.append(("min_support", describe_threshold(s["support_threshold"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _thread_rows(threads: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The engine's llama.cpp threads and OpenMP wait policy (none on the vLLM backend)."""
    if threads is None:
        return []
    count = str(threads["threads"]) + (" (all cores)" if threads["n_threads"] == 0 else "")
    env = threads["OMP_WAIT_POLICY"] or "unset"
    return [
        ("threads", count),
        ("wait policy", f"{threads['omp_wait_policy']} (OMP_WAIT_POLICY={env})"),
    ]


def cmd_models(args: argparse.Namespace) -> int:
    from selfrag.infra.model_presets import list_models

    settings = _settings(args)
    rows = list_models(settings.model, settings.home)
    print(json.dumps(rows, indent=2) if args.json else render_models(rows))
    return 0


def render_models(rows: Sequence[dict[str, Any]]) -> str:
    """`selfrag models` as text: a block per model, the configured one marked `*`."""
    from selfrag.infra.model_presets import NO_LICENSE

    lines = []
    for r in rows:
        mark = "*" if r["active"] else " "
        lines.append(f"{mark} {r['name']}  {r['title']}")
        if not r["installed"]:
            lines.append(f"    not installed: missing {', '.join(r['missing'])}")
            lines.append(f"    install: {r['install']}")
            continue
        if r["path"] is None:
            lines.append(f"    file     joined on first use into {r['joins_to']}")
        else:
            lines.append(f"    file     {r['path']}")
        lines.append(f"    size     {r['size'] / 2**20:,.1f} MiB  sha256 {r['sha256'][:12]}")
        heads = r["heads"] or "none: critique 'auto' falls back to 'likelihood' (selfrag train)"
        lines.append(f"    heads    {heads}")
        if "license" in r:
            lines.append(f"    license  {r['license']} (shipped as {r['file_type']})")
            if r["license"] == NO_LICENSE:
                lines.append(f"             {r['license_note']}")
    lines.append("* the configured model (model.preset, or model.path when set)")
    return "\n".join(lines)


COMMANDS = {
    "index": cmd_index,
    "ask": cmd_ask,
    "serve": cmd_serve,
    "config": cmd_config,
    "models": cmd_models,
    "status": cmd_status,
}


def _limit(args: argparse.Namespace) -> int | None:
    if args.limit is not None and args.limit < 1:
        raise CLIError("--limit must be at least 1")
    return args.limit


def cmd_eval(args: argparse.Namespace) -> int:
    from selfrag.jobs.evaluation import (
        ensure_indexed,
        load_questions,
        parse_systems,
        render_table,
        run_evaluation,
        write_plots,
    )
    from selfrag.runtime.system import SelfRAGSystem

    systems = parse_systems(args.systems)
    questions = load_questions(args.dataset, article=args.article, limit=_limit(args))
    chosen = {n: getattr(args, n) for n in DecodingOverrides.model_fields}
    overrides = DecodingOverrides.model_validate({n: v for n, v in chosen.items() if v is not None})
    settings = _settings(args)
    with SelfRAGSystem(settings) as rag:
        ensure_indexed(rag, args.corpus, progress=not args.no_progress)
        config = overrides.apply_to(settings.decoding)
        if args.ray:
            from selfrag.jobs.batch import run_eval_systems

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
            rag,
            questions,
            systems,
            args.out,
            config,
            progress=not args.no_progress,
            probe_p_ret=args.plot,
        )
    print(render_table(report))
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
    from selfrag.jobs.evaluation import ensure_indexed, load_questions
    from selfrag.runtime.system import SelfRAGSystem

    if args.dataset is None:
        return _calibrate_corpus(args)
    questions = load_questions(args.dataset, article=args.article, limit=_limit(args))
    if all(q.context is None for q in questions):
        raise CLIError(
            "calibrate needs SQuAD-format questions (their gold paragraphs label the samples)"
        )
    settings = _settings(args)
    tokens = args.max_segment_tokens or settings.decoding.max_segment_tokens
    with SelfRAGSystem(settings) as rag:
        ensure_indexed(rag, args.corpus, progress=not args.no_progress)
        samples = collect_samples(rag, questions, args.top_k, tokens, progress=not args.no_progress)
    if args.samples is not None:
        args.samples.write_text("".join(json.dumps(s) + "\n" for s in samples))
    cal, stats = fit_samples(samples, dataset_label(args.dataset, args.article, len(questions)))
    print(describe(stats, cal))
    if not args.dry_run:
        print(f"wrote {write_calibration(settings.home, cal)}")
    return 0


def _calibrate_corpus(args: argparse.Namespace) -> int:
    """`selfrag calibrate` without a dataset: the support threshold, fitted on the index."""
    from selfrag.jobs.evaluation import ensure_indexed
    from selfrag.jobs.support_calibration import corpus_plan, run_calibration
    from selfrag.runtime.system import SelfRAGSystem

    plan = corpus_plan(
        questions=args.questions,
        seed=args.seed,
        max_answerable_abstain=args.max_answerable_abstain,
        time_limit_s=args.time_limit,
    )
    with SelfRAGSystem(_settings(args)) as rag:
        ensure_indexed(rag, args.corpus, progress=not args.no_progress)
        if rag.store.count() == 0:
            raise CLIError(f"the index in {rag.settings.home} is empty: run `selfrag index` first")
        done, message = run_calibration(rag, plan, progress=not args.no_progress)
    print(message)
    return 0 if done else EXIT_PARTIAL


def cmd_batch(args: argparse.Namespace) -> int:
    from selfrag.jobs.batch import run_batch
    from selfrag.jobs.batch_inputs import parse_shard

    if args.actors is not None and args.actors < 1:
        raise CLIError("--actors must be at least 1")
    if args.per_actor < 1:
        raise CLIError("--per-actor must be at least 1")
    if args.actor_cpus is not None and args.actor_cpus <= 0:
        raise CLIError("--actor-cpus must be above 0")
    summary = run_batch(
        _settings(args),
        args.questions,
        args.out,
        actors=args.actors,
        per_actor=args.per_actor,
        limit=_limit(args),
        shard=parse_shard(args.shard),
        address=args.address,
        progress=not args.no_progress,
        retry_failed=args.retry_failed,
        actor_cpus=args.actor_cpus,
    )
    print(summary.line())
    return EXIT_PARTIAL if summary.failed or summary.malformed else 0


def cmd_train(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from selfrag.infra.heads_store import heads_path, save_heads
    from selfrag.infra.model_files import file_sha256
    from selfrag.jobs.evaluation import ensure_indexed, load_questions
    from selfrag.jobs.indexing import corpus_passages
    from selfrag.jobs.training import TrainingPlan, describe, train
    from selfrag.runtime.system import SelfRAGSystem

    if args.answerability:
        return train_answerability(args)
    if args.reuse and args.export_gguf is None:
        raise CLIError("--reuse only applies with --export-gguf")
    if args.passages is not None and args.passages < 10:
        raise CLIError("--passages must be at least 10")
    questions = []
    for path in args.qa:
        questions += load_questions(path, article=args.article if path.suffix == ".json" else None)
    plan = TrainingPlan(seed=args.seed)
    if args.passages is not None:
        n = args.passages
        plan = replace(
            plan,
            relevance_passages=n,
            support_passages=max(n // 2, 5),
            utility_passages=max(n // 3, 12),
            retrieve_passages=max(n // 3, 12),
        )
    settings = _settings(args)
    protected: list[Path] = []
    if args.export_gguf is not None:
        from selfrag.infra.gguf_export import check_export_target, engine_model_files

        # Checked before training: a refusal after it would throw minutes of work away.
        protected = engine_model_files(settings.model, settings.home)
        check_export_target(args.export_gguf, protected)
    with SelfRAGSystem(settings) as rag:
        sha = file_sha256(rag.model_path)
        out = args.out or heads_path(settings.home, sha)
        if args.reuse:
            heads = rag.heads
            if heads is None:
                raise CLIError(f"no reflection heads for {rag.model_path.name}: train them first")
        else:
            ensure_indexed(rag, args.corpus, progress=not args.no_progress)
            passages = None
            if args.corpus:
                r = settings.retrieval
                passages = [
                    p
                    for c in args.corpus
                    for p in corpus_passages(c, r.passage_words, r.passage_overlap_words)
                ]
            data = {
                "qa": [str(p) for p in args.qa],
                "article": args.article,
                "corpus": [str(c) for c in args.corpus or []],
                "command": "selfrag " + " ".join(sys.argv[1:]),
            }
            weights, manifest = train(
                rag, questions, plan, data=data, passages=passages, progress=not args.no_progress
            )
            heads = save_heads(out, sha, weights, manifest)
            print(describe(manifest, out))
        if args.export_gguf is not None:
            from selfrag.infra.gguf_export import export_reflection_model

            written = export_reflection_model(rag.model_path, heads, args.export_gguf, protected)
            print(f"wrote {written} (critique 'native': reflection tokens with the learned rows)")
    return 0


def train_answerability(args: argparse.Namespace) -> int:
    """`selfrag train --answerability`: collect (or read) the features, fit, write."""
    from selfrag.infra.heads_store import answerability_path, save_answerability
    from selfrag.infra.model_files import file_sha256
    from selfrag.jobs.answerability import (
        collect_table,
        describe,
        fit_model,
        load_table,
        save_table,
    )
    from selfrag.jobs.evaluation import ensure_indexed, load_questions
    from selfrag.runtime.system import SelfRAGSystem

    if args.export_gguf is not None:
        raise CLIError(
            "--export-gguf exports the heads only: the answerability model is not exportable"
        )
    with SelfRAGSystem(_settings(args), layer_tap=True) as rag:
        sha = file_sha256(rag.model_path)
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


COMMANDS.update(
    {"eval": cmd_eval, "calibrate": cmd_calibrate, "batch": cmd_batch, "train": cmd_train}
)


def version_text() -> str:
    """`selfrag --version`: this package's version, then llama-cpp-python's and Ray's."""

    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    engines = f"llama-cpp-python {of('llama-cpp-python')}, ray {of('ray')}"
    return f"selfrag {_selfrag_version()}\n{engines}"


def _selfrag_version() -> str:
    """selfrag's installed version, as `selfrag.__version__` reads it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("selfrag")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each record to `sys.stderr` as it is at that moment (tests replace it)."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


@contextmanager
def cli_logging(verbose: bool = False, quiet: bool = False) -> Iterator[None]:
    """selfrag's log records on stderr for one command: INFO and above, DEBUG and above when
    `verbose`, WARNING and above when `quiet`. Other libraries' loggers keep their own levels
    (their warnings still show). Undone when the command ends."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logger = logging.getLogger("selfrag")
    handler = _Stderr()
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s selfrag: %(levelname)s %(name)s: %(message)s"
            if verbose
            else "selfrag: %(levelname)s: %(message)s"
        )
    )
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with cli_logging(args.verbose, args.quiet):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.command](args)
    except ValidationError as exc:
        from selfrag.infra.settings import describe_validation_error

        print(f"selfrag: invalid request: {describe_validation_error(exc)}", file=sys.stderr)
    except AnswerError as exc:
        print(f"selfrag: {exc.kind.replace('_', ' ')}: {exc.detail}", file=sys.stderr)
        return EXIT_USAGE if exc.kind == "unprocessable" else EXIT_FAILED
    except (CLIError, ValueError, OSError) as exc:
        print(f"selfrag: {exc}", file=sys.stderr)
    except RecursionError as exc:
        # The readers refuse deep nesting themselves; this is the last line, never a traceback.
        print(f"selfrag: input nested too deeply to process ({exc})", file=sys.stderr)
    except RuntimeError as exc:
        from selfrag.infra.llama_backend import BackendError
        from selfrag.infra.model_files import ModelFileError
        from selfrag.infra.qdrant_store import StoreError

        if not isinstance(exc, ModelFileError | BackendError | StoreError):
            raise
        print(f"selfrag: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("selfrag: interrupted", file=sys.stderr)
        return 130
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
