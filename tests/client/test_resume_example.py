"""Issue 28 item 3: examples/producer_fleet.py killed with SIGKILL mid-step (every rollout has
staged 2 of its 3 calls, no receipt sent), restarted with --resume: every rollout is resumed from
what it staged, every group is published once with all its rows valid (no placeholder), the
trainer reads each group once, and the fleet reports every staged token reused."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from stage.wire import AvroCodec
from tests.examples.test_examples import EXAMPLES, ROOT, LocalStage
from tests.integration.harness import read_all

SUMMARY = AvroCodec("GroupSummary")


@pytest.fixture
def local_stage(kafka, tmp_path):
    stage = LocalStage(kafka.bootstrap, tmp_path, group_timeout_ms="120000").start()
    yield stage
    assert stage.stop() == 0, stage.log()[-4000:]


def test_the_fleet_killed_mid_step_resumes_every_rollout_and_each_group_is_trained_once(local_stage, tmp_path):
    run = ("--topic-prefix", local_stage.prefix, "--groups", "3", "--group-size", "4", "--turns", "3",
           "--run-id", "crash", "--seed", "5")
    killed = subprocess.run([sys.executable, str(EXAMPLES / "producer_fleet.py"), *run, "--crash-after-calls", "2"],
                            cwd=ROOT, env=local_stage.env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stdout, killed.stderr)
    assert "killing the fleet (SIGKILL)" in killed.stdout and "groups:" not in killed.stdout

    out = local_stage.example("producer_fleet.py", *run, "--resume").stdout
    print("\n".join(line for line in out.splitlines() if line.startswith(("resume:", "tokens"))))
    assert "resume: 12/12 rollouts resumed (resumed 12)" in out, out
    per_rollout = 64 + 32 + 16 + 32              # the two calls staged before the kill
    assert f"tokens reused {12 * per_rollout}, regenerated 0 (100.0% of the staged tokens reused)" in out, out
    groups = out.split("groups: ")[1].split()
    assert groups == ["crash-p0", "crash-p1", "crash-p2"]

    _out, trained, stale = local_stage.train(tmp_path / "trainer.ckpt", "--idle-timeout", "8")
    assert sorted(trained) == groups and not stale, _out
    summaries = [SUMMARY.decode(m.value()) for m in read_all(local_stage.bootstrap, local_stage.topics.finalized_groups)]
    assert sorted((s["group_id"], s["outcome"], s["valid_rows"], s["total_rows"]) for s in summaries) == \
        [(g, "complete", 4, 4) for g in groups]
    # each staged call once: 3 per rollout, none staged again by the resumed fleet
    staged = [m for m in read_all(local_stage.bootstrap, local_stage.topics.staged_calls)]
    assert len(staged) == 3 * 4 * 3
