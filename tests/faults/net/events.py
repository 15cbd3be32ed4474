"""What a replica's log says it did during a fault (for the report and failure messages)."""

from __future__ import annotations

import re

EVENTS = {
    "brokers unreachable": r"brokers unreachable",
    "lost partitions": r"lost partitions",
    "revoked": r"revoked partitions",
    "stuck": r"publication stuck in",
    "fenced": r"fenced",
    "transaction outcome": r"transaction (committed|aborted|outcome)",
    "new producer": r"new producer ready",
    "rewind": r"rewinding every partition",
}


def events(log: str) -> dict[str, int]:
    """How many log lines match each event (only those that occur)."""
    lines = [line for line in log.splitlines() if not line.startswith("%")]
    counts = {name: sum(1 for line in lines if re.search(pattern, line)) for name, pattern in EVENTS.items()}
    return {name: count for name, count in counts.items() if count}
