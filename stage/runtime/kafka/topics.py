"""Topic layout checks and creation. Every topic is keyed by group_id and co-partitioned: a
group's receipts, staged calls, outputs and ledger entry share one partition number."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from stage.wire.codec import MANAGED_MAX_MESSAGE_BYTES, RECORD_HEADROOM_BYTES

if TYPE_CHECKING:   # the CLI reads this module's defaults while building its parser: keep it light
    from stage.config.model import StageConfig

# Topics whose partition counts must all be equal (the dead-letter topic is exempt).
COPARTITIONED = ("receipts", "staged_calls", "staged_routes", "canonical_rows", "route_plans", "finalized_groups",
                 "stage_ledger")


class TopologyError(RuntimeError):
    pass


def partition_counts(admin: AdminClient, names: list[str], timeout: float = 10.0) -> dict[str, int | None]:
    metadata = admin.list_topics(timeout=timeout)
    out = {}
    for name in names:
        topic = metadata.topics.get(name)
        out[name] = None if topic is None or topic.error is not None else len(topic.partitions)
    return out


def check_copartitioning(admin: AdminClient, cfg: StageConfig) -> int:
    """Refuse to start unless every co-partitioned topic exists with the same partition count."""
    names = {role: getattr(cfg.topics, role) for role in COPARTITIONED}
    counts = partition_counts(admin, list(names.values()) + [cfg.topics.dead_letter])
    missing = [f"{role} ({name})" for role, name in names.items() if counts[name] is None]
    if counts[cfg.topics.dead_letter] is None:
        missing.append(f"dead_letter ({cfg.topics.dead_letter})")
    if missing:
        raise TopologyError("missing topics: " + ", ".join(missing)
                            + "; create them with `rollout-reassembler topics create`")
    distinct = {counts[name] for name in names.values()}
    if len(distinct) != 1:
        layout = ", ".join(f"{name}={counts[name]}" for name in names.values())
        raise TopologyError(
            "input, output and ledger topics must have the same number of partitions "
            f"(co-partitioned by group_id), got {layout}")
    return distinct.pop()


# Exactly-once needs every committed write on more than one broker: acks=all waits for
# min.insync.replicas copies, and a topic with replication 3 keeps accepting writes with one
# broker down. A single development broker needs --replication 1 --min-insync-replicas 1.
DEFAULT_REPLICATION = 3
DEFAULT_MIN_INSYNC_REPLICAS = 2
# Every topic's max.message.bytes (a record batch at most): 8 MiB, the most managed Kafka allows
# (Confluent Cloud Basic/Standard/Enterprise), holding a record of the default max_record_bytes
# with RECORD_HEADROOM_BYTES to spare; a larger max_record_bytes raises it (max_message_bytes_for).
DEFAULT_MAX_MESSAGE_BYTES = MANAGED_MAX_MESSAGE_BYTES
# The route topic (RouteChunk records) deletes by time: its chunks must outlive the policy's
# consumption of every plan naming them (deferred: the trainer fetches them when it trains on
# the group; direct: the stage reads them before the group is published), with room for a
# trainer restarting from an older checkpoint. 7 days, Kafka's default retention, set
# explicitly so that a cluster default cannot shorten it (docs/operations.md, Route topic).
DEFAULT_ROUTE_RETENTION_MS = 7 * 24 * 3600 * 1000
ONE_BROKER_FLAGS = "--replication 1 --min-insync-replicas 1"


def _too_few_brokers(replication: int, brokers: int) -> TopologyError:
    return TopologyError(
        f"replication factor {replication} needs {replication} brokers, but only {brokers} "
        f"broker(s) are registered. On a single development broker create the topics with "
        f"`{ONE_BROKER_FLAGS}` (`rollout-reassembler broker --create-topics` does); in "
        f"production keep the defaults (3 replicas, min ISR 2: exactly-once needs every commit on "
        f"more than one broker)")


def max_message_bytes_for(max_record_bytes: int) -> int:
    """The topics' max.message.bytes for records up to ``max_record_bytes``: 8 MiB (managed
    Kafka's limit) unless the records need more (a self-run broker with a raised cap)."""
    return max(DEFAULT_MAX_MESSAGE_BYTES, max_record_bytes + RECORD_HEADROOM_BYTES)


