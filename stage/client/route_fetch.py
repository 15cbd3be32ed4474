"""Deferred router replay, the policy worker's side: ``DeferredRouteFetcher`` reads a row's
staged route fragments back by the Kafka coordinates its RoutePlan names and runs the shared
route executor (``stage.routes.execute_route_plan``) with the model's (L, K). A failure gives an
all ``-1`` route tensor of the row's length and a counted reason (``failures``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from confluent_kafka import Consumer, KafkaError, TopicPartition

from stage.client.assembly import TrainingGroup, route_plan_from_record
from stage.client.consuming import codec_for, reader_defaults, take
from stage.decode import staged_row
from stage.routes import (
    ROUTE_MISSING_SENTINEL,
    ROUTED_EXPERTS_FALLBACK_DTYPE,
    RouteFragment,
    execute_route_plan,
    resolve_device,
)
from stage.wire import TopicNames, WireError

logger = logging.getLogger(__name__)


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
                 schema_registry_url: str | None = None,
                 schema_registry_config: Mapping[str, Any] | None = None, timeout: float = 10.0,
                 cache_size: int = 4096, max_gap: int = 256) -> None:
        self.dims = (int(dims[0]), int(dims[1]))
        self.device = resolve_device(device)
        self.timeout = timeout
        self.max_gap = max_gap
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple[str, int, int], Any] = OrderedDict()
        self.codec = codec_for("StagedCall", TopicNames().staged_calls, framing, schema_registry_url,
                               schema_registry_config)
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

