"""docker-compose.yml's Kafka volume, and the override files: the GPU variant
(docker-compose.gpu.yml) and the host-network variant for an engine without a bridge
(tools/docker/compose.host.yml), merged by compose-go's loader as Docker Compose merges them."""

from __future__ import annotations

import json
import os

import yaml

from tests.ops.support import (
    COMPOSE, ROOT, compose, compose_environment, interpolate, load_stage_config, run, tool,
)

GPU = ROOT / "docker-compose.gpu.yml"
HOST = ROOT / "tools" / "docker" / "compose.host.yml"


def environment(service: dict) -> dict:
    """compose-go writes a merged environment as a list of NAME=value."""
    return compose_environment(service)


def merged(*files) -> dict:
    """compose-go's model of docker-compose.yml plus the given overrides."""
    loader = tool("compose-spec", "ops-tools")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAGE_", "PARTITIONS", "KAFKA_", "PROMETHEUS_"))}
    result = run([loader, "--format", "json", COMPOSE, *files], env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_kafka_data_volume_is_where_the_broker_writes():
    kafka = compose()["services"]["kafka"]
    log_dirs = compose_environment(kafka)["KAFKA_LOG_DIRS"].split(",")
    targets = {v.split(":")[1]: v.split(":")[0] for v in kafka["volumes"]}
    assert log_dirs == ["/var/lib/kafka/data"] and targets["/var/lib/kafka/data"] == "kafka-data"
    assert "kafka-data" in compose()["volumes"]


def test_gpu_override_reserves_a_gpu_for_a_cuda_stage():
    override = interpolate(yaml.safe_load(GPU.read_text()))["services"]["stage"]
    (device,) = override["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia" and device["count"] >= 1
    assert override["build"]["args"]["TORCH_INDEX_URL"] == ""  # PyPI's torch: CUDA as pip packages
    assert "BASE_IMAGE" not in override["build"]["args"]       # ... on the slim base, not a CUDA one
    stage = merged(GPU)["services"]["stage"]
    assert stage["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert load_stage_config(None, environment(stage)).finalize.device == "cuda"  # the stage's own loader
    args = compose_environment({"environment": stage["build"]["args"]})
    assert args["BASE_IMAGE"] == "python:3.11-slim" and args["TORCH_INDEX_URL"] == ""
    assert stage["image"] != compose()["services"]["stage"]["image"]  # the CPU image is not overwritten


def test_host_override_puts_every_service_on_loopback():
    model = merged(HOST)
    assert set(model["services"]) == set(compose()["services"])
    for name, service in model["services"].items():
        assert service.get("network_mode") == "host", name
        assert {"kafka:127.0.0.1", "stage:127.0.0.1"} <= set(service.get("extra_hosts") or []), name
    listeners = environment(model["services"]["kafka"])["KAFKA_LISTENERS"].split(",")
    assert all("://127.0.0.1:" in item for item in listeners), listeners
    command = model["services"]["prometheus"]["command"]
    assert "--web.listen-address=127.0.0.1:9090" in command
    assert "networks" not in model or set(model["networks"]) <= {"default"}
