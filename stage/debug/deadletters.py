"""``rollout-reassembler dead-letters list|replay``: find dead letters, and re-produce selected
ones to their source topic after a fix, each at most once.

A dead letter (``stage.publish.deadletters``) carries the original key, value and headers, then
five headers the stage appends: ``source-topic``, ``source-partition``, ``source-offset``,
``error``, ``error-class``. The dead-letter topic is not co-partitioned: every partition is read.

Re-producing, at most once: each re-produced record is recorded by a *marker* in a small
compacted topic (the replay log, default ``<dead-letter topic>.replays``, created on first use),
keyed by the dead letter's own coordinates (``topic/partition/offset``) and naming where the copy
went. The copy and its marker are written in one Kafka transaction, so both exist or neither.
Every replay uses the same transactional id (``<group_id>.dead-letter-replay``) and reads the
markers only after ``init_transactions``: a replay started meanwhile elsewhere is fenced (its
open transaction aborted) before we look, so two operators cannot both re-produce one record.

The copy follows the contract: key = the record's group id, partition = the contract's
partitioner of the key. A record whose key is not its group id (dead-lettered as
``misrouted``) is re-produced keyed by its group id only with ``--rekey``. Refused, because the
stage would dead-letter the copy again: a record that does not decode with the current schemas,
one the stage refused for its content (``invalid``, ``conflict``), and a copy replayed before
that was dead-lettered again. The copy
is a new record at a new offset, above the stage's dead-letter watermark, so the stage
processes it like any other; its headers are the original ones plus ``dead-letter-replay``
naming the dead letter.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from stage.debug.kafka import PartitionReader, Record
from stage.debug.text import marker_target
from stage.publish.deadletters import CONFLICT, ERROR_CLASSES, INVALID
from stage.runtime.kafka.clients import common, replay_producer_config
from stage.config.model import StageConfig
from stage.wire import WireError
from stage.wire.partitioner import partition_for

STAGE_HEADERS = ("source-topic", "source-partition", "source-offset", "error", "error-class")
REPLAY_HEADER = "dead-letter-replay"
# Error classes the stage gives a record whose bytes it read and then refused: a copy of the same
# bytes is refused again (the input limits are constants, a conflict contradicts its group), so
# replay never re-produces them, or `replay --all` would re-produce and re-dead-letter them forever.
REFUSED_CONTENT = {INVALID: "a field out of range or malformed",
                   CONFLICT: "it contradicts the other records of its group"}


def replay_log_topic(cfg: StageConfig) -> str:
    return f"{cfg.topics.dead_letter}.replays"


@dataclass(frozen=True)
class DeadLetterView:
    record: Record
    source_topic: str | None
    source_partition: int | None
    source_offset: int | None
    error: str | None
    error_class: str | None
    original_headers: tuple

    @property
    def marker_key(self) -> str:
        return f"{self.record.topic}/{self.record.partition}/{self.record.offset}"

    @property
    def well_formed(self) -> bool:
        return self.source_topic is not None

    def as_dict(self, marker: dict | None = None) -> dict:
        key = self.record.key
        return {"dead_letter": {"topic": self.record.topic, "partition": self.record.partition,
                                "offset": self.record.offset, "timestamp_ms": self.record.timestamp_ms},
                "source": {"topic": self.source_topic, "partition": self.source_partition,
                           "offset": self.source_offset},
                "error_class": self.error_class, "error": self.error,
                "key": None if key is None else key.decode("utf-8", "backslashreplace"),
                "value_bytes": None if self.record.value is None else len(self.record.value),
                "replayed": marker}


def parse(record: Record) -> DeadLetterView:
    """The stage's five trailing headers, or a view with ``well_formed`` False."""
    headers = tuple(record.headers)
    tail = headers[-len(STAGE_HEADERS):]
    if len(tail) != len(STAGE_HEADERS) or tuple(k for k, _ in tail) != STAGE_HEADERS:
        return DeadLetterView(record, None, None, None, "not a dead letter of this stage (its "
                              "source headers are missing)", None, headers)
    text = {k: (v or b"").decode("utf-8", "replace") for k, v in tail}
    try:
        partition, offset = int(text["source-partition"]), int(text["source-offset"])
    except ValueError:
        return DeadLetterView(record, None, None, None, "malformed source-partition/source-offset "
                              "headers", None, headers)
    return DeadLetterView(record, text["source-topic"], partition, offset, text["error"],
                          text["error-class"], headers[:-len(STAGE_HEADERS)])


