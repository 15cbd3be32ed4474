"""Workloads, topic setup and output readers for the broker-backed tests."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from stage.client import receipt_event, staged_call_from_record
from stage.contract import encode_routed_experts
from stage.contract.producer import RolloutBuilder
from stage.finalize import GroupFinalizer, InMemoryTokenSource, ReassemblyConfig
from stage.publish.records import row_record
from stage.config.model import StageConfig
from stage.runtime.loop import StageRuntime
from stage.runtime.kafka.topics import create_topics
from stage.wire import AvroCodec, TopicNames
from stage.wire.partitioner import LIBRDKAFKA_PARTITIONER

_ids = itertools.count()


def unique_topics() -> TopicNames:
    tag = f"t{next(_ids)}-{uuid.uuid4().hex[:6]}"
    return TopicNames(**{name: f"{tag}.{value}" for name, value in TopicNames().all().items()})


def stage_config(bootstrap: str, topics: TopicNames, **overrides) -> StageConfig:
    base = dict(bootstrap_servers=bootstrap, topics=topics, group_id=f"stage-{topics.receipts}",
                transactional_id=f"tx-{topics.receipts}", group_timeout_ms=5_000,
                publish_linger_ms=10, poll_timeout_ms=20, metrics_port=0,   # many stages per host
                consumer={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
    base.update(overrides)
    return StageConfig(**base)


# The test brokers are single nodes: the production defaults (3 replicas, min ISR 2) cannot be met.
ONE_BROKER = {"replication": 1, "min_insync_replicas": 1}


def setup_topics(cfg: StageConfig, partitions: int = 2) -> None:
    """Create the stage's topics (create_topics returns once every partition has a leader)."""
    create_topics(AdminClient({"bootstrap.servers": cfg.bootstrap_servers}), cfg, partitions=partitions,
                  **ONE_BROKER)


@dataclass
class GroupSpec:
    group_id: str
    receipts: list          # ReceiptEvent values (index order)
    staged: list            # StagedCall values
    records: dict = field(default_factory=dict)   # staging_key -> StagedCallRecord (for expectations)
    receipt_json: list = field(default_factory=list)


def make_group(group_id: str, n: int, *, calls: int = 3, seed: int = 0, routes: tuple | None = (2, 2),
               prompt_idx: int = 0, prompt: tuple[int, int] = (6, 3), generated: int = 4) -> GroupSpec:
    """``prompt``: prompt tokens of the root call and of each later call; ``generated``: tokens
    each call generates."""
    rng = np.random.default_rng(seed)
    spec = GroupSpec(group_id, [], [])
    for i in range(n):
        builder = RolloutBuilder(f"{group_id}-r{i}")
        parent = None
        for c in range(calls):
            carry, gen = (prompt[0] if parent is None else prompt[1]), generated
            extras = None
            if routes:
                layers, topk = routes
                extras = {"routed_experts": encode_routed_experts(
                    rng.integers(0, 60, (carry + gen, layers, topk)), "int8")}
            staged = builder.stage(f"c{c}", parent_call_id=parent,
                                   prompt_delta=rng.integers(0, 50_000, carry),
                                   generated=rng.integers(0, 50_000, gen),
                                   generated_logprobs=-rng.random(gen), weight_version=3 + c,
                                   extras=extras)
            spec.staged.append(staged_call_from_record(group_id, staged.record))
            spec.records[staged.record.staging_key] = staged.record
            parent = f"c{c}"
        receipt = builder.receipt(parent)
        spec.receipt_json.append(receipt.to_json())
        spec.receipts.append(receipt_event(group_id=group_id, rollout_id=builder.rollout_id,
                                           rollout_index=i, group_size=n, prompt_idx=prompt_idx,
                                           reward=float(i % 2), receipt=receipt))
    return spec


