"""schemas/decoding.py: `DecodingOverrides` is `DecodingConfig` with every field optional."""

from __future__ import annotations

import pydantic
import pytest

from selfrag.schemas.decoding import DecodingConfig, DecodingOverrides


def _typed(schema: dict) -> dict:
    """The non-null branch of an optional property (`anyOf: [{...}, {type: null}]`)."""
    options = [o for o in schema.get("anyOf", [schema]) if o.get("type") != "null"]
    assert len(options) == 1, schema
    return options[0]


def test_every_field_of_the_config_can_be_overridden_with_its_bounds_and_description() -> None:
    config = DecodingConfig.model_json_schema()
    overrides = DecodingOverrides.model_json_schema()
    assert list(DecodingOverrides.model_fields) == list(DecodingConfig.model_fields)
    assert "required" not in overrides and overrides["additionalProperties"] is False
    defs = config.get("$defs", {})
    for name, full in config["properties"].items():
        part = overrides["properties"][name]
        assert part.get("default") is None
        assert part.get("description") == full.get("description"), name
        # The same type and bounds: the config's own schema, less its default and title.
        expected = {
            k: v for k, v in _typed(full).items() if k not in ("default", "title", "description")
        }
        got = {
            k: v for k, v in _typed(part).items() if k not in ("default", "title", "description")
        }
        assert got == expected, name
        assert "$ref" not in got or got["$ref"].split("/")[-1] in defs


def test_overrides_change_only_what_they_set_and_keep_the_config_bounds() -> None:
    base = DecodingConfig(top_k=4, critique="likelihood")
    changed = DecodingOverrides.model_validate({"top_k": 7, "seed": None}).apply_to(base)
    assert changed == base.model_copy(update={"top_k": 7})
    assert DecodingOverrides().apply_to(base) == base
    for bad in ({"top_k": 0}, {"top_k": 51}, {"timeout_s": 0}, {"mode": "sometimes"}):
        with pytest.raises(pydantic.ValidationError):
            DecodingOverrides.model_validate(bad)
    with pytest.raises(pydantic.ValidationError, match="extra"):
        DecodingOverrides.model_validate({"top_kk": 3})
    with pytest.raises(pydantic.ValidationError, match="at most"):
        DecodingOverrides(instructions="x" * 5000)


def test_the_overrides_are_a_class_of_this_module_that_can_be_extended() -> None:
    assert DecodingOverrides.__module__ == "selfrag.schemas.decoding"
    assert DecodingOverrides.__name__ == "DecodingOverrides"
    assert "partial `DecodingConfig`" in (DecodingOverrides.__doc__ or "")

    class WithMore(DecodingOverrides):
        extra_dial: int | None = None

    got = WithMore.model_validate({"top_k": 2, "extra_dial": 1})
    assert (got.top_k, got.extra_dial) == (2, 1)
    with pytest.raises(pydantic.ValidationError):
        WithMore.model_validate({"top_k": 0})
