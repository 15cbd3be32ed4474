"""The stage refuses to start on a topic layout that breaks co-partitioning."""

import time

import pytest
import yaml
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

from stage.cli import main
from stage.runtime.exits import EXIT_TOPOLOGY, StageExit
from stage.runtime.loop import StageRuntime
from stage.runtime.kafka.topics import TopologyError, check_copartitioning, create_topics, durability_warnings
from tests.integration.harness import ONE_BROKER, stage_config, unique_topics


def test_missing_and_mismatched_topics_are_refused_with_a_clear_message(kafka):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    with pytest.raises(TopologyError, match="missing topics: receipts"):
        check_copartitioning(admin, cfg)
    for future in admin.create_topics([NewTopic(topics.receipts, 3, 1)]).values():
        future.result()
    deadline = time.monotonic() + 30   # creation returns before the metadata shows it
    while topics.receipts not in admin.list_topics(timeout=10).topics and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(TopologyError, match=rf"{topics.receipts} has 3 partitions, asked 2"):
        create_topics(admin, cfg, partitions=2, **ONE_BROKER)    # refused: nothing created
    assert topics.staged_calls not in admin.list_topics(timeout=10).topics
    others = [t for t in topics.all().values() if t != topics.receipts]
    for future in admin.create_topics([NewTopic(t, 2, 1) for t in others]).values():
        future.result()
    deadline = time.monotonic() + 30   # creation returns before the metadata shows them
    while time.monotonic() < deadline:
        shown = admin.list_topics(timeout=10).topics
        if all(t in shown and shown[t].error is None for t in others):
            break
        time.sleep(0.1)
    with pytest.raises(TopologyError, match=r"same number of partitions.*receipts=3.*staged-calls=2"):
        check_copartitioning(admin, cfg)
    with pytest.raises(StageExit, match=r"refusing to start: .*same number of partitions") as info:
        StageRuntime(cfg).start()
    assert info.value.code == EXIT_TOPOLOGY


def test_created_layout_passes_and_the_ledger_is_compacted(kafka):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    create_topics(admin, cfg, partitions=3, **ONE_BROKER)
    assert check_copartitioning(admin, cfg) == 3
    from confluent_kafka.admin import ConfigResource
    resources = {t: ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics.all().values()}
    configs = {t: f.result() for t, f in zip(resources, admin.describe_configs(list(resources.values())).values())}
    assert configs[topics.stage_ledger]["cleanup.policy"].value == "compact"
    assert {c["min.insync.replicas"].value for c in configs.values()} == {"1"}
    assert create_topics(admin, cfg, partitions=3, **ONE_BROKER) == []     # idempotent


def test_topics_create_refuses_existing_topics_that_differ(kafka, tmp_path, capsys):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    create_topics(admin, cfg, partitions=2, **ONE_BROKER)
    with pytest.raises(TopologyError, match=rf"{topics.receipts} has replication factor 1, asked 2.*"
                                            rf"{topics.receipts} has min.insync.replicas=1, asked 2"):
        create_topics(admin, cfg, partitions=2, replication=2, min_insync_replicas=2)
    config = tmp_path / "stage.yaml"
    config.write_text(yaml.safe_dump({"topics": topics.all(), "bootstrap_servers": kafka.bootstrap}))
    one_broker = ["--replication", "1", "--min-insync-replicas", "1"]
    assert main(["topics", "create", "--config", str(config), "--partitions", "4", *one_broker]) == 1
    err = capsys.readouterr().err
    assert f"{topics.receipts} has 2 partitions, asked 4" in err and "drain the topics first" in err
    assert main(["topics", "create", "--config", str(config), "--partitions", "2", *one_broker]) == 0
    assert "ok: 2 partitions per topic" in capsys.readouterr().out
    # the production defaults (3 replicas, min ISR 2) cannot be what a single broker's topics have
    assert main(["topics", "create", "--config", str(config), "--partitions", "2"]) == 1
    assert f"{topics.receipts} has replication factor 1, asked 3" in capsys.readouterr().err


def test_topics_check_warns_about_weak_durability_and_can_require_it(kafka, tmp_path, capsys):
    topics = unique_topics()
    cfg = stage_config(kafka.bootstrap, topics)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    create_topics(admin, cfg, partitions=2, **ONE_BROKER)
    ledger = ConfigResource(ConfigResource.Type.TOPIC, topics.stage_ledger, incremental_configs=[
        ConfigEntry("cleanup.policy", "delete", incremental_operation=AlterConfigOpType.SET)])
    for future in admin.incremental_alter_configs([ledger]).values():
        future.result()
    config = tmp_path / "stage.yaml"
    config.write_text(yaml.safe_dump({"topics": topics.all(), "bootstrap_servers": kafka.bootstrap}))
    deadline = time.monotonic() + 30     # an altered config reaches describe_configs shortly after
    while "delete" not in "".join(durability_warnings(admin, cfg)) and time.monotonic() < deadline:
        time.sleep(0.2)

    assert main(["topics", "check", "--config", str(config)]) == 0
    captured = capsys.readouterr()
    assert "ok: 2 partitions per topic" in captured.out
    assert f"warning: receipts ({topics.receipts}): replication factor 1 (< 3), " \
           "min.insync.replicas 1 (< 2)" in captured.err
    assert f"stage_ledger ({topics.stage_ledger}): replication factor 1 (< 3), min.insync.replicas 1 " \
           "(< 2), cleanup.policy delete" in captured.err
    assert captured.err.count("warning: ") == 9          # eight topics and the advice
    assert main(["topics", "check", "--config", str(config), "--require-durable"]) == 1


def test_topics_create_on_one_broker_names_the_flags_it_needs(kafka, tmp_path, capsys):
    """The production defaults (3 replicas) on a single broker: refused before anything is
    created, with the flags that work there."""
    topics = unique_topics()
    config = tmp_path / "stage.yaml"
    config.write_text(yaml.safe_dump({"topics": topics.all(), "bootstrap_servers": kafka.bootstrap}))
    assert main(["topics", "create", "--config", str(config), "--partitions", "2"]) == 1
    err = capsys.readouterr().err
    assert "replication factor 3 needs 3 brokers, but only 1 broker(s) are registered" in err
    assert "--replication 1 --min-insync-replicas 1" in err
    shown = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(timeout=10).topics
    assert not set(topics.all().values()) & set(shown)                 # nothing half-created
    assert main(["topics", "create", "--config", str(config), "--partitions", "2",
                 "--replication", "1", "--min-insync-replicas", "1"]) == 0
    assert "ok: 2 partitions per topic" in capsys.readouterr().out