def input_schemas(cfg: StageConfig) -> dict[str, str]:
    """The stage's input topics and their record names: what a dead letter can be replayed to."""
    return {cfg.topics.receipts: "ReceiptEvent", cfg.topics.staged_calls: "StagedCall"}


def group_of(view: DeadLetterView, codecs: dict, inputs: dict[str, str]) -> str | None:
    """The group id in the dead letter's value; None when it names none: not from an input
    topic, no value, or a value that does not decode with the current schemas."""
    schema = inputs.get(view.source_topic) if view.well_formed else None
    if schema is None or view.record.value is None:
        return None
    try:
        return codecs[schema].decode(view.record.value)["group_id"]
    except WireError:
        return None


@dataclass
class Filters:
    """What to select; ``list`` and ``replay`` select the same records with the same filters.
    ``key`` (a group id as bytes) selects the dead letters of that group: keyed so, or whose
    value names the group under another key (misrouted)."""

    error_classes: set = field(default_factory=set)
    source_topic: str | None = None
    source_partition: int | None = None
    key: bytes | None = None
    grep: str | None = None
    at: set = field(default_factory=set)     # {(dead-letter partition, offset)}

    def __post_init__(self) -> None:
        unknown = set(self.error_classes) - set(ERROR_CLASSES)
        if unknown:
            raise ValueError(f"unknown error class(es) {sorted(unknown)}; known: {', '.join(ERROR_CLASSES)}")

    @property
    def any(self) -> bool:
        return bool(self.error_classes or self.source_topic or self.source_partition is not None
                    or self.key is not None or self.grep or self.at)

    def match(self, view: DeadLetterView, group=None) -> bool:
        """``group()``: the group id the view's value names (None: none; not given: keys only)."""
        return ((not self.error_classes or view.error_class in self.error_classes)
                and (self.source_topic is None or view.source_topic == self.source_topic)
                and (self.source_partition is None or view.source_partition == self.source_partition)
                and (not self.grep or self.grep in (view.error or ""))
                and (not self.at or (view.record.partition, view.record.offset) in self.at)
                and (self.key is None or self._of_group(view, group)))

    def _of_group(self, view: DeadLetterView, group) -> bool:
        if view.record.key == self.key or group is None:
            return view.record.key == self.key
        named = group()
        return named is not None and named.encode("utf-8") == self.key


def find(cfg: StageConfig, reader: PartitionReader, filters: Filters, *, since_ms: int | None = None,
         until_ms: int | None = None, codecs: dict | None = None) -> tuple[list[DeadLetterView], int]:
    """Every dead letter matching ``filters`` between the two times (offset order per
    partition), and how many records were read. With ``codecs`` a key filter also looks at the
    group id each value names (Filters)."""
    topic = cfg.topics.dead_letter
    count = reader.partitions(topic)
    if count is None:
        raise LookupError(f"topic {topic} does not exist")
    out, read = [], 0
    wanted = {p for p, _ in filters.at} if filters.at else set(range(count))
    if any(p >= count for p in wanted):
        raise ValueError(f"{topic} has {count} partitions, --at names partition(s) "
                         f"{sorted(p for p in wanted if p >= count)}")
    inputs = input_schemas(cfg)

    def keep(record) -> bool:
        view = parse(record)
        return filters.match(view, None if codecs is None else (lambda: group_of(view, codecs, inputs)))

    for p in sorted(wanted):
        low, high = reader.bounds(topic, p)
        start = max(low, reader.offset_at(topic, p, since_ms, low))
        end = reader.offset_at(topic, p, until_ms, high)
        if filters.at:      # just the offsets asked for
            offsets = [o for q, o in filters.at if q == p]
            start, end = max(start, min(offsets)), min(end, max(offsets) + 1)
        records, n = reader.scan(topic, p, start, end, keep)
        read += n
        out += [parse(r) for r in records]
    return out, read


