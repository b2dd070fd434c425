"""Load `Settings` with pydantic-settings: defaults, then a TOML file, then `SELFRAG_*`
environment variables, then the caller's overrides (init arguments).

Environment names: `SELFRAG_HOME`, `SELFRAG_REDIS_URL`, and `SELFRAG_<SECTION>__<FIELD>` for
nested fields, e.g. `SELFRAG_MODEL__PATH`, `SELFRAG_DECODING__TOP_K`,
`SELFRAG_RETRIEVAL__QDRANT_URL`. A value is read as the type of the field it names: text stays
text (a numeric API key or path is not a number), numbers and booleans are converted by the
field's validation, a whole section is JSON (`SELFRAG_CALIBRATION__SUPPORT='{"a": 2.0}'`; a
variable naming one of its fields wins over the JSON); an empty value is ignored, as if the
variable were not set. A name whose first part is not a setting (e.g. the service-link variables
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
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar

import pydantic_settings
from pydantic import BaseModel, SecretStr, ValidationError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from selfrag.schemas.settings import Settings

log = logging.getLogger("selfrag.settings")

ENV_PREFIX = "SELFRAG_"
ENV_NESTED_DELIMITER = "__"
CONFIG_ENV = "SELFRAG_CONFIG"
# Read by the HTTP ingress itself and kept out of `Settings`, so `selfrag config` and the
# deployment arguments never carry the keys.
API_KEYS_ENV = "SELFRAG_API_KEYS"
# Read by scripts/install.sh: the model presets to install.
MODELS_ENV = "SELFRAG_MODELS"
# Read by the engine's CPU backend choice (`infra/engine/cpu_builds/cpu_variants.py`, which
# install loads by path with no dependency, so it cannot import this room's name).
CPU_BACKEND_ENV = "SELFRAG_CPU_BACKEND"
_NOT_SETTINGS = frozenset({CONFIG_ENV, API_KEYS_ENV, MODELS_ENV, CPU_BACKEND_ENV})
CALIBRATION_FILE = "calibration.toml"


class SettingsError(ValueError):
    """Configuration that cannot be used, with the offending source named."""


def default_home() -> Path:
    """The per-user data folder (XDG data home)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "selfrag"


# `settings_customise_sources` is a classmethod that sees nothing of the call: each
# `load_settings` hands it that call's sources below the init arguments, highest first (a
# context variable, so threads and tasks loading at once each see their own).
_SOURCES: ContextVar[tuple[PydanticBaseSettingsSource, ...]] = ContextVar("selfrag_settings")


class _SettingsLoader(BaseSettings, Settings):
    """`Settings` as pydantic-settings builds it; `load_settings` returns a plain `Settings`
    (schemas stay free of the loader, and a constructed `Settings` never reads the
    environment)."""

    model_config: ClassVar[SettingsConfigDict] = SettingsConfigDict(
        extra="forbid",
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        env_ignore_empty=True,
        # Field names in TOML and overrides match exactly; environment names are matched
        # case-insensitively after the prefix by `_Environment`.
        case_sensitive=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, *_SOURCES.get())


