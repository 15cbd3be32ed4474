"""Helpers of the docker suite: the engine and images (skips where there are none: `make test`
brings them up here, tools/docker/engine.sh), containers on the host network labelled for
clean-up, and the demo's checks on what a containerized stage published."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.support.brokers import docker_available
from tests.support.docker_broker import TEST_LABEL

ROOT = Path(__file__).resolve().parents[2]


def image(variable: str, builds: str) -> str:
    """The image named by ``variable``; skips (saying how to build it) without an engine or it."""
    if not docker_available():
        pytest.skip("no Docker engine answers (`make test` starts one where it can: tools/docker/engine.sh)")
    name = os.environ.get(variable)
    if not name:
        pytest.skip(f"{variable} is not set: build the image with `tools/docker/images.sh {builds}` "
                    f"and export {variable} (make test does both)")
    if subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode != 0:
        pytest.fail(f"{variable}={name}: no such image")
    return name


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} -> {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


class Container:
    """``docker run`` on the host network with the test label; ``remove()`` in a finally."""

    def __init__(self, image_name: str, *args: str, options: tuple = (), detach: bool = True) -> None:
        self.name = f"rr-test-{uuid.uuid4().hex[:10]}"
        base = ["run", "--name", self.name, "--network", "host", "--label", f"{TEST_LABEL}=stage", *options]
        if detach:
            docker(*base, "-d", image_name, *args)
            self.result = None
        else:
            self.result = docker(*base, image_name, *args, timeout=300, check=False)

    def logs(self) -> str:
        out = docker("logs", "--tail", "200", self.name, check=False)
        return out.stdout + out.stderr

    def state(self, field: str) -> str:
        return docker("inspect", "-f", "{{" + field + "}}", self.name).stdout.strip()

    def remove(self) -> None:
        docker("rm", "--force", "--volumes", self.name, check=False)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_for(what: str, predicate, timeout: float, on_timeout=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{on_timeout()}")


def check_published(bootstrap: str, demo_argv: list[str], topics, *, timeout: float = 180.0) -> list:
    """Reads what a stage published for the workload ``demo --produce-only <demo_argv>`` fed it
    and runs the demo's checks on it (stage.demo.checks, against an independent recomputation).
    Returns the checks; the caller asserts they passed."""
    from stage.cli import _parser
    from stage.client import CanonicalReader
    from stage.demo import checks as C
    from stage.cli.demo import options
    from stage.demo.run import CLIENT_TIMEOUTS, finalize_config, read_topic
    from stage.wire import AvroCodec
    from stage.workload import generate

    opts = options(_parser().parse_args(["demo", *demo_argv]))
    workload = generate(opts.workload)
    reader = CanonicalReader(bootstrap, topics=topics, config=dict(CLIENT_TIMEOUTS))
    read: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(read) < len(workload.groups) and time.monotonic() < deadline:
            for group in reader.poll(0.2):
                read[group.group_id] = group
        counts = Counter(reader.counts)
    finally:
        reader.close()
    recomputed = {g.group_id: C.recompute_group(g, finalize_config(opts, topics), staged_topic=topics.staged_calls)
                  for g in workload.groups}
    codec = AvroCodec("GroupSummary")
    summaries: dict = {}
    for value, _ in read_topic(bootstrap, topics.finalized_groups, expect=len(workload.groups), timeout=30):
        summary = codec.decode(value)
        summaries.setdefault(summary["group_id"], summary)
    garbage = sum(len(g.garbage) for g in workload.groups)
    letters = read_topic(bootstrap, topics.dead_letter, expect=garbage, timeout=30 if garbage else 2)
    return [C.check_groups(workload, read, counts),
            C.check_rejections(workload, read, topics.staged_calls),
            C.check_rows_equal(workload, read, recomputed),
            C.check_padded_tensors(workload, read, recomputed, device="cpu"),
            C.check_summaries(workload, summaries),
            C.check_dead_letters(workload, letters, topics)]


def failed(checks: list) -> list[str]:
    return [f"{c.name}: {c.detail}" for c in checks if not c.passed]
