"""The producer's side of routes by reference (claim-check): a staged call's route payload is
written as ``RouteChunk`` records to the route topic first, and the ``StagedCall`` naming them
(``routes_ref``: partition, each chunk's offset, length and SHA-256) only once the broker has
acknowledged every chunk.

``StagingProducer.send_staged`` (stage.client.producer) drives it; this module holds what does
not need a Kafka client: the chunk size a record cap allows, the chunk records (encoded from
views of the payload: one copy, into the record), the size a reference adds to its staged call,
and ``PendingCall``, the state of one call between its first chunk and its staged call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from stage.staging.route_refs import (
    DEFAULT_ROUTE_CHUNK_BYTES,
    MAX_ROUTE_CHUNKS,
    ROUTE_ITEMSIZE,
    chunk_sha256,
    split_payload,
)
from stage.wire import AvroCodec, WireError, zigzag_long

# What a RouteChunk record holds besides its data, at most: group id and staging key (the stage
# accepts up to 4096 characters each, up to 16 KiB of UTF-8), index, count, the 64-character
# digest, the length prefixes and a Schema Registry header. A chunk size must leave this much
# room under the record cap.
ROUTE_CHUNK_ROOM = 64 << 10
# The bytes a RouteReference adds to a StagedCall besides its topic name: union branch, partition,
# dtype, shape (3 longs) and the array framing; and per chunk: offset, length (longs, up to 10
# bytes each) and the digest (a 2-byte length, 64 characters).
_REFERENCE_FIXED_BYTES = 64
_REFERENCE_CHUNK_BYTES = 10 + 10 + 2 + 64


def route_chunk_size(max_record_bytes: int, route_chunk_bytes: int | None = None) -> int:
    """The chunk payload size to use under ``max_record_bytes``: ``route_chunk_bytes`` if it
    leaves ``ROUTE_CHUNK_ROOM`` for the rest of the record (ValueError naming both settings
    otherwise); None: ``DEFAULT_ROUTE_CHUNK_BYTES``, or less where the cap needs it."""
    room = max_record_bytes - ROUTE_CHUNK_ROOM
    if route_chunk_bytes is None:
        if room < 1:
            raise ValueError(f"max_record_bytes={max_record_bytes} leaves no room for route chunks "
                             f"(a RouteChunk needs up to {ROUTE_CHUNK_ROOM} bytes besides its data)")
        return min(DEFAULT_ROUTE_CHUNK_BYTES, room)
    if type(route_chunk_bytes) is not int or route_chunk_bytes < 1:
        raise ValueError(f"route_chunk_bytes must be a positive int, got {route_chunk_bytes!r}")
    if route_chunk_bytes > room:
        raise ValueError(f"route_chunk_bytes={route_chunk_bytes} does not fit max_record_bytes="
                         f"{max_record_bytes}: a RouteChunk record needs up to {ROUTE_CHUNK_ROOM} bytes "
                         f"besides its data, so route_chunk_bytes must be <= {room}")
    return route_chunk_bytes


def reference_bytes(topic: str, chunks: int) -> int:
    """At most how many bytes a RouteReference of ``chunks`` chunks on ``topic`` adds to an
    encoded StagedCall whose ``routes_ref`` is null."""
    return _REFERENCE_FIXED_BYTES + len(topic.encode("utf-8")) + chunks * _REFERENCE_CHUNK_BYTES


class ChunkEncoder:
    """Encodes RouteChunk records from views of a payload. ``data`` is the record's last field,
    so the record is the codec's encoding with empty data, whose final byte (the zero length)
    is replaced by the data's length and the data: the view is copied once, into the record,
    never through the Avro writer's buffer. ``encode`` equals ``codec.encode`` of the full value."""

    def __init__(self, codec: AvroCodec) -> None:
        if codec.schema_name != "RouteChunk" or codec.schema["fields"][-1]["name"] != "data":
            raise ValueError("ChunkEncoder needs the RouteChunk codec, whose last field is data")
        self.codec = codec

    def encode(self, group_id: str, staging_key: str, index: int, count: int, data,
               digest: str | None = None) -> tuple[bytes, str]:
        """(the record, the data's SHA-256 hex); ``digest``: that hex, computed already (by
        ``ChunkHasher`` over these very bytes)."""
        view = memoryview(data).cast("B")
        if digest is None:
            digest = chunk_sha256(view)
        head = self.codec.encode({"group_id": group_id, "staging_key": staging_key, "index": index,
                                  "count": count, "sha256": digest, "data": b""})
        record = b"".join((head[:-1], zigzag_long(view.nbytes), view))
        if len(record) > self.codec.max_record_bytes:
            raise WireError(f"RouteChunk {index} of {staging_key} is {len(record)} bytes, over "
                            f"max_record_bytes={self.codec.max_record_bytes}: lower route_chunk_bytes")
        return record, digest


