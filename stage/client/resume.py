"""Resume an unfinished rollout from what it already staged, instead of regenerating it.

Every model call a rollout made before its worker died is on ``topics.staged_calls``, digested
and chained. ``RolloutResumer.resume(group_id, rollout_id)`` reads the group's partition of that
topic from the stage's committed offset to its end, keeps the rollout's calls as the stage's
buffer holds them, verifies them with the stage's own checks (stage.client.resume_chain) and
returns the longest verified chain with a ``RolloutStager`` rehydrated on it::

    with RolloutResumer("broker:9092", stage_group_id="rollout-reassembler") as resumer:
        result = resumer.resume("g7", "g7-r0", producer=producer)
        if result.resumed:   # result.token_ids: prompt + generation so far; generate from there
            result.stager.stage("c9", parent_call_id=result.last_call_id, ...)
            emitter.emit(0, result.stager.receipt(), reward=r)   # names every call, old and new
        else:                # result.outcome: why not (a constant below), result.reason: details
            ...

``resume_all([(group, rollout), ...])`` does a worker's rollouts at once: each partition its
groups live in is read once (one consumer fetching them together), from the committed offset.

Refusals are results, not exceptions: the outcome names one of the constants below.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from stage.buffer import Position
from stage.client.connection import DEFAULT_CONNECT_TIMEOUT_S, kafka_logger, reach
from stage.client.consuming import codec_for, reader_defaults, retrying, take
from stage.client.producer import RolloutStager, StagingProducer
from stage.client.resume_chain import (
    StagedRecord, held_calls, longest_verified, rehydrate, route_chunk_offsets,
)
from stage.client.staleness import Staleness
from stage.decode.limits import InputLimits
from stage.wire import DEFAULT_MAX_RECORD_BYTES, TopicNames
from stage.wire.partitioner import partition_for

RESUMED = "resumed"
PUBLISHED = "published"              # the stage published the group (its ledger entry is live)
GROUP_COMPLETE = "group_complete"    # every rollout of the group has its receipt: it publishes now
RECEIPT_EMITTED = "receipt_emitted"  # this rollout already has a receipt (finished or missing)
DEADLINE_PASSED = "deadline_passed"  # the group's deadline passed: the stage publishes it without it
PAST_RETENTION = "past_retention"    # the committed offset is below the log start, or chunks are gone
NOTHING_STAGED = "nothing_staged"    # no staged call of the rollout at or after the committed offset
CHAIN_BROKEN = "chain_broken"        # staged calls, but none verifies (digest, chain, conflict)
STALE = "stale"                      # the chain's oldest weights are past the trainer's bound
REFUSALS = (PUBLISHED, GROUP_COMPLETE, RECEIPT_EMITTED, DEADLINE_PASSED, PAST_RETENTION,
            NOTHING_STAGED, CHAIN_BROKEN, STALE)


@dataclass(frozen=True)
class ResumeResult:
    """One rollout's resume: ``outcome`` RESUMED with the chain, or a refusal and its ``reason``.

    ``token_ids``: the chain's tokens, prompt and generation so far (uint64), what the engine
    continues from; ``call_ids``/``weight_versions``: the chain's calls, root first;
    ``tokens_reused``: len(token_ids); ``stager``: rehydrated on every verified call (the next
    staged call chains onto ``last_call_id``; ``stager.receipt()`` names the old calls and the
    new); ``dropped``: staging keys staged but not kept, and why; ``conflicts``: the stage's text
    for each conflicting second copy (the first copy is the one kept)."""

    group_id: str
    rollout_id: str
    outcome: str
    reason: str = ""
    stager: RolloutStager | None = None
    last_call_id: str | None = None
    token_ids: np.ndarray | None = None
    call_ids: tuple[str, ...] = ()
    weight_versions: tuple[int, ...] = ()
    dropped: Mapping[str, str] = field(default_factory=dict)
    conflicts: tuple[str, ...] = ()

    @property
    def resumed(self) -> bool:
        return self.outcome == RESUMED

    @property
    def tokens_reused(self) -> int:
        return 0 if self.token_ids is None else int(len(self.token_ids))


@dataclass
class _Partition:
    """What was read of one input partition: the stage's committed offset, the log start, and
    the group's records from the committed offset (or the log start) to the end."""

    committed: int | None
    low: int
    high: int
    messages: list = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.low if self.committed is None else max(self.committed, self.low)

    @property
    def past_retention(self) -> bool:
        return self.committed is not None and self.committed < self.low


