"""Document readers under attack: the seconds, text and peak memory of reading pages of deeply
nested HTML, a 2.6 MB page (and one of unclosed `<div>`s), a page whose text sits straight in
`<body>`, small PDFs of nested form XObjects (a few KB that expand to megabytes of text) and a
PDF cut before its EOF marker, with the readers' default bounds (`ReadLimits()`; none where the
readers have none).

Each case runs in a process of its own, cut off after `--cap` seconds (wall clock); the figures
are its CPU seconds, as others may share the machine. Run it once per tree to compare two of
them side by side, e.g. before and after a change:

    for tree in base b-harden; do PYTHONPATH=/work/pkg/$tree .venv/bin/python -m bench.readers; done

Last line: name=value.
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.corpus_files import pdf_form_bomb, write_pdf


def _nested_divs(depth: int) -> bytes:
    return f"<html><body>{'<div>' * depth}deep text{'</div>' * depth}</body></html>".encode()


def _large_page(size: int, closed: bool = True) -> bytes:
    """A page of `size` bytes of sections; with `closed` false, no section's `<div>` is closed
    (each nests in the one before)."""
    chunk = (
        "<div class='c'><h2>Section</h2><p>Some <b>bold</b> text and a <a href='#'>link</a>."
        "</p><ul><li>one</li><li>two <i>it</i></li></ul><table><tr><td>a</td><td>b</td></tr>"
        "<tr><td><table><tr><td>inner</td></tr></table></td><td>c</td></tr></table>"
        + ("</div>\n" if closed else "\n")
    )
    return f"<html><body><main>{chunk * (size // len(chunk))}</main></body></html>".encode()


def _cut_pdf() -> bytes:
    """A one-page PDF of ordinary text whose `%%EOF` marker is damaged."""
    with tempfile.TemporaryDirectory() as folder:
        pdf = write_pdf(Path(folder) / "cut.pdf", [["Some text."]])
        return pdf.read_bytes().replace(b"%%EOF", b"%%EOX")


# name: (reader, the file's bytes)
CASES: dict[str, tuple[str, Callable[[], bytes]]] = {
    "html_nested_2500": ("html", lambda: _nested_divs(2_500)),
    "html_nested_5000": ("html", lambda: _nested_divs(5_000)),
    "html_nested_10000": ("html", lambda: _nested_divs(10_000)),
    "html_2600kB": ("html", lambda: _large_page(2_600_000)),
    "html_2600kB_unclosed": ("html", lambda: _large_page(2_600_000, closed=False)),
    "html_body_text": ("html", lambda: b"<html><body>Text straight in the body.</body></html>"),
    "pdf_forms_1_page": ("pdf", lambda: pdf_form_bomb(levels=5, fanout=8, leaf_chars=200)),
    "pdf_forms_big_leaf": ("pdf", lambda: pdf_form_bomb(levels=6, fanout=8, leaf_chars=750)),
    "pdf_no_eof": ("pdf", _cut_pdf),
}


def run_case(name: str) -> dict[str, object]:
    """Read one case's file in this process: wall and CPU seconds (the CPU's, as others may
    share the machine), outcome, text, peak RSS."""
    from selfrag.infra.corpus import formats

    kind, make = CASES[name]
    data = make()
    reader = formats.read_pdf if kind == "pdf" else formats.read_html
    bounded = "limits" in inspect.signature(reader).parameters
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        found = reader(data, formats.ReadLimits()) if bounded else reader(data)
        outcome, chars = f"{len(found.blocks)} blocks", sum(len(b.text) for b in found.blocks)
    except formats.UnreadableFile as error:
        outcome, chars = f"refused: {error}", 0
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "file_bytes": len(data),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "outcome": outcome,
        "text_chars": chars,
        "peak_mb": peak_mb,
        "bounded": bounded,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", type=float, default=90.0, help="seconds a case may run")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    import selfrag

    print(f"selfrag from {selfrag.__file__}")
    print(
        f"{'case':<20} {'file B':>9} {'s':>7} {'CPU s':>7} {'text chars':>11} {'peak MB':>8} "
        "stderr  outcome"
    )
    fields = []
    for name in args.cases.split(","):
        command = [sys.executable, "-m", "bench.readers", "--case", name]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.cap)
        except subprocess.TimeoutExpired:
            print(f"{name:<20} {'':>9} {'>' + format(args.cap, 'g'):>7}  did not finish")
            fields.append(f"{name}_cpu_s=>{args.cap:g}")
            continue
        if done.returncode != 0:
            print(f"{name:<20} failed: {done.stderr.strip().splitlines()[-1:]}")
            fields.append(f"{name}_cpu_s=failed")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        noise = len(done.stderr.splitlines())
        print(
            f"{name:<20} {r['file_bytes']:>9} {r['seconds']:>7.2f} {r['cpu_seconds']:>7.2f} "
            f"{r['text_chars']:>11} "
            f"{r['peak_mb']:>8.0f} {noise:>6}  {str(r['outcome'])[:90]}"
        )
        fields.append(f"{name}_cpu_s={r['cpu_seconds']:.2f}")
        if name.startswith("pdf"):
            fields.append(f"{name}_stderr_lines={noise}")
    print(" ".join(fields))


if __name__ == "__main__":
    main()
