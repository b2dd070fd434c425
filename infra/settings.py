"""Load `Settings`: defaults, then a TOML file, then `SELFRAG_*` environment variables.

Environment names: `SELFRAG_HOME`, `SELFRAG_REDIS_URL`, and `SELFRAG_<SECTION>__<FIELD>` for
nested fields, e.g. `SELFRAG_MODEL__PATH`, `SELFRAG_DECODING__TOP_K`,
`SELFRAG_RETRIEVAL__QDRANT_URL`. Values are parsed as JSON when they parse, else taken as text.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from schemas.settings import Settings

ENV_PREFIX = "SELFRAG_"
CONFIG_ENV = "SELFRAG_CONFIG"
# Read by the HTTP ingress itself and kept out of `Settings`, so `selfrag config` and the
# deployment arguments never carry the keys.
API_KEYS_ENV = "SELFRAG_API_KEYS"


class SettingsError(ValueError):
    """Configuration that cannot be used, with the offending source named."""


def default_home() -> Path:
    """The per-user data folder (XDG data home)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "selfrag"


def _parse_env_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


_TEXT_FIELDS = frozenset({"home", "path", "qdrant_url", "redis_url", "vllm_url", "vllm_model"})


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name in (CONFIG_ENV, API_KEYS_ENV):
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = values
        for part in path[:-1]:
            node = node.setdefault(part, {})
        # Text fields like paths and URLs stay text even when they look like JSON numbers.
        node[path[-1]] = raw if path[-1] in _TEXT_FIELDS else _parse_env_value(raw)
    return values


def config_file(environ: Mapping[str, str], explicit: Path | None, home: Path) -> Path | None:
    """The TOML file to read: --config, else $SELFRAG_CONFIG, else HOME/config.toml if present."""
    if explicit is not None:
        return explicit
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV])
    candidate = home / "config.toml"
    return candidate if candidate.exists() else None


def load_settings(
    config_path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build the effective settings; raises `SettingsError` naming the bad file or field."""
    env = os.environ if environ is None else environ
    env_values = _from_env(env)
    home = Path(env_values.get("home") or default_home()).expanduser()
    path = config_file(env, config_path, home)
    file_values: dict[str, Any] = {}
    if path is not None:
        try:
            file_values = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise SettingsError(f"config file not found: {path}") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise SettingsError(f"config file {path} is not valid TOML: {exc}") from exc
    # The calibration belongs to the data folder actually used, which an override may name.
    data_home = Path((overrides or {}).get("home") or home).expanduser()
    merged = _merge({"home": str(home)}, _calibration_values(data_home))
    merged = _merge(merged, file_values)
    merged = _merge(merged, env_values)
    merged = _merge(merged, overrides or {})
    try:
        settings = Settings.model_validate(merged)
    except ValidationError as exc:
        source = f" (from {path} and SELFRAG_* variables)" if path else ""
        raise SettingsError(f"invalid settings{source}: {describe_validation_error(exc)}") from exc
    return settings.model_copy(update={"home": settings.home.expanduser()})


CALIBRATION_FILE = "calibration.toml"


def _calibration_values(home: Path) -> dict[str, Any]:
    """`HOME/calibration.toml` (written by `selfrag calibrate`) as the `calibration` section;
    it ranks below the config file so an explicit setting there still wins."""
    path = home / CALIBRATION_FILE
    if not path.exists():
        return {}
    try:
        return {"calibration": tomllib.loads(path.read_text(encoding="utf-8"))}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(f"calibration file {path} is not valid TOML: {exc}") from exc


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming each invalid field and why."""
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        parts.append(f"{field}: {err['msg']}")
    return "; ".join(parts)
