"""Where settings come from: a YAML file and the environment (docs/configuration.md), and which
source gave each value, so that an error names the file or the variable it came from.

The environment is read by pydantic-settings' EnvSettingsSource (prefix, ``__`` nesting, case
folding, a whole section as JSON). Two rules it does not have are added here: a variable in our
namespace that names no setting is an error (pydantic-settings silently ignores it, and a typo
must not fall back to a default), and Kubernetes service-link variables are not settings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import EnvSettingsSource, SettingsError

ENV_PREFIX = "ROLLOUT_REASSEMBLER_"
NESTING = "__"
BOOTSTRAP_ALIAS = "KAFKA_BOOTSTRAP_SERVERS"   # the common convention; no other KAFKA_* is read
# Variables in our namespace that are not settings (read by the modules named).
NOT_SETTINGS = frozenset({
    "ROLLOUT_REASSEMBLER_FAULT",           # stage.publish.faults (crash injection in tests)
    "ROLLOUT_REASSEMBLER_MALLOC_TUNING",   # stage.runtime.malloc
    "ROLLOUT_REASSEMBLER_SCHEMAS_DIR",     # stage.wire.schemas
    "ROLLOUT_REASSEMBLER_KAFKA_JARS",      # stage.brokers.kraft
    "ROLLOUT_REASSEMBLER_REJECTION_LOG_LEVEL",  # stage.runtime.kafka.logs (per-rejection log level)
    "ROLLOUT_REASSEMBLER_DOCKER_STATE",    # tools/docker/engine.sh
    "ROLLOUT_REASSEMBLER_NATIVE",          # stage.contract.native (0: the Python loops)
    "ROLLOUT_REASSEMBLER_REQUIRE_NATIVE",  # the test suite (make test sets it)
})

# Kubernetes gives every pod variables for each Service of its namespace (unless the pod spec
# sets enableServiceLinks: false). A Service named `rollout-reassembler` (what `helm install
# rollout-reassembler` creates), or `rollout-reassembler-<x>`, yields ROLLOUT_REASSEMBLER_[<X>_]
# SERVICE_HOST, SERVICE_PORT[_<NAME>], PORT=tcp://ip:port and PORT_<n>_<PROTO>[_PROTO|_PORT|_ADDR].
_SERVICE_LINK = re.compile(
    r"(?:[A-Z0-9_]+_)?(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?|PORT_[0-9]+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)")
# <PREFIX><X>_PORT is also the name of a setting when X is METRICS (metrics_port): only the
# value, proto://ip:port, tells a service link from a port number.
_SERVICE_PORT_URL = re.compile(r"(?:[A-Z0-9_]+_)?PORT")
_URL = re.compile(r"(?:tcp|udp|sctp)://\S+:[0-9]+")


def is_service_link(name: str, value: str) -> bool:
    rest = name.upper()[len(ENV_PREFIX):]
    return bool(_SERVICE_LINK.fullmatch(rest)
                or (_SERVICE_PORT_URL.fullmatch(rest) and _URL.fullmatch(str(value).strip())))


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names each setting, its source and what
    is allowed."""


def _is_section(model: type[BaseModel], name: str) -> type[BaseModel] | type[dict] | None:
    annotation = model.model_fields[name].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if annotation is dict or getattr(annotation, "__origin__", None) is dict:
        return dict
    return None


