"""The consumer's fetch states as the DEBUG log shows them (stage.runtime.kafka.fetchstates)."""

import json

from stage.runtime.kafka.fetchstates import FetchStates, fetch_states


def _stats(**partitions):
    return json.dumps({"topics": {"receipts": {"partitions": {
        "-1": {"fetch_state": "none"},
        **{str(p): fields for p, fields in partitions.items()}}}}})


ACTIVE = dict(assigned=True, fetch_state="active", next_offset=12, app_offset=10, committed_offset=8,
              hi_offset=14, ls_offset=14, fetchq_cnt=2)


def test_assigned_partitions_only_with_their_offsets():
    states = fetch_states(_stats(**{"0": ACTIVE, "1": dict(assigned=False, fetch_state="none")}))
    assert states == {"receipts[0]": ("active", 12, 10, 8, 14, 14, 2)}


def test_a_line_only_when_something_moved():
    watch = FetchStates()
    first = watch.changed(_stats(**{"0": ACTIVE}))
    assert first == "receipts[0]: active next 12 app 10 committed 8 end 14 stable 14 queued 2"
    assert watch.changed(_stats(**{"0": ACTIVE})) is None
    stuck = watch.changed(_stats(**{"0": {**ACTIVE, "fetch_state": "offset-query"}}))
    assert stuck.startswith("receipts[0]: offset-query")


def test_unreadable_statistics_are_no_partitions():
    assert fetch_states("not json") == {}
    assert FetchStates().changed("[]") == "no partition assigned"