def check_max_message_bytes(max_message_bytes: int, max_record_bytes: int) -> None:
    """ValueError unless topics of ``max_message_bytes`` take every record up to the stage's
    ``max_record_bytes`` with its key, headers and batch framing."""
    if max_message_bytes < max_record_bytes + RECORD_HEADROOM_BYTES:
        raise ValueError(
            f"max.message.bytes {max_message_bytes} is below max_record_bytes {max_record_bytes} + "
            f"{RECORD_HEADROOM_BYTES} (key, headers and batch framing): the topics would refuse the "
            f"largest records the stage and its producers write; lower max_record_bytes to "
            f"{max_message_bytes - RECORD_HEADROOM_BYTES} or less, or ask for larger topics")


def topic_specs(cfg: StageConfig, partitions: int, replication: int, max_message_bytes: int,
                min_insync_replicas: int,
                route_retention_ms: int = DEFAULT_ROUTE_RETENTION_MS) -> list[NewTopic]:
    common = {"min.insync.replicas": str(min_insync_replicas)}
    big = {**common, "max.message.bytes": str(max_message_bytes)}
    configs = {"stage_ledger": {**common, "cleanup.policy": "compact"},
               # keyed by group id like every topic: compaction would keep one chunk a group
               "staged_routes": {**big, "cleanup.policy": "delete", "retention.ms": str(route_retention_ms)}}
    specs = [NewTopic(getattr(cfg.topics, role), partitions, replication, config=dict(configs.get(role, big)))
             for role in COPARTITIONED]
    specs.append(NewTopic(cfg.topics.dead_letter, partitions, replication, config=dict(big)))
    return specs


def create_topics(admin: AdminClient, cfg: StageConfig, *, partitions: int,
                  replication: int = DEFAULT_REPLICATION,
                  min_insync_replicas: int = DEFAULT_MIN_INSYNC_REPLICAS,
                  max_message_bytes: int | None = None,
                  route_retention_ms: int = DEFAULT_ROUTE_RETENTION_MS, timeout: float = 30.0) -> list[str]:
    """Create whatever is missing; returns the names created. Topics that exist already must be
    what would be created (partitions, replication factor, the configs set here; a larger
    max.message.bytes than asked is fine): otherwise
    TopicsDiffer names every difference, after creating the missing ones, unless an existing
    topic has another partition count (new ones would not be co-partitioned with it).
    ``max_message_bytes``: every topic's but the ledger's (default: ``max_message_bytes_for``
    the config's max_record_bytes; ValueError below what that cap needs). ``route_retention_ms``:
    the route topic's retention.ms (-1: keep for ever); it deletes, never compacts."""
    if partitions < 1 or not 1 <= min_insync_replicas <= replication:
        raise ValueError(f"need partitions >= 1 and 1 <= min_insync_replicas <= replication, got "
                         f"{partitions}, {min_insync_replicas}, {replication}")
    if route_retention_ms < 1 and route_retention_ms != -1:
        raise ValueError(f"route_retention_ms must be >= 1 (or -1: for ever), got {route_retention_ms}")
    if max_message_bytes is None:
        max_message_bytes = max_message_bytes_for(cfg.max_record_bytes)
    check_max_message_bytes(max_message_bytes, cfg.max_record_bytes)
    specs = topic_specs(cfg, partitions, replication, max_message_bytes, min_insync_replicas,
                        route_retention_ms)
    metadata = admin.list_topics(timeout=timeout)
    existing = metadata.topics
    differences = _differences(admin, [s for s in specs if s.topic in existing], existing, timeout)
    if any(len(existing[s.topic].partitions) != partitions for s in specs
           if s.topic in existing and s.topic != cfg.topics.dead_letter):
        raise TopicsDiffer([], differences)
    specs = [s for s in specs if s.topic not in existing]
    if specs:
        raced = _create(admin, specs, partitions, replication, len(metadata.brokers), timeout)
        if raced:   # created meanwhile by someone else (or not yet in the metadata): compared too
            _wait_visible(admin, [s.topic for s in raced], None, timeout)
            shown = admin.list_topics(timeout=timeout).topics
            differences += _differences(admin, raced, shown, timeout)
            specs = [s for s in specs if s not in raced]
    if differences:
        raise TopicsDiffer([s.topic for s in specs], differences)
    return [s.topic for s in specs]


