"""Every program in examples/ runs as a user runs it, against a real broker and a running stage.

The stage is ``rollout-reassembler run --config examples/stage.yaml`` as a process, its topics
made by ``topics create`` with that same file; the environment overrides only what must differ
per test run (bootstrap servers, topic names, group and transactional ids, the metrics port), as
a user's deployment would. The examples run as subprocesses with their documented options and
the tests read what they print (and what they leave behind: the trainer's checkpoint).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from stage.brokers.kraft import free_port
from stage.wire import TopicNames

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
STAGE_YAML = EXAMPLES / "stage.yaml"


def base_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ROLLOUT_REASSEMBLER_") and k != "KAFKA_BOOTSTRAP_SERVERS"}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    return env


class LocalStage:
    """examples/stage.yaml, run by ``python -m stage run`` with per-test overrides in its environment."""

    def __init__(self, bootstrap: str, workdir: Path, **settings: str) -> None:
        self.prefix = f"ex{uuid.uuid4().hex[:6]}."
        self.topics = TopicNames(**{r: self.prefix + n for r, n in TopicNames().all().items()})
        self.metrics_port = free_port()
        self.env = {**base_env(), "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
                    "ROLLOUT_REASSEMBLER_GROUP_ID": f"{self.prefix}stage",
                    "ROLLOUT_REASSEMBLER_TRANSACTIONAL_ID": f"{self.prefix}stage-0",
                    "ROLLOUT_REASSEMBLER_METRICS_PORT": str(self.metrics_port),
                    **{f"ROLLOUT_REASSEMBLER_TOPICS__{role.upper()}": name for role, name in self.topics.all().items()},
                    **{f"ROLLOUT_REASSEMBLER_{k.upper()}": v for k, v in settings.items()}}
        self.bootstrap = bootstrap
        self.log_path = workdir / f"stage-{self.prefix}log"
        self.proc: subprocess.Popen | None = None

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "stage", *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def start(self) -> "LocalStage":
        created = self.cli("topics", "create", "--config", str(STAGE_YAML), "--partitions", "2",
                           "--replication", "1", "--min-insync-replicas", "1")
        assert created.returncode == 0, created.stderr
        self.proc = subprocess.Popen([sys.executable, "-m", "stage", "run", "--config", str(STAGE_YAML)],
                                     cwd=ROOT, env=self.env, stdout=open(self.log_path, "wb"),
                                     stderr=subprocess.STDOUT)
        self.wait(lambda: self.http("/readyz")[0] == 200, 120, "/readyz 200")
        return self

    def http(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
        except OSError:
            return 0, ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the stage exited ({self.proc.returncode}) waiting for {what}:\n{self.log()[-4000:]}")
            if predicate():
                return
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log()[-4000:]}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def example(self, name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        command = ["bash", str(EXAMPLES / name)] if name.endswith(".sh") else [sys.executable, str(EXAMPLES / name)]
        proc = subprocess.run([*command, *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, f"{name} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        return proc

    def produce(self, *args: str) -> list[str]:
        out = self.example("producer_fleet.py", "--topic-prefix", self.prefix, *args).stdout
        assert "all acknowledged" in out, out
        return re.search(r"^groups: (.*)$", out, re.M).group(1).split()

    def train(self, checkpoint: Path, *args: str) -> tuple[str, list[str], list[str]]:
        """(stdout, the groups trained on in this run in order, the groups set aside as stale)."""
        out = self.example("trainer_loop.py", "--topic-prefix", self.prefix, "--checkpoint", str(checkpoint),
                           "--reader-group-id", f"{self.prefix}trainer", *args).stdout
        trained = [g for m in re.finditer(r"^step \d+: \d+ group\(s\) \[(.*?)\]", out, re.M) for g in m.group(1).split(", ")]
        stale = [g for m in re.finditer(r"^stale: set aside (.*?) \(", out, re.M) for g in m.group(1).split(", ")]
        return out, trained, stale


@pytest.fixture
def local_stage(kafka, tmp_path):
    stage = LocalStage(kafka.bootstrap, tmp_path, group_timeout_ms="120000").start()
    yield stage
    assert stage.stop() == 0, stage.log()[-4000:]


def test_the_example_stage_yaml_runs_the_stage_with_metrics_and_health(local_stage):
    status, text = local_stage.http("/readyz")
    assert status == 200 and "partitions assigned" in text
    assert local_stage.http("/healthz")[0] == 200
    status, metrics = local_stage.http("/metrics")
    assert status == 200 and "rollout_reassembler_" in metrics


def test_producer_fleet_then_a_trainer_that_resumes_from_its_checkpoint(local_stage, tmp_path):
    checkpoint = tmp_path / "trainer.ckpt"
    first = local_stage.produce("--groups", "6", "--group-size", "4", "--run-id", "a", "--missing-rate", "0.1",
                                "--seed", "1")
    assert first == [f"a-p{i}" for i in range(6)]
    out, trained1, _ = local_stage.train(checkpoint, "--max-steps", "2", "--idle-timeout", "60")
    assert "stopping: --max-steps 2 reached" in out and 2 <= len(trained1) <= 4, out
    assert checkpoint.exists()

    out, trained2, stale = local_stage.train(checkpoint, "--idle-timeout", "8")   # resumes: the rest
    assert f"resumed from {checkpoint}: step 2, weight version 2, {len(trained1)} groups trained" in out, out
    assert "stopping: no new group for 8 s" in out and not stale
    assert sorted(trained1 + trained2) == sorted(first), out            # every group once, in total

    import torch
    version = torch.load(checkpoint, weights_only=True)["weight_version"]   # one per step so far
    assert version >= 3
    # groups generated with weight version 0 are now more than 2 versions behind the policy
    old = local_stage.produce("--groups", "2", "--run-id", "old", "--weight-version", "0")
    new = local_stage.produce("--groups", "2", "--run-id", "new", "--weight-version", str(version))
    out, trained3, stale = local_stage.train(checkpoint, "--idle-timeout", "8", "--max-lag", "2")
    assert sorted(stale) == sorted(old) and sorted(trained3) == sorted(new), out
    assert "(oldest weight version 0, policy at" in out and "max lag 2)" in out
    saved = torch.load(checkpoint, weights_only=True)
    assert sorted(saved["trained"]) == sorted(first + new) and sorted(saved["stale"]) == sorted(old)
    assert saved["step"] == saved["weight_version"] == version + len(re.findall(r"^step ", out, re.M))
    rc, report = check(local_stage, checkpoint)
    assert rc == 0 and counts(report) == {"trained": 8, "stale": 2, "not yet": 0, "missing": 0,
                                          "twice": 0}, report
    later = local_stage.produce("--groups", "1", "--run-id", "later")         # not read yet
    rc, report = check(local_stage, checkpoint, "--list")
    assert rc == 0 and f"not yet   1: {later[0]}" in report, report


def check(stage: LocalStage, checkpoint: Path, *args: str) -> tuple[int, str]:
    """examples/check_trainer.py against the stage's topics: (exit status, its output)."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "check_trainer.py"), "--topic-prefix", stage.prefix,
                           "--checkpoint", str(checkpoint), *args], cwd=ROOT, env=stage.env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def counts(report: str) -> dict[str, int]:
    return {m.group(1).strip(): int(m.group(2))
            for m in re.finditer(r"^(trained|stale|not yet|missing|twice|unknown)\s+(\d+)", report, re.M)}


