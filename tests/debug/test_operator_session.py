"""docs/operations.md's debugging session, run as written against a real broker and the
stage: a group stays unpublished because one of its receipts was produced to the wrong partition
(a producer with librdkafka's default partitioner); ``inspect`` shows the three receipts that
arrived and the dead letter of the fourth, ``dead-letters list`` finds it, ``replay`` puts it
where the contract says, and ``inspect`` then shows the published group and why its last row
was rejected. ``-s`` prints the transcript (docs/operations.md quotes it, topic prefix removed)."""

from __future__ import annotations

from stage.wire.partitioner import partition_for
from tests.debug.helpers import CoordinateFeeder, run_cli
from tests.integration.harness import RunningStage, make_group, read_all, setup_topics, stage_config, unique_topics

GROUP = "g-0042"


def test_the_readme_debugging_session(kafka, capsys, tmp_path):
    topics = unique_topics()
    prefix = topics.receipts.split(".rollouts.")[0] + "."
    cfg = stage_config(kafka.bootstrap, topics, group_timeout_ms=120_000)
    setup_topics(cfg, partitions=4)
    spec = make_group(GROUP, 4, seed=42, prompt_idx=42)
    spec.staged[-1] = dict(spec.staged[-1], digest="f" * 64)     # rollout 3's last call corrupted
    key = GROUP.encode()
    home = partition_for(key, 4)
    feeder = CoordinateFeeder(kafka.bootstrap, topics)
    feeder.staged(spec)
    feeder.receipts(spec, spec.receipts[:2] + spec.receipts[3:])
    feeder.send(topics.receipts, key, feeder.receipt_codec.encode(spec.receipts[2]), partition=(home + 2) % 4)
    feeder.flush()
    transcript: list[str] = []

    def command(*args: str) -> tuple[int, str]:
        rc, out, _ = run_cli(capsys, cfg, tmp_path, *args, as_json=False)
        transcript.append(f"$ rollout-reassembler {' '.join(args)} --config stage.yaml")
        transcript.append(out.replace(prefix, "").rstrip())
        return rc, out

    with RunningStage(cfg) as stage:
        stage.wait(lambda: read_all(kafka.bootstrap, topics.dead_letter, timeout=2), 60, "the dead letter")
        rc, out = command("inspect", GROUP)
        assert rc == 1 and "summary: none found" in out and "(misrouted" in out
        assert out.count("  receipt ") == 3
        rc, out = command("dead-letters", "list", "--key", GROUP)
        assert rc == 0 and "misrouted" in out and f"belongs in partition {home} of 4" in out
        rc, out = command("dead-letters", "replay", "--key", GROUP, "--dry-run")
        assert rc == 0 and f"would_replay" in out and f"receipts[{home}]" in out
        rc, out = command("dead-letters", "replay", "--key", GROUP)
        assert rc == 0 and "1 replayed" in out
        stage.wait(lambda: read_all(kafka.bootstrap, topics.finalized_groups, timeout=2), 60, "publication")
        rc, out = command("inspect", GROUP)
        assert rc == 0 and "complete, 3/4 valid rows" in out
        assert "row 3  REJECTED g-0042-r3" in out and out.count("  receipt ") == 4
        rc, out = command("dead-letters", "replay", "--key", GROUP)
        assert rc == 0 and "1 already replayed" in out
    print("\n".join(transcript))