def setting_variables(model: type[BaseModel], env: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Our variables that are settings -> the setting each sets. Refuses names that are none."""
    out: dict[str, tuple[str, ...]] = {}
    for name, value in env.items():
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in NOT_SETTINGS or is_service_link(name, value):
            continue
        head, nested, tail = upper[len(ENV_PREFIX):].lower().partition(NESTING)
        if head not in model.model_fields:
            raise ConfigError(f"{name} (environment): unknown setting {head!r}; settings: "
                              f"{', '.join(model.model_fields)}; not settings: {', '.join(sorted(NOT_SETTINGS))}")
        section = _is_section(model, head)
        if nested and (section is None or not tail or (section is not dict and NESTING in tail)):
            raise ConfigError(f"{name} (environment): {head} is not a section with field {tail!r} "
                              f"(sections: {', '.join(f for f in model.model_fields if _is_section(model, f))})")
        out[name] = (head, tail.replace("_", ".") if section is dict else tail) if nested else (head,)
    return out


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping instead of os.environ."""

    def __init__(self, model: type[BaseModel], env: Mapping[str, str]) -> None:
        self._given = env
        super().__init__(model, case_sensitive=False, env_prefix=ENV_PREFIX, env_nested_delimiter=NESTING)

    def _load_env_vars(self) -> Mapping[str, str | None]:   # the hook DotEnvSettingsSource overrides too
        return {name.lower(): value for name, value in self._given.items()}


def from_environment(model: type[BaseModel], env: Mapping[str, str]) -> tuple[dict, dict]:
    """(values, origins): the settings the environment sets, and setting path -> variable."""
    paths = setting_variables(model, env)
    try:
        values = _Environment(model, {name: env[name] for name in paths})()
    except SettingsError:   # a whole section that is not JSON
        whole = [name for name, path in paths.items() if len(path) == 1 and _is_section(model, path[0])]
        raise ConfigError(f"{', '.join(whole)} (environment): a whole section must be one JSON object, "
                          f"e.g. '{{\"device\": \"cuda\"}}'; or set its fields one by one "
                          f"({ENV_PREFIX}<SECTION>{NESTING}<FIELD>)") from None
    for name in (n for n, s in model.model_fields.items() if _is_section(model, n) is dict):
        if isinstance(values.get(name), dict):   # librdkafka properties: `_` in a variable is `.`
            values[name] = {key.replace("_", "."): value for key, value in values[name].items()}
    origins = {path: f"environment {name}" for name, path in paths.items()}
    if BOOTSTRAP_ALIAS in env and "bootstrap_servers" not in values:
        values["bootstrap_servers"] = env[BOOTSTRAP_ALIAS]
        origins[("bootstrap_servers",)] = f"environment {BOOTSTRAP_ALIAS}"
    return values, origins


def from_file(path: str | Path | None) -> tuple[dict, dict]:
    """(values, origins) of a YAML file."""
    if not path:
        return {}, {}
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of settings")
    origins: dict = {}

    def walk(node: Any, at: tuple[str, ...]) -> None:   # the values, not the sections holding them
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, at + (str(key),))
        else:
            origins[at] = f"file {path}"
    for key, value in loaded.items():
        walk(value, (str(key),))
    return loaded, origins


def merge(base: dict, override: dict) -> dict:
    """``override`` wins, section by section."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _origin(origins: dict, path: tuple[str, ...]) -> str:
    """The source of a value; of a section, the sources of the values in it."""
    if path in origins:
        return origins[path]
    inside = sorted({source for at, source in origins.items() if at[:len(path)] == path})
    if inside:
        return " and ".join(inside)
    for end in range(len(path) - 1, 0, -1):   # a value inside one set whole (a JSON section)
        if path[:end] in origins:
            return origins[path[:end]]
    return "default"


def _fields_at(model: type[BaseModel], path: tuple[str, ...]) -> list[str]:
    for name in path:
        section = _is_section(model, name) if name in model.model_fields else None
        if not isinstance(section, type) or not issubclass(section, BaseModel):
            return []
        model = section
    return list(model.model_fields)


def _is_secret(model: type[BaseModel], path: tuple[str, ...]) -> bool:
    """True when ``path`` names a SecretStr field (or a value inside one)."""
    for name in path:
        field = model.model_fields.get(name) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return False
        if "SecretStr" in str(field.annotation):
            return True
        model = field.annotation
    return False


def explain(error: ValidationError, model: type[BaseModel], origins: dict) -> ConfigError:
    """One line per problem: the setting, its value and source, and what is allowed."""
    lines = []
    for item in error.errors(include_url=False):
        path = tuple(str(p) for p in item["loc"])
        where = ".".join(path)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "config_conflict":
            fields = [path + (f,) for f in item["ctx"]["fields"]]
            sources = ", ".join(f"{'.'.join(f)}: {_origin(origins, f)}" for f in fields)
            lines.append(f"{message} [{sources}]")
        elif item["type"] == "extra_forbidden":
            lines.append(f"{where} ({_origin(origins, path)}): unknown setting; known: "
                         f"{', '.join(_fields_at(model, path[:-1]))}")
        else:
            # client properties may hold secrets, and SecretStr fields are: values not repeated
            secret = (path[0] in model.model_fields and _is_section(model, path[0]) is dict) \
                or _is_secret(model, path)
            shown = "" if secret else f" = {item['input']!r}"
            lines.append(f"{where}{shown} ({_origin(origins, path)}): {message}")
    return ConfigError("; ".join(lines) if len(lines) == 1 else
                       f"{len(lines)} problems:\n  " + "\n  ".join(lines))