def test_the_readme_path_trains_every_group_and_the_check_says_so(local_stage, tmp_path):
    """Issue 27 item 4: the README's commands (8 groups from the fleet at its default weight
    version 0, the trainer with its defaults) set 2 of 8 groups aside as stale on the first run,
    and nothing told a user how to check that every group was trained exactly once."""
    checkpoint = tmp_path / "trainer.ckpt"
    groups = local_stage.produce("--groups", "8", "--run-id", "readme")
    out, trained, stale = local_stage.train(checkpoint, "--idle-timeout", "8")
    assert sorted(trained) == sorted(groups) and not stale, out
    rc, report = check(local_stage, checkpoint)
    assert rc == 0 and "result: OK" in report, report
    assert counts(report) == {"trained": 8, "stale": 0, "not yet": 0, "missing": 0, "twice": 0}, report

    # the check fails when the checkpoint lost a group or holds one twice
    import torch
    saved = torch.load(checkpoint, weights_only=True)
    saved["trained"] = saved["trained"][1:] + [saved["trained"][-1]]
    torch.save(saved, checkpoint)
    rc, report = check(local_stage, checkpoint, "--list")
    assert rc == 1 and "FAIL" in report, report
    assert counts(report)["missing"] == 1 and counts(report)["twice"] == 1, report
    assert f"missing   1: {trained[0]}" in report


def test_the_operator_session(local_stage):
    """Run as a user runs it: no venv activated (issue 27 item 5: `No module named 'numpy'`
    from the system python), so neither the venv's bin nor RR/PYTHON are given."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and Path(d).resolve() != Path(venv_bin).resolve())
    env = {k: v for k, v in local_stage.env.items() if k not in ("RR", "PYTHON", "VIRTUAL_ENV")}
    env.update(PATH=path or "/usr/bin:/bin", GROUP="g-0042")
    proc = subprocess.run(["bash", str(EXAMPLES / "operator_session.sh"), str(STAGE_YAML)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    steps = out.split("$ rollout-reassembler ")[1:]
    assert [s.split(" --config")[0] for s in steps] == [
        "inspect g-0042 --quiet", "dead-letters list --key g-0042 --quiet",
        "dead-letters replay --key g-0042 --dry-run --quiet", "dead-letters replay --key g-0042 --quiet",
        "inspect g-0042 --quiet", "dead-letters replay --key g-0042 --quiet"]
    inspect_before, listing, dry, replay, inspect_after, again = steps
    assert "summary: none found" in inspect_before and inspect_before.count("  receipt ") == 3
    assert "(exit 1)" in inspect_before
    assert "misrouted" in listing and "1 dead letter(s) matched" in listing and "(exit 0)" in listing
    assert "would_replay" in dry and "(exit 0)" in dry
    assert "1 replayed" in replay and "(exit 0)" in replay
    assert "complete, 4/4 valid rows" in inspect_after and "(exit 0)" in inspect_after
    assert "1 already replayed" in again and "(exit 0)" in again


@pytest.mark.parametrize("layers,topk", [(4, 2)])
def test_producer_routes_reach_the_trainer_with_router_replay_on(kafka, tmp_path, layers, topk):
    stage = LocalStage(kafka.bootstrap, tmp_path, finalize__router_replay="true").start()
    try:
        groups = stage.produce("--groups", "2", "--group-size", "2", "--run-id", "moe",
                               "--route-layers", str(layers), "--route-topk", str(topk))
        out, trained, _ = stage.train(tmp_path / "moe.ckpt", "--idle-timeout", "8")
        assert sorted(trained) == sorted(groups), out
        shapes = re.findall(r"routed_experts \[2, (\d+), (\d+), (\d+)\]", out)
        assert shapes and {(int(l), int(k)) for _, l, k in shapes} == {(layers, topk)}, out
    finally:
        assert stage.stop() == 0, stage.log()[-4000:]
