"""Load `Settings`: defaults, then a TOML file, then `SELFRAG_*` environment variables.

Environment names: `SELFRAG_HOME`, `SELFRAG_REDIS_URL`, and `SELFRAG_<SECTION>__<FIELD>` for
nested fields, e.g. `SELFRAG_MODEL__PATH`, `SELFRAG_DECODING__TOP_K`,
`SELFRAG_RETRIEVAL__QDRANT_URL`. A value is read as the type of the field it names: text stays
text (a numeric API key or path is not a number), numbers and booleans are converted by the
field's validation, lists, mappings and whole sections are JSON; an empty value of an optional
field means unset. A name whose first part is not a setting (e.g. the service-link variables
Kubernetes injects, `SELFRAG_SERVE_SVC_PORT`) is ignored and logged once; a name inside a known
section that matches no field (`SELFRAG_MODEL__PATHH`) is an error.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import logging
import os
import sys
import threading
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr, ValidationError

from selfrag.schemas.settings import Settings

log = logging.getLogger("selfrag.settings")

ENV_PREFIX = "SELFRAG_"
CONFIG_ENV = "SELFRAG_CONFIG"
# Read by the HTTP ingress itself and kept out of `Settings`, so `selfrag config` and the
# deployment arguments never carry the keys.
API_KEYS_ENV = "SELFRAG_API_KEYS"
_NOT_SETTINGS = frozenset({CONFIG_ENV, API_KEYS_ENV})


class SettingsError(ValueError):
    """Configuration that cannot be used, with the offending source named."""


def default_home() -> Path:
    """The per-user data folder (XDG data home)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "selfrag"


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The settings section (a model) a field holds, if it holds one."""
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def _resolve_env_name(name: str) -> tuple[tuple[str, ...], Any] | None:
    """The field path and annotation `name` addresses by walking `Settings`' fields; None when
    its first part is no setting. Raises `SettingsError` for a path that enters a known
    section and then names no field of it."""
    parts = name[len(ENV_PREFIX) :].lower().split("__")
    model: type[BaseModel] | None = Settings
    path: list[str] = []
    annotation: Any = None
    for part in parts:
        if model is None:
            raise SettingsError(f"{name}: {'.'.join(path)} is a value, not a section")
        field = model.model_fields.get(part)
        if field is None:
            if not path:
                return None
            known = list(model.model_fields)
            close = difflib.get_close_matches(part, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(known)}"
            raise SettingsError(f"{name}: unknown setting {'.'.join([*path, part])}{hint}")
        path.append(part)
        annotation = field.annotation
        model = _section_model(annotation)
    return tuple(path), annotation


_JSON_ORIGINS = (list, tuple, set, frozenset, dict)


def _env_value(name: str, raw: str, annotation: Any) -> Any:
    """`raw` as the field's type wants it: JSON for containers and sections, else the text
    itself, which the field's validation converts (`"5"` -> 5 for an int, `"true"` -> True
    for a bool) or keeps (`"12345"` stays text for a str or a secret)."""
    members: tuple[Any, ...] = (annotation,)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
    kinds = [m for m in members if m is not type(None)]
    if len(kinds) < len(members) and not raw.strip():
        return None  # an empty optional value means unset
    if len(kinds) == 1:
        kind = kinds[0]
        section = _section_model(kind) is not None
        if section or (typing.get_origin(kind) or kind) in _JSON_ORIGINS:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise SettingsError(f"{name}: expected a JSON value: {exc.msg}") from exc
            if section and not isinstance(value, dict):
                raise SettingsError(f"{name}: a section is a JSON object")
            return value
    return raw


class _EnvSettings(typing.NamedTuple):
    values: dict[str, Any]
    sources: dict[tuple[str, ...], str]  # field path -> the variable that set it
    ignored: list[str]


def _from_env(environ: Mapping[str, str]) -> _EnvSettings:
    values: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    ignored: list[str] = []
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name in _NOT_SETTINGS:
            continue
        resolved = _resolve_env_name(name)
        if resolved is None:
            ignored.append(name)
            continue
        path, annotation = resolved
        node = values
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _env_value(name, raw, annotation)
        sources[path] = name
    return _EnvSettings(values, sources, ignored)


_reported_lock = threading.Lock()
_reported: set[str] = set()


def _report_ignored(names: Sequence[str]) -> None:
    """One WARNING per process listing the variables that are no settings (names only: their
    values may be anything)."""
    with _reported_lock:
        new = [n for n in names if n not in _reported]
        _reported.update(new)
    if new:
        log.warning(
            "ignoring %d %s* variable(s) that are not settings (e.g. Kubernetes service links): %s",
            len(new),
            ENV_PREFIX,
            ", ".join(new),
        )


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
    from_env = _from_env(env)
    _report_ignored(from_env.ignored)
    env_values = from_env.values
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
        detail = describe_validation_error(exc, from_env.sources)
        raise SettingsError(f"invalid settings{source}: {detail}") from exc
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


def describe_validation_error(
    exc: ValidationError, sources: Mapping[tuple[str, ...], str] | None = None
) -> str:
    """One line naming each invalid field and why (never its value: it may be a secret), and
    the variable that set it when `sources` knows one."""
    parts = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        field = ".".join(loc)
        variable = next(
            (v for p, v in (sources or {}).items() if loc[: len(p)] == p),
            None,
        )
        parts.append(f"{field}{f' ({variable})' if variable else ''}: {err['msg']}")
    return "; ".join(parts)


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def exposure_warning(host: str, api_keys: Sequence[SecretStr]) -> str | None:
    """The warning for serving the API on a non-loopback `host` without API keys, or None."""
    if api_keys or is_loopback(host):
        return None
    return (
        f"the HTTP API binds {host} and {API_KEYS_ENV} is not set: anyone who can reach this "
        f"port can ask questions and read /metrics. Set {API_KEYS_ENV}=key1,key2 or bind "
        "127.0.0.1."
    )


_warned_lock = threading.Lock()
_warned_hosts: set[str] = set()


def warn_if_exposed(host: str, api_keys: Sequence[SecretStr]) -> str | None:
    """Log the exposure warning (WARNING) and write it to stderr, once per process and host;
    returns it (None when there is nothing to warn about)."""
    warning = exposure_warning(host, api_keys)
    if warning is None:
        return None
    with _warned_lock:
        if host in _warned_hosts:
            return warning
        _warned_hosts.add(host)
    log.warning("%s", warning)
    print(f"selfrag: WARNING: {warning}", file=sys.stderr, flush=True)
    return warning
