"""`topics create` on a real broker when some topics exist already and differ from what is asked:
the missing ones are still created (the stage's start-up check sends the user to this command
to create them), the differing one is named, and the exit status says the layout is not as
asked."""

import time

import yaml
from confluent_kafka.admin import AdminClient, NewTopic

from stage.cli import main
from tests.integration.harness import unique_topics

ONE_BROKER = ["--replication", "1", "--min-insync-replicas", "1"]


def _create(admin, topic: NewTopic) -> None:
    """Create it and wait until the metadata shows it (creation returns before)."""
    admin.create_topics([topic])[topic.topic].result(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        shown = admin.list_topics(timeout=10).topics.get(topic.topic)
        if shown is not None and shown.error is None:
            return
        time.sleep(0.1)
    raise AssertionError(f"{topic.topic} not visible after 30 s")


def _config(tmp_path, kafka, topics):
    path = tmp_path / "stage.yaml"
    path.write_text(yaml.safe_dump({"topics": topics.all(), "bootstrap_servers": kafka.bootstrap}))
    return str(path)


def test_missing_topics_are_created_when_an_existing_one_differs_in_its_configs(kafka, tmp_path, capsys):
    """Issue 27 item 9: a dead-letter topic created by hand with 1 MiB records made `topics
    create` refuse to create the six missing topics."""
    topics = unique_topics()
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    _create(admin, NewTopic(topics.dead_letter, 2, 1, config={"max.message.bytes": "1048576"}))
    config = _config(tmp_path, kafka, topics)
    assert main(["run", "--config", config, "--log-level", "ERROR"]) == 5          # run: missing topics
    assert "create them with `rollout-reassembler topics create`" in capsys.readouterr().err

    assert main(["topics", "create", "--config", config, "--partitions", "2", *ONE_BROKER]) == 1
    captured = capsys.readouterr()
    assert f"{topics.dead_letter} has max.message.bytes=1048576, asked 67108864" in captured.err
    created = captured.out.splitlines()[0]
    assert created.startswith("created: ") and set(created[len("created: "):].split(", ")) == \
        set(topics.all().values()) - {topics.dead_letter}
    assert "ok: 2 partitions per topic" in captured.out
    # run starts past the topology check now (it would next need a consumer group: not run here)
    assert main(["topics", "check", "--config", config]) == 0


def test_another_partition_count_creates_nothing_and_says_which_to_ask(kafka, tmp_path, capsys):
    topics = unique_topics()
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    _create(admin, NewTopic(topics.receipts, 3, 1))
    config = _config(tmp_path, kafka, topics)
    assert main(["topics", "create", "--config", config, "--partitions", "2", *ONE_BROKER]) == 1
    captured = capsys.readouterr()
    assert f"{topics.receipts} has 3 partitions, asked 2" in captured.err
    assert "nothing was created" in captured.err and "created: nothing\n" in captured.out
    assert topics.staged_calls not in admin.list_topics(timeout=10).topics
    assert main(["topics", "create", "--config", config, "--partitions", "3", *ONE_BROKER]) == 0
