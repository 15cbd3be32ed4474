"""`topics create` on a real broker: topics sized for the record cap (managed Kafka's 8 MiB by
default) and a route topic that deletes by time; and when some topics exist already and differ
from what is asked, the missing ones are still created (the stage's start-up check sends the
user to this command to create them), the differing one is named, and the exit status says the
layout is not as asked."""

import time

import pytest
import yaml
from confluent_kafka import KafkaError, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from stage.cli import main
from stage.decode.limits import InputLimits
from stage.publish.deadletters import MAX_ERROR_BYTES
from stage.runtime.kafka.topics import DEFAULT_ROUTE_RETENTION_MS
from stage.wire import DEFAULT_MAX_RECORD_BYTES, MANAGED_MAX_MESSAGE_BYTES, RECORD_HEADROOM_BYTES
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


def _config(tmp_path, kafka, topics, **settings):
    path = tmp_path / "stage.yaml"
    path.write_text(yaml.safe_dump({"topics": topics.all(), "bootstrap_servers": kafka.bootstrap, **settings}))
    return str(path)


def _configs(admin, names) -> dict:
    resources = {name: ConfigResource(ConfigResource.Type.TOPIC, name) for name in names}
    futures = admin.describe_configs(list(resources.values()))
    return {name: {k: e.value for k, e in futures[r].result(30).items()} for name, r in resources.items()}


def _deliver(bootstrap, topic, key, value, headers=None) -> KafkaError | None:
    """Produce one record; the delivery error (None: the broker took it)."""
    errors = []
    producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 32 << 20,
                         "compression.type": "none", "linger.ms": 0})
    producer.produce(topic, key=key, value=value, headers=headers,
                     on_delivery=lambda error, _msg: errors.append(error))
    assert producer.flush(60) == 0
    return errors[0]


def test_topics_fit_managed_kafka_and_the_route_topic_deletes_by_time(kafka, tmp_path, capsys):
    """Issue 26 items 4-5: by default every data topic takes batches of 8 MiB (the most managed
    Kafka allows) and so every record of the default cap, with the largest key and a dead
    letter's headers; the route topic deletes (never compacts: chunks are keyed by group id)
    after 7 days unless asked otherwise, and an existing one that differs is named."""
    topics = unique_topics()
    config = _config(tmp_path, kafka, topics)
    assert main(["topics", "create", "--config", config, "--partitions", "1", *ONE_BROKER]) == 0
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    configs = _configs(admin, topics.all().values())
    for role, name in topics.all().items():
        if role != "stage_ledger":
            assert configs[name]["max.message.bytes"] == str(MANAGED_MAX_MESSAGE_BYTES) == "8388608", role
    assert configs[topics.stage_ledger]["cleanup.policy"] == "compact"
    routes = configs[topics.staged_routes]
    assert routes["cleanup.policy"] == "delete"
    assert routes["retention.ms"] == str(DEFAULT_ROUTE_RETENTION_MS) == "604800000"
    # a record of the cap with the longest key the stage accepts and a dead letter's headers
    key = "\U0001F600".encode() * InputLimits().max_id_chars                       # 16 KiB
    headers = [("error", b"e" * MAX_ERROR_BYTES), ("source-topic", topics.staged_calls.encode()),
               ("source-partition", b"0"), ("source-offset", b"123456789"), ("error-class", b"undecodable")]
    for topic in (topics.dead_letter, topics.canonical_rows, topics.staged_routes):
        assert _deliver(kafka.bootstrap, topic, key, bytes(DEFAULT_MAX_RECORD_BYTES), headers) is None, topic
    # and the limit is the topic's: a value of 8 MiB does not fit with its batch framing
    refused = _deliver(kafka.bootstrap, topics.canonical_rows, b"g", bytes(MANAGED_MAX_MESSAGE_BYTES))
    assert refused is not None and refused.code() == KafkaError.MSG_SIZE_TOO_LARGE
    capsys.readouterr()
    # asked for another retention, the existing route topic is named (exit 1)
    assert main(["topics", "create", "--config", config, "--partitions", "1", *ONE_BROKER,
                 "--route-retention-ms", "3600000"]) == 1
    err = capsys.readouterr().err
    assert f"{topics.staged_routes} has retention.ms=604800000, asked 3600000" in err
    assert err.count(" has ") == 1                      # nothing else differs


