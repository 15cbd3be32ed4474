"""Deferred router replay, the policy worker's side: ``DeferredRouteFetcher`` reads a row's
staged route fragments back by the Kafka coordinates its RoutePlan names and runs the shared
route executor (``stage.routes.execute_route_plan``) with the model's (L, K). A failure gives an
all ``-1`` route tensor of the row's length and a counted reason (``failures``).

Fetched fragments are kept in an LRU bounded by bytes (``cache_bytes``): the route tensors are
views of the fetched records' route bytes (nothing else of a record is kept), and a fragment
that passed its integrity check against a digest is never checked against that digest again.

Routes staged by reference (a plan span with ``chunks``, stage.staging.route_refs): the fetcher
reads exactly the RouteChunk records the reference names on the route topic (never the staged
calls), checks each against the reference (identity, index, length, declared SHA-256), copies
it into the call's one payload buffer (sized by the checked reference, allocated once; a call
of one chunk uses that chunk's bytes as they are) and builds the fragment from it; the extras digest over the joined payload is the integrity check,
run once per fragment. The stage never read these bytes (deferred mode): this is where they are
verified. A failure is one reason a row in ``failures``: chunk_missing, chunk_mismatch,
chunk_corrupt (the extras digest failed and a chunk's SHA-256 names the wrong one),
invalid_reference; the row's routes are all ``-1``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from stage.client.assembly import TrainingGroup, route_plan_from_record
from stage.client.connection import DEFAULT_CONNECT_TIMEOUT_S, reach
from stage.client.consuming import (
    DEFAULT_MAX_RECORD_BYTES,
    ClientLog,
    UnreadableRecord,
    codec_for,
    oversize_error,
    reader_defaults,
    take,
)
from stage.decode import staged_route_fragment
from stage.routes import (
    ROUTE_ENCODING_ENVELOPE,
    ROUTE_ENCODING_LIST,
    ROUTE_FAILURE_CHUNK_CORRUPT,
    ROUTE_FAILURE_CHUNK_MISMATCH,
    ROUTE_FAILURE_CHUNK_MISSING,
    ROUTE_FAILURE_INTEGRITY,
    ROUTE_FAILURE_INVALID_REFERENCE,
    ROUTE_MISSING_SENTINEL,
    ROUTED_EXPERTS_FALLBACK_DTYPE,
    RouteFragment,
    execute_route_plan,
    resolve_device,
    verify_route_fragment_integrity,
)
from stage.routes.fragment import readonly_tensor
from stage.staging.route_refs import RouteReference, RouteReferenceError, check_chunk, chunk_sha256
from stage.wire import TopicNames, WireError, unpack_tensor

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 1 << 30
# The largest payload one reference may name before anything is allocated for it (a frontier
# 128k-token call, 40x22 uint16, is 225 MB).
DEFAULT_MAX_FRAGMENT_BYTES = 1 << 31
_ROUTE_NUMPY = {"int8": "<i1", "int16": "<i2", "int32": "<i4"}
_ENTRY_OVERHEAD = 1024   # the entry, its key, the fragment object and its metadata text


@dataclass(frozen=True)
class _DigestSpan:
    """What the integrity check reads of a plan span."""

    extras_digest_version: int
    extras_digest: str


@dataclass(frozen=True, eq=False)
class FetchedFragment:
    """What the fetcher keeps of one StagedCall: its staging key and its route fragment."""

    staging_key: str
    fragment: RouteFragment | None    # None: the call staged no routes
    # staged by reference: the reference the chunks were checked against, and the joined
    # payload the fragment's routes are a view of (hashed chunk by chunk to name a corrupt one)
    reference: RouteReference | None = None
    payload: np.ndarray | None = None     # uint8

    @property
    def nbytes(self) -> int:
        f = self.fragment
        if f is None:
            return _ENTRY_OVERHEAD
        side = 0 if f.boundary_routes is None else f.boundary_routes.nbytes
        return f.routes.nbytes + side + len(f.extras_metadata_json) + _ENTRY_OVERHEAD


def _long(view, at: int) -> tuple[int, int]:
    """One Avro long (zigzag varint) at ``at``: (value, next position); IndexError past the end."""
    shift = result = 0
    while True:
        byte = view[at]
        at += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), at
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def plain_route_chunk(value) -> dict | None:
    """A plain-framed RouteChunk record whose ``data`` is a view of ``value`` (no copy of the
    payload), or None when the bytes are not exactly one such record (the codec then decodes
    them and says why). Field order and types are the schema's (schemas/RouteChunk.avsc)."""
    view = memoryview(value).cast("B")
    try:
        out, at = {}, 0
        for name in ("group_id", "staging_key", "index", "count", "sha256", "data"):
            number, at = _long(view, at)
            if name in ("index", "count"):
                if not -(1 << 31) <= number < (1 << 31):
                    return None
                out[name] = number
                continue
            if number < 0 or at + number > len(view):
                return None
            field = view[at:at + number]
            at += number
            out[name] = field if name == "data" else str(field, "utf-8")
        return out if at == len(view) else None
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