def read_markers(reader: PartitionReader, topic: str) -> dict[str, dict]:
    """The replay log: dead letter coordinates -> where its copy went (empty if no log yet).
    A record of the log that is not a JSON object (someone else's record in our topic) still
    counts as a marker, so its dead letter is never re-produced, but it names no copy."""
    count = reader.partitions(topic)
    markers: dict[str, dict] = {}
    for p in range(count or 0):
        low, high = reader.bounds(topic, p)
        records, _ = reader.scan(topic, p, low, high)
        for record in records:
            key = (record.key or b"").decode("utf-8", "replace")
            if record.value is None:
                markers.pop(key, None)
                continue
            try:
                marker = json.loads(record.value)
            except ValueError:
                marker = None
            if not isinstance(marker, dict) or not isinstance(marker.get("replayed_to", {}), dict):
                marker = {"unreadable_marker": record.where}
            markers[key] = marker
    return markers


def ensure_replay_log(cfg: StageConfig, topic: str, timeout: float = 30.0) -> bool:
    """Create the compacted replay log if it does not exist (returns True when created), with
    the dead-letter topic's replication factor."""
    admin = AdminClient(common(cfg))
    metadata = admin.list_topics(timeout=timeout)
    if topic in metadata.topics and metadata.topics[topic].error is None:
        return False
    dead = metadata.topics.get(cfg.topics.dead_letter)
    replication = len(dead.partitions[0].replicas) if dead and dead.partitions else 1
    future = admin.create_topics([NewTopic(topic, 1, replication, config={"cleanup.policy": "compact"})],
                                 operation_timeout=timeout)[topic]
    future.result()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        meta = admin.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta is not None and meta.error is None and all(p.leader >= 0 for p in meta.partitions.values()):
            return True
        time.sleep(0.1)
    raise TimeoutError(f"created {topic}, but it has no leader after {timeout}s")


