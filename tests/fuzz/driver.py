"""The stage's own intake and finalize code, driven without a broker.

``Driver`` holds a ``StageRuntime`` that is never started (no Kafka client exists): each input
record becomes a message the runtime's intake step (``stage.runtime.steps.intake.Intake.record``:
decode, routing check, buffer, dead letter) consumes as the loop would; ready groups go
through ``stage.runtime.task.finalize_task.finalize_and_encode`` exactly as the loop submits them, and a
group that comes back with an error halts its partition, as the loop's publication step does.
What happened to every record, by its offset, and what every group published is recorded for
the invariants (tests/fuzz/invariants.py).
"""

from __future__ import annotations

import tracemalloc
from collections import Counter
from dataclasses import dataclass, field

from stage.buffer import PartitionBuffer
from stage.config.model import StageConfig
from stage.finalize import ReassemblyConfig
from stage.routes import RouteDimsCache
from stage.runtime.loop import StageRuntime
from stage.runtime.task.finalize_task import Outputs, finalize_and_encode
from stage.wire.partitioner import partition_for
from tests.fuzz.traffic import PARTITIONS, RECEIPTS, Wire

START_MS = 1_700_000_000_000
GROUP_TIMEOUT_MS = 60_000


class Message:
    """The part of confluent_kafka.Message the intake step reads."""

    def __init__(self, topic: str, partition: int, offset: int, key, value, timestamp_ms: int) -> None:
        self._topic, self._partition, self._offset = topic, partition, offset
        self._key, self._value, self._ts = key, value, timestamp_ms

    def error(self):
        return None

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def timestamp(self):
        return (1, self._ts)   # TIMESTAMP_CREATE_TIME

    def key(self):
        return self._key

    def value(self):
        return self._value

    def headers(self):
        return None


@dataclass
class Fate:
    """What the stage did with one input record."""

    wire: Wire
    topic: str
    partition: int
    offset: int
    outcome: str = ""              # added | skipped | dead_letter | raised
    reason: str = ""               # skip reason, error class, or the exception
    text: str = ""                 # the dead letter's error text
    peak_bytes: int = 0            # tracemalloc peak of its intake


@dataclass
class Published:
    partition: int
    group_id: str
    why: str
    outputs: Outputs


@dataclass
class CaseResult:
    fates: list[Fate] = field(default_factory=list)
    published: list[Published] = field(default_factory=list)
    halted: dict[int, str] = field(default_factory=dict)        # partition -> error
    orphaned: set = field(default_factory=set)                  # (topic, partition, offset)
    unfinished: list[str] = field(default_factory=list)         # groups never finalized
    raised: list[str] = field(default_factory=list)             # exceptions past the handlers


class Driver:
    def __init__(self, finalize: ReassemblyConfig | None = None, **settings) -> None:
        self.cfg = StageConfig(bootstrap_servers="fuzz.invalid:9092", group_timeout_ms=GROUP_TIMEOUT_MS,
                               finalize=finalize or ReassemblyConfig(), **settings)
        self.runtime = StageRuntime(self.cfg)   # never started: no Kafka client is created
        self.runtime.partition_count = PARTITIONS

    def topic_of(self, role: str) -> str:
        topics = self.cfg.topics
        return topics.receipts if role == RECEIPTS else topics.staged_calls

    def _reset(self) -> None:
        """Every partition assigned afresh, its ledger loaded empty (as the loop's loads step
        leaves it)."""
        rt = self.runtime
        parts = rt.partitions
        parts.drop(parts.numbers())
        for p in range(PARTITIONS):
            parts.add(p).buffer = PartitionBuffer(p, receipts_topic=self.cfg.topics.receipts,
                                                  staged_topic=self.cfg.topics.staged_calls,
                                                  group_timeout_ms=self.cfg.group_timeout_ms,
                                                  late_retention_ms=self.cfg.late_retention_ms)
        rt.intake.blocked.clear()
        rt.dims_cache = RouteDimsCache()   # what a fresh stage knows: nothing learned yet

    def run(self, wires: list[Wire], *, measure_memory: bool = True) -> CaseResult:
        self._reset()
        result = CaseResult()
        offsets: Counter = Counter()
        now = START_MS
        for phase in (0, 1):
            for wire in (w for w in wires if w.phase == phase):
                now += 1
                result.fates.append(self._intake(wire, offsets, now, measure_memory))
            now = self._finalize_ready(result, now)
            # every deadline passes: deadline groups and orphans are finalized / expired
            now = self._finalize_ready(result, now + GROUP_TIMEOUT_MS + 1)
        for partition, buffer in self.runtime.buffers.items():
            if partition not in result.halted:
                result.unfinished += [g for g in buffer.groups]
        return result

    # -- intake ----------------------------------------------------------------------------
    def _intake(self, wire: Wire, offsets: Counter, now: int, measure_memory: bool) -> Fate:
        rt = self.runtime
        topic = self.topic_of(wire.role)
        partition = wire.partition
        if partition is None:
            partition = partition_for(wire.key, PARTITIONS) if wire.key else 0
        offset = offsets[(topic, partition)]
        offsets[(topic, partition)] += 1
        fate = Fate(wire, topic, partition, offset)
        buffer = rt.buffers[partition]
        before = Counter(buffer.counts)
        message = Message(topic, partition, offset, wire.key, wire.value, now)
        if measure_memory:
            tracemalloc.start()
        try:
            letter = rt.intake.record(message, now)
        except BaseException as error:   # noqa: BLE001 - an invariant violation, reported
            fate.outcome, fate.reason = "raised", f"{type(error).__name__}: {error}"
            return fate
        finally:
            if measure_memory:
                fate.peak_bytes = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
        if letter is not None:
            fate.outcome, fate.reason, fate.text = "dead_letter", letter.error_class, letter.error
            return fate
        diff = Counter(buffer.counts)
        diff.subtract(before)
        changed = [k for k, v in diff.items() if v > 0 and k.startswith(("receipt_", "staged_"))]
        if changed == [f"{'receipt' if wire.role == RECEIPTS else 'staged'}_added"]:
            fate.outcome = "added"
        elif len(changed) == 1:
            fate.outcome, fate.reason = "skipped", changed[0].split("_", 1)[1]
        else:
            fate.outcome, fate.reason = "unaccounted", f"buffer counts changed by {dict(diff)}"
        return fate

    # -- finalization, as the loop's publication step handles its outcome --------------------
    def _finalize_ready(self, result: CaseResult, now: int) -> int:
        rt = self.runtime
        for partition, buffer in rt.buffers.items():
            if partition in result.halted:
                continue
            ready, orphans = buffer.take_ready(now, None)
            for group in orphans:
                result.orphaned.update((item.position.topic, item.position.partition, item.position.offset)
                                       for item in group.staged.values())
            for group, why in ready:
                if partition in result.halted:
                    break   # the loop drops what waits behind a halt
                try:
                    out = finalize_and_encode(
                        group, why, 0, config=self.cfg.finalize, dims_cache=rt.dims_cache,
                        codecs=rt.codecs, topics=self.cfg.topics, limits=rt.limits,
                        now_ms=lambda: now)
                except BaseException as error:   # noqa: BLE001 - it must never raise
                    result.raised.append(f"finalize_and_encode raised {type(error).__name__}: {error}")
                    result.halted[partition] = "raised"
                    break
                if out.error is not None:
                    result.halted[partition] = f"group {group.group_id}: {out.error}"
                    break
                buffer.mark_published(group.group_id, now)
                result.published.append(Published(partition, group.group_id, why, out))
        return now