class ChunkHasher:
    """A call's chunk digests computed on a helper thread while the caller computes Gym's
    extras digest over the same routes (hashlib releases the GIL for buffers this size, so the
    two SHA-256 passes run side by side on two cores instead of one after the other). One job
    at a time: while the helper is busy (calls staged from several threads at once), or for a
    small payload, the caller hashes itself, when it needs the digests."""

    MIN_BYTES = 256 << 10   # below this, handing the work over costs about what it saves

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._busy = threading.Lock()
        self._start = threading.Lock()

    def start(self, raw, chunk_bytes: int) -> Callable[[], list[str]]:
        """Begin hashing ``raw``'s pieces of ``chunk_bytes``; returns what waits for (or, when
        not handed over, computes) their hex digests, in order. ``raw`` must not change until
        then."""
        pieces = split_payload(raw, chunk_bytes)
        if sum(p.nbytes for p in pieces) < self.MIN_BYTES or not self._busy.acquire(blocking=False):
            return lambda: [chunk_sha256(p) for p in pieces]
        try:
            future = self._executor().submit(self._hash, pieces)
        except BaseException:   # e.g. shut down: hash inline
            self._busy.release()
            return lambda: [chunk_sha256(p) for p in pieces]
        return future.result

    def _hash(self, pieces) -> list[str]:
        try:
            return [chunk_sha256(p) for p in pieces]
        finally:
            self._busy.release()

    def _executor(self) -> ThreadPoolExecutor:
        with self._start:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="route-chunk-sha256")
            return self._pool

    def close(self) -> None:
        with self._start:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


@dataclass(frozen=True)
class RoutePayload:
    """A staged call's routes as the reference describes them: raw little-endian bytes, C order."""

    dtype: str
    shape: tuple[int, int, int]
    data: memoryview

    @classmethod
    def of(cls, tensor: Mapping[str, Any], delta_len: int) -> "RoutePayload":
        """From the StagedCall value's ``routed_experts`` PackedTensor dict (checked)."""
        dtype, shape = tensor.get("dtype"), tensor.get("shape")
        if dtype not in ROUTE_ITEMSIZE:
            raise WireError(f"routed_experts dtype must be one of {sorted(ROUTE_ITEMSIZE)} to go by "
                            f"reference, got {dtype!r}", field="StagedCall.routed_experts")
        if not isinstance(shape, (list, tuple)) or len(shape) != 3 or any(
                type(d) is not int or d <= 0 for d in shape) or shape[0] != delta_len:
            raise WireError(f"routed_experts shape must be [delta_len={delta_len}, L, K], got {shape!r}",
                            field="StagedCall.routed_experts")
        data = memoryview(tensor.get("data", b"")).cast("B")
        want = shape[0] * shape[1] * shape[2] * ROUTE_ITEMSIZE[dtype]
        if data.nbytes != want:
            raise WireError(f"routed_experts holds {data.nbytes} bytes, its shape {list(shape)} of "
                            f"{dtype} needs {want}", field="StagedCall.routed_experts")
        return cls(dtype, (shape[0], shape[1], shape[2]), data)

    def pieces(self, chunk_bytes: int) -> list[memoryview]:
        pieces = split_payload(self.data, chunk_bytes)
        if len(pieces) > MAX_ROUTE_CHUNKS:
            raise WireError(f"routes of {self.data.nbytes} bytes make {len(pieces)} chunks of "
                            f"route_chunk_bytes={chunk_bytes}, more than a reference may name "
                            f"({MAX_ROUTE_CHUNKS}): raise route_chunk_bytes")
        return pieces


@dataclass(frozen=True)
class ChunkReport:
    partition: int
    offset: int
    error: str | None


