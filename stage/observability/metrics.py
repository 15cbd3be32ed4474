"""Prometheus export of the runtime's numbers: base units, ``rollout_reassembler_`` prefix,
histogram buckets up to minutes (finalization on a busy GPU and deadline-closed groups are
slow, and prometheus_client's default buckets stop at 10 s).

At start (``configure``) the sink also creates every labelled series an alert reads at 0
(``INITIAL_LABELS``) and exports the settings alert thresholds depend on (``CONFIG_GAUGES``).
Process, GC, platform, build and memory-limit metrics: ``stage.observability.process``."""

from __future__ import annotations

import itertools
import json
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary

from stage.buffer import COMPLETE, CONFLICT, DEADLINE, DUPLICATE, LATE, REPLAYED
from stage.observability.process import register_process_metrics
from stage.publish.deadletters import DEAD_LETTERED_BEFORE, ERROR_CLASSES
from stage.publish.records import DROPPED
from stage.wire import INPUT_ROLES

logger = logging.getLogger(__name__)

PREFIX = "rollout_reassembler_"
# Above 2.5 s each bound is at most twice the one below (20, 240 and 1200 are there for that):
# histogram_quantile interpolates inside a bucket, so a quantile of observations that are all
# <= x reads at most 2x. RolloutReassemblerEndToEndSlow's threshold relies on it.
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 240, 300,
                   600, 1200)

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
    "publication_stuck": ("publication_stuck", "Publications found stuck in a coordinator call past "
                          "publish_stuck_ms (librdkafka #5511 after a broker restart)", ()),
    "records_spilled": ("records_spilled", "Staged records spilled to local disk (admitted while the stage "
                        "held max_buffered_bytes)", ()),
    "publication_recoveries": ("publication_recoveries", "Stuck publications recovered in process (a new "
                               "producer fenced the stuck one, then a rewind)", ()),
}
GAUGES = {
    "open_groups": "Groups buffered and not yet published",
    "buffered_bytes": "Bytes of input records held in the buffers",
    "held_bytes": "Bytes held for unpublished groups (buffered input, finalize working sets, outputs "
                  "waiting, the transaction in flight): what max_buffered_bytes caps",
    "spilled_bytes": "Bytes of staged records spilled to local disk while the stage held its memory cap",
    "paused_partitions": "Input partitions paused by back-pressure",
    "assigned_partitions": "Input topic-partitions assigned to this member: receipts and staged calls, two per co-partitioned partition",
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
    "publication_recovery_seconds": "From a publication found stuck to its replacement producer being ready",
}

# Label values known before the first event, per labelled metric (a key of COUNTERS or GAUGES).
# Their series are created at 0 by configure(): a counter series that first appears at 1 has no
# increase() and no rate(), so the first dead letter or dropped group would never alert.
# A tuple lists the values; a string names a set known only from the configuration
# (configure() resolves it, see value_sets()).
INPUT_TOPICS = "input topics"
INITIAL_LABELS = {
    "records_consumed": {"topic": INPUT_TOPICS},
    "records_skipped": {"topic": INPUT_TOPICS,
                        "reason": (DUPLICATE, LATE, REPLAYED, CONFLICT, DEAD_LETTERED_BEFORE)},
    "dead_letters": {"topic": INPUT_TOPICS, "reason": ERROR_CLASSES},
    "groups_published": {"outcome": (COMPLETE, DEADLINE, DROPPED)},
    "rows_published": {"valid": ("true", "false")},
    "rebalances": {"kind": ("assign", "revoke", "lost")},
}
# Settings exported as rollout_reassembler_config_<name> gauges, so alert thresholds follow the
# configuration (EndToEndSlow is relative to the group timeout).
CONFIG_GAUGES = {
    "group_timeout_seconds": ("The group deadline, group_timeout_ms, in seconds",
                              lambda cfg: cfg.group_timeout_ms / 1000),
    "max_buffered_bytes": ("Back-pressure cap on buffered input bytes (max_buffered_bytes)",
                           lambda cfg: cfg.max_buffered_bytes),
    "max_buffered_groups": ("Back-pressure cap on buffered groups (max_buffered_groups)",
                            lambda cfg: cfg.max_buffered_groups),
}


def value_sets(cfg) -> dict[str, tuple]:
    """The label value sets INITIAL_LABELS names, for this configuration."""
    # the route topic is an input of direct router replay only
    roles = [role for role in INPUT_ROLES if role != "staged_routes" or cfg.finalize.direct_routes]
    return {INPUT_TOPICS: tuple(getattr(cfg.topics, role) for role in roles)}


def label_combinations(labels: dict, sets: dict[str, tuple]) -> list[dict[str, str]]:
    """Every combination of the label values of one INITIAL_LABELS entry."""
    names = list(labels)
    choices = [sets[v] if isinstance(v, str) else v for v in labels.values()]
    return [dict(zip(names, combo)) for combo in itertools.product(*choices)]


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
        self.config = {key: Gauge(PREFIX + "config_" + key, doc, registry=self.registry)
                       for key, (doc, _) in CONFIG_GAUGES.items()}
        register_process_metrics(self.registry)

    def configure(self, cfg) -> None:
        """At start: export the settings of CONFIG_GAUGES and create INITIAL_LABELS' series at 0."""
        for key, (_, value) in CONFIG_GAUGES.items():
            self.config[key].set(value(cfg))
        sets = value_sets(cfg)
        for name, labels in INITIAL_LABELS.items():
            metric = self.counters[name] if name in self.counters else self.gauges[name]
            for combination in label_combinations(labels, sets):
                metric.labels(**combination)

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
