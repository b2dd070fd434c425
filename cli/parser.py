"""The argument parser of every command."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from selfrag.cli.decoding_flags import add_decoding_flags
from selfrag.cli.versions import VersionAction


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
        action=VersionAction,
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
    _index_parser(sub)
    _docs_parser(sub)
    _ask_parser(sub)
    _serve_parser(sub)
    _inspection_parsers(sub)
    _eval_parsers(sub)
    _batch_parser(sub)
    return parser


def _index_parser(sub: Any) -> None:
    p_index = sub.add_parser(
        "index",
        help="Index JSONL, SQuAD JSON, .txt/.md/.pdf/.html files, or folders of them; what is "
        "gone from a file or folder since its last index is removed.",
    )
    p_index.add_argument("paths", nargs="*", type=Path)
    p_index.add_argument("--no-progress", action="store_true")
    p_index.add_argument(
        "--follow-links",
        action="store_true",
        help="Also read files and folders that symbolic links in a folder point to outside it "
        "(by default they are reported and not read; /proc, /sys and /dev never are).",
    )
    p_index.add_argument(
        "--ray",
        action="store_true",
        help="Embed on Ray Data (one embedder per actor, over the cluster's nodes); the store "
        "is written from this process (a Qdrant server for a real cluster).",
    )
    p_index.add_argument(
        "--address", help="With --ray: the cluster to join (default: a private local instance)."
    )
    p_index.add_argument(
        "--actors", type=int, default=2, help="With --ray: embedding actors, one CPU each."
    )
    _collection_flag(p_index)
    _model_flag(p_index)
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
        "does it alone; minutes, whatever the corpus size).",
    )


def _ask_parser(sub: Any) -> None:
    p_ask = sub.add_parser("ask", help="Answer a question from the index.")
    p_ask.add_argument("question")
    p_ask.add_argument("--json", action="store_true", help="Print the full response as JSON.")
    _model_flag(p_ask)
    _collection_flag(p_ask)
    add_decoding_flags(p_ask)


def _serve_parser(sub: Any) -> None:
    p_serve = sub.add_parser("serve", help="Run the HTTP API (Ray Serve) in the foreground.")
    p_serve.add_argument("--host", help="Bind address (default: serve.host, 127.0.0.1).")
    p_serve.add_argument("--port", type=int, help="Port (default: serve.port, 8000).")
    p_serve.add_argument(
        "--address", help="Join this Ray cluster instead of starting a local Ray instance."
    )
    _model_flag(p_serve)
    _collection_flag(p_serve)


def _inspection_parsers(sub: Any) -> None:
    """The read-only commands: config, status and models."""
    p_config = sub.add_parser("config", help="Print the effective settings.")
    p_config.add_argument("--json", action="store_true")

    p_status = sub.add_parser(
        "status",
        help="Show the index (passages, embedder, store, version), the model and reflection "
        "heads in use and the critique `auto` resolves to, without loading the model.",
    )
    p_status.add_argument("--json", action="store_true")
    _model_flag(p_status)
    _collection_flag(p_status)

    p_models = sub.add_parser(
        "models",
        help="List the model presets and what is installed: file, size, SHA-256, whether "
        "reflection heads exist for the file, which one is configured.",
    )
    p_models.add_argument("--json", action="store_true")


def _docs_parser(sub: Any) -> None:
    p_docs = sub.add_parser("docs", help="List the indexed documents, or remove some.")
    docs = p_docs.add_subparsers(dest="docs_command", required=True)
    p_list = docs.add_parser("list", help="Id, passages, when indexed, title and source.")
    p_list.add_argument("--json", action="store_true")
    _collection_flag(p_list)
    p_rm = docs.add_parser(
        "rm",
        help="Remove documents: their passages leave every search, and no cached answer "
        "citing them is served again.",
    )
    p_rm.add_argument(
        "refs", nargs="+", metavar="ID|PATH", help="A document id, or a file or folder indexed."
    )
    p_rm.add_argument("--json", action="store_true")
    _collection_flag(p_rm)


def _collection_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--collection",
        metavar="NAME",
        help="The index collection to use (default: retrieval.collection, 'passages'); "
        "several corpora kept apart in one home.",
    )


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
    _model_flag(p)
    _collection_flag(p)


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
    """`eval`, `calibrate` and `train`."""
    _eval_parser(sub)
    _calibrate_parser(sub)
    _train_parser(sub)


def _eval_parser(sub: Any) -> None:
    # not jobs.evaluation: --help stays light
    from selfrag.schemas.records import DEFAULT_LONGFORM_SYSTEMS, DEFAULT_SYSTEMS, SYSTEMS

    p_eval = sub.add_parser("eval", help="Run QA systems on a dataset and write a report.")
    _dataset_args(p_eval)
    _model_flag(p_eval)
    _collection_flag(p_eval)
    p_eval.add_argument(
        "--systems",
        help=f"Comma-separated, from: {', '.join(SYSTEMS)} (default: "
        f"{','.join(DEFAULT_SYSTEMS)}; on a long-form set, whose questions list facts, "
        f"{','.join(DEFAULT_LONGFORM_SYSTEMS)}).",
    )
    p_eval.add_argument(
        "--split",
        choices=("tune", "report"),
        help="Keep the questions of one split of a JSONL set whose records name theirs.",
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
    p_eval.add_argument(
        "--table",
        action="store_true",
        help="Print every column (report.md's tables) instead of the short summary.",
    )
    add_decoding_flags(p_eval)


def _calibrate_parser(sub: Any) -> None:
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
        help="Without a dataset: synthetic questions drawn from the index, at least 20 per "
        "corpus file (default 20).",
    )
    p_cal.add_argument(
        "--report",
        action="store_true",
        help="Without a dataset: also read the unanswerable pairs, for the score's AUROC and "
        "what the threshold abstains on among them (about three times the reads; the "
        "threshold does not depend on them).",
    )
    p_cal.add_argument("--seed", type=int, help="Without a dataset: the draw's seed (default 0).")
    p_cal.add_argument(
        "--max-answerable-abstain",
        type=float,
        help="Without a dataset: the share of the synthetic answerable pairs read that the "
        "threshold may abstain on (default 0.05). New pairs like them fall below it more "
        "often: about 10%% with 20 pairs per corpus file (docs/cli.md).",
    )
    p_cal.add_argument(
        "--time-limit",
        type=float,
        help="Without a dataset: seconds of critique before calibrating on the pairs read "
        "(default 900).",
    )
    _model_flag(p_cal)
    _collection_flag(p_cal)
    p_cal.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="Retrieved passages per question (default: the decoding setting).",
    )
    p_cal.add_argument(
        "--max-segment-tokens",
        type=int,
        default=None,
        help="Draft length (default: the decoding setting).",
    )
    p_cal.add_argument("--samples", type=Path, help="Also write the raw samples (JSONL) here.")
    p_cal.add_argument("--dry-run", action="store_true", help="Fit and print; write nothing.")


def _train_parser(sub: Any) -> None:
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
        "--critic",
        metavar="PRESET|PATH",
        help="A model (e.g. qwen2.5-coder-1.5b) whose verification read labels the support "
        "examples and the model's drafts on synthetic questions (--critic-mode replace), or only "
        "the drafts (add), for the heads to train on; reads cached in HOME/critic_labels/.",
    )
    p_train.add_argument("--critic-mode", choices=("replace", "add"), default="replace")
    _answerability_training_flags(p_train)
    p_train.add_argument("--no-progress", action="store_true")


def _answerability_training_flags(p_train: argparse.ArgumentParser) -> None:
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


def _model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="PRESET|PATH",
        help="The model for this command: a preset (`selfrag models` lists them) or a GGUF file; "
        "default: the model.preset / model.path settings.",
    )
