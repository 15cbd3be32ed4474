"""Trainer-side reader: canonical rows -> complete groups -> NeMo RL's padded training tensors.

``CanonicalReader`` consumes ``rollouts.canonical-rows`` (and, in deferred router replay,
``rollouts.route-plans``) read_committed, hands every record to a ``GroupAssembler`` (no Kafka:
joins by group id, de-duplicates by sample id) and returns each group once all of its N rows
(and plans) are in::

    reader = CanonicalReader("broker:9092", group_id="trainer", device="cuda")
    for group in reader:                      # TrainingGroup, rows in row_index order
        batch = group.tensors()               # input_ids [N, max_len], token_mask, ... on cuda
        train_step(batch)
        reader.commit()                       # group-member mode: offsets of handed-out groups

Duplicates are expected: an at-least-once stage, a replayed transaction, or a broker that shows
aborted records to read_committed readers (Tansu) can deliver a row twice. The first copy of a
sample id wins; a copy with different content is counted as a conflict (``counts``), never used.

``DeferredRouteFetcher`` is the policy worker's half of deferred router replay: for a row's
RoutePlan it reads the staged fragments back by their Kafka coordinates and runs the shared
route executor (``stage.routes.execute_route_plan``) with the model's (L, K). A failure gives an
all ``-1`` route tensor of the row's length and a counted reason (``failures``).
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from stage.decode import staged_row
from stage.finalize import CanonicalRow, FinalizedGroup, pad_group
from stage.routes import (
    ROUTE_MISSING_SENTINEL,
    ROUTED_EXPERTS_FALLBACK_DTYPE,
    RouteAssemblyPlan,
    RouteFragment,
    RouteSpan,
    execute_route_plan,
    resolve_device,
)
from stage.wire import AvroCodec, TopicNames, WireError, unpack_torch, value_subject

logger = logging.getLogger(__name__)

_ROW_TENSORS = ("input_ids", "generation_logprobs", "token_mask", "prompt_ids_for_adv")
_OPTIONAL_TENSORS = ("routed_experts", "generation_topk_ids", "generation_topk_logprobs")
# Media fields: allowed dtypes and dims (a row's logical row; see docs/schemas.md).
_MEDIA = {"pixel_values": (("float16", "bfloat16", "float32"), 2), "imgs_sizes": (("int32",), 2),
          "num_frames": (("int32",), 1)}


def row_from_record(record: Mapping[str, Any], *, device="cpu") -> CanonicalRow:
    """A decoded CanonicalRow value -> ``stage.finalize.CanonicalRow`` (torch on ``device``)."""
    target = resolve_device(device)
    tensors = {name: unpack_torch(record[name], device=target, field=name) for name in _ROW_TENSORS}
    optional = {name: None if record.get(name) is None
                else unpack_torch(record[name], device=target, field=name) for name in _OPTIONAL_TENSORS}
    media = {name: unpack_torch(record[name], device=target, field=name, expect_dtypes=dtypes,
                                expect_ndim=ndim)
             for name, (dtypes, ndim) in _MEDIA.items() if record.get(name) is not None} or None
    return CanonicalRow(
        group_id=record["group_id"], sample_id=record["sample_id"], row_index=record["row_index"],
        group_size=record["group_size"], prompt_idx=record["prompt_idx"],
        rollout_id=record["rollout_id"], weight_version=record["weight_version"],
        group_max_wv=record["group_max_wv"], valid=record["valid"],
        rejection_reason=record["rejection_reason"], input_lengths=record["input_lengths"],
        sample_mask=record["sample_mask"], total_reward=record["total_reward"],
        mask_sample=record["mask_sample"], truncated=record["truncated"], media=media,
        **tensors, **optional)


def route_plan_from_record(record: Mapping[str, Any]) -> RouteAssemblyPlan:
    """A decoded RoutePlan value -> the executor's RouteAssemblyPlan (coordinates dropped)."""
    return RouteAssemblyPlan(
        record["schema_version"], record["staging_partition"],
        tuple(RouteSpan(s["staging_key"], s["carry_len"], s["generation_len"], s["staged_route_len"],
                        s["extras_digest_version"], s["extras_digest"], s["boundary_token_index"],
                        s["repair_previous_token"]) for s in record["spans"]),
        tuple(record["cleanup_staging_keys"]), record["expected_token_length"])