class PendingCall:
    """One staged call whose chunks are in flight: collects their delivery reports (from any
    thread) and, when the last one is in, says what to do (``outcome``)."""

    def __init__(self, group_id: str, call: dict, payload: RoutePayload, lengths: list[int],
                 digests: list[str], topic: str) -> None:
        self.group_id = group_id
        self.call = call                  # the StagedCall value, routes_ref to be set
        self.payload = payload
        self.lengths = lengths
        self.digests = digests
        self.topic = topic
        self.expected = len(lengths)
        self.reports: dict[int, ChunkReport] = {}
        self.abandoned = False            # produce raised part way: no staged call, ever
        self.rounds = 1                   # times its chunks were produced (resent_round)
        self.partition: int | None = None  # where the chunks landed, once all are in
        self.headers = None               # the StagedCall's, and its per-record delivery callback
        self.on_delivery = None
        self._lock = threading.Lock()

    @property
    def staging_key(self) -> str:
        return self.call["staging_key"]

    def report(self, index: int, partition: int, offset: int, error: str | None) -> bool:
        """Record chunk ``index``'s delivery; True when it was the last one awaited."""
        with self._lock:
            if index in self.reports:
                return False
            self.reports[index] = ChunkReport(partition, offset, error)
            return len(self.reports) == self.expected

    def offsets_unknown(self) -> list[int]:
        """Chunks acknowledged without their offset: librdkafka reports an idempotent
        producer's retry of a record the broker had already written (DUPLICATE_SEQUENCE_NUMBER)
        as delivered at offset -1001 (confluent-kafka: ``offset()`` None). Such a chunk is in
        the log but nothing can name it."""
        with self._lock:
            return sorted(i for i, r in self.reports.items()
                          if r.error is None and (r.offset is None or r.offset < 0))

    def any_failed(self) -> bool:
        with self._lock:
            return any(r.error is not None for r in self.reports.values())

    def resend_round(self) -> None:
        """Every chunk is produced again (a fresh, ordered set of offsets; the earlier copies
        stay in the route topic unreferenced until its retention deletes them)."""
        with self._lock:
            self.reports.clear()
            self.rounds += 1

    def abandon(self, queued: int) -> bool:
        """Produce failed after ``queued`` chunks were queued: only their reports are awaited,
        and the staged call is never produced. True when none is awaited any more."""
        with self._lock:
            self.abandoned = True
            self.expected = queued
            return len(self.reports) >= queued

    def outcome(self) -> tuple[dict | None, str | None]:
        """(the StagedCall value with its reference, None), or (None, why it is not produced),
        or (None, None) when it was abandoned (its caller saw the error)."""
        if self.abandoned:
            return None, None
        count = len(self.lengths)
        failed = [(i, r.error) for i, r in sorted(self.reports.items()) if r.error is not None]
        if failed:
            shown = ", ".join(f"{i}" for i, _ in failed[:8]) + (" ..." if len(failed) > 8 else "")
            return None, (f"StagedCall {self.staging_key} not produced: route chunk(s) {shown} of {count} "
                          f"to {self.topic} not delivered ({failed[0][1]})")
        reports = [self.reports[i] for i in range(count)]
        unknown = [i for i, r in enumerate(reports) if r.offset is None or r.offset < 0]
        if unknown:
            return None, (f"StagedCall {self.staging_key} not produced: route chunk(s) "
                          f"{', '.join(map(str, unknown[:8]))} of {count} to {self.topic} were acknowledged "
                          f"without an offset {self.rounds} time(s) in a row (an idempotent producer's "
                          "retry of a record already written), so no reference can name them")
        partitions = sorted({r.partition for r in reports})
        if len(partitions) != 1:
            return None, (f"StagedCall {self.staging_key} not produced: its route chunks landed in "
                          f"partitions {partitions} of {self.topic}, not one (keyed by group id, they "
                          "must share a partition)")
        offsets = [r.offset for r in reports]
        if any(b <= a for a, b in zip(offsets, offsets[1:])):
            return None, (f"StagedCall {self.staging_key} not produced: its route chunks' offsets "
                          f"{offsets} in {self.topic} are not in payload order (enable.idempotence "
                          "keeps a partition's records in order)")
        self.partition = partitions[0]
        reference = {"topic": self.topic, "partition": self.partition, "dtype": self.payload.dtype,
                     "shape": list(self.payload.shape),
                     "chunks": [{"offset": o, "length": n, "sha256": d}
                                for o, n, d in zip(offsets, self.lengths, self.digests)]}
        return {**self.call, "routes_ref": reference}, None


# Rounds of a call's chunks before its staged call fails for chunks acknowledged without offsets.
MAX_CHUNK_ROUNDS = 3

__all__ = ["MAX_CHUNK_ROUNDS", "ROUTE_CHUNK_ROOM", "ChunkEncoder", "ChunkHasher", "PendingCall", "RoutePayload", "reference_bytes",
           "route_chunk_size"]