class RouteChunkError(Exception):
    """Why a by-reference fragment could not be built: ``reason`` is one of
    stage.routes.ROUTE_CHUNK_FAILURE_REASONS, the text says which chunk and why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class _RefWant:
    """One by-reference span the plans name: its checked reference and the chunks' identity."""

    reference: RouteReference
    group_id: str
    staging_key: str
    encoding: int
    metadata: bytes                # extras_metadata_json, UTF-8
    boundary: torch.Tensor | None  # [1, L, K], checked


def ref_key(span: Mapping[str, Any]) -> tuple:
    """The cache key of a by-reference span's fragment: where its chunks are."""
    ref = span["chunks"]["reference"]
    return ("chunks", ref["topic"], ref["partition"], ref["dtype"], tuple(ref["shape"]),
            tuple(c["offset"] for c in ref["chunks"]))


class _Joining:
    """One call's payload while its chunks arrive: the buffer (allocated on the first chunk)
    and the chunks still missing."""

    __slots__ = ("want", "buffer", "missing", "starts")

    def __init__(self, want: _RefWant) -> None:
        self.want = want
        self.buffer: np.ndarray | None = None   # uint8: the payload, or its only chunk's bytes
        self.missing = len(want.reference.chunks)
        self.starts = want.reference.start


class DeferredRouteFetcher:
    """Rebuild a row's routed experts from its RoutePlan by fetching the staged fragments at
    their Kafka coordinates; the shared executor assembles them with the model's ``dims``.

    ``routes(plan)`` always returns an int16 ``[len, L, K]`` tensor: on any failure (fragment
    gone, undecodable, another key at that offset, integrity or shape mismatch) it is all
    ``-1`` and the executor's reason is counted in ``failures``. Fetched fragments are cached,
    least recently used first out, within ``cache_bytes`` (route bytes plus ~1 KiB an entry;
    0: no cache); a fragment bigger than the budget is used and not kept. ``verified`` counts
    integrity checks run, ``verified_cached`` the ones answered from a fragment's earlier check.
    Spans staged by reference (``chunks``) are fetched from the route topic chunk by chunk
    (module doc); ``chunks_fetched`` counts the chunk records read, ``max_fragment_bytes``
    bounds one reference's payload (checked before anything is allocated for it).
    ``attach`` runs a group's checks, while its records are still being read, and then the
    rows' assembly on ``verify_threads`` threads (default: up to 4 cores; 1: all inline, in the
    executor). ``max_record_bytes``: the stage's (as for
    CanonicalReader): the StagedCall decode cap and the fetch limits follow it.
    A fetch response too large for its limits (a staged call over this fetcher's
    ``max_record_bytes``) raises ``UnreadableRecord`` naming the value to set.
    ``connect_timeout``: the first fetch that needs the broker asks the cluster for its
    metadata, at most this long; ``BrokerUnreachable`` (one line naming the address) when no
    broker answers, rather than every row's routes failing one fetch timeout after another.
    """

    def __init__(self, bootstrap_servers: str, *, dims: tuple[int, int], device="cpu",
                 config: Mapping[str, Any] | None = None, framing: str = "plain",
                 schema_registry_url: str | None = None,
                 schema_registry_config: Mapping[str, Any] | None = None, timeout: float = 10.0,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, max_gap: int = 256, max_chunk_gap: int = 16,
                 verify_threads: int | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 max_fragment_bytes: int = DEFAULT_MAX_FRAGMENT_BYTES) -> None:
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self.dims = (int(dims[0]), int(dims[1]))
        self.device = resolve_device(device)
        self.timeout = timeout
        self.max_gap = max_gap
        self.max_chunk_gap = max_chunk_gap   # chunk records skipped rather than a new assign
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        self.cache: OrderedDict[tuple[str, int, int], FetchedFragment] = OrderedDict()
        # fragment -> {(extras_digest_version, extras_digest): passed}: gone with the fragment
        self._checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.verify_threads = min(4, os.cpu_count() or 1) if verify_threads is None else verify_threads
        self._pool: ThreadPoolExecutor | None = None
        self.codec = codec_for("StagedCall", TopicNames().staged_calls, framing, schema_registry_url,
                               max_record_bytes, schema_registry_config)
        self.chunk_codec = codec_for("RouteChunk", TopicNames().staged_routes, framing,
                                     schema_registry_url, max_record_bytes, schema_registry_config)
        self.max_fragment_bytes = max_fragment_bytes
        # Random access to records known to exist: never let the broker hold a fetch open.
        self._log = ClientLog()      # librdkafka only logs a fetch response too large to receive
        self.max_record_bytes = max_record_bytes
        conf = {**reader_defaults(bootstrap_servers, f"route-fetcher-{uuid.uuid4().hex}", max_record_bytes),
                "enable.partition.eof": True, "fetch.wait.max.ms": 10, "auto.offset.reset": "error",
                "logger": self._log, **(config or {})}
        self.consumer = Consumer(conf)
        self.bootstrap_servers, self.connect_timeout = bootstrap_servers, connect_timeout
        self._reached = False      # set by the first fetch that needs the broker
        self.failures: Counter = Counter()
        self.executed = 0
        self.fetched = 0
        self.chunks_fetched = 0
        self.verified = 0
        self.verified_cached = 0

    # -- fetching ----------------------------------------------------------------------------
    def fetch(self, coordinates, on_fragment=None) -> dict[tuple[str, int, int], FetchedFragment | Exception]:
        """(topic, partition, offset) -> FetchedFragment, or the Exception that explains its absence.
        ``on_fragment(coordinates, entry)`` is called for each fragment as soon as it is at hand
        (a cache hit, or a record just decoded), so its checks can start while the rest is read."""
        wanted = sorted(set(coordinates))
        out = {}
        for c in wanted:
            hit = self.cache.get(c)
            if hit is not None:
                self.cache.move_to_end(c)
                out[c] = hit
                if on_fragment is not None:
                    on_fragment(c, hit)
        by_tp: dict[tuple[str, int], list[int]] = {}
        for topic, partition, offset in wanted:
            if (topic, partition, offset) not in out:
                by_tp.setdefault((topic, partition), []).append(offset)
        if by_tp and not self._reached:
            reach(self.consumer, self.bootstrap_servers, "DeferredRouteFetcher", self.connect_timeout)
            self._reached = True
        for (topic, partition), offsets in by_tp.items():
            run = [offsets[0]]
            for offset in offsets[1:]:
                if offset - run[-1] > self.max_gap:
                    self._remember(self._read_run(topic, partition, run, on_fragment), out)
                    run = []
                run.append(offset)
            self._remember(self._read_run(topic, partition, run, on_fragment), out)
        return out

    # -- routes staged by reference ----------------------------------------------------------
    def want_of(self, plan: Mapping[str, Any], span: Mapping[str, Any]) -> _RefWant:
        """A by-reference span checked completely (RouteChunkError ``invalid_reference``
        otherwise) before anything is allocated for it: the reference (chunk lengths within
        this reader's max_record_bytes, shape against staged_route_len), its payload within
        ``max_fragment_bytes``, the route encoding, the metadata and the boundary route."""
        chunks = span["chunks"]
        try:
            if span.get("fragment") is not None:
                raise ValueError("a span names an inline fragment and chunks both")
            reference = RouteReference.from_value(chunks["reference"], max_chunk_bytes=self.max_record_bytes,
                                                  delta_len=span["staged_route_len"])
            if reference.payload_bytes > self.max_fragment_bytes:
                raise ValueError(f"payload of {reference.payload_bytes} bytes exceeds this fetcher's "
                                 f"max_fragment_bytes ({self.max_fragment_bytes})")
            encoding = chunks["route_encoding"]
            if encoding not in (ROUTE_ENCODING_ENVELOPE, ROUTE_ENCODING_LIST):
                raise ValueError(f"route encoding {encoding!r} is not 1 (envelope) or 2 (list)")
            metadata = chunks["extras_metadata_json"]
            if not isinstance(metadata, str):
                raise ValueError("extras_metadata_json is not a string")
            boundary = None
            if chunks.get("boundary") is not None:
                array = unpack_tensor(chunks["boundary"], expect_dtypes=tuple(_ROUTE_NUMPY), expect_ndim=3,
                                      field="chunks.boundary")
                if array.shape[0] != 1 or tuple(array.shape[1:]) != reference.shape[1:]:
                    raise ValueError(f"boundary route {tuple(array.shape)} is not one row of the "
                                     f"routes' {list(reference.shape[1:])}")
                boundary = readonly_tensor(array)
        except (RouteReferenceError, WireError, ValueError, KeyError, TypeError) as error:
            raise RouteChunkError(ROUTE_FAILURE_INVALID_REFERENCE,
                                  f"{span.get('staging_key')!r}: {error}") from None
        return _RefWant(reference, plan["group_id"], span["staging_key"], encoding,
                        metadata.encode("utf-8"), boundary)

    def wants_of(self, plans) -> dict[tuple, _RefWant]:
        """Every usable by-reference span of ``plans``, by its key (``ref_key``); unusable ones
        are left to ``routes``, which reports them."""
        out: dict[tuple, _RefWant] = {}
        for plan in plans:
            for span in plan["spans"]:
                if span.get("chunks") is None:
                    continue
                try:
                    out.setdefault(ref_key(span), self.want_of(plan, span))
                except (RouteChunkError, KeyError, TypeError):
                    continue
        return out

    def fetch_chunks(self, wants: Mapping[tuple, _RefWant], on_fragment=None) -> dict:
        """ref_key -> FetchedFragment built from exactly the chunks its reference names, or the
        RouteChunkError saying why not. Chunks are read partition by partition, a run of
        nearby offsets (``max_chunk_gap``) with one assign; each is checked (identity, index,
        length, declared SHA-256; its bytes are hashed only if the extras digest later fails)
        and copied into its call's one buffer. ``on_fragment(key, entry)`` as in ``fetch``."""
        out: dict = {}
        joins: dict[tuple, _Joining] = {}
        for key, want in wants.items():
            hit = self.cache.get(key)
            if hit is not None and hit.staging_key == want.staging_key:
                self.cache.move_to_end(key)
                out[key] = hit
                if on_fragment is not None:
                    on_fragment(key, hit)
            else:
                joins[key] = _Joining(want)
        by_tp: dict[tuple[str, int], dict[int, list]] = {}
        for key, join in joins.items():
            ref = join.want.reference
            offsets = by_tp.setdefault((ref.topic, ref.partition), {})
            for index, chunk in enumerate(ref.chunks):
                offsets.setdefault(chunk.offset, []).append((key, index))
        if by_tp and not self._reached:
            reach(self.consumer, self.bootstrap_servers, "DeferredRouteFetcher", self.connect_timeout)
            self._reached = True
        fresh: dict = {}
        for (topic, partition), targets in by_tp.items():
            offsets = sorted(targets)
            run = [offsets[0]]
            for offset in offsets[1:]:
                if offset - run[-1] > self.max_chunk_gap:
                    self._read_chunk_run(topic, partition, run, targets, joins, fresh, on_fragment)
                    run = []
                run.append(offset)
            self._read_chunk_run(topic, partition, run, targets, joins, fresh, on_fragment)
        for key in joins:
            if key not in fresh:   # never: every chunk ends fetched or failed
                fresh[key] = RouteChunkError(ROUTE_FAILURE_CHUNK_MISSING, "chunks not fetched")
        self._remember(fresh, out)
        return out

    def _read_chunk_run(self, topic: str, partition: int, run: list[int], targets: dict,
                        joins: dict, fresh: dict, on_fragment) -> None:
        """Read one partition forward over ``run`` (sorted offsets), one assign."""
        pending = set(run)
        at = 0     # run[at]: the lowest offset that may still be pending

        def fail(offset: int, reason: str, detail: str) -> None:
            pending.discard(offset)
            for key, index in targets[offset]:
                if key not in fresh:
                    joins[key].buffer = None
                    fresh[key] = RouteChunkError(reason, f"route chunk {index} of {joins[key].want.staging_key} "
                                                         f"at {topic}[{partition}]@{offset}: {detail}")

        self.consumer.assign([TopicPartition(topic, partition, run[0])])
        deadline = time.monotonic() + self.timeout
        try:
            while pending and time.monotonic() < deadline:
                span = min(500, max(pending) - min(pending) + 1)
                for msg in take(self.consumer, span, min(0.5, max(0.0, deadline - time.monotonic()))):
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            for offset in sorted(pending):
                                fail(offset, ROUTE_FAILURE_CHUNK_MISSING, "beyond the end of the log")
                        elif err.code() == KafkaError._AUTO_OFFSET_RESET:   # outside the log
                            try:
                                low, high = self.consumer.get_watermark_offsets(
                                    TopicPartition(topic, partition),
                                    timeout=max(0.1, deadline - time.monotonic()))
                            except KafkaException as error:   # what is left times out below
                                logger.warning("route chunk fetch %s[%d]: offsets unknown: %s",
                                               topic, partition, error)
                                break
                            for offset in sorted(pending):
                                if offset < low:
                                    fail(offset, ROUTE_FAILURE_CHUNK_MISSING,
                                         f"deleted or expired (the log starts at {low})")
                                elif offset >= high:
                                    fail(offset, ROUTE_FAILURE_CHUNK_MISSING, "beyond the end of the log")
                            if pending:
                                self.consumer.assign([TopicPartition(topic, partition, min(pending))])
                            break
                        else:
                            logger.warning("route chunk fetch %s[%d]: %s", topic, partition, err)
                        continue
                    offset = msg.offset()
                    while at < len(run) and run[at] < offset:   # deleted, compacted, control
                        if run[at] in pending:
                            fail(run[at], ROUTE_FAILURE_CHUNK_MISSING, "no record at this offset")
                        at += 1
                    if offset in pending:
                        pending.discard(offset)
                        self.chunks_fetched += 1
                        self._take_chunk(msg.value(), f"{topic}[{partition}]@{offset}", targets[offset],
                                         joins, fresh, on_fragment)
                    if not pending:
                        break
        finally:
            self.consumer.unassign()
        if pending and self._log.oversize is not None:   # every later fetch would fail the same way
            raise UnreadableRecord("route chunk, at or after", topic, partition, min(pending),
                                   oversize_error(*self._log.oversize, self.max_record_bytes),
                                   self.max_record_bytes)
        for offset in sorted(pending):
            fail(offset, ROUTE_FAILURE_CHUNK_MISSING, f"not fetched within {self.timeout}s")

    def _take_chunk(self, value: bytes, where: str, targets: list, joins: dict, fresh: dict,
                    on_fragment) -> None:
        """One chunk record into the payload of each call that names it."""
        record = None
        if self.chunk_codec.framing == "plain" and len(value) <= self.chunk_codec.max_record_bytes:
            record = plain_route_chunk(value)   # the payload stays a view of the message's bytes
        if record is None:
            try:
                record = self.chunk_codec.decode(value)
            except (WireError, ValueError, KeyError, TypeError) as error:
                record, error_text = None, f"not a RouteChunk record at {where}: {error}"
        for key, index in targets:
            if key in fresh:            # already failed
                continue
            join = joins[key]
            want = join.want
            if record is None:
                join.buffer = None
                fresh[key] = RouteChunkError(ROUTE_FAILURE_CHUNK_MISMATCH, error_text)
                continue
            try:
                data = check_chunk(want.reference, index, record, group_id=want.group_id,
                                   staging_key=want.staging_key, verify_digest=False)
            except RouteReferenceError as error:
                join.buffer = None
                fresh[key] = RouteChunkError(ROUTE_FAILURE_CHUNK_MISMATCH, str(error))
                continue
            if join.missing == 1 and join.buffer is None:   # the only chunk: its bytes, no copy
                join.buffer = np.frombuffer(data, dtype=np.uint8)
            else:
                if join.buffer is None:   # its size: the checked reference's, within max_fragment_bytes
                    join.buffer = np.empty(want.reference.payload_bytes, dtype=np.uint8)
                start = join.starts[index]
                join.buffer[start:start + len(data)] = np.frombuffer(data, dtype=np.uint8)
            join.missing -= 1
            if join.missing == 0:
                entry = fresh[key] = self._fragment_of(join)
                if on_fragment is not None:
                    on_fragment(key, entry)

    @staticmethod
    def _fragment_of(join: _Joining) -> FetchedFragment:
        want, ref = join.want, join.want.reference
        array = join.buffer.view(_ROUTE_NUMPY[ref.dtype]).reshape(ref.shape)
        fragment = RouteFragment(routes=readonly_tensor(array) if not array.flags.writeable else torch.from_numpy(array),
                                 encoding=want.encoding, extras_metadata_json=want.metadata,
                                 boundary_routes=want.boundary)
        return FetchedFragment(want.staging_key, fragment, reference=ref, payload=join.buffer)

    @staticmethod
    def corrupt_chunks(entry: FetchedFragment) -> list[str]:
        """The chunks of a by-reference fragment whose bytes do not match their SHA-256."""
        ref, view = entry.reference, memoryview(entry.payload)
        return [f"chunk {i} at {ref.topic}[{ref.partition}]@{c.offset}"
                for i, (c, start) in enumerate(zip(ref.chunks, ref.start))
                if chunk_sha256(view[start:start + c.length]) != c.sha256]

    def _remember(self, fetched: dict, out: dict) -> None:
        out.update(fetched)
        for coords, entry in fetched.items():
            if isinstance(entry, Exception):
                continue
            size = entry.nbytes
            if size > self.cache_bytes:
                continue   # used by this call, not kept
            self.cache[coords] = entry
            self.cached_bytes += size
        while self.cached_bytes > self.cache_bytes and self.cache:
            _coords, old = self.cache.popitem(last=False)
            self.cached_bytes -= old.nbytes

    def _integrity(self, span, fragment: RouteFragment) -> bool:
        """The executor's integrity check, run once per fragment and digest."""
        key = (getattr(span, "extras_digest_version", None), getattr(span, "extras_digest", None))
        with self._lock:
            seen = self._checked.setdefault(fragment, {})
            if key in seen:
                self.verified_cached += 1
                return seen[key]
        passed = verify_route_fragment_integrity(span, fragment)   # the hashing: no lock held
        with self._lock:
            self.verified += 1
            seen[key] = passed
        return passed

    def _checks_of(self, plans) -> dict[tuple, list[_DigestSpan]]:
        """Each fragment's distinct (digest version, digest) pairs the plans bind it to, by its
        key: (topic, partition, offset) of an inline fragment, ``ref_key`` of one by reference."""
        checks: dict[tuple, dict] = {}
        for plan in plans:
            for span in plan["spans"]:
                c = span["fragment"]
                digest = (span["extras_digest_version"], span["extras_digest"])
                if c is not None:
                    checks.setdefault((c["topic"], c["partition"], c["offset"]), {})[digest] = _DigestSpan(*digest)
                elif span.get("chunks") is not None:
                    try:
                        key = ref_key(span)
                    except (KeyError, TypeError):
                        continue
                    checks.setdefault(key, {})[digest] = _DigestSpan(*digest)
        return {coords: list(spans.values()) for coords, spans in checks.items()}

    def _pool_for(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.verify_threads, thread_name_prefix="route-verify")
        return self._pool

    def _read_run(self, topic: str, partition: int, offsets: list[int], on_fragment=None) -> dict:
        """Read one partition forward from offsets[0] to offsets[-1] (one assign)."""
        out: dict = {}
        wanted = set(offsets)
        self.consumer.assign([TopicPartition(topic, partition, offsets[0])])
        deadline = time.monotonic() + self.timeout
        try:
            while wanted and time.monotonic() < deadline:
                span = min(500, max(wanted) - min(wanted) + 1)
                for msg in take(self.consumer, span, min(0.5, max(0.0, deadline - time.monotonic()))):
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
                            key, fragment = staged_route_fragment(self.codec.decode(msg.value()))
                        except (WireError, ValueError, KeyError, TypeError) as error:
                            out[(topic, partition, offset)] = error
                        else:
                            entry = out[(topic, partition, offset)] = FetchedFragment(key, fragment)
                            if on_fragment is not None:
                                on_fragment((topic, partition, offset), entry)
                    if not wanted:
                        break
        finally:
            self.consumer.unassign()
        if wanted and self._log.oversize is not None:   # every later fetch would fail the same way
            raise UnreadableRecord("staged call (route fragment), at or after", topic, partition,
                                   min(wanted), oversize_error(*self._log.oversize, self.max_record_bytes),
                                   self.max_record_bytes)
        for offset in wanted:
            out[(topic, partition, offset)] = TimeoutError(f"not fetched within {self.timeout}s")
        return out

    # -- assembly ----------------------------------------------------------------------------
    def routes(self, plan: Mapping[str, Any], *, canonical_len: int | None = None,
               fetched: Mapping | None = None) -> torch.Tensor:
        """int16 ``[canonical_len, L, K]`` for one RoutePlan value (all -1 on failure)."""
        length = plan["expected_token_length"] if canonical_len is None else int(canonical_len)
        failure, fragments = self._fragments_for(plan, fetched)
        with self._lock:
            self.executed += 1
        if failure is None:
            try:
                routes, failure = execute_route_plan(route_plan_from_record(plan), fragments,
                                                     dims=self.dims, canonical_len=length,
                                                     device=self.device, integrity=self._integrity)
            except (TypeError, ValueError) as error:  # a malformed plan record
                routes, failure = None, f"invalid_plan: {error}"
        if failure is not None:
            logger.warning("routes of %s: %s", plan.get("sample_id"), failure)
            with self._lock:
                self.failures[failure.split(":", 1)[0]] += 1
            return torch.full((length, *self.dims), ROUTE_MISSING_SENTINEL,
                              dtype=ROUTED_EXPERTS_FALLBACK_DTYPE, device=self.device)
        return routes

    def _fragments_for(self, plan: Mapping[str, Any], fetched: Mapping | None):
        """(failure or None, staging_key -> RouteFragment) of one plan. A by-reference span
        that cannot be had is the row's failure (its chunk reason); its fragment is checked
        against the span's extras digest here, and when that fails its chunks are hashed to
        name the corrupt one (chunk_corrupt; fragment_integrity when every chunk is as its
        reference says: the reference itself commits to other bytes)."""
        inline = [s for s in plan["spans"] if s["fragment"] is not None]
        coords = {s["staging_key"]: (s["fragment"]["topic"], s["fragment"]["partition"],
                                     s["fragment"]["offset"]) for s in inline}
        by_ref = [s for s in plan["spans"] if s.get("chunks") is not None]
        wants = {}
        for span in by_ref:
            try:
                key = ref_key(span)
                if fetched is None or key not in fetched:   # fetched: its want was checked then
                    wants[key] = self.want_of(plan, span)
            except RouteChunkError as error:
                return str(error), {}
            except (KeyError, TypeError) as error:
                return f"{ROUTE_FAILURE_INVALID_REFERENCE}: {type(error).__name__}: {error}", {}
        if fetched is None:
            fetched = {**self.fetch(coords.values()), **(self.fetch_chunks(wants) if wants else {})}
        fragments: dict[str, RouteFragment] = {}
        for key, c in coords.items():
            row = fetched.get(c)
            if row is None or isinstance(row, Exception):
                logger.warning("route fragment %s at %s unavailable: %s", key, c, row)
                continue
            if row.staging_key != key:
                logger.warning("route fragment at %s is %s, the plan names %s", c, row.staging_key, key)
                continue
            if row.fragment is not None:
                fragments[key] = row.fragment
        for span in by_ref:
            key = span["staging_key"]
            entry = fetched.get(ref_key(span))
            if entry is None:
                return f"{ROUTE_FAILURE_CHUNK_MISSING}: {key}: its chunks were not fetched", {}
            if isinstance(entry, Exception):
                return str(entry), {}
            if entry.staging_key != key:
                return f"{ROUTE_FAILURE_CHUNK_MISMATCH}: chunks of {entry.staging_key}, the plan names {key}", {}
            if not self._integrity(_DigestSpan(span["extras_digest_version"], span["extras_digest"]),
                                   entry.fragment):
                corrupt = self.corrupt_chunks(entry)
                if corrupt:
                    logger.error("routes of %s: %s of %s corrupt (SHA-256 differs from its reference)",
                                 plan.get("sample_id"), ", ".join(corrupt), key)
                    return f"{ROUTE_FAILURE_CHUNK_CORRUPT}: {key}: {', '.join(corrupt)}", {}
                return f"{ROUTE_FAILURE_INTEGRITY}: {key}: its chunks match their reference, not the extras digest", {}
            fragments[key] = entry.fragment
        return None, fragments

    def attach(self, group: TrainingGroup) -> list[torch.Tensor]:
        """Fetch every row's routes (one batched fetch for the group) and set
        ``row.routed_experts``, so ``group.tensors()`` includes ``routed_experts``.

        With ``verify_threads`` > 1 the work overlaps: each fragment's integrity checks start on
        the pool as soon as its record is decoded, or its last chunk is in (SHA-256 releases
        the GIL, so hashing runs while the next records are read), and the rows are then
        assembled on the pool (the copies into each row's fresh tensor, page faults included,
        release the GIL too)."""
        if group.plans is None:
            raise ValueError("the group has no route plans (read it with route_plans=True)")
        coords = [(s["fragment"]["topic"], s["fragment"]["partition"], s["fragment"]["offset"])
                  for plan in group.plans for s in plan["spans"] if s["fragment"] is not None]
        wants = self.wants_of(group.plans)
        pairs = list(zip(group.rows, group.plans))
        if self.verify_threads <= 1 or len(coords) + len(wants) < 2:
            fetched = {**self.fetch(coords), **(self.fetch_chunks(wants) if wants else {})}
            out = [self.routes(plan, canonical_len=row.input_lengths, fetched=fetched) for row, plan in pairs]
        else:
            pool, checks, pending = self._pool_for(), self._checks_of(group.plans), []

            def start_checks(c, entry: FetchedFragment) -> None:
                if entry.fragment is not None:
                    pending.extend(pool.submit(self._integrity, span, entry.fragment)
                                   for span in checks.get(c, ()))

            fetched = self.fetch(coords, on_fragment=start_checks)
            if wants:
                fetched.update(self.fetch_chunks(wants, on_fragment=start_checks))
            for future in pending:
                future.result()
            out = list(pool.map(lambda pair: self.routes(pair[1], canonical_len=pair[0].input_lengths,
                                                         fetched=fetched), pairs))
        for (row, _plan), routes in zip(pairs, out):
            row.routed_experts = routes
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.consumer.close()

    def __enter__(self) -> "DeferredRouteFetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