class Feeder:
    """Produces input records keyed by group id (so they co-partition)."""

    def __init__(self, bootstrap: str, topics: TopicNames) -> None:
        self.topics = topics
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2,
                                  "message.max.bytes": 64 << 20,
                                  "partitioner": LIBRDKAFKA_PARTITIONER})
        self.receipt_codec = AvroCodec("ReceiptEvent")
        self.staged_codec = AvroCodec("StagedCall")

    def staged(self, spec: GroupSpec, values=None) -> None:
        for value in (spec.staged if values is None else values):
            self.producer.produce(self.topics.staged_calls, key=spec.group_id.encode(),
                                  value=self.staged_codec.encode(value))

    def receipts(self, spec: GroupSpec, values=None) -> None:
        for value in (spec.receipts if values is None else values):
            self.producer.produce(self.topics.receipts, key=spec.group_id.encode(),
                                  value=self.receipt_codec.encode(value))

    def raw(self, topic: str, key: bytes, value: bytes, headers=None) -> None:
        self.producer.produce(topic, key=key, value=value, headers=headers)

    def flush(self) -> None:
        assert self.producer.flush(30) == 0


def send_group(producer, spec: GroupSpec) -> None:
    """A group's staged calls, then its receipts, through the SDK's StagingProducer."""
    for value in spec.staged:
        producer.send_staged(spec.group_id, value)
    for value in spec.receipts:
        producer.send_receipt(spec.group_id, value)
    producer.flush()


def rows_by_group(rows: list[dict]) -> dict[str, list[dict]]:
    """Decoded CanonicalRow records by group id, each group's in row order."""
    by_group: dict[str, list[dict]] = {}
    for row in rows:
        by_group.setdefault(row["group_id"], []).append(row)
    return {gid: sorted(group, key=lambda r: r["row_index"]) for gid, group in by_group.items()}


def expected_rows(spec: GroupSpec, config: ReassemblyConfig) -> list[dict]:
    """The rows the library computes for this group (an independent path: in-memory source)."""
    source = InMemoryTokenSource(partition="staging")
    for record in spec.records.values():
        source.stage(record)
    n = len(spec.receipts)
    group = GroupFinalizer(source, config).finalize_group(
        spec.group_id, [r["rollout_id"] for r in spec.receipts],
        [r["receipt"] for r in spec.receipts], [r["reward"] for r in spec.receipts],
        mask_sample=[False] * n, fallback_weight_version=0, prompt_idx=spec.receipts[0]["prompt_idx"])
    return [row_record(row) for row in group.rows]


def read_all(bootstrap: str, topic: str, *, timeout: float = 20.0, expect: int | None = None,
             isolation: str = "read_committed") -> list:
    """Every record of ``topic`` (until ``expect`` records or the end is reached)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "isolation.level": isolation, "enable.partition.eof": True})
    metadata = consumer.list_topics(topic, timeout=10)
    partitions = list(metadata.topics[topic].partitions)
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    out, eof = [], set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = consumer.poll(0.2)
        if msg is None:
            if expect is None and len(eof) == len(partitions):
                break
            continue
        if msg.error():
            eof.add(msg.partition())
            if expect is None and len(eof) == len(partitions):
                break
            continue
        eof.discard(msg.partition())
        out.append(msg)
        if expect is not None and len(out) >= expect:
            break
    consumer.close()
    return out


class RunningStage:
    """A StageRuntime in a background thread (stopped and joined on exit)."""

    def __init__(self, cfg: StageConfig, **kwargs) -> None:
        self.runtime = StageRuntime(cfg, **kwargs)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.runtime.run()
        except BaseException as error:  # noqa: BLE001 - surfaced to the test
            self.error = error

    def __enter__(self) -> "RunningStage":
        self.runtime.start()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.runtime.stop()
        self.thread.join(60)
        if self.error is not None and exc[0] is None:
            raise self.error

    def wait(self, predicate, timeout: float = 60.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.error is not None:
                raise self.error
            if predicate():
                return
            time.sleep(0.05)
        raise TimeoutError(f"timed out waiting for {what}")


def replace(cfg: StageConfig, **changes) -> StageConfig:
    return cfg.replace(**changes)
