"""Small real PDF and HTML files for the corpus tests, made here (no fixture binaries)."""

from __future__ import annotations

from pathlib import Path


def write_pdf(path: Path, pages: list[list[str]], title: str | None = None) -> Path:
    """A PDF whose text layer has `pages`, each a list of lines (Helvetica), with an info
    dictionary carrying `title` when given; offsets in the xref table are exact."""
    objects: list[bytes] = []
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(len(pages)))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {len(pages)} >>".encode())
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    for i, lines in enumerate(pages):
        ops = ["BT", "/F1 12 Tf", "14 TL", "72 720 Td"]
        for line in lines:
            escaped = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
            ops += [f"({escaped}) Tj", "T*"]
        ops.append("ET")
        stream = "\n".join(ops).encode("latin-1")
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 3 0 R >> >> /Contents {5 + 2 * i} 0 R >>".encode()
        )
        objects.append(f"<< /Length {len(stream)} >>\nstream\n".encode() + stream + b"\nendstream")
    info = None
    if title is not None:
        objects.append(f"<< /Title ({title}) >>".encode("latin-1"))
        info = len(objects)
    path.write_bytes(_pdf(objects, info))
    return path


def _pdf(objects: list[bytes], info: int | None = None) -> bytes:
    """A PDF file of `objects` (numbered from 1, the first the catalog), with the info
    dictionary `info` when given; offsets in the xref table are exact."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for n, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{n} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    for offset in offsets:
        out += f"{offset:010d} 00000 n \n".encode()
    trailer = f"<< /Size {len(objects) + 1} /Root 1 0 R" + (f" /Info {info} 0 R" if info else "")
    out += f"trailer\n{trailer} >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def pdf_form_bomb(
    levels: int, fanout: int, leaf_chars: int, pages: int = 1, leaf_ops: int = 0
) -> bytes:
    """A small PDF whose text is large: nested form XObjects, each level drawing the one below
    `fanout` times; the innermost shows `leaf_chars` characters and runs `leaf_ops` operators
    that draw nothing (a save and restore of the graphics state). Every page draws the top
    form."""
    objects: list[bytes] = [b"<< /Type /Catalog /Pages 2 0 R >>", b""]
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    for level in range(levels):
        if level == 0:
            ops = ["q Q"] * leaf_ops
            if leaf_chars:
                ops.append(f"BT /F1 12 Tf 72 720 Td ({'A' * leaf_chars}) Tj ET")
            resources = "<< /Font << /F1 3 0 R >> >>"
        else:
            ops = ["/X Do"] * fanout
            resources = f"<< /XObject << /X {3 + level} 0 R >> /Font << /F1 3 0 R >> >>"
        stream = " ".join(ops).encode()
        objects.append(
            f"<< /Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources {resources} "
            f"/Length {len(stream)} >>\nstream\n".encode()
            + stream
            + b"\nendstream"
        )
    top = 3 + levels
    kids = []
    for _ in range(pages):
        kids.append(f"{len(objects) + 1} 0 R")
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /XObject "
            f"<< /X {top} 0 R >> >> /Contents {len(objects) + 2} 0 R >>".encode()
        )
        objects.append(b"<< /Length 5 >>\nstream\n/X Do\nendstream")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {pages} >>".encode()
    return _pdf(objects)


HTML_PAGE = """<!doctype html>
<html><head><title>Lava Guide</title>
<link rel="canonical" href="https://example.org/lava">
<script>var tracking = "do not index";</script></head>
<body>
<nav><a href="/">Home</a> | <a href="/about">Site navigation text</a></nav>
<header>Site banner</header>
<main>
<h1>Lava Guide</h1>
<p>Lava is molten rock that flows from a volcano.</p>
<h2>Cooling</h2>
<p>Basalt forms when lava cools quickly at the surface.</p>
<pre>cool(lava)
  -> basalt</pre>
<table><tr><th>Rock</th><th>Silica</th></tr><tr><td>Basalt</td><td>low</td></tr></table>
</main>
<footer>Copyright footer text</footer>
</body></html>
"""