def test_the_topics_follow_a_raised_cap_and_refuse_one_below_it(kafka, tmp_path, capsys):
    topics = unique_topics()
    raised = 64 << 20                                    # a self-run broker's cap
    config = _config(tmp_path, kafka, topics, max_record_bytes=raised)
    assert main(["topics", "create", "--config", config, "--partitions", "1", *ONE_BROKER,
                 "--max-message-bytes", str(raised)]) == 3    # below the cap + headroom: refused
    assert "below max_record_bytes 67108864 + 65536" in capsys.readouterr().err
    assert topics.receipts not in AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=10).topics
    assert main(["topics", "create", "--config", config, "--partitions", "1", *ONE_BROKER]) == 0
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    assert _configs(admin, [topics.staged_calls])[topics.staged_calls]["max.message.bytes"] == \
        str(raised + RECORD_HEADROOM_BYTES)
    # the default-cap stage asks for 8 MiB: topics that take more already are not a difference
    assert main(["topics", "create", "--config", _config(tmp_path, kafka, topics), "--partitions", "1",
                 *ONE_BROKER]) == 0


def test_a_compacted_route_topic_is_a_durability_warning(kafka, tmp_path, capsys):
    topics = unique_topics()
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    _create(admin, NewTopic(topics.staged_routes, 1, 1, config={"cleanup.policy": "compact"}))
    config = _config(tmp_path, kafka, topics)
    assert main(["topics", "create", "--config", config, "--partitions", "1", *ONE_BROKER]) == 1
    assert f"{topics.staged_routes} has cleanup.policy=compact, asked delete" in capsys.readouterr().err
    assert main(["topics", "check", "--config", config, "--require-durable"]) == 1
    err = capsys.readouterr().err
    assert f"staged_routes ({topics.staged_routes}): " in err and "compaction keeps one chunk a group" in err


@pytest.mark.parametrize("value", ["0", "-2"])
def test_route_retention_must_be_positive_or_for_ever(value, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["topics", "create", "--partitions", "1", "--route-retention-ms", value])
    assert refused.value.code == 2 and "must be >= 1 ms, or -1" in capsys.readouterr().err


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
    assert f"{topics.dead_letter} has max.message.bytes=1048576, asked {MANAGED_MAX_MESSAGE_BYTES}" in captured.err
    created = captured.out.splitlines()[0]
    assert created.startswith("created: ") and set(created[len("created: "):].split(", ")) == \
        set(topics.all().values()) - {topics.dead_letter}
    assert "ok: 2 partitions per topic" in captured.out
    # run starts past the topology check now (it would next need a consumer group: not run here)
    assert main(["topics", "check", "--config", config]) == 0
    assert f"dead_letter ({topics.dead_letter}): " in (err := capsys.readouterr().err)
    assert "max.message.bytes 1048576 (< max_record_bytes 8000000 + 65536: records at the cap would be refused" in err
    assert main(["topics", "check", "--config", config, "--require-durable"]) == 1


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


def test_a_topic_created_meanwhile_is_compared_not_a_crash(kafka):
    """Two `topics create` at once (a chart's job and an operator): a topic missing from the
    metadata read first exists by the time it is created (TOPIC_ALREADY_EXISTS). It is compared
    like any existing topic instead of failing the command with a Kafka error."""
    from stage.runtime.kafka.topics import TopicsDiffer, create_topics
    from tests.integration.harness import stage_config
    topics = unique_topics()
    real = AdminClient({"bootstrap.servers": kafka.bootstrap})
    _create(real, NewTopic(topics.staged_routes, 1, 1, config={"retention.ms": "3600000"}))

    class Late:
        """The admin client, whose first metadata answer does not show the route topic yet."""
        first = True

        def __getattr__(self, name):
            return getattr(real, name)

        def list_topics(self, *args, **kwargs):
            metadata = real.list_topics(*args, **kwargs)
            if Late.first:
                Late.first = False
                metadata.topics.pop(topics.staged_routes)
            return metadata

    with pytest.raises(TopicsDiffer) as differ:
        create_topics(Late(), stage_config(kafka.bootstrap, topics), partitions=1, replication=1,
                      min_insync_replicas=1)
    assert differ.value.differences == [f"{topics.staged_routes} has retention.ms=3600000, asked 604800000"]
    assert set(differ.value.created) == set(topics.all().values()) - {topics.staged_routes}