def _create(admin: AdminClient, specs: list[NewTopic], partitions: int, replication: int,
            brokers: int, timeout: float) -> list[NewTopic]:
    """Create ``specs``; returns those that existed already (TOPIC_ALREADY_EXISTS: created since
    the metadata was read, e.g. by a concurrent `topics create`, or not in it yet)."""
    if replication > brokers:    # Kafka would refuse each topic: say what to ask for
        raise _too_few_brokers(replication, brokers)
    raced = []
    futures = admin.create_topics(specs, operation_timeout=timeout)
    for spec in specs:
        future = futures[spec.topic]
        try:
            future.result()
        except KafkaException as error:   # a broker left since the metadata above
            if error.args[0].code() == KafkaError.INVALID_REPLICATION_FACTOR:
                raise _too_few_brokers(replication, len(admin.list_topics(timeout=timeout).brokers)) from error
            if error.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                raced.append(spec)
                continue
            raise
    _wait_visible(admin, [s.topic for s in specs if s not in raced], partitions, timeout)
    return raced


class TopicsDiffer(TopologyError):
    """Existing topics differ from what ``create_topics`` was asked; ``created``: the missing
    ones, created all the same (the stage's start-up check sends users here to create them)."""

    def __init__(self, created: list[str], differences: list[str]) -> None:
        super().__init__("existing topics differ from what was asked: " + "; ".join(differences)
                         + ". Ask for what they have, or alter them (adding partitions remaps "
                           "group_id keys: drain the topics first)"
                         + ("" if created else "; nothing was created"))
        self.created, self.differences = created, differences


def _differences(admin: AdminClient, specs: list[NewTopic], metadata: dict, timeout: float) -> list[str]:
    out = []
    for spec in specs:
        topic = metadata[spec.topic]
        replicas = {len(p.replicas) for p in topic.partitions.values()}
        if len(topic.partitions) != spec.num_partitions:
            out.append(f"{spec.topic} has {len(topic.partitions)} partitions, asked {spec.num_partitions}")
        if replicas != {spec.replication_factor}:
            out.append(f"{spec.topic} has replication factor {'/'.join(map(str, sorted(replicas)))}, "
                       f"asked {spec.replication_factor}")
    configs = _topic_configs(admin, [s.topic for s in specs], timeout)
    for spec in specs:
        have = configs[spec.topic]
        for key, want in sorted(spec.config.items()):
            value = have[key].value if key in have else None
            if key == "max.message.bytes" and value is not None and value.isdigit() \
                    and int(value) >= int(want):
                continue    # larger batches than asked hold every record asked for
            if value != want:
                out.append(f"{spec.topic} has {key}={value}, asked {want}")
    return out