class _BadEnvironmentValue(ValueError):
    """A JSON value that does not parse, named by its variable."""


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source over the mapping `load_settings` is given (not
    necessarily `os.environ`), limited to `SELFRAG_*` names (the prefix matched
    case-sensitively, the rest not, as before), with a bad JSON value reported by its
    variable's name."""

    def __init__(self, environ: Mapping[str, str]):
        self._given = {n: v for n, v in environ.items() if n.startswith(ENV_PREFIX)}
        super().__init__(_SettingsLoader, case_sensitive=False)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # The hook pydantic-settings' DotEnvSettingsSource overrides to read a .env file; names
        # lower-cased (case_sensitive=False) and empty values dropped (env_ignore_empty) as there.
        return {
            n.lower(): v for n, v in self._given.items() if not (self.env_ignore_empty and v == "")
        }

    def decode_complex_value(self, field_name: str, field: Any, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except json.JSONDecodeError as exc:
            # pydantic-settings passes the field's name, not the variable's: find the latter.
            key = field_name.lower()
            named = [n for n, v in sorted(self._given.items()) if v == value]
            name = next((n for n in named if n.lower().endswith(key)), field_name)
            raise _BadEnvironmentValue(f"{name}: expected a JSON value: {exc.msg}") from exc


def _setting_path(name: str) -> tuple[str, ...] | None:
    """The field path the variable `name` addresses; None when its first part is no setting.
    pydantic-settings skips such names silently; selfrag reports them (`_report_ignored`) and
    refuses a name that enters a known section and then misses (pydantic-settings would drop
    `SELFRAG_HOME__X` without a word, and say only "extra inputs" for `SELFRAG_MODEL__PATHH`)."""
    parts = tuple(name[len(ENV_PREFIX) :].lower().split(ENV_NESTED_DELIMITER))
    model: type[BaseModel] | None = Settings
    for depth, part in enumerate(parts):
        if model is None:
            raise SettingsError(f"{name}: {'.'.join(parts[:depth])} is a value, not a section")
        field = model.model_fields.get(part)
        if field is None:
            if depth == 0:
                return None
            known = list(model.model_fields)
            close = difflib.get_close_matches(part, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(known)}"
            raise SettingsError(f"{name}: unknown setting {'.'.join(parts[: depth + 1])}{hint}")
        kind = field.annotation
        model = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None
    return parts


def _environment_names(environ: Mapping[str, str]) -> tuple[dict[tuple[str, ...], str], list[str]]:
    """(field path -> the variable that sets it, the `SELFRAG_*` variables that are no setting)."""
    sources: dict[tuple[str, ...], str] = {}
    ignored: list[str] = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in _NOT_SETTINGS:
            continue
        path = _setting_path(name)
        if path is None:
            ignored.append(name)
        else:
            sources[path] = name
    return sources, ignored


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


def _toml(path: Path | None, what: str) -> TomlConfigSettingsSource:
    """pydantic-settings' source for the TOML file at `path` (none: an empty source)."""
    try:
        return TomlConfigSettingsSource(_SettingsLoader, toml_file=path)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{what} {path} is not valid TOML: {exc}") from exc


def load_settings(
    config_path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build the effective settings; raises `SettingsError` naming the bad file or field."""
    env = os.environ if environ is None else environ
    env_sources, ignored = _environment_names(env)
    _report_ignored(ignored)
    overrides = dict(overrides or {})
    # Init arguments starting with "_" are BaseSettings' own options (`_env_file`,
    # `_cli_parse_args`, ...), never settings.
    if private := [k for k in overrides if k.startswith("_")]:
        raise SettingsError(f"invalid settings: unknown setting {', '.join(private)}")
    home_variable = env_sources.get(("home",))
    home = Path((home_variable and env[home_variable]) or default_home()).expanduser()
    path = config_file(env, config_path, home)
    if path is not None and not path.expanduser().is_file():
        raise SettingsError(f"config file not found: {path}")
    # HOME/calibration.toml (written by `selfrag calibrate`) is the `calibration` section of the
    # data folder actually used, which an override may name; it ranks below the config file so
    # an explicit setting there still wins.
    data_home = Path(overrides.get("home") or home).expanduser()
    calibration = _toml(data_home / CALIBRATION_FILE, "calibration file").toml_data
    calibration = {"calibration": calibration} if calibration else {}
    token = _SOURCES.set(
        (
            _Environment(env),
            _toml(path, "config file"),
            InitSettingsSource(_SettingsLoader, calibration),
            InitSettingsSource(_SettingsLoader, {"home": str(default_home())}),
        )
    )
    try:
        loaded = _SettingsLoader(**overrides)
    except ValidationError as exc:
        source = f" (from {path} and SELFRAG_* variables)" if path else ""
        detail = describe_validation_error(exc, env_sources)
        raise SettingsError(f"invalid settings{source}: {detail}") from exc
    except pydantic_settings.SettingsError as exc:
        cause = exc.__cause__
        raise SettingsError(str(cause if isinstance(cause, _BadEnvironmentValue) else exc)) from exc
    finally:
        _SOURCES.reset(token)
    settings = Settings.model_validate(dict(loaded))
    return settings.model_copy(update={"home": settings.home.expanduser()})


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
    """Log the exposure warning (WARNING), or write it to stderr where no handler would show
    the record, once per process and host; returns it (None when there is nothing to warn
    about)."""
    warning = exposure_warning(host, api_keys)
    if warning is None:
        return None
    with _warned_lock:
        if host in _warned_hosts:
            return warning
        _warned_hosts.add(host)
    if log.hasHandlers():
        log.warning("%s", warning)
    else:  # a bare process (an app built by `serve run`): Python's last resort drops the prefix
        print(f"selfrag: WARNING: {warning}", file=sys.stderr, flush=True)
    return warning