class RolloutResumer:
    """Reads what the stage has not consumed yet, for the rollouts of crashed workers.

    ``stage_group_id``: the stage's consumer group (StageConfig.group_id), whose committed
    offsets bound the read; ``topics``, ``framing``, the registry settings and
    ``max_record_bytes``: the stage's; ``config``: librdkafka properties added to the consumer
    and the offsets consumer (security settings); ``limits``: the stage's input limits (its route
    topic is ``topics.staged_routes``). Nothing is committed and the stage's group is never
    joined: its offsets are only read (``committed()``)."""

    def __init__(self, bootstrap_servers: str, *, stage_group_id: str = "rollout-reassembler",
                 topics: TopicNames | None = None, config: Mapping[str, Any] | None = None,
                 framing: str = "plain", schema_registry_url: str | None = None,
                 schema_registry_config: Mapping[str, Any] | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, timeout: float = 30.0,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 limits: InputLimits | None = None) -> None:
        self.topics = topics or TopicNames()
        self.stage_group_id = stage_group_id
        self.timeout = timeout
        self.limits = limits or InputLimits(route_topic=self.topics.staged_routes,
                                            max_route_chunk_bytes=max_record_bytes)
        codec = lambda name, topic: codec_for(name, topic, framing, schema_registry_url,  # noqa: E731
                                              max_record_bytes, schema_registry_config)
        self.codecs = {"staged": codec("StagedCall", self.topics.staged_calls),
                       "receipts": codec("ReceiptEvent", self.topics.receipts),
                       "ledger": codec("LedgerEntry", self.topics.stage_ledger)}
        # a private group id: this consumer only assigns partitions, it never joins or commits
        self.consumer = Consumer({**reader_defaults(bootstrap_servers, f"resume-{uuid.uuid4().hex}",
                                                    max_record_bytes),
                                  "enable.partition.eof": True, **(config or {})})
        try:
            reach(self.consumer, bootstrap_servers, "RolloutResumer", connect_timeout)
        except BaseException:
            self.consumer.close()
            raise
        self.offsets = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": stage_group_id,
                                 "enable.auto.commit": False, "isolation.level": "read_committed",
                                 "logger": kafka_logger(), **(config or {})})
        self.records_read = 0
        self.bytes_read = 0
        self.starts: dict[tuple[str, int], int] = {}

    def close(self) -> None:
        self.consumer.close()
        self.offsets.close()

    def __enter__(self) -> "RolloutResumer":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    # -- the API -----------------------------------------------------------------------------
    def resume(self, group_id: str, rollout_id: str, **kwargs) -> ResumeResult:
        """One rollout; keyword arguments as ``resume_all``."""
        return self.resume_all([(group_id, rollout_id)], **kwargs)[0]

    def resume_all(self, rollouts: Iterable[tuple[str, str]], *,
                   producer: StagingProducer | None = None,
                   max_weight_version_lag: int | None = None, current_weight_version: int | None = None,
                   min_weight_version: int | None = None, group_timeout_ms: int | None = None,
                   now_ms: int | None = None) -> list[ResumeResult]:
        """One result per ``(group_id, rollout_id)``, in order. ``producer``: the stagers'
        (None: ``prepare()`` only). ``max_weight_version_lag`` with ``current_weight_version``,
        ``min_weight_version``: the trainer's staleness bound (stage.client.staleness), checked
        against the chain's weight versions. ``group_timeout_ms``: the stage's; a group whose
        earliest input record is older than that (at ``now_ms``, default the clock) is refused."""
        rollouts = list(rollouts)
        if max_weight_version_lag is not None and current_weight_version is None:
            raise ValueError("max_weight_version_lag needs current_weight_version")
        staleness = Staleness(max_weight_version_lag=max_weight_version_lag,
                              min_weight_version=min_weight_version)
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        inputs = self._read_inputs({group for group, _ in rollouts})
        return [self._judge(group, rollout, inputs, producer=producer, staleness=staleness,
                            current=current_weight_version, group_timeout_ms=group_timeout_ms,
                            now_ms=now_ms) for group, rollout in rollouts]

    # -- reading -----------------------------------------------------------------------------
    def _partitions(self, topic: str) -> int:
        metadata = self.consumer.list_topics(topic, timeout=self.timeout)
        meta = metadata.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise KafkaException(meta.error if meta is not None and meta.error else
                                 KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, f"topic {topic} not found"))
        return len(meta.partitions)

    def _committed(self, tps: list[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
        """The stage's committed offsets, asked by a consumer under the stage's group id that
        never subscribes (so it never joins the group nor commits). read_committed: an offset
        committed inside a pending transaction is waited for (require_stable). Not the
        AdminClient's list_consumer_group_offsets: librdkafka 2.16 crashes (SIGSEGV in
        rd_kafka_cgrp_op) parsing some of its responses."""
        listed = retrying(lambda: self.offsets.committed([TopicPartition(t, p) for t, p in tps],
                                                         timeout=self.timeout), timeout=self.timeout)
        out = {}
        for tp in listed:
            if tp.error is not None:
                raise KafkaException(tp.error)
            out[(tp.topic, tp.partition)] = tp.offset if tp.offset >= 0 else None
        return out

    def _read_inputs(self, groups: set[str]) -> dict:
        """Each needed partition read once: staged calls and receipts from the stage's committed
        offset, the (compacted) ledger whole.

        Why the committed offset is enough: the stage commits, in the transaction that publishes
        groups, the lowest offset an unpublished group still needs (stage.buffer.partition
        ``committable``), never more; so every record of a group not yet published is at or
        after it, and what lies before it belongs to published groups only."""
        t = self.topics
        counts = {topic: self._partitions(topic) for topic in (t.staged_calls, t.receipts, t.stage_ledger)}
        where = {g: {topic: partition_for(g.encode("utf-8"), n) for topic, n in counts.items()} for g in groups}
        inputs = sorted({(topic, where[g][topic]) for g in groups for topic in (t.staged_calls, t.receipts)})
        ledgers = sorted({(t.stage_ledger, where[g][t.stage_ledger]) for g in groups})
        committed = self._committed(inputs)
        parts = {}
        for tp in inputs + ledgers:
            low, high = self.consumer.get_watermark_offsets(TopicPartition(*tp), timeout=self.timeout,
                                                            cached=False)
            parts[tp] = _Partition(None if tp in ledgers else committed.get(tp), low, high)
        self.starts = {tp: p.start for tp, p in parts.items()}   # where the last call read from
        self._read({tp: p for tp, p in parts.items() if not p.past_retention})
        return {"where": where, "parts": parts}

    def _read(self, parts: dict[tuple[str, int], _Partition]) -> None:
        todo = {tp: p for tp, p in parts.items() if p.start < p.high}
        if not todo:
            return
        self.consumer.assign([TopicPartition(t, p, part.start) for (t, p), part in todo.items()])
        deadline = time.monotonic() + self.timeout
        try:
            while todo:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"RolloutResumer: {sorted(todo)} not read to their end in {self.timeout}s")
                for msg in take(self.consumer, 1000, 0.2):
                    tp = (msg.topic(), msg.partition())
                    part = todo.get(tp)
                    if part is None:
                        continue
                    error = msg.error()
                    if error is not None:
                        if error.code() != KafkaError._PARTITION_EOF:
                            raise KafkaException(error)
                        del todo[tp]        # read_committed: the end is the last stable offset
                        continue
                    if msg.offset() < part.high:
                        part.messages.append(msg)
                        self.records_read += 1
                        self.bytes_read += len(msg.value() or b"")
                    if msg.offset() >= part.high - 1:
                        del todo[tp]
        finally:
            self.consumer.unassign()

    # -- judging one rollout -----------------------------------------------------------------
    def _judge(self, group_id: str, rollout_id: str, inputs: dict, *, producer, staleness: Staleness,
               current, group_timeout_ms, now_ms) -> ResumeResult:
        t = self.topics
        where, parts = inputs["where"][group_id], inputs["parts"]
        staged = parts[(t.staged_calls, where[t.staged_calls])]
        receipts = parts[(t.receipts, where[t.receipts])]
        ledger = parts[(t.stage_ledger, where[t.stage_ledger])]

        def refuse(outcome: str, reason: str, **extra) -> ResumeResult:
            return ResumeResult(group_id, rollout_id, outcome, reason, **extra)

        entry = self._ledger_entry(ledger.messages, group_id)
        if entry is not None:   # written in the transaction that published the summary and rows
            return refuse(PUBLISHED, f"the stage published group {group_id} ({entry['outcome']}) "
                                     f"at {entry['published_at_ms']} ms")
        if staged.past_retention:
            return refuse(PAST_RETENTION, f"{t.staged_calls}[{where[t.staged_calls]}]: the stage's "
                                          f"committed offset {staged.committed} is below the log "
                                          f"start {staged.low}: its staged calls were deleted")
        events = [v for v in self._decoded(receipts.messages, "receipts") if v.get("group_id") == group_id]
        mine = [v for v in events if v.get("rollout_id") == rollout_id]
        if mine:
            return refuse(RECEIPT_EMITTED, f"rollout {rollout_id} already has a receipt event "
                                           f"(rollout_index {mine[0].get('rollout_index')})")
        indexes = {v.get("rollout_index") for v in events}
        if events and len(indexes) >= int(events[0].get("group_size") or 0):
            return refuse(GROUP_COMPLETE, f"all {len(indexes)} rollouts of group {group_id} have "
                                          "receipts: the stage publishes it without this one")
        records = self._staged_records(staged.messages, group_id)
        if group_timeout_ms is not None:
            stamps = [min(r.position.timestamp_ms, now_ms) for r in records]
            stamps += [min(m.timestamp()[1], now_ms) for m in receipts.messages
                       if m.key() == group_id.encode("utf-8")]
            if stamps and now_ms >= min(stamps) + group_timeout_ms:
                return refuse(DEADLINE_PASSED, f"group {group_id}'s deadline ({min(stamps)} + "
                                               f"{group_timeout_ms} ms) has passed")
        candidates, dropped, conflicts = held_calls(records, group_id, rollout_id, self.limits)
        verdict = longest_verified(rollout_id, candidates, dropped, conflicts)
        if verdict.terminal is None:
            if not candidates and not dropped:
                return refuse(NOTHING_STAGED, f"no staged call of {rollout_id} in "
                                              f"{t.staged_calls}[{where[t.staged_calls]}] from offset "
                                              f"{staged.start}")
            if verdict.missing_parents and staged.committed is None and staged.low > 0:
                return refuse(PAST_RETENTION, f"parents {sorted(verdict.missing_parents)} are absent "
                                              f"and the log starts at {staged.low}: deleted",
                              dropped=verdict.dropped, conflicts=tuple(verdict.conflicts))
            return refuse(CHAIN_BROKEN, "no staged call verifies: " + "; ".join(
                f"{k}: {v}" for k, v in list(verdict.dropped.items())[:3]),
                dropped=verdict.dropped, conflicts=tuple(verdict.conflicts))
        row = verdict.linearized
        gone = self._routes_gone(verdict.calls)
        if gone:
            return refuse(PAST_RETENTION, gone, dropped=verdict.dropped, conflicts=tuple(verdict.conflicts))
        versions = tuple(row.weight_versions)
        if staleness.reason(min(versions), max(versions), current, True) is not None:
            return refuse(STALE, f"weight versions {min(versions)}..{max(versions)} are past the bound "
                                 f"(current {current}, max lag {staleness.max_weight_version_lag}, "
                                 f"min version {staleness.min_weight_version})",
                          dropped=verdict.dropped, conflicts=tuple(verdict.conflicts))
        stager = RolloutStager.rehydrated(producer, group_id, rehydrate(rollout_id, verdict.calls),
                                          reserved=verdict.taken_call_ids)
        return ResumeResult(group_id, rollout_id, RESUMED, "", stager, verdict.terminal.call_id,
                            row.token_ids, tuple(row.model_call_ids), versions, verdict.dropped,
                            tuple(verdict.conflicts))

    def _decoded(self, messages, codec: str) -> list[dict]:
        out = []
        for msg in messages:
            try:
                out.append(self.codecs[codec].decode(msg.value()))
            except Exception:   # noqa: BLE001 - the stage dead-letters what it cannot decode
                continue
        return out

    def _staged_records(self, messages, group_id: str) -> list[StagedRecord]:
        key = group_id.encode("utf-8")
        out = []
        for msg in messages:
            if msg.key() != key or msg.value() is None:
                continue
            try:
                value = self.codecs["staged"].decode(msg.value())
            except Exception:   # noqa: BLE001 - dead-lettered by the stage: never held
                continue
            out.append(StagedRecord(value, Position(msg.topic(), msg.partition(), msg.offset(),
                                                    msg.timestamp()[1]), len(msg.value())))
        return out

    def _ledger_entry(self, messages, group_id: str) -> dict | None:
        """The group's live LedgerEntry (compacted topic: the last value of its key wins, a
        tombstone clears it)."""
        key, entry = group_id.encode("utf-8"), None
        for msg in messages:
            if msg.key() != key:
                continue
            entry = None if msg.value() is None else self.codecs["ledger"].decode(msg.value())
        return entry

    def _routes_gone(self, calls) -> str | None:
        """Why a kept call's route chunks are no longer on the route topic (None: all there)."""
        for partition, lowest in route_chunk_offsets(calls).items():
            low, _high = self.consumer.get_watermark_offsets(
                TopicPartition(self.topics.staged_routes, partition), timeout=self.timeout, cached=False)
            if lowest < low:
                return (f"route chunks at {self.topics.staged_routes}[{partition}]@{lowest} are below "
                        f"the log start {low}: deleted")
        return None


__all__ = ["CHAIN_BROKEN", "DEADLINE_PASSED", "GROUP_COMPLETE", "NOTHING_STAGED", "PAST_RETENTION",
           "PUBLISHED", "RECEIPT_EMITTED", "REFUSALS", "RESUMED", "STALE", "ResumeResult", "RolloutResumer"]
