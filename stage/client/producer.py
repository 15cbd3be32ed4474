"""Producer SDK: inference workers stage model calls, the rollout owner emits receipts.

One ``StagingProducer`` (one confluent-kafka Producer, the Avro codecs and the topic names) is
shared by every ``RolloutStager`` (one per rollout, on the inference worker that serves it) and
``ReceiptEmitter`` (one per prompt group, on the rollout owner)::

    with StagingProducer("broker:9092") as producer:          # flush() on exit, raises on failures
        stager = RolloutStager(producer, group_id="g7", rollout_id="g7-r0")
        c0 = stager.stage("c0", prompt_delta=prompt, generated=out, generated_logprobs=lps,
                          weight_version=12, routed_experts=routes)          # [delta, L, K]
        c1 = stager.stage("c1", parent_call_id="c0", prompt_delta=tool_output, generated=out2,
                          generated_logprobs=lps2, weight_version=12, routed_experts=routes2,
                          routed_experts_boundary=boundary)                  # [1, L, K]
        emitter = ReceiptEmitter(producer, group_id="g7", group_size=4, prompt_idx=7)
        emitter.emit(0, stager.receipt("c1"), reward=1.0)
        emitter.emit_missing(1, rollout_id="g7-r1")                          # no receipt at all

Digests, chain and cumulative hashes come from ``stage.contract.producer.RolloutBuilder`` (Gym's
worker-side staging), so a staged call is byte-compatible with what Gym would stage. Every
record is keyed by group id (co-partitioning). Produce is asynchronous and batched (librdkafka
``linger.ms``); delivery errors are collected by the delivery callback and raised by
``flush()`` / ``raise_for_errors()`` as ``DeliveryError``, never swallowed.

Routes go by reference (``routes_by_reference=True``, the default): a call's route payload is
written as ``RouteChunk`` records to ``topics.staged_routes`` and its StagedCall, carrying a
``routes_ref`` instead of the bytes, is produced from the delivery callback of its last chunk,
once the broker has acknowledged every chunk (claim-check order; stage.client.route_staging).
``stage()`` does not wait for that; ``flush()`` does, and names any call left unproduced.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException, Producer

from stage.client.connection import DEFAULT_CONNECT_TIMEOUT_S, BrokerUnreachable, kafka_logger, reach
from stage.client.records import (
    receipt_event,
    route_envelopes,
    staged_call_from_record,
    staged_call_value,
    staged_row_from_envelopes,
)
from stage.client.route_staging import (
    MAX_CHUNK_ROUNDS,
    ChunkEncoder,
    ChunkHasher,
    PendingCall,
    RoutePayload,
    reference_bytes,
    route_chunk_size,
)
from stage.contract import CallRecord, RolloutReceipt, RouteEnvelope, StagedCallRecord
from stage.contract.producer import RolloutBuilder, StagedCall
from stage.finalize import StagedMedia, TopK
from stage.routes import ROUTED_EXPERTS_FIELD
from stage.wire import DEFAULT_MAX_RECORD_BYTES, AvroCodec, TopicNames, WireError, value_subject
from stage.wire.partitioner import LIBRDKAFKA_PARTITIONER

@dataclass(frozen=True)
class Delivery:
    """One acknowledgement (or failure) of a produced record: where it landed."""

    topic: str
    partition: int                # -1 when it failed
    offset: int                   # -1 when it failed
    key: bytes | None
    error: str | None = None


DeliveryCallback = Callable[[Delivery], None]


@dataclass(frozen=True)
class DeliveryFailure:
    topic: str
    key: bytes | None
    error: str
    not_produced: bool = False    # a StagedCall never produced: its route chunks failed


class DeliveryError(RuntimeError):
    """Records the broker did not acknowledge (``.failures``), raised by ``flush()``. The
    message shows the staged calls not produced (their route chunks failed) first."""

    def __init__(self, failures: list[DeliveryFailure]) -> None:
        self.failures = list(failures)
        ordered = sorted(self.failures, key=lambda f: not f.not_produced)
        shown = "; ".join(f"{f.topic} key={f.key!r}: {f.error}" for f in ordered[:3])
        more = f" (+{len(self.failures) - 3} more)" if len(self.failures) > 3 else ""
        super().__init__(f"{len(self.failures)} record(s) not delivered: {shown}{more}")


# After a broker outage the stage lets a group's deadline fire once the input partition has
# answered again for a few seconds (stage.runtime.kafka.availability.SETTLE_S). librdkafka backs
# off reconnecting up to reconnect.backoff.max.ms, 10 s by default: a producer could find the
# broker back only after the deadlines of the groups still in its queue had fired (placeholders
# for rollouts that were merely delayed). One attempt a second per broker costs nothing.
RECONNECT_BACKOFF_MAX_MS = 1000


def producer_defaults(bootstrap_servers: str, max_record_bytes: int) -> dict:
    """Idempotent, acks=all, small linger (batching without adding visible latency), the
    contract's partitioner (murmur2 of the key, as Kafka's Java client: librdkafka's default
    would place group ids in other partitions than the stage expects), a reconnect back-off
    that finds a broker back within a second, and librdkafka's own log lines rate limited
    through ``logging`` (stage.client.connection)."""
    return {"bootstrap.servers": bootstrap_servers, "enable.idempotence": True, "acks": "all",
            "linger.ms": 5, "message.max.bytes": max(max_record_bytes + (1 << 20), 1_000_000),
            "partitioner": LIBRDKAFKA_PARTITIONER, "reconnect.backoff.max.ms": RECONNECT_BACKOFF_MAX_MS,
            "logger": kafka_logger()}


class StagingProducer:
    """The shared producer of the input topics (thread-safe, like confluent-kafka's Producer).

    ``config`` adds or overrides librdkafka properties; ``producer`` injects a ready Producer
    instead. ``framing="confluent"`` writes Schema Registry framing (``schema_registry_url``;
    ``schema_registry_config``: registry client properties such as ``basic.auth.user.info`` and
    ``ssl.ca.location``, stage.client.registry).
    ``on_delivery(Delivery)`` sees every acknowledgement (``send_*``/``produce`` also take a
    per-record ``on_delivery``: e.g. to learn a staged call's Kafka coordinates).
    ``connect_timeout``: the first record queued also asks the cluster for its metadata, at most
    this long, and raises ``BrokerUnreachable`` (one line naming the address) when no broker
    answers, instead of records unacknowledged a minute later (None: no such check; a producer
    passed in as ``producer`` is never checked).
    ``routes_by_reference`` (default True): a staged call's routes go to ``topics.staged_routes``
    as chunks of ``route_chunk_bytes`` (default: ``DEFAULT_ROUTE_CHUNK_BYTES``, or less where
    ``max_record_bytes`` needs it; a value that leaves no room for the rest of a RouteChunk
    under ``max_record_bytes`` is refused here) and the StagedCall names them (``routes_ref``),
    produced once every chunk is acknowledged. False: the routes ride inside the StagedCall,
    for stages that predate routes by reference.
    """

    def __init__(self, bootstrap_servers: str | None = None, *, topics: TopicNames | None = None,
                 config: Mapping[str, Any] | None = None, producer: Producer | None = None,
                 framing: str = "plain", schema_registry_url: str | None = None,
                 schema_registry_config: Mapping[str, Any] | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                 on_delivery: DeliveryCallback | None = None,
                 connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S,
                 routes_by_reference: bool = True, route_chunk_bytes: int | None = None) -> None:
        self.routes_by_reference = bool(routes_by_reference)
        self.route_chunk_bytes = route_chunk_size(max_record_bytes, route_chunk_bytes)
        self.max_record_bytes = max_record_bytes
        self.bootstrap_servers = bootstrap_servers
        self._unchecked = producer is None and connect_timeout is not None
        self._unreachable: BrokerUnreachable | None = None   # once found: every produce raises it
        self.connect_timeout = connect_timeout
        if producer is None:
            if not bootstrap_servers:
                raise ValueError("StagingProducer needs bootstrap_servers or a producer")
            producer = Producer({**producer_defaults(bootstrap_servers, max_record_bytes),
                                 **(config or {})})
        self.producer = producer
        self.topics = topics or TopicNames()
        registry = None
        if framing == "confluent":
            if not schema_registry_url:
                raise ValueError("framing 'confluent' needs schema_registry_url")
            from stage.client.registry import schema_registry_client
            registry = schema_registry_client(schema_registry_url, schema_registry_config)
        self.codecs = {
            name: AvroCodec(name, framing=framing, registry=registry,
                            subject=value_subject(topic), max_record_bytes=max_record_bytes)
            for name, topic in (("StagedCall", self.topics.staged_calls),
                                ("ReceiptEvent", self.topics.receipts),
                                ("RouteChunk", self.topics.staged_routes))}
        self._chunks = ChunkEncoder(self.codecs["RouteChunk"])
        self._hasher = ChunkHasher()
        self.on_delivery = on_delivery
        self._lock = threading.Lock()
        self._contact = threading.Lock()
        self._failures: list[DeliveryFailure] = []
        self.produced = 0
        self.delivered = 0
        self.produced_bytes = 0
        self._deferred = 0     # staged calls whose chunks or own record are not acknowledged yet
        self._ready: deque = deque()   # (PendingCall, record) the callback could not queue

    # -- records of the contract -----------------------------------------------------------
    def send_staged(self, group_id: str, value: Mapping[str, Any], *, headers=None,
                    on_delivery: DeliveryCallback | None = None,
                    _chunk_digests: Callable[[], list[str]] | None = None) -> int:
        """Encode and produce one StagedCall value (``stage.client.records``); returns the bytes
        queued. With ``routes_by_reference`` and inline ``routed_experts`` in ``value``: its
        route chunks now, the StagedCall (``routes_ref`` set, ``routed_experts`` null) once
        they are acknowledged; ``on_delivery`` and ``headers`` are the StagedCall's. Anything
        that cannot be encoded or exceeds ``max_record_bytes`` raises WireError before a
        record is produced."""
        routes = value.get("routed_experts")
        if routes is None or not self.routes_by_reference or value.get("routes_ref") is not None:
            return self.produce(self.topics.staged_calls, group_id,
                                self.codecs["StagedCall"].encode(value), headers=headers,
                                on_delivery=on_delivery)
        return self._send_by_reference(group_id, value, routes, headers, on_delivery, _chunk_digests)

    def chunk_digests(self, raw) -> Callable[[], list[str]] | None:
        """For ``RolloutStager.stage``: start hashing the route chunks ``raw`` (a call's route
        payload) will be sent as, beside the caller's own work (``ChunkHasher``); None when
        routes do not go by reference."""
        return self._hasher.start(raw, self.route_chunk_bytes) if self.routes_by_reference else None

    def send_receipt(self, group_id: str, value: Mapping[str, Any], **kwargs) -> int:
        """Encode and produce one ReceiptEvent value (``receipt_event``); returns bytes."""
        return self.produce(self.topics.receipts, group_id,
                            self.codecs["ReceiptEvent"].encode(value), **kwargs)

    # -- routes by reference (claim-check) ---------------------------------------------------
    def _send_by_reference(self, group_id: str, value: Mapping[str, Any], routes, headers,
                           on_delivery, chunk_digests=None) -> int:
        payload = RoutePayload.of(routes, value.get("delta_len"))
        call = {**value, "routed_experts": None, "routes_ref": None}
        staging_key = call.get("staging_key")
        pieces = payload.pieces(self.route_chunk_bytes)
        codec = self.codecs["StagedCall"]
        try:    # the staged call's own size, checked before anything is produced
            size = len(codec.encode(call)) - 1 + reference_bytes(self.topics.staged_routes, len(pieces))
        except WireError as error:
            if "max_record_bytes" not in str(error):
                raise
            size = None
        if size is None or size > codec.max_record_bytes:
            raise WireError(
                f"StagedCall {staging_key} is {'over' if size is None else f'{size} bytes, over'} "
                f"max_record_bytes={codec.max_record_bytes} even without its routes (they go by reference "
                f"to {self.topics.staged_routes}): its token columns, media or top-k are too large for "
                "one record; raise max_record_bytes together with the topic's max.message.bytes, "
                "or stage the call's tokens in more calls")
        digests = chunk_digests() if chunk_digests is not None else None
        records, digests = self._encode_chunks(group_id, staging_key, pieces, digests)
        pending = PendingCall(group_id, call, payload, [p.nbytes for p in pieces], digests,
                              self.topics.staged_routes)
        pending.headers, pending.on_delivery = headers, on_delivery
        with self._lock:
            self._deferred += 1
        self._drain_ready()
        self._queue_chunks(pending, records)
        if self._unchecked:
            try:
                self._first_contact()
            except BaseException:
                if pending.abandon(len(records)):
                    self._settle()
                raise
        self.producer.poll(0)
        return sum(map(len, records))

    def _encode_chunks(self, group_id: str, staging_key: str, pieces,
                       known: list[str] | None = None) -> tuple[list[bytes], list[str]]:
        """``known``: the pieces' digests, computed already (a list of another length is ignored)."""
        if known is not None and len(known) != len(pieces):
            known = None
        records, digests = [], []
        for index, piece in enumerate(pieces):    # every chunk encoded before one is produced
            record, digest = self._chunks.encode(group_id, staging_key, index, len(pieces), piece,
                                                 digest=None if known is None else known[index])
            records.append(record)
            digests.append(digest)
        return records, digests

    def _queue_chunks(self, pending: PendingCall, records: list[bytes]) -> None:
        """Produce a call's chunks; if that raises part way, only the queued ones' reports are
        awaited and the staged call is never produced."""
        key, queued = pending.group_id.encode("utf-8"), 0
        try:
            for index, record in enumerate(records):
                self._queue(self.topics.staged_routes, key, record, None,
                            lambda d, index=index: self._chunk_delivered(pending, index, d))
                queued += 1
        except BaseException:
            if pending.abandon(queued):
                self._settle()
            raise

    def _resend_chunks(self, pending: PendingCall) -> None:
        """A round whose chunks came back without offsets, produced again (same bytes, same
        digests); a failure to queue them is the staged call's failure, named at flush."""
        try:
            records, _ = self._encode_chunks(pending.group_id, pending.staging_key,
                                             pending.payload.pieces(self.route_chunk_bytes))
            self._queue_chunks(pending, records)
        except Exception as error:
            self._fail(self.topics.staged_calls, pending.group_id,
                       f"StagedCall {pending.staging_key} not produced: resending its route chunks "
                       f"failed: {type(error).__name__}: {error}", not_produced=True)
            if not pending.abandoned and pending.abandon(0):
                self._settle()

    def _chunk_delivered(self, pending: PendingCall, index: int, delivery: Delivery) -> None:
        """A chunk's delivery report (a librdkafka callback: never raises)."""
        if not pending.report(index, delivery.partition, delivery.offset, delivery.error):
            return
        if not pending.abandoned and pending.rounds < MAX_CHUNK_ROUNDS and pending.offsets_unknown() \
                and not pending.any_failed():
            pending.resend_round()      # produced from the next produce, poll or flush: not from
            self._ready.append((pending, None))   # inside librdkafka's callback
            return
        try:
            call, why = pending.outcome()
            if call is None:
                if why is not None:
                    self._fail(self.topics.staged_calls, pending.group_id, why, not_produced=True)
                self._settle()
                return
            record = self.codecs["StagedCall"].encode(call)
        except Exception as error:   # a surprise: the call was encoded once already
            self._fail(self.topics.staged_calls, pending.group_id,
                       f"StagedCall {pending.staging_key} not produced: {type(error).__name__}: {error}",
                       not_produced=True)
            self._settle()
            return
        self._send_deferred(pending, record, block=False)

    def _send_deferred(self, pending: PendingCall, record: bytes, *, block: bool) -> None:
        """Queue a staged call whose chunks are all acknowledged (from a delivery callback:
        ``block=False``, a full queue leaves it to the next produce, poll or flush)."""
        def staged_delivered(delivery: Delivery) -> None:
            if delivery.error is None and delivery.partition != pending.partition:
                self._fail(delivery.topic, pending.group_id,
                           f"StagedCall {pending.staging_key} landed in partition {delivery.partition} "
                           f"of {delivery.topic}, its route chunks in partition {pending.partition} of "
                           f"{pending.topic}: the topics must have the same partition count")
            self._settle()
            if pending.on_delivery is not None:
                pending.on_delivery(delivery)

        try:
            if not self._queue(self.topics.staged_calls, pending.group_id.encode("utf-8"), record,
                               pending.headers, staged_delivered, block=block):
                self._ready.append((pending, record))
        except DeliveryError as error:
            with self._lock:
                self._failures.extend(error.failures)
            self._settle()

    def _drain_ready(self) -> None:
        """Queue the staged calls a delivery callback found no room for."""
        while True:
            try:
                pending, record = self._ready.popleft()
            except IndexError:
                return
            if record is None:          # its chunks, to produce again (_chunk_delivered)
                self._resend_chunks(pending)
            else:
                self._send_deferred(pending, record, block=True)

    def _fail(self, topic: str, group_id: str, error: str, *, not_produced: bool = False) -> None:
        with self._lock:
            self._failures.append(DeliveryFailure(topic, group_id.encode("utf-8"), error, not_produced))

    def _settle(self) -> None:
        with self._lock:
            self._deferred -= 1

    @property
    def deferred(self) -> int:
        """Staged calls waiting on their route chunks or on their own acknowledgement."""
        with self._lock:
            return self._deferred

    # -- raw produce -----------------------------------------------------------------------
    def produce(self, topic: str, key: str | bytes | None, value: bytes, *, headers=None,
                on_delivery: DeliveryCallback | None = None) -> int:
        """Queue one record (non-blocking unless librdkafka's local queue is full, then it
        serves callbacks until there is room). Returns the value's size."""
        if isinstance(key, str):
            key = key.encode("utf-8")
        self._drain_ready()
        self._queue(topic, key, value, headers, on_delivery)
        if self._unchecked:   # after the record is queued: a record too large fails as such first
            self._first_contact()
        self.producer.poll(0)
        return len(value)

    def _queue(self, topic: str, key: bytes | None, value: bytes, headers, on_delivery,
               *, block: bool = True) -> bool:
        """Hand one record to librdkafka; False if its queue is full and ``block`` is off."""
        def delivered(err, msg, topic=topic, key=key):
            self._delivered(topic, key, err, msg, on_delivery)

        while True:
            try:
                self.producer.produce(topic, key=key, value=value, headers=headers,
                                      on_delivery=delivered)
                break
            except BufferError:
                if not block:
                    return False
                self.producer.poll(0.05)
            except KafkaException as error:  # e.g. message too large: fail here, loudly
                raise DeliveryError([DeliveryFailure(topic, key, str(error))]) from error
        with self._lock:
            self.produced += 1
            self.produced_bytes += len(value)
        return True

    def _first_contact(self) -> None:
        with self._contact:          # one probe at a time: the others then see its outcome
            if self._unchecked and self._unreachable is None:
                try:
                    reach(self.producer, self.bootstrap_servers, "StagingProducer", self.connect_timeout)
                except BrokerUnreachable as error:
                    self._unreachable = error
                else:
                    self._unchecked = False
            if self._unreachable is not None:
                raise self._unreachable

    def _delivered(self, topic, key, err, msg, callback) -> None:
        ok = err is None and msg is not None
        delivery = Delivery(topic, msg.partition() if ok else -1, msg.offset() if ok else -1, key,
                            None if ok else str(err))
        with self._lock:
            if ok:
                self.delivered += 1
            else:
                self._failures.append(DeliveryFailure(topic, key, delivery.error))
        for cb in (callback, self.on_delivery):
            if cb is not None:
                cb(delivery)

    def poll(self, timeout: float = 0.0) -> int:
        """Serve delivery callbacks; returns how many were served."""
        self._drain_ready()
        return self.producer.poll(timeout)

    @property
    def failures(self) -> list[DeliveryFailure]:
        with self._lock:
            return list(self._failures)

    def raise_for_errors(self) -> None:
        """Raise (and forget) the delivery failures collected so far."""
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise DeliveryError(failures)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until everything queued is acknowledged; DeliveryError on any failure or on
        records still unacknowledged after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:   # a staged call produced by its last chunk's callback is waited for too
            self._drain_ready()
            remaining = self.producer.flush(max(0.0, deadline - time.monotonic()))
            deferred = self.deferred
            if (not remaining and not deferred and not self._ready) or time.monotonic() >= deadline:
                break
            if not remaining and not self._ready:
                self.producer.poll(0.01)
        with self._lock:
            if remaining:
                self._failures.append(DeliveryFailure(
                    "*", None, f"{remaining} record(s) still unacknowledged after {timeout}s"))
            if deferred:
                self._failures.append(DeliveryFailure(
                    self.topics.staged_calls, None, f"{deferred} staged call(s) not acknowledged after "
                    f"{timeout}s (those waiting on their route chunks not produced yet)"))
        self.raise_for_errors()

    def close(self, timeout: float = 60.0) -> None:
        try:
            self.flush(timeout)
        finally:
            self._hasher.close()

    def __enter__(self) -> "StagingProducer":
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        try:
            if exc_type is None:
                self.flush()
            else:  # do not hide the original error behind a delivery error (nor wait for none)
                self.producer.flush(0 if self._unreachable is not None else 5)
        finally:
            self._hasher.close()


# ---------------------------------------------------------------------------------------------
# Inference workers


@dataclass(frozen=True, eq=False)
class PreparedCall:
    """One staged call before it is sent: the Gym record, its manifest row, the wire value."""

    group_id: str
    staged: StagedCall            # the staged call (base snapshot, extras, manifest row)
    manifest_row: CallRecord      # token-free coordinates the receipt names
    value: dict                   # the StagedCall Avro value

    @property
    def record(self) -> StagedCallRecord:
        """Gym's token-bearing StagedCallRecord (route envelopes written out on first use)."""
        return self.staged.record

    @property
    def staging_key(self) -> str:
        return self.manifest_row.staging_key


class RolloutStager:
    """Stages the model calls of one rollout (parents before children, as Gym admits them).

    ``stage()`` builds the record with Gym's digests, produces it keyed by ``group_id`` and
    returns the call's ``CallRecord`` (the token-free coordinates the rollout owner puts in
    the receipt); with the producer's ``routes_by_reference`` its routes go first, as chunks,
    and the StagedCall follows from their delivery callback (``flush()`` waits for both).
    ``prepare()`` does the same without producing: ``prepared.value`` holds the routes inline
    (send it with ``producer.send_staged(group_id, prepared.value)``, which moves them out)."""

    def __init__(self, producer: StagingProducer | None, group_id: str, rollout_id: str) -> None:
        self.producer = producer
        self.group_id = group_id
        self.builder = RolloutBuilder(rollout_id)
        self.reserved: frozenset[str] = frozenset()   # call ids the stage already holds

    @classmethod
    def rehydrated(cls, producer: StagingProducer | None, group_id: str, builder: RolloutBuilder,
                   reserved=()) -> "RolloutStager":
        """A stager continuing ``builder``'s calls (stage.client.resume): they are not produced
        again; ``reserved`` call ids (every id the stage holds for the rollout) are refused by
        ``prepare()``."""
        stager = cls(producer, group_id, builder.rollout_id)
        stager.builder, stager.reserved = builder, frozenset(reserved)
        return stager

    @property
    def rollout_id(self) -> str:
        return self.builder.rollout_id

    @property
    def manifest(self) -> list[CallRecord]:
        return [call.manifest_row for call in self.builder.calls.values()]

    def prepare(self, model_call_id: str, *, prompt_delta, generated, generated_logprobs,
                weight_version: int, parent_call_id: str | None = None, routed_experts=None,
                routed_experts_boundary=None, route_dtype: str = "int16",
                extras: Mapping[str, Any] | None = None, media: StagedMedia | None = None,
                topk: TopK | None = None, response_id: str | None = None,
                admitted_at: float | None = None, _route_views: bool = False,
                _routes_seen: Callable[[Any], None] | None = None) -> PreparedCall:
        """``prompt_delta``: tokens this call adds before generating (the whole prompt for a
        root, the new turn for a child); ``routed_experts``: ``[len(prompt_delta) +
        len(generated), L, K]``; ``routed_experts_boundary``: ``[1, L, K]``, the child's prefill
        route of its parent's last token; ``topk``: ``[len(generated), k]`` columns."""
        if model_call_id in self.reserved:
            raise ValueError(f"call {model_call_id!r} is already staged for rollout {self.rollout_id}: "
                             "a new call needs a new id (the stage keeps the first copy of a key)")
        boundary_index = None
        if routed_experts_boundary is not None:
            parent = self.builder.calls.get(parent_call_id) if parent_call_id else None
            if parent is None:
                raise ValueError("a boundary route belongs to a child call (its parent's last token)")
            boundary_index = parent.manifest_row.cum_len - 1
        # Routes stay arrays: their envelopes are digested as parts, never written as base64
        # text, and the wire value takes the tensors as they are.
        call_extras = route_envelopes(routed_experts, boundary=routed_experts_boundary,
                                      boundary_index=boundary_index, dtype=route_dtype, extras=extras)
        envelope = None if call_extras is None else call_extras.get(ROUTED_EXPERTS_FIELD)
        if _routes_seen is not None and isinstance(envelope, RouteEnvelope):
            _routes_seen(envelope.raw)   # stage(): the chunk digests start beside Gym's digest
        staged = self.builder.stage(
            model_call_id, parent_call_id=parent_call_id, prompt_delta=prompt_delta,
            generated=generated, generated_logprobs=generated_logprobs,
            weight_version=weight_version, extras=call_extras, response_id=response_id,
            admitted_at=admitted_at)
        if call_extras is not None and isinstance(call_extras.get(ROUTED_EXPERTS_FIELD), RouteEnvelope):
            row = staged_row_from_envelopes(staged.snapshot, call_extras, media=media, topk=topk)
            # stage(): the routes as a view of the envelope's (immutable) bytes, copied once, into
            # the record or its chunks; prepare(): bytes, as a value handed out always was
            value = staged_call_value(self.group_id, row, copy_routes=not _route_views)
        else:   # no routes, or the caller's own extras carry them: the general path
            value = staged_call_from_record(self.group_id, staged.record, media=media, topk=topk)
        return PreparedCall(self.group_id, staged, staged.manifest_row, value)

    def stage(self, model_call_id: str, **kwargs) -> CallRecord:
        """Prepare and produce one call; returns its manifest row (CallRecord)."""
        if self.producer is None:
            raise RuntimeError("this stager has no producer: use prepare()")
        digests = []

        def routes_seen(raw) -> None:
            digests.append(self.producer.chunk_digests(raw))

        prepared = self.prepare(model_call_id, **kwargs, _route_views=True, _routes_seen=routes_seen)
        # The digests were hashed from the envelope's bytes, the very bytes the value's routes
        # view (copy_routes=False), split at the producer's chunk size as send_staged splits them.
        self.producer.send_staged(self.group_id, prepared.value,
                                  _chunk_digests=digests[0] if digests and digests[0] else None)
        return prepared.manifest_row

    def receipt(self, terminal_model_call_id: str | None = None, *, order=None, reward=None,
                terminal_selection: str = "declared", capture_poisoned: bool = False,
                failure_reason: str | None = None) -> RolloutReceipt:
        """The rollout's receipt naming every staged call (admission order unless ``order``).
        Default terminal: the last staged call."""
        if terminal_model_call_id is None:
            terminal_model_call_id = next(reversed(self.builder.calls))
        receipt = self.builder.receipt(terminal_model_call_id, order=order, reward=reward,
                                       terminal_selection=terminal_selection)
        if capture_poisoned or failure_reason is not None:
            fields = receipt.to_json()
            fields.update(capture_poisoned=True, failure_reason=failure_reason)
            receipt = RolloutReceipt.from_json(fields)
        return receipt


# ---------------------------------------------------------------------------------------------
# The rollout owner


class ReceiptEmitter:
    """Emits the receipt event of each rollout of one prompt group (or its missing-receipt
    event: the row becomes a ``missing_receipt`` placeholder at once, no deadline wait)."""

    def __init__(self, producer: StagingProducer, *, group_id: str, group_size: int,
                 prompt_idx: int, fallback_weight_version: int = 0, labels=()) -> None:
        if group_size <= 0:
            raise ValueError(f"group_size must be positive, got {group_size}")
        self.producer = producer
        self.group_id = group_id
        self.group_size = group_size
        self.prompt_idx = prompt_idx
        self.fallback_weight_version = fallback_weight_version
        self.labels = tuple(labels)

    def event(self, rollout_index: int, receipt: RolloutReceipt | dict | None, *, reward: float,
              rollout_id: str | None = None, mask_sample: bool = False,
              loss_multiplier: float = 1.0, result_stats=()) -> dict:
        """The ReceiptEvent value (not produced)."""
        if not 0 <= rollout_index < self.group_size:
            raise ValueError(f"rollout_index must be in 0..{self.group_size - 1}, got {rollout_index}")
        if rollout_id is None:
            if receipt is None:
                raise ValueError("a missing-receipt event needs the rollout_id")
            rollout_id = receipt.rollout_id if isinstance(receipt, RolloutReceipt) else receipt["rollout_id"]
        return receipt_event(
            group_id=self.group_id, rollout_id=rollout_id, rollout_index=rollout_index,
            group_size=self.group_size, prompt_idx=self.prompt_idx, reward=reward, receipt=receipt,
            mask_sample=mask_sample, loss_multiplier=loss_multiplier,
            fallback_weight_version=self.fallback_weight_version,
            canonical_sample_id=f"{self.group_id}_g{rollout_index}", labels=self.labels,
            result_stats=result_stats)

    def emit(self, rollout_index: int, receipt: RolloutReceipt | dict | None, *, reward: float,
             **kwargs) -> dict:
        """Produce one rollout's receipt event; returns the value sent."""
        value = self.event(rollout_index, receipt, reward=reward, **kwargs)
        self.producer.send_receipt(self.group_id, value)
        return value

    def emit_missing(self, rollout_index: int, *, rollout_id: str, reward: float = 0.0,
                     **kwargs) -> dict:
        """The rollout produced no receipt (crashed, timed out): a placeholder row."""
        return self.emit(rollout_index, None, reward=reward, rollout_id=rollout_id, **kwargs)


__all__ = [
    "Delivery", "DeliveryError", "DeliveryFailure", "PreparedCall", "ReceiptEmitter", "RolloutStager",
    "StagingProducer", "producer_defaults",
]