@dataclass(eq=False)
class TrainingGroup:
    """One complete group: exactly ``group_size`` rows (row_index order), plans if deferred."""

    group_id: str
    rows: list[CanonicalRow]
    records: list[dict]                      # the decoded CanonicalRow values, same order
    plans: list[dict] | None = None          # the decoded RoutePlan values, same order
    first_seen: float = 0.0                  # time.monotonic() of its first record
    completed_at: float = 0.0                # time.monotonic() when its last record arrived

    @property
    def group_size(self) -> int:
        return len(self.rows)

    @property
    def valid_rows(self) -> int:
        return sum(1 for row in self.rows if row.valid)

    @property
    def rejections(self) -> list[tuple[int, str]]:
        return [(row.row_index, row.rejection_reason) for row in self.rows if not row.valid]

    def finalized(self) -> FinalizedGroup:
        """The rows as the finalizer's FinalizedGroup (what ``pad_group`` takes)."""
        valid = [row for row in self.rows if row.valid]
        return FinalizedGroup(
            group_id=self.group_id, rows=self.rows, group_min_wv=self.rows[0].weight_version,
            group_max_wv=self.rows[0].group_max_wv, staging_keys=[], cleanup_staging_keys=[],
            canonical_output_tokens=int(sum(int(torch.count_nonzero(r.token_mask)) for r in valid)),
            metrics={}, valid_row_count=len(valid), total_row_count=len(self.rows))

    def tensors(self, *, pad_token_id: int = 0, device=None) -> dict[str, torch.Tensor]:
        """NeMo RL's training tensors (``stage.finalize.pad_group``): input_ids [N, max_len]
        padded with ``pad_token_id``, input_lengths, generation_logprobs, token_mask,
        sample_mask, prompt_ids_for_adv, total_reward, mask_sample, truncated, plus
        routed_experts (-1 padded) and top-k when the rows carry them, and in a group with
        media pixel_values, imgs_sizes, num_frames (the rows concatenated along dim 0, as
        NeMo RL's PackedTensor.as_tensor) with ``<field>__row_counts`` per row."""
        return pad_group(self.finalized(), pad_token_id=pad_token_id, device=device)


@dataclass(eq=False)
class _Pending:
    group_size: int
    first_seen: float
    rows: dict = field(default_factory=dict)     # row_index -> (record, digest)
    plans: dict = field(default_factory=dict)    # row_index -> (record, digest)
    offsets: dict = field(default_factory=dict)  # (topic, partition) -> lowest offset held


def _digest(record: Mapping[str, Any], raw: bytes | None) -> bytes:
    if raw is None:
        raw = repr(sorted(record.items())).encode()
    return hashlib.blake2b(raw, digest_size=16).digest()


