"""`selfrag config`, `selfrag status` and `selfrag models`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from selfrag.cli.common import CLIError, settings_from_args
from selfrag.cli.versions import selfrag_version
from selfrag.schemas.settings import Settings


def cmd_config(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
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


def cmd_status(args: argparse.Namespace) -> int:
    status = collect_status(settings_from_args(args))
    print(json.dumps(status, indent=2) if args.json else render_status(status))
    return 0


def collect_status(settings: Settings) -> dict[str, Any]:
    """What `selfrag status` shows: the home, the index, the model and heads in use and the
    critique the configured one resolves to. Opens the store, resolves (and, the first time,
    derives) the model file; never loads the language model."""
    from selfrag.infra.store.qdrant_store import StoreError, StoreMisconfigured, StoreUnavailable
    from selfrag.runtime.system import LocalRuntime

    r = settings.retrieval
    # Never calibrates (no first use): status only reads what is there.
    with LocalRuntime(settings) as system:
        try:
            store = system.store
            index = {
                "passages": store.count(),
                "version": store.index_version(),
                "store": "embedded" if r.qdrant_url is None else "server",
                "where": store.where,
                "collection": r.collection,
                "hybrid": r.hybrid,
                "fusion": r.fusion,
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
            from selfrag.infra.models.model_files import file_sha256
            from selfrag.jobs.threshold_status import threshold_status
            from selfrag.runtime.answering import AnswerPath

            sha = file_sha256(system.model.path)
            decoding = settings.decoding.model_copy(update={"critique": critique["resolved"]})
            threshold = threshold_status(
                settings.home,
                sha,
                AnswerPath(settings.decoding, facts=system).settle(decoding),
                index["version"],
                r.collection,
                configured=settings.decoding.min_support_score is not None,
            )
    return {
        "selfrag": selfrag_version(),
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
    m = settings.model
    configured = settings.decoding.critique
    if m.backend == "vllm":
        model = {"backend": "vllm", "url": m.vllm_url, "id": m.vllm_model, "path": None}
        resolved = configured if configured != "auto" else None  # the served model decides
        return model, None, {"configured": configured, "resolved": resolved, "usable": True}
    from selfrag.infra.engine.engine_threads import describe as describe_threads
    from selfrag.runtime.model_artefacts import missing_heads_message, model_id_for

    path = system.model.path
    heads = system.model.heads_file
    native = system.model.has_reflection_tokens
    usable = {"native": native, "learned": heads is not None}.get(configured, True)
    resolved = system.model.auto_critique(warn=False)  # the warning is in the report
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
        ("hybrid", f"on ({index['fusion']})" if index["hybrid"] else "off"),
        ("model", model["id"] or "?"),
        ("model file", model["path"] or f"vLLM server {model['url']}"),
        *_thread_rows(model.get("threads")),
        ("heads", s["heads"] or "none"),
        ("critique", shown),
    ]
    if s.get("support_threshold") is not None:
        from selfrag.jobs.threshold_status import describe_threshold

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
    from selfrag.infra.models.model_listing import list_models

    settings = settings_from_args(args)
    rows = list_models(settings.model, settings.home)
    print(json.dumps(rows, indent=2) if args.json else render_models(rows))
    return 0


def render_models(rows: Sequence[dict[str, Any]]) -> str:
    """`selfrag models` as text: a block per model, the configured one marked `*`."""
    from selfrag.infra.models.model_presets import NO_LICENSE

    lines = []
    for r in rows:
        mark = "*" if r["active"] else " "
        lines.append(f"{mark} {r['name']}  {r['title']}")
        if not r["installed"]:
            lines.append(f"    not installed: missing {', '.join(r['missing'])}")
            lines.append(f"    install: {r['install']}")
            continue
        derived = r.get("derives_to")
        if derived is not None:
            lines.append(f"    file     derived on first use into {derived}")
            lines.append(f"             from {r['derived_from']}")
        elif r["path"] is None:
            lines.append(f"    file     joined on first use into {r['joins_to']}")
        else:
            lines.append(f"    file     {r['path']}")
        of = " (of the source)" if derived is not None else ""
        size = f"{r['size'] / 2**20:,.1f} MiB  sha256 {r['sha256'][:12]}{of}"
        lines.append(f"    size     {size}")
        if derived is not None and r["heads"] is None:
            heads = "looked up by the derived copy's SHA-256 once it is made"
        else:
            heads = r["heads"] or "none: critique 'auto' falls back to 'likelihood' (selfrag train)"
        lines.append(f"    heads    {heads}")
        if "license" in r:
            lines.append(f"    license  {r['license']} (shipped as {r['file_type']})")
            if r["license"] == NO_LICENSE:
                lines.append(f"             {r['license_note']}")
    lines.append("* the configured model (model.preset, or model.path when set)")
    return "\n".join(lines)
