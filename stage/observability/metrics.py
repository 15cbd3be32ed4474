"""Prometheus export of the runtime's numbers: base units, ``rollout_reassembler_`` prefix,
histogram buckets up to minutes (finalization on a busy GPU and deadline-closed groups are
slow, and prometheus_client's default buckets stop at 10 s)."""

from __future__ import annotations

import json
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

logger = logging.getLogger(__name__)

PREFIX = "rollout_reassembler_"
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# runtime stat name -> (kind, prometheus name, help, label names)
COUNTERS = {
    "records_consumed": ("records_consumed", "Input records consumed", ("topic",)),
    "records_skipped": ("records_skipped", "Input records skipped (late, replayed, duplicate, conflict)", ("topic", "reason")),
    "dead_letters": ("dead_letters", "Input records sent to the dead-letter topic, by error class "
                     "(undecodable, invalid, misrouted, conflict)", ("topic", "reason")),
    "groups_published": ("groups_published", "Groups published, by outcome (complete, deadline, dropped)", ("outcome",)),
    "rows_published": ("rows_published", "Canonical rows published, by validity", ("valid",)),
    "rejections": ("rejections", "Rejected rollouts (placeholder rows), by reason bucket", ("bucket",)),
    "orphan_groups_expired": ("orphan_groups_expired", "Groups with staged calls but no receipt that expired", ()),
    "orphan_staged_expired": ("orphan_staged_expired", "Staged calls expired with their orphan group", ()),
    "transactions_committed": ("transactions_committed", "Output transactions committed", ()),
    "transactions_aborted": ("transactions_aborted", "Output transactions aborted (then rewound)", ()),
    "rebalances": ("rebalances", "Rebalance callbacks, by kind (assign, revoke, lost)", ("kind",)),
    "finalize_errors": ("finalize_errors", "Groups that failed in finalization (their partition halts)", ()),
    "deadlines_forced": ("deadlines_forced", "Deadlines fired after deadline_hold_max_ms of waiting for "
                         "an unavailable input partition", ()),
}
GAUGES = {
    "open_groups": "Groups buffered and not yet published",
    "buffered_bytes": "Bytes of input records held in the buffers",
    "paused_partitions": "Input partitions paused by back-pressure",
    "assigned_partitions": "Input partitions assigned to this member (receipts and staged calls)",
    "inflight_groups": "Groups finalizing or waiting for a transaction",
    "halted_partitions": "Partitions halted because a group failed in finalization",
    "deadline_held_partitions": "Partitions whose due deadlines wait for an unavailable input partition",
    "schema_registry_unavailable": "1 while records wait for a schema the registry cannot serve",
}
HISTOGRAMS = {
    "group_fill_seconds": "From a group's first input record to it being ready (complete or deadline)",
    "finalize_seconds": "Finalizing one group (verify, rows, routes, encoding)",
    "publish_seconds": "One transaction: produce, send offsets, commit",
    "end_to_end_seconds": "From a group's last input record timestamp to its publication",
}


class PrometheusSink:
    """Receives RuntimeStats updates and keeps the Prometheus metrics in step."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._children: dict = {}
        self.counters = {key: Counter(PREFIX + name, doc, labels, registry=self.registry)
                         for key, (name, doc, labels) in COUNTERS.items()}
        self.gauges = {key: Gauge(PREFIX + key, doc, registry=self.registry) for key, doc in GAUGES.items()}
        self.histograms = {key: Histogram(PREFIX + key, doc, buckets=SECONDS_BUCKETS, registry=self.registry)
                           for key, doc in HISTOGRAMS.items()}
        self.lag = Gauge(PREFIX + "consumer_lag", "Consumer lag in records (librdkafka statistics)",
                         ("topic", "partition"), registry=self.registry)
        # NeMo RL's per-group metrics (finalize/*, row_assembly/*, group_stats/*): sum and count
        # per name, so dashboards can show means without a series per group.
        self.group_metrics = Summary(PREFIX + "group_metric", "Per-group finalize metrics under NeMo RL's names",
                                     ("name",), registry=self.registry)

    def inc(self, name: str, value: float, labels: dict) -> None:
        if not value:
            return
        key = (name, tuple(labels.items()))
        child = self._children.get(key)
        if child is None:  # labels() costs microseconds: resolve each series once
            counter = self.counters.get(name)
            if counter is None:
                return
            child = self._children[key] = counter.labels(**labels) if labels else counter
        child.inc(value)

    def set(self, name: str, value: float) -> None:
        gauge = self.gauges.get(name)
        if gauge is not None:
            gauge.set(value)

    def observe(self, name: str, value: float) -> None:
        histogram = self.histograms.get(name)
        if histogram is not None:
            histogram.observe(value)

    def group_metrics_observed(self, metrics: dict) -> None:
        for key, value in metrics.items():
            self.group_metrics.labels(name=key).observe(float(value))

    def librdkafka_stats(self, stats_json: str) -> None:
        """stats_cb: per-partition consumer_lag (-1 until known) from the consumer statistics."""
        try:
            stats = json.loads(stats_json)
            self.lag.clear()  # partitions given up in a rebalance must not keep stale series
            for topic, info in stats.get("topics", {}).items():
                for partition, pstats in info.get("partitions", {}).items():
                    if partition == "-1" or not pstats.get("assigned", pstats.get("fetch_state") == "active"):
                        continue
                    lag = pstats.get("consumer_lag_stored", pstats.get("consumer_lag", -1))
                    if lag is not None and lag >= 0:
                        self.lag.labels(topic=topic, partition=partition).set(lag)
        except (ValueError, AttributeError, TypeError) as error:
            logger.debug("unreadable librdkafka statistics: %s", error)
