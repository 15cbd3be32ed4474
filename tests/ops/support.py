"""Shared helpers of the ops tests: paths, the Go-built tools in .cache/bin, Helm rendering,
interpolation of Compose variables, and checking ROLLOUT_REASSEMBLER_* settings with the stage's
own loader."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".cache" / "bin"
CHART = ROOT / "helm" / "rollout-reassembler"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DASHBOARD = ROOT / "ops" / "grafana" / "rollout-reassembler.json"
OPS = ROOT / "ops"


def tool(name: str, make_target: str) -> Path:
    """A binary that `make <target>` puts into .cache/bin; skips the test when it is missing,
    except under CI (`CI` set, as .ci/run runs), where `make test` must have provided it."""
    path = BIN / name
    if path.is_file() and os.access(path, os.X_OK):
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{name} is missing under CI: `make {make_target}` (part of `make test`) did not provide it")
    if shutil.which("go") is None:
        pytest.skip(f"{name} needs the Go toolchain (`make {make_target}` builds it from the Go module "
                    "proxy): no `go` on this machine")
    pytest.skip(f"{name} is not built: run `make {make_target}` (or `make test`)")


def helm() -> Path:
    return tool("helm", "helm")


def run(cmd: list, *, input: str | None = None, timeout: float = 60, cwd: Path = ROOT,
        env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], input=input, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def _values_args(values: dict | None, sets: tuple = ()) -> tuple[list, Path | None]:
    args: list = []
    path = None
    if values:
        fd, name = tempfile.mkstemp(suffix=".yaml", prefix="values-")
        with os.fdopen(fd, "w") as handle:
            yaml.safe_dump(values, handle)
        path = Path(name)
        args += ["-f", path]
    for item in sets:
        args += ["--set", item]
    return args, path


def helm_cmd(verb: str, values: dict | None = None, sets: tuple = (), extra: tuple = (), *,
             release: str = "rr", namespace: str = "stage") -> subprocess.CompletedProcess:
    args, path = _values_args(values, sets)
    try:
        if verb == "lint":
            return run([helm(), "lint", "--strict", CHART, *args, *extra])
        return run([helm(), "template", release, CHART, "--namespace", namespace, *args, *extra])
    finally:
        if path is not None:
            path.unlink()


@functools.lru_cache(maxsize=None)
def _render(values_json: str, release: str, namespace: str) -> tuple:
    values = json.loads(values_json)
    result = helm_cmd("template", values, release=release, namespace=namespace)
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    return tuple(docs)


def render(values: dict | None = None, *, release: str = "rr", namespace: str = "stage") -> list[dict]:
    """Rendered manifests (parsed) of the chart with these values; cached per value set."""
    return [json.loads(json.dumps(d)) for d in _render(json.dumps(values or {}, sort_keys=True), release, namespace)]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


# -- Compose ---------------------------------------------------------------------------------
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict | None = None):
    """Compose-style ${VAR}, ${VAR:-default} and ${VAR-default} with `env` (default: none set)."""
    env = env or {}
    if isinstance(value, str):
        def substitute(match):
            name, default = match.group(1) or match.group(3), match.group(2) or ""
            if name in env and (env[name] or ":-" not in match.group(0)):
                return env[name]
            return default
        return _VAR.sub(substitute, value.replace("$$", "\0")).replace("\0", "$")
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


@functools.lru_cache(maxsize=None)
def compose_raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose() -> dict:
    """docker-compose.yml, merge keys resolved (PyYAML) and variables at their defaults."""
    return interpolate(compose_raw())


def compose_environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


# -- the stage's configuration -----------------------------------------------------------------
def load_stage_config(yaml_text: str | None, env: dict[str, str]):
    """The stage's own loader (defaults, YAML, environment); raises what the stage would raise."""
    from stage.config.model import load_config
    if yaml_text is None:
        return load_config(None, env)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        handle.write(yaml_text)
        name = handle.name
    try:
        return load_config(name, env)
    finally:
        os.unlink(name)


def cli_parser():
    from stage.cli import _parser
    return _parser()


def cli_commands() -> set[str]:
    import argparse
    parser = cli_parser()
    for action in parser._actions:  # argparse keeps subcommands in its _SubParsersAction
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()


def parse_cli(argv: list[str]):
    """Parse a command line with the stage's CLI parser; argparse errors become AssertionError."""
    parser = cli_parser()
    try:
        return parser.parse_args(argv)
    except SystemExit as error:
        raise AssertionError(f"the CLI parser rejects {argv!r}") from error


# -- the stage's health server -----------------------------------------------------------------
@contextlib.contextmanager
def health_server(*, ready: bool = True, stalled: bool = False):
    """The stage's real HealthServer on a free port, over a stand-in runtime; yields the port."""
    from stage.observability import HealthServer, PrometheusSink
    stats = SimpleNamespace(sink=PrometheusSink(),
                            last_loop_at=time.monotonic() - (3600 if stalled else 0))
    runtime = SimpleNamespace(stats=stats, readiness=lambda: (ready, "1 partitions assigned" if ready
                                                              else "no partitions assigned"))
    server = HealthServer(runtime, 0, host="127.0.0.1").start()
    try:
        yield server.port
    finally:
        server.stop()


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
