"""The runtime's gauges, derived from the state once an iteration (never set where the state
changes, so a gauge cannot outlive what it shows: a rewind that clears a halt clears
halted_partitions at the end of that iteration). Every name is a key of
stage.observability.metrics.GAUGES (tests/runtime/test_metric_names.py checks every name the
stage uses against the declared ones)."""

from __future__ import annotations

from dataclasses import dataclass

from stage.runtime.state.memory import Holdings


@dataclass(frozen=True)
class Gauges:
    held: Holdings
    open_groups: int
    paused_partitions: int
    assigned_partitions: int          # input topic-partitions: every input topic's partition p
    inflight_groups: int
    halted_partitions: int
    deadline_held_partitions: int
    schema_registry_unavailable: bool

    def values(self) -> dict[str, float]:
        return {
            "buffered_bytes": self.held.buffered,
            "held_bytes": self.held.total,
            "spilled_bytes": self.held.spilled,
            "open_groups": self.open_groups,
            "paused_partitions": self.paused_partitions,
            "assigned_partitions": self.assigned_partitions,
            "inflight_groups": self.inflight_groups,
            "halted_partitions": self.halted_partitions,
            "deadline_held_partitions": self.deadline_held_partitions,
            "schema_registry_unavailable": 1.0 if self.schema_registry_unavailable else 0.0,
        }
