"""`selfrag ask`, and how an answer is printed."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

from selfrag.cli.common import CLIError, settings_from_args
from selfrag.cli.remote import open_home
from selfrag.schemas.decoding import DecodingOverrides

if TYPE_CHECKING:  # for `ask` only: `config`, `status` and `--help` start without them
    from selfrag.schemas.answer import AnswerRequest, AnswerResponse, SegmentOut


def _request_from_args(args: argparse.Namespace, collection: str) -> AnswerRequest:
    from selfrag.schemas.answer import AnswerRequest

    overrides = {
        name: getattr(args, name)
        for name in DecodingOverrides.model_fields
        if getattr(args, name, None) is not None
    }
    return AnswerRequest.model_validate(
        {"question": args.question, "config": overrides, "collection": collection}
    )


def cmd_ask(args: argparse.Namespace) -> int:
    """Answer through the home's answer client: in this process, or through the server that
    holds its store (`cli.remote.open_home`); either settles the request's config alike."""
    settings = settings_from_args(args)
    # --collection, else the configured one; refused before the model loads.
    request = _request_from_args(args, settings.retrieval.collection)
    with open_home(settings) as rag:
        if rag.url is None and rag.count() == 0:
            raise CLIError(f"the index in {settings.home} is empty: run `selfrag index PATH` first")
        response = rag.client.answer(request).response
    if args.json:
        print(response.model_dump_json(indent=2))
    else:
        print(render_answer(response))
    return 0


def flag_lines(segments: Sequence[SegmentOut]) -> list[str]:
    """One warning line per kind of flag the segments carry (`SegmentOut.flags`)."""

    def which(flag: str) -> str:
        return ", ".join(str(i) for i, seg in enumerate(segments, 1) if flag in seg.flags)

    lines = []
    if low := which("low_support"):
        lines.append(
            f"Low support: the cited evidence does not fully support segment(s) {low} "
            "(IsSup below); check the source before relying on it."
        )
    if uncited := which("uncited"):
        lines.append(
            f"Uncited: segment(s) {uncited} cite no source although the answer retrieved; "
            "the model wrote them without evidence."
        )
    for i, seg in enumerate(segments, 1):
        if "unsupported_terms" in seg.flags:
            terms = ", ".join(seg.unsupported_terms)
            lines.append(f"Not in the source: segment {i} states {terms}, which its source lacks.")
    return lines


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
    lines.extend(flag_lines(r.segments))
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
            source = f"{pid}, {p.corpus}" if p is not None and p.corpus else pid
            lines.append(f"[{n}] {title} ({source})")
            lines.extend(_evidence_lines(r.segments, pid))
        lines.append("")
    u = r.usage
    lines.append(
        f"critique={r.critique} retrievals={u.retrievals} branches={u.branches_opened} "
        f"pruned={u.branches_pruned} filtered={u.branches_filtered} "
        f"prefill={u.prefill_tokens} decode={u.decode_tokens} "
        f"time={r.timings_ms.get('total', 0.0) / 1000:.1f}s"
        + (f" stopped_by={u.stopped_by}" if u.stopped_by else "")
        + _support_field(r)
    )
    return "\n".join(lines)


def _support_field(r: AnswerResponse) -> str:
    """The support that decided abstention and the threshold it was held to, when read."""
    if r.support is None:
        return ""
    held = f" threshold={r.support_threshold:.3f}" if r.support_threshold else ""
    return f" support={r.support:.3f}{held}"


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
