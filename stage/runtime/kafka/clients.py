"""confluent-kafka client configurations derived from the StageConfig, and ``Clients``: the
clients one stage process holds.

Sizing notes (why these values): a StagedCall with routes is delta_len x L x K values (an 8k
token call of a 48-layer top-8 model is ~6 MB as int16), so fetch and message limits follow
max_record_bytes; the transaction timeout must cover the worst finalize+publish, and
max.poll.interval.ms must exceed the revoke budget plus a publish.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stage.config.model import EXACTLY_ONCE, StageConfig
from stage.runtime.kafka.logs import kafka_logger


# librdkafka backs off reconnecting to a broker up to reconnect.backoff.max.ms (10 s by default)
# between attempts: after a broker restart each client would find it back up to 10 s late. One
# attempt a second per broker while it is away costs nothing.
RECONNECT_BACKOFF_MAX_MS = 1000


def common(cfg: StageConfig) -> dict:
    """Every client: the brokers, the reconnect back-off, the ``kafka:`` passthrough, and
    librdkafka's log lines through the stage's rate-limited logger (stage.runtime.kafka.logs)."""
    return {"bootstrap.servers": cfg.bootstrap_servers, "logger": kafka_logger(),
            "reconnect.backoff.max.ms": RECONNECT_BACKOFF_MAX_MS, **cfg.kafka}


def static_member_id(cfg: StageConfig) -> str | None:
    """The group.instance.id the stage gives its consumer (``static_membership``), None when it
    gives none: off, or set in ``consumer`` by the operator (then Kafka's static behaviour)."""
    if not cfg.static_membership or "group.instance.id" in cfg.consumer:
        return None
    if cfg.group_protocol == "consumer":
        # KIP-848 needs no static id for that: a member's id outlives a broker restart, and one
        # fenced after its session rejoins at once. A static member could not leave on shutdown
        # (librdkafka leaves it with epoch -2: its partitions wait out the session timeout).
        return None
    # Kafka takes [a-zA-Z0-9._-], at most 249 characters (as a topic name); a transactional id
    # takes anything
    return re.sub(r"[^A-Za-z0-9._-]", "_", cfg.effective_transactional_id)[:249]


def consumer_config(cfg: StageConfig) -> dict:
    fetch = max(cfg.max_record_bytes + (1 << 20), 52_428_800)
    return {
        **common(cfg),
        "group.id": cfg.group_id,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        # KIP-848 assigns on the brokers and refuses the classic assignor setting; both are
        # incremental, so the revoke and assign callbacks see the same partitions either way.
        **({"group.protocol": "consumer"} if cfg.group_protocol == "consumer"
           else {"partition.assignment.strategy": "cooperative-sticky"}),
        "max.poll.interval.ms": cfg.max_poll_interval_ms,
        "fetch.max.bytes": fetch,
        "max.partition.fetch.bytes": cfg.max_record_bytes + (1 << 20),
        "receive.message.max.bytes": fetch + 1_000_000,
        "enable.partition.eof": False,
        **({"group.instance.id": static} if (static := static_member_id(cfg)) else {}),
        **cfg.consumer,
    }


def producer_config(cfg: StageConfig) -> dict:
    conf = {
        **common(cfg),
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "message.max.bytes": max(cfg.max_record_bytes + (1 << 20), 1_000_000),
        "queue.buffering.max.kbytes": 2_097_151,
        **cfg.producer,
    }
    if cfg.processing == EXACTLY_ONCE:
        conf["transactional.id"] = cfg.effective_transactional_id
        conf["transaction.timeout.ms"] = cfg.transaction_timeout_ms
    return conf


def reader_config(cfg: StageConfig, group_suffix: str) -> dict:
    """A group-less reader (ledger reload): assign-only, read_committed, never commits."""
    return {
        **common(cfg),
        "group.id": f"{cfg.group_id}.{group_suffix}",
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        # never a group member: a static member id (the pod name) belongs to the stage's consumer
        **{k: v for k, v in cfg.consumer.items() if k != "group.instance.id"},
    }


def replay_producer_config(cfg: StageConfig, transactional_id: str) -> dict:
    """The dead-letter replay's transactional producer (``rollout-reassembler dead-letters
    replay``): the stage's client settings, never the stage's own transactional id."""
    return {
        **common(cfg),
        "enable.idempotence": True,
        "acks": "all",
        "message.max.bytes": max(cfg.max_record_bytes + (1 << 20), 1_000_000),
        **cfg.producer,
        "transactional.id": transactional_id,
        "transaction.timeout.ms": 60_000,
    }


@dataclass
class Clients:
    """The Kafka services of one stage process, made by ``StageRuntime.start`` (None before it)
    and written only there: a step given this reads the service it uses at call time. The
    publisher is not here: the publish step's flight owns it (stage.runtime.steps.flight)."""

    consumer: object = None        # confluent_kafka.Consumer
    admin: object = None           # AdminClient (start-up checks and topic layout)
    queries: object = None         # BrokerQueries: end/start offsets and partition counts
    probe: object = None           # EndOffsetProbe: is an input partition read to its end
    start_offsets: object = None   # StartOffsets: where a fetch began before its first record
