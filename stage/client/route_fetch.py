"""Deferred router replay, the policy worker's side: ``DeferredRouteFetcher`` reads a row's
staged route fragments back by the Kafka coordinates its RoutePlan names and runs the shared
route executor (``stage.routes.execute_route_plan``) with the model's (L, K). A failure gives an
all ``-1`` route tensor of the row's length and a counted reason (``failures``).

Fetched fragments are kept in an LRU bounded by bytes (``cache_bytes``): the route tensors are
views of the fetched records' route bytes (nothing else of a record is kept), and a fragment
that passed its integrity check against a digest is never checked against that digest again.
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

import torch
from confluent_kafka import Consumer, KafkaError, TopicPartition

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
    ROUTE_MISSING_SENTINEL,
    ROUTED_EXPERTS_FALLBACK_DTYPE,
    RouteFragment,
    execute_route_plan,
    resolve_device,
    verify_route_fragment_integrity,
)
from stage.wire import TopicNames, WireError

logger = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 1 << 30
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

    @property
    def nbytes(self) -> int:
        f = self.fragment
        if f is None:
            return _ENTRY_OVERHEAD
        side = 0 if f.boundary_routes is None else f.boundary_routes.nbytes
        return f.routes.nbytes + side + len(f.extras_metadata_json) + _ENTRY_OVERHEAD


class DeferredRouteFetcher:
    """Rebuild a row's routed experts from its RoutePlan by fetching the staged fragments at
    their Kafka coordinates; the shared executor assembles them with the model's ``dims``.

    ``routes(plan)`` always returns an int16 ``[len, L, K]`` tensor: on any failure (fragment
    gone, undecodable, another key at that offset, integrity or shape mismatch) it is all
    ``-1`` and the executor's reason is counted in ``failures``. Fetched fragments are cached,
    least recently used first out, within ``cache_bytes`` (route bytes plus ~1 KiB an entry;
    0: no cache); a fragment bigger than the budget is used and not kept. ``verified`` counts
    integrity checks run, ``verified_cached`` the ones answered from a fragment's earlier check.
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
                 cache_bytes: int = DEFAULT_CACHE_BYTES, max_gap: int = 256,
                 verify_threads: int | None = None,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        if cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
        self.dims = (int(dims[0]), int(dims[1]))
        self.device = resolve_device(device)
        self.timeout = timeout
        self.max_gap = max_gap
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

    def _checks_of(self, plans) -> dict[tuple[str, int, int], list[_DigestSpan]]:
        """Each fragment's distinct (digest version, digest) pairs the plans bind it to."""
        checks: dict[tuple[str, int, int], dict] = {}
        for plan in plans:
            for span in plan["spans"]:
                c = span["fragment"]
                if c is not None:
                    key = (span["extras_digest_version"], span["extras_digest"])
                    checks.setdefault((c["topic"], c["partition"], c["offset"]), {})[key] = _DigestSpan(*key)
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
            if row.fragment is not None:
                fragments[key] = row.fragment
        with self._lock:
            self.executed += 1
        try:
            routes, failure = execute_route_plan(route_plan_from_record(plan), fragments,
                                                 dims=self.dims, canonical_len=length,
                                                 device=self.device, integrity=self._integrity)
        except (TypeError, ValueError) as error:  # a malformed plan record
            routes, failure = None, f"invalid_plan: {error}"
        if failure is not None:
            with self._lock:
                self.failures[failure.split(":", 1)[0]] += 1
            return torch.full((length, *self.dims), ROUTE_MISSING_SENTINEL,
                              dtype=ROUTED_EXPERTS_FALLBACK_DTYPE, device=self.device)
        return routes

    def attach(self, group: TrainingGroup) -> list[torch.Tensor]:
        """Fetch every row's routes (one batched fetch for the group) and set
        ``row.routed_experts``, so ``group.tensors()`` includes ``routed_experts``.

        With ``verify_threads`` > 1 the work overlaps: each fragment's integrity checks start on
        the pool as soon as its record is decoded (SHA-256 releases the GIL, so hashing runs
        while the next records are read), and the rows are then assembled on the pool (the
        copies into each row's fresh tensor, page faults included, release the GIL too)."""
        if group.plans is None:
            raise ValueError("the group has no route plans (read it with route_plans=True)")
        coords = [(s["fragment"]["topic"], s["fragment"]["partition"], s["fragment"]["offset"])
                  for plan in group.plans for s in plan["spans"] if s["fragment"] is not None]
        pairs = list(zip(group.rows, group.plans))
        if self.verify_threads <= 1 or len(coords) < 2:
            fetched = self.fetch(coords)
            out = [self.routes(plan, canonical_len=row.input_lengths, fetched=fetched) for row, plan in pairs]
        else:
            pool, checks, pending = self._pool_for(), self._checks_of(group.plans), []

            def start_checks(c, entry: FetchedFragment) -> None:
                if entry.fragment is not None:
                    pending.extend(pool.submit(self._integrity, span, entry.fragment)
                                   for span in checks.get(c, ()))

            fetched = self.fetch(coords, on_fragment=start_checks)
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

