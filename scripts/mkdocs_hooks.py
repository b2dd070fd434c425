"""MkDocs hook: the configuration reference, generated from the settings and decoding schemas.

A page holding `<!-- reference:settings -->` gets one table per settings section (TOML
section, environment name, type, default, description), read from `schemas/settings.py`'s
`Settings` and `schemas/decoding.py`'s `DecodingConfig`, so the reference cannot drift from
the code.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

MARKER = "<!-- reference:settings -->"


def on_page_markdown(markdown: str, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, settings_reference())


def settings_reference() -> str:
    """Markdown: the top-level settings, then a section per nested model."""
    from selfrag.schemas.settings import Settings

    top: list[tuple[str, FieldInfo]] = []
    sections: list[str] = []
    for name, field in Settings.model_fields.items():
        model = _model_of(field.annotation)
        if model is None:
            top.append((name, field))
            continue
        title = "Decoding (per request)" if name == "decoding" else name.capitalize()
        doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        lines = [f"## {title}", "", f"TOML section `[{name}]`. {doc}".strip(), ""]
        lines += _table(model.model_fields.items(), section=name)
        sections.append("\n".join(lines))
    head = ["## Top level", "", *_table(top, section=None)]
    return "\n\n".join(["\n".join(head), *sections])


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _table(fields: Any, section: str | None) -> list[str]:
    rows = ["| Field | Environment | Type | Default | Description |", "|---|---|---|---|---|"]
    for name, field in fields:
        env = f"SELFRAG_{section.upper()}__{name.upper()}" if section else f"SELFRAG_{name.upper()}"
        cells = [
            f"`{name}`",
            f"`{env}`",
            _cell(_type_name(field.annotation)),
            _cell(_default(field)),
            _cell(_description(field)),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _description(field: FieldInfo) -> str:
    text = " ".join((field.description or "").split())
    bounds = [
        f"{op} {getattr(m, attr)}"
        for m in field.metadata
        for attr, op in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
        if getattr(m, attr, None) is not None
    ]
    if bounds:
        text = f"{text} ({', '.join(bounds)})" if text else f"({', '.join(bounds)})"
    return text


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "computed"
        return "" if isinstance(value, BaseModel) else f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "required"
    value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{value!r}`"


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a!r}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if "\\|" not in text else text