class GroupAssembler:
    """Joins row (and plan) records by group id; no Kafka. ``add_row`` / ``add_plan`` return
    the TrainingGroup they complete, else None.

    ``counts``: rows, plans, duplicates (same sample id, same content: dropped), conflicts
    (same sample id, other content: dropped, the first copy wins), invalid (a record that
    contradicts its group: wrong sample id, index out of range, another group size), groups.
    Completed groups are remembered (``remember`` most recent) so later copies of their rows
    are still recognised as duplicates or conflicts.
    """

    def __init__(self, *, with_plans: bool = False, device="cpu", remember: int = 100_000) -> None:
        self.with_plans = with_plans
        self.device = device
        self.remember = remember
        self.pending: dict[str, _Pending] = {}
        self.completed: OrderedDict[str, dict] = OrderedDict()  # group -> {(kind, index): digest}
        self.counts: Counter = Counter()

    def add_row(self, record: Mapping[str, Any], raw: bytes | None = None,
                position: tuple[str, int, int] | None = None) -> TrainingGroup | None:
        return self._add("rows", record, raw, position)

    def add_plan(self, record: Mapping[str, Any], raw: bytes | None = None,
                 position: tuple[str, int, int] | None = None) -> TrainingGroup | None:
        if not self.with_plans:
            raise ValueError("this assembler was built without with_plans=True")
        return self._add("plans", record, raw, position)

    def _add(self, kind: str, record, raw, position) -> TrainingGroup | None:
        self.counts[kind] += 1
        group_id, index = record["group_id"], record["row_index"]
        digest = _digest(record, raw)
        done = self.completed.get(group_id)
        if done is not None:
            seen = done.get((kind, index))
            self.counts["duplicates" if seen == digest else "conflicts"] += 1
            return None
        if record["sample_id"] != f"{group_id}_g{index}":
            self.counts["invalid"] += 1
            return None
        pending = self.pending.get(group_id)
        size = record.get("group_size") if kind == "rows" else None
        if pending is None:
            if size is None:  # a plan before any row: size unknown yet, keep it aside
                pending = _Pending(group_size=0, first_seen=time.monotonic())
            elif not 0 <= index < size:
                self.counts["invalid"] += 1
                return None
            else:
                pending = _Pending(group_size=size, first_seen=time.monotonic())
            self.pending[group_id] = pending
        elif size is not None:
            if pending.group_size == 0:
                pending.group_size = size
            elif size != pending.group_size:
                self.counts["invalid"] += 1
                return None
        if pending.group_size and not 0 <= index < pending.group_size:
            self.counts["invalid"] += 1
            return None
        held = getattr(pending, kind)
        if index in held:
            self.counts["duplicates" if held[index][1] == digest else "conflicts"] += 1
            return None
        held[index] = (record, digest)
        if position is not None:
            topic, partition, offset = position
            key = (topic, partition)
            pending.offsets[key] = min(offset, pending.offsets.get(key, offset))
        return self._complete(group_id, pending)

    def _complete(self, group_id: str, pending: _Pending) -> TrainingGroup | None:
        n = pending.group_size
        if not n or len(pending.rows) != n or (self.with_plans and len(pending.plans) != n):
            return None
        if self.with_plans and any(not 0 <= i < n for i in pending.plans):
            return None  # a plan for a row index this group does not have: wait (invalid)
        del self.pending[group_id]
        self.completed[group_id] = {**{("rows", i): d for i, (_, d) in pending.rows.items()},
                                    **{("plans", i): d for i, (_, d) in pending.plans.items()}}
        while len(self.completed) > self.remember:
            self.completed.popitem(last=False)
        records = [pending.rows[i][0] for i in range(n)]
        self.counts["groups"] += 1
        return TrainingGroup(
            group_id=group_id, rows=[row_from_record(r, device=self.device) for r in records],
            records=records,
            plans=[pending.plans[i][0] for i in range(n)] if self.with_plans else None,
            first_seen=pending.first_seen, completed_at=time.monotonic())

    def lowest_pending_offsets(self) -> dict[tuple[str, int], int]:
        """Per (topic, partition): the lowest offset an incomplete group still holds."""
        out: dict[tuple[str, int], int] = {}
        for pending in self.pending.values():
            for key, offset in pending.offsets.items():
                out[key] = min(offset, out.get(key, offset))
        return out


def _take(consumer: Consumer, max_records: int, timeout: float) -> list:
    """Up to ``max_records`` messages: whatever is already fetched, else wait at most
    ``timeout`` for the first one (``Consumer.consume`` would wait the whole timeout for a
    full batch)."""
    messages = consumer.consume(max_records, 0)
    if messages:
        return messages
    first = consumer.poll(timeout)
    if first is None:
        return []
    return [first, *consumer.consume(max_records - 1, 0)] if max_records > 1 else [first]


