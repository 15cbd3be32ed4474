"""The consumer's per-partition fetch state, from its librdkafka statistics, for the DEBUG log.

A partition that is assigned but does not advance (a fetch that never starts, an offset query
that never returns, a pause flag left set) leaves nothing in the stage's own log: its groups
simply wait for records. librdkafka's statistics say where each assigned partition is
(``fetch_state``: offset-query, offset-wait, active, ...; its fetch, application and committed
offsets; the log end and last stable offset it last saw); ``FetchStates`` turns them into one
line, logged only when it changed, so a stall shows as a line that stops changing.
"""

from __future__ import annotations

import json

_FIELDS = ("fetch_state", "next_offset", "app_offset", "committed_offset", "hi_offset", "ls_offset",
           "fetchq_cnt")


def fetch_states(stats_json: str) -> dict[str, tuple]:
    """``topic[partition]`` -> the fetch fields of every assigned (or fetching) partition."""
    try:
        topics = json.loads(stats_json).get("topics", {})
        out = {}
        for topic, info in topics.items():
            for partition, p in info.get("partitions", {}).items():
                if partition == "-1" or not (p.get("assigned") or p.get("desired")
                                           or p.get("fetch_state") not in (None, "none")):
                    continue
                out[f"{topic}[{partition}]"] = tuple(p.get(f) for f in _FIELDS)
        return out
    except (ValueError, AttributeError, TypeError):
        return {}


class FetchStates:
    """The last line logged; ``changed(stats_json)`` -> a new line, or None when nothing moved."""

    def __init__(self) -> None:
        self._last: dict[str, tuple] | None = None

    def changed(self, stats_json: str) -> str | None:
        states = fetch_states(stats_json)
        if states == self._last:
            return None
        self._last = states
        if not states:
            return "no partition assigned"
        return "; ".join(f"{tp}: {s[0]} next {s[1]} app {s[2]} committed {s[3]} end {s[4]} stable {s[5]} "
                         f"queued {s[6]}" for tp, s in sorted(states.items()))
