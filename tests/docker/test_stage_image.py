"""The project's Dockerfile, built for real (STAGE_TEST_IMAGE: tools/docker/images.sh stage
builds it on a local Python base), run as a container against the dockerized broker: topics
created by the image, the stage in its own container (read-only root, as in compose), the
demo's `--produce-only` feed from a third container, and the demo's checks on what it published.
Also the image's HEALTHCHECK turning healthy and a clean exit on `docker stop` (SIGTERM)."""

from __future__ import annotations

import uuid

import yaml

from stage.brokers.kraft import free_port
from stage.wire import TopicNames
from tests.docker.support import ROOT, Container, check_published, docker, failed, http_ok, image, wait_for

# seed 2, 8 groups of 3 with every rollout fault and garbage; no media or sampler top-k, as
# ops/stage.yaml configures the stage (router replay with routes in the rows)
FEED = ["--groups", "8", "--group-size", "3", "--seed", "2", "--fault-rate", "0.1",
        "--fault", "garbage=0.3", "--media-rate", "0", "--sampler-topk", "0", "--no-progress"]


def stage_yaml(tmp_path, topics: TopicNames, group_id: str) -> str:
    """ops/stage.yaml (what compose mounts) on per-test topics, with a 3 s group deadline."""
    config = yaml.safe_load((ROOT / "ops" / "stage.yaml").read_text())
    config.update(group_id=group_id, group_timeout_ms=3000, topics=topics.all())
    config["finalize"]["staging_partition"] = topics.staged_calls
    path = tmp_path / "stage.yaml"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o644)
    return str(path)


def test_stage_image_processes_the_produce_only_feed(kafka, tmp_path):
    stage_image = image("STAGE_TEST_IMAGE", "stage")
    prefix = f"img-{uuid.uuid4().hex[:8]}"
    topics = TopicNames(**{k: f"{prefix}.{v}" for k, v in TopicNames().all().items()})
    config = stage_yaml(tmp_path, topics, f"{prefix}-stage")
    mount = ("-v", f"{config}:/etc/rollout-reassembler/stage.yaml:ro")
    env = ("-e", f"ROLLOUT_REASSEMBLER_BOOTSTRAP_SERVERS={kafka.bootstrap}")

    topics_run = Container(stage_image, "topics", "create", "--config", "/etc/rollout-reassembler/stage.yaml",
                           "--partitions", "2", "--replication", "1", "--min-insync-replicas", "1",
                           options=(*mount, *env), detach=False)
    topics_run.remove()
    assert topics_run.result.returncode == 0, topics_run.result.stdout + topics_run.result.stderr

    port = free_port()
    stage = Container(stage_image, "run", "--config", "/etc/rollout-reassembler/stage.yaml", options=(
        *mount, *env, "-e", f"ROLLOUT_REASSEMBLER_METRICS_PORT={port}",
        "-e", f"ROLLOUT_REASSEMBLER_TRANSACTIONAL_ID={prefix}-tx", "--read-only", "--tmpfs", "/tmp"))
    try:
        wait_for("the stage container ready (/readyz)", lambda: http_ok(f"http://127.0.0.1:{port}/readyz"),
                 120, stage.logs)
        feed = Container(stage_image, "demo", "--bootstrap-servers", kafka.bootstrap, "--produce-only",
                         "--topic-prefix", prefix, *FEED, detach=False)
        feed.remove()
        assert feed.result.returncode == 0, feed.result.stdout + feed.result.stderr
        assert "produced 8 groups" in feed.result.stdout

        checks = check_published(kafka.bootstrap, FEED, topics)
        assert failed(checks) == [], stage.logs()
        assert len(checks) == 6

        # HEALTHCHECK: its first probe runs 15 s after the start
        wait_for("the image's HEALTHCHECK healthy", lambda: stage.state(".State.Health.Status") == "healthy",
                 60, stage.logs)
        docker("stop", "-t", "60", stage.name, timeout=90)
        assert stage.state(".State.ExitCode") == "0", stage.logs()
    finally:
        stage.remove()