class Replayer:
    """Re-produces dead letters to their source topics, each at most once (see module doc)."""

    def __init__(self, cfg: StageConfig, reader: PartitionReader, codecs: dict, *, log_topic: str,
                 rekey: bool = False, dry_run: bool = False, into_published: bool = False) -> None:
        self.cfg, self.reader, self.codecs = cfg, reader, codecs
        self.log_topic, self.rekey, self.dry_run = log_topic, rekey, dry_run
        self.into_published = into_published
        self.inputs = input_schemas(cfg)
        self.producer: Producer | None = None
        self.markers: dict[str, dict] = {}
        self._published: dict[str, str | None] = {}

    def prepare(self) -> None:
        """Fence any other replay, then read the markers (in that order: see module doc)."""
        if not self.dry_run:
            ensure_replay_log(self.cfg, self.log_topic)
            self.producer = Producer(replay_producer_config(self.cfg, f"{self.cfg.group_id}.dead-letter-replay"))
            self.producer.init_transactions(60)
        self.markers = read_markers(self.reader, self.log_topic)

    def plan(self, view: DeadLetterView) -> tuple[str, str, dict | None]:
        """(status, detail, target) for one dead letter; target: topic, partition, key, rekeyed."""
        marker = self.markers.get(view.marker_key)
        if marker is not None:
            return "already_replayed", f"replayed before to {marker_target(marker)}", None
        if not view.well_formed:
            return "refused", view.error, None
        again = dict(view.original_headers).get(REPLAY_HEADER)
        if again is not None:
            return "refused", (f"this is a copy replayed from {again.decode('utf-8', 'replace')} that "
                               f"the stage dead-lettered again ({view.error_class}): replaying it "
                               f"once more would be refused the same way"), None
        if view.error_class in REFUSED_CONTENT:
            return "refused", (f"the stage refused this record's content ({view.error_class}: "
                               f"{REFUSED_CONTENT[view.error_class]}); the same bytes would be "
                               f"dead-lettered again: fix the producer and send a corrected record"), None
        schema = self.inputs.get(view.source_topic)
        if schema is None:
            return "refused", (f"source topic {view.source_topic} is not one of the stage's input "
                               f"topics ({', '.join(self.inputs)})"), None
        if view.record.value is None:
            return "refused", "the record has no value (a tombstone): nothing the stage could use", None
        try:
            group_id = self.codecs[schema].decode(view.record.value)["group_id"]
        except WireError as error:
            return "refused", (f"does not decode with the current schemas and limits either, so the "
                               f"stage would dead-letter it again: {error}"), None
        published = self.published(group_id)
        if published is not None and not self.into_published:
            return "refused", f"{published}; --into-published re-produces it anyway", None
        key, rekeyed = view.record.key, False
        if key != group_id.encode("utf-8"):
            if not self.rekey:
                shown = "no key" if key is None else f"key {key[:100].decode('utf-8', 'backslashreplace')!r}"
                return "refused", (f"{shown}, but the record's group_id is {group_id!r}: unchanged it "
                                   f"would be dead-lettered again as misrouted; --rekey re-produces it "
                                   f"keyed by {group_id!r}"), None
            key, rekeyed = group_id.encode("utf-8"), True
        count = self.reader.partitions(view.source_topic)
        if count is None:
            return "refused", f"source topic {view.source_topic} does not exist", None
        target = {"topic": view.source_topic, "partition": partition_for(key, count), "key": key,
                  "rekeyed": rekeyed, "warning": None}
        if published is not None:
            target["warning"] = f"{published}; re-produced anyway (--into-published)"
        return ("would_replay" if self.dry_run else "ready"), "", target

    def published(self, group_id: str) -> str | None:
        """Why the ledger says ``group_id`` was published, and what a copy would then do (None:
        not published, as far as the ledger knows). A live entry: published, its late records are skipped. A tombstone: it
        was published and then forgotten after ``late_retention_ms``, so a copy would start the
        group again and publish it a second time. The ledger is compacted: once compaction has
        dropped a tombstone too (``delete.retention.ms``), nothing is known."""
        if group_id not in self._published:
            self._published[group_id] = self._ledger_says(group_id)
        return self._published[group_id]

    def _ledger_says(self, group_id: str) -> str | None:
        topic, key = self.cfg.topics.stage_ledger, group_id.encode("utf-8")
        count = self.reader.partitions(topic)
        if not count:
            return None
        p = partition_for(key, count)
        low, high = self.reader.bounds(topic, p)
        records, _ = self.reader.scan(topic, p, low, high, lambda r: r.key == key)
        if not records:
            return None
        last = records[-1]
        if last.value is None:
            return (f"group {group_id!r} was published and then forgotten (ledger tombstone at "
                    f"{last.where}, after late_retention_ms): a copy would start it again and "
                    f"publish it a second time")
        try:
            entry = self.codecs["LedgerEntry"].decode(last.value)
        except WireError as error:
            return f"group {group_id!r} has an unreadable ledger entry at {last.where} ({error})"
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry["published_at_ms"] / 1000))
        return (f"group {group_id!r} was already published at {when} ({entry['outcome']}; ledger "
                f"{last.where}): the stage would count a copy as a late record and never use it")

    def replay(self, view: DeadLetterView, target: dict) -> dict:
        """Produce the copy and its marker in one transaction; returns where the copy went."""
        delivered: dict = {}

        def on_delivery(err, msg):
            delivered["error"] = err
            delivered["offset"] = None if err else msg.offset()

        headers = list(view.original_headers) + [(REPLAY_HEADER, view.marker_key.encode())]
        self.producer.begin_transaction()
        try:
            self.producer.produce(target["topic"], key=target["key"], value=view.record.value,
                                  headers=headers, partition=target["partition"], on_delivery=on_delivery)
            self.producer.flush(60)
            if delivered.get("error") is not None or "offset" not in delivered:
                raise RuntimeError(f"the copy was not acknowledged: {delivered.get('error')}")
            to = {"topic": target["topic"], "partition": target["partition"], "offset": delivered["offset"]}
            marker = {"dead_letter": view.as_dict()["dead_letter"], "source": view.as_dict()["source"],
                      "replayed_to": to, "rekeyed": target["rekeyed"],
                      "replayed_at_ms": int(time.time() * 1000), "host": socket.gethostname()}
            self.producer.produce(self.log_topic, key=view.marker_key.encode(),
                                  value=json.dumps(marker, sort_keys=True).encode())
            self.producer.commit_transaction(60)
        except BaseException:
            try:
                self.producer.abort_transaction(60)
            except Exception:  # noqa: BLE001 - fenced or fatal: the first error says why
                pass
            raise
        self.markers[view.marker_key] = marker
        return marker
