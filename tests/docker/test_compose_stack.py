"""`docker compose up` of docker-compose.yml (with tools/docker/compose.host.yml: this engine has
no bridge, so every service uses the host network on 127.0.0.1): the broker, topic creation, the
stage and Prometheus from images built here (KAFKA_/STAGE_/PROMETHEUS_TEST_IMAGE), the compose
`demo` service's produce-only feed, the demo's checks on the stage's output, Prometheus scraping
the stage, and the broker's data in its volume. Grafana is not started: no registry serves its
image here and its source is AGPL (docs/status.md, "What was not run here")."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.parse
import urllib.request
import uuid

import pytest

from stage.wire import TopicNames
from tests.docker.support import ROOT, check_published, docker, failed, http_ok, image, wait_for

COMPOSE_CLI = ROOT / ".cache" / "bin" / "docker-compose"
FILES = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "tools" / "docker" / "compose.host.yml")]
PORTS = {"kafka": 9092, "controller": 9093, "kafka from the host": 29092, "stage metrics": 9400, "prometheus": 9090}
SERVICES = ["kafka", "topics", "stage", "prometheus"]
# No fault that waits for the group deadline (ops/stage.yaml: 60 s): every group completes.
FEED = ["--groups", "6", "--group-size", "3", "--seed", "3", "--fault-rate", "0",
        "--fault", "tampered_tokens=0.2", "--fault", "tampered_digest=0.2", "--fault", "poisoned_receipt=0.2",
        "--fault", "garbage=0.5", "--media-rate", "0", "--sampler-topk", "0", "--no-progress"]


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def prometheus_value(query: str) -> float:
    url = "http://127.0.0.1:9090/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            result = json.load(response)["data"]["result"]
    except (OSError, ValueError, KeyError):
        return -1.0
    return sum(float(r["value"][1]) for r in result) if result else -1.0


@pytest.fixture
def stack():
    if not COMPOSE_CLI.is_file():
        pytest.skip("no compose CLI: `make compose-cli` builds docker compose v2 from the Go module proxy")
    env = {**os.environ, "KAFKA_IMAGE": image("KAFKA_TEST_IMAGE", "kafka"),
           "STAGE_IMAGE": image("STAGE_TEST_IMAGE", "stage"),
           "PROMETHEUS_IMAGE": image("PROMETHEUS_TEST_IMAGE", "prometheus"),
           "PARTITIONS": "2", "COMPOSE_PROJECT_NAME": f"rr-compose-{uuid.uuid4().hex[:8]}"}
    taken = [f"{name} {port}" for name, port in PORTS.items() if port_taken(port)]
    if taken:
        pytest.skip(f"the compose file's ports are in use on this machine: {', '.join(taken)}")

    def compose(*args, timeout=300, check=True):
        result = subprocess.run([str(COMPOSE_CLI), *FILES, *args], env=env, capture_output=True,
                                text=True, timeout=timeout, cwd=ROOT)
        assert not check or result.returncode == 0, f"compose {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result

    model = json.loads(compose("config", "--format", "json").stdout)
    assert not model.get("networks"), "the stack must create no network here (no bridge, no private range)"
    try:
        yield compose, env["COMPOSE_PROJECT_NAME"]
    finally:
        compose("down", "--volumes", "--remove-orphans", "--timeout", "30", check=False)


def test_compose_stack_runs_the_produce_only_demo(stack):
    compose, project = stack
    compose("up", "--detach", "--no-build", *SERVICES)
    logs = lambda: compose("logs", "--tail", "60", check=False).stdout  # noqa: E731
    wait_for("the stage service ready (/readyz on :9400)", lambda: http_ok("http://127.0.0.1:9400/readyz"), 240, logs)
    assert compose("ps", "--all", "--format", "{{.Service}} {{.State}} {{.ExitCode}}").stdout.count("topics exited 0") == 1

    # the compose `demo` service, with a small feed instead of its 3000 groups at 5/s
    feed = compose("run", "--rm", "--no-deps", "demo", "demo", "--bootstrap-servers", "kafka:9092",
                   "--produce-only", *FEED, timeout=300, check=False)
    assert feed.returncode == 0 and "produced 6 groups" in feed.stdout, feed.stdout + feed.stderr

    checks = check_published("127.0.0.1:29092", FEED, TopicNames())
    assert failed(checks) == [], logs()

    # Prometheus scrapes the stage (ops/prometheus/prometheus.yml) and sees every group published
    wait_for("Prometheus: the stage target up", lambda: prometheus_value('up{job="rollout-reassembler"}') == 1.0,
             120, logs)
    wait_for("Prometheus: 6 groups published", lambda: prometheus_value(
        "sum(rollout_reassembler_groups_published_total)") >= 6, 120, logs)

    # the broker writes where the named volume is mounted
    data = compose("exec", "-T", "kafka", "ls", "/var/lib/kafka/data").stdout.split()
    assert "meta.properties" in data and any(name.startswith("rollouts.receipts-") for name in data)
    volumes = docker("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={project}").stdout.split()
    assert f"{project}_kafka-data" in volumes