def reader_defaults(bootstrap_servers: str, group_id: str) -> dict:
    fetch = 64 << 20
    return {"bootstrap.servers": bootstrap_servers, "group.id": group_id,
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "isolation.level": "read_committed", "fetch.max.bytes": fetch,
            "max.partition.fetch.bytes": fetch, "receive.message.max.bytes": fetch + (2 << 20)}


def _codec(name: str, topic: str, framing: str, schema_registry_url: str | None) -> AvroCodec:
    registry = None
    if framing == "confluent":
        from confluent_kafka.schema_registry import SchemaRegistryClient
        registry = SchemaRegistryClient({"url": schema_registry_url})
    return AvroCodec(name, framing=framing, registry=registry, subject=value_subject(topic))


class CanonicalReader:
    """Complete groups from the canonical-rows topic (and route plans with ``route_plans``).

    Without ``group_id`` the reader assigns itself every partition from the beginning (no
    consumer-group join, nothing committed: replay, evaluation, the demo). With ``group_id`` it
    joins that consumer group (trainer replicas share the partitions) and ``commit()`` stores,
    per partition, the lowest offset a group not yet handed out still needs, so a restarted
    trainer re-reads incomplete groups and nothing it already trained on.
    """

    def __init__(self, bootstrap_servers: str, *, topics: TopicNames | None = None,
                 group_id: str | None = None, route_plans: bool = False, device="cpu",
                 config: Mapping[str, Any] | None = None, framing: str = "plain",
                 schema_registry_url: str | None = None) -> None:
        self.topics = topics or TopicNames()
        self.assembler = GroupAssembler(with_plans=route_plans, device=device)
        self.codecs = {self.topics.canonical_rows: ("rows", _codec(
            "CanonicalRow", self.topics.canonical_rows, framing, schema_registry_url))}
        if route_plans:
            self.codecs[self.topics.route_plans] = ("plans", _codec(
                "RoutePlan", self.topics.route_plans, framing, schema_registry_url))
        self.grouped = group_id is not None
        conf = {**reader_defaults(bootstrap_servers, group_id or f"canonical-reader-{uuid.uuid4().hex}"),
                **(config or {})}
        self.consumer = Consumer(conf)
        self._consumed: dict[tuple[str, int], int] = {}  # (topic, partition) -> next offset
        self.undecodable = 0
        names = list(self.codecs)
        if self.grouped:
            self.consumer.subscribe(names)
        else:
            metadata = self.consumer.list_topics(timeout=30)
            tps = []
            for name in names:
                topic = metadata.topics.get(name)
                if topic is None or topic.error is not None:
                    raise RuntimeError(f"topic {name} does not exist")
                tps += [TopicPartition(name, p, OFFSET_BEGINNING) for p in topic.partitions]
            self.consumer.assign(tps)

    @property
    def counts(self) -> Counter:
        return self.assembler.counts

    def poll(self, timeout: float = 1.0, max_records: int = 500) -> list[TrainingGroup]:
        """Consume what is available (waiting at most ``timeout``); the groups completed."""
        out = []
        for msg in _take(self.consumer, max_records, timeout):
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    if err.fatal():
                        raise RuntimeError(f"consumer error: {err}")
                    logger.warning("canonical reader: %s", err)
                continue
            topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
            self._consumed[(topic, partition)] = offset + 1
            kind, codec = self.codecs[topic]
            value = msg.value()
            try:
                record = codec.decode(value)
            except WireError as error:
                self.undecodable += 1
                logger.error("undecodable %s record at %s[%d]@%d: %s", kind, topic, partition, offset, error)
                continue
            add = self.assembler.add_row if kind == "rows" else self.assembler.add_plan
            group = add(record, value, (topic, partition, offset))
            if group is not None:
                out.append(group)
        return out

    def read(self, groups: int, *, timeout: float = 60.0) -> list[TrainingGroup]:
        """Poll until ``groups`` complete groups arrived or ``timeout`` seconds passed."""
        out: list[TrainingGroup] = []
        deadline = time.monotonic() + timeout
        while len(out) < groups and time.monotonic() < deadline:
            out += self.poll(min(0.5, max(0.0, deadline - time.monotonic())))
        return out

    def __iter__(self) -> Iterator[TrainingGroup]:
        while True:
            yield from self.poll(1.0)

    def committable(self) -> list[TopicPartition]:
        """Per consumed partition: the lowest offset an incomplete group holds, else the next."""
        held = self.assembler.lowest_pending_offsets()
        return [TopicPartition(t, p, held.get((t, p), nxt)) for (t, p), nxt in self._consumed.items()]

    def commit(self) -> None:
        """Commit the committable offsets (group-member mode only)."""
        if not self.grouped:
            raise RuntimeError("commit() needs a group_id (assign-only readers commit nothing)")
        offsets = self.committable()
        if offsets:
            self.consumer.commit(offsets=offsets, asynchronous=False)

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> "CanonicalReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Deferred router replay (the policy worker's side)