def _topic_configs(admin: AdminClient, names: list[str], timeout: float) -> dict[str, dict]:
    """Each topic's configs (name -> ConfigEntry), asked in one request. Right after a topic is
    created, the broker answering may not know it yet (UNKNOWN_TOPIC_OR_PART while the metadata
    propagates on a multi-broker cluster): asked again until ``timeout``."""
    if not names:
        return {}
    resources = {name: ConfigResource(ConfigResource.Type.TOPIC, name) for name in names}
    deadline = time.monotonic() + timeout
    while True:
        futures = admin.describe_configs(list(resources.values()), request_timeout=timeout)
        try:
            return {name: futures[resource].result(timeout=timeout) for name, resource in resources.items()}
        except KafkaException as error:
            if error.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def durability_warnings(admin: AdminClient, cfg: StageConfig, timeout: float = 10.0) -> list[str]:
    """What makes the stage's exactly-once weaker than production needs, one line per topic:
    fewer than DEFAULT_REPLICATION replicas or min.insync.replicas below
    DEFAULT_MIN_INSYNC_REPLICAS (a committed transaction can be lost with one broker), a
    ledger that is not compacted (its entries expire with retention), a route topic that is
    (compaction keeps one chunk of each group id), and a topic whose max.message.bytes cannot
    hold a record of the stage's max_record_bytes. Right for a single
    development broker; a warning, not a refusal."""
    roles = {role: getattr(cfg.topics, role) for role in (*COPARTITIONED, "dead_letter")}
    metadata = admin.list_topics(timeout=timeout).topics
    present = {role: name for role, name in roles.items() if name in metadata}
    described = _topic_configs(admin, list(present.values()), timeout)
    out = []
    for role, name in present.items():
        replicas = min((len(p.replicas) for p in metadata[name].partitions.values()), default=0)
        configs = described[name]
        min_isr = int(configs["min.insync.replicas"].value) if "min.insync.replicas" in configs else 1
        weak = []
        if replicas < DEFAULT_REPLICATION:
            weak.append(f"replication factor {replicas} (< {DEFAULT_REPLICATION})")
        if min_isr < DEFAULT_MIN_INSYNC_REPLICAS:
            weak.append(f"min.insync.replicas {min_isr} (< {DEFAULT_MIN_INSYNC_REPLICAS})")
        if role == "stage_ledger" and "cleanup.policy" in configs \
                and "compact" not in configs["cleanup.policy"].value:
            weak.append(f"cleanup.policy {configs['cleanup.policy'].value} (ledger entries expire "
                        "with retention; want compact)")
        least = cfg.max_record_bytes + RECORD_HEADROOM_BYTES
        if role != "stage_ledger" and "max.message.bytes" in configs \
                and configs["max.message.bytes"].value.isdigit() and int(configs["max.message.bytes"].value) < least:
            weak.append(f"max.message.bytes {configs['max.message.bytes'].value} (< max_record_bytes "
                        f"{cfg.max_record_bytes} + {RECORD_HEADROOM_BYTES}: records at the cap would be "
                        "refused; lower max_record_bytes or raise the topic's)")
        if role == "staged_routes" and "cleanup.policy" in configs \
                and "compact" in configs["cleanup.policy"].value:
            weak.append(f"cleanup.policy {configs['cleanup.policy'].value} (chunks are keyed by group "
                        "id: compaction keeps one chunk a group; want delete)")
        if weak:
            out.append(f"{role} ({name}): " + ", ".join(weak))
    return out


def _wait_visible(admin: AdminClient, names: list[str], partitions: int | None, timeout: float) -> None:
    """Creation returns before every broker's metadata has the topics; a consumer assigned a
    partition it cannot see yet does not fetch it for a while, so wait until all have leaders."""
    deadline = time.monotonic() + timeout
    while True:
        topics = admin.list_topics(timeout=timeout).topics
        if all(n in topics and topics[n].error is None
               and (partitions is None or len(topics[n].partitions) == partitions)
               and all(p.leader >= 0 for p in topics[n].partitions.values()) for n in names):
            return
        if time.monotonic() > deadline:
            raise TopologyError(f"created topics not visible with leaders after {timeout}s: {names}")
        time.sleep(0.1)


class PartitionWatch:
    """Notices partitions added to an input topic while the stage runs (asked off the loop
    thread, stage.runtime.kafka.probes). ``poll()`` -> (topic, new count) or None."""

    def __init__(self, queries, topics, expected: int, interval_s: float) -> None:
        self.queries, self.topics, self.expected, self.interval_s = queries, tuple(topics), expected, interval_s
        self._next = time.monotonic() + interval_s
        self._futures: dict = {}

    def poll(self) -> tuple[str, int] | None:
        if self._futures:
            if not all(f.done() for f in self._futures.values()):
                return None
            futures, self._futures = self._futures, {}
            for topic, future in futures.items():
                try:
                    count = future.result()
                except Exception:  # noqa: BLE001 - a failed lookup says nothing about the layout
                    continue
                if count != self.expected:
                    return topic, count
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + self.interval_s
            self._futures = {topic: self.queries.partition_count(topic) for topic in self.topics}
        return None