class DeferredRouteFetcher:
    """Rebuild a row's routed experts from its RoutePlan by fetching the staged fragments at
    their Kafka coordinates; the shared executor assembles them with the model's ``dims``.

    ``routes(plan)`` always returns an int16 ``[len, L, K]`` tensor: on any failure (fragment
    gone, undecodable, another key at that offset, integrity or shape mismatch) it is all
    ``-1`` and the executor's reason is counted in ``failures``. Fetched rows are cached
    (``cache_size`` most recent coordinates).
    """

    def __init__(self, bootstrap_servers: str, *, dims: tuple[int, int], device="cpu",
                 config: Mapping[str, Any] | None = None, framing: str = "plain",
                 schema_registry_url: str | None = None, timeout: float = 10.0,
                 cache_size: int = 4096, max_gap: int = 256) -> None:
        self.dims = (int(dims[0]), int(dims[1]))
        self.device = resolve_device(device)
        self.timeout = timeout
        self.max_gap = max_gap
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple[str, int, int], Any] = OrderedDict()
        self.codec = _codec("StagedCall", TopicNames().staged_calls, framing, schema_registry_url)
        # Random access to records known to exist: never let the broker hold a fetch open.
        conf = {**reader_defaults(bootstrap_servers, f"route-fetcher-{uuid.uuid4().hex}"),
                "enable.partition.eof": True, "fetch.wait.max.ms": 10, "auto.offset.reset": "error",
                **(config or {})}
        self.consumer = Consumer(conf)
        self.failures: Counter = Counter()
        self.executed = 0
        self.fetched = 0

    # -- fetching ----------------------------------------------------------------------------
    def fetch(self, coordinates) -> dict[tuple[str, int, int], Any]:
        """(topic, partition, offset) -> StagedRow, or the Exception that explains its absence."""
        wanted = sorted(set(coordinates))
        out = {c: self.cache[c] for c in wanted if c in self.cache}
        by_tp: dict[tuple[str, int], list[int]] = {}
        for topic, partition, offset in wanted:
            if (topic, partition, offset) not in out:
                by_tp.setdefault((topic, partition), []).append(offset)
        for (topic, partition), offsets in by_tp.items():
            run = [offsets[0]]
            for offset in offsets[1:]:
                if offset - run[-1] > self.max_gap:
                    out.update(self._read_run(topic, partition, run))
                    run = []
                run.append(offset)
            out.update(self._read_run(topic, partition, run))
        for coords, row in out.items():
            if not isinstance(row, Exception):
                self.cache[coords] = row
                self.cache.move_to_end(coords)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return out

    def _read_run(self, topic: str, partition: int, offsets: list[int]) -> dict:
        """Read one partition forward from offsets[0] to offsets[-1] (one assign)."""
        out: dict = {}
        wanted = set(offsets)
        self.consumer.assign([TopicPartition(topic, partition, offsets[0])])
        deadline = time.monotonic() + self.timeout
        try:
            while wanted and time.monotonic() < deadline:
                span = min(500, max(wanted) - min(wanted) + 1)
                for msg in _take(self.consumer, span, min(0.5, max(0.0, deadline - time.monotonic()))):
                    err = msg.error()
                    if err is not None:
                        if err.code() in (KafkaError._PARTITION_EOF, KafkaError._AUTO_OFFSET_RESET):
                            for offset in wanted:
                                out[(topic, partition, offset)] = LookupError("offset beyond the end")
                            wanted.clear()
                        else:
                            logger.warning("route fetch %s[%d]: %s", topic, partition, err)
                        continue
                    offset = msg.offset()
                    for gone in [o for o in wanted if o < offset]:  # deleted, compacted, control
                        out[(topic, partition, gone)] = LookupError("no record at this offset")
                        wanted.discard(gone)
                    if offset in wanted:
                        wanted.discard(offset)
                        self.fetched += 1
                        try:
                            out[(topic, partition, offset)] = staged_row(self.codec.decode(msg.value()))
                        except (WireError, ValueError, KeyError, TypeError) as error:
                            out[(topic, partition, offset)] = error
                    if not wanted:
                        break
        finally:
            self.consumer.unassign()
        for offset in wanted:
            out[(topic, partition, offset)] = TimeoutError(f"not fetched within {self.timeout}s")
        return out

    # -- assembly ----------------------------------------------------------------------------
    def routes(self, plan: Mapping[str, Any], *, canonical_len: int | None = None,
               fetched: Mapping | None = None) -> torch.Tensor:
        """int16 ``[canonical_len, L, K]`` for one RoutePlan value (all -1 on failure)."""
        length = plan["expected_token_length"] if canonical_len is None else int(canonical_len)
        spans = [s for s in plan["spans"] if s["fragment"] is not None]
        coords = {s["staging_key"]: (s["fragment"]["topic"], s["fragment"]["partition"],
                                     s["fragment"]["offset"]) for s in spans}
        if fetched is None:
            fetched = self.fetch(coords.values())
        fragments: dict[str, RouteFragment] = {}
        for key, c in coords.items():
            row = fetched.get(c)
            if row is None or isinstance(row, Exception):
                logger.warning("route fragment %s at %s unavailable: %s", key, c, row)
                continue
            if row.staging_key != key:
                logger.warning("route fragment at %s is %s, the plan names %s", c, row.staging_key, key)
                continue
            try:
                fragment = row.fragment()
            except (KeyError, ValueError, TypeError) as error:
                logger.warning("route fragment %s unusable: %s", key, error)
                continue
            if fragment is not None:
                fragments[key] = fragment
        self.executed += 1
        try:
            routes, failure = execute_route_plan(route_plan_from_record(plan), fragments,
                                                 dims=self.dims, canonical_len=length,
                                                 device=self.device)
        except (TypeError, ValueError) as error:  # a malformed plan record
            routes, failure = None, f"invalid_plan: {error}"
        if failure is not None:
            self.failures[failure.split(":", 1)[0]] += 1
            return torch.full((length, *self.dims), ROUTE_MISSING_SENTINEL,
                              dtype=ROUTED_EXPERTS_FALLBACK_DTYPE, device=self.device)
        return routes

    def attach(self, group: TrainingGroup) -> list[torch.Tensor]:
        """Fetch every row's routes (one batched fetch for the group) and set
        ``row.routed_experts``, so ``group.tensors()`` includes ``routed_experts``."""
        if group.plans is None:
            raise ValueError("the group has no route plans (read it with route_plans=True)")
        coords = [(s["fragment"]["topic"], s["fragment"]["partition"], s["fragment"]["offset"])
                  for plan in group.plans for s in plan["spans"] if s["fragment"] is not None]
        fetched = self.fetch(coords)
        out = []
        for row, plan in zip(group.rows, group.plans):
            row.routed_experts = self.routes(plan, canonical_len=row.input_lengths, fetched=fetched)
            out.append(row.routed_experts)
        return out

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> "DeferredRouteFetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [
    "CanonicalReader", "DeferredRouteFetcher", "GroupAssembler", "TrainingGroup",
    "route_plan_from_record", "row_from_record",
]
