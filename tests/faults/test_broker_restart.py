"""The README's dev broker restarted under a running stage with the default settings, down for
longer than the consumer's session timeout (a newcomer measured 55-61 s for its restart; the
session timeout is 45 s): the order of what happens, not how fast (the seconds are the
benchmark's: ``python -m tests.faults.restart_bench``, docs/guarantees.md).

- /readyz turns false because the brokers are unreachable, before the consumer's session
  expires (not because the partitions were lost), and answers nothing but 503 until the broker
  is back;
- it turns true again only after a new producer was initialized with the broker back (a
  transaction can be opened: publishing works) and the partitions are assigned again;
- the stage takes its partitions back as the same static member: the group coordinator replaces
  the old member at once and never expires it for a session timeout (a dynamic member had to
  wait out its old session, up to 45 s after the broker was back);
- the stage never exits, and every group is published exactly once: those published before,
  those open across the restart, and those sent after it.
"""

from __future__ import annotations

import re

import pytest

from stage.brokers.kraft import jars_available
from tests.faults.outage import N, close, restart_under_stage
from tests.faults.procs import assert_exactly_once, read_outputs

DEV_BROKER_RESTART_S = 55      # what a newcomer measured for `rollout-reassembler broker`

pytestmark = [
    pytest.mark.skipif(not jars_available(), reason="Kafka jars not found (make kafka-jars)"),
    pytest.mark.slow,
]


def test_a_broker_restart_longer_than_the_session_timeout_is_ridden_out_in_order(tmp_path):
    seen, context = restart_under_stage(tmp_path, down_s=DEV_BROKER_RESTART_S, partitions=2, groups=4)
    stage, broker, cfg = context["stage"], context["broker"], context["cfg"]
    try:
        timeline = "\n".join(seen.timeline())
        assert seen.exit_code is None, f"the stage exited (rc {seen.exit_code})\n{timeline}\n{stage.tail(60)}"
        lost = seen.first("session lost")
        assert lost is not None, f"the session did not expire: not the case under test\n{timeline}"

        # false while the broker is away, for the outage itself, before the partitions went
        during = seen.answers(seen.stopped, seen.ready)
        unready = [t for t, status, _ in during if status == 503]
        assert unready and unready[0] < lost, timeline
        assert [a for a in during if a[0] >= unready[0] and a[1] != 503] == [], timeline
        assert any("brokers unreachable" in body for _, _, body in during), timeline

        # true again only once a new producer works and the partitions are back
        reachable = seen.first("brokers reachable", after=seen.ready)
        assigned = seen.first("assigned again", after=seen.ready)
        assert reachable is not None and assigned is not None, timeline
        ready_again = [t for t, status, _ in seen.answers(unready[0], float("inf")) if status == 200]
        assert ready_again and ready_again[0] > max(reachable, assigned), timeline
        assert seen.readiness[-1][1] == 200, seen.readiness[-3:]

        # the same static member took its place back; its old session was never waited out
        group = re.escape(cfg.group_id)
        assert re.search(rf"Static member with groupInstanceId=\S+ and unknown member id joins group "
                         rf"{group} .*Replacing previously mapped member", seen.broker_log), timeline
        assert not re.search(rf"Member \S+ in group {group} has failed", seen.broker_log), timeline

        _every_group_once_then_stopped(seen, context, timeline)
    except BaseException:
        print(stage.tail(80))
        print(broker.log_tail(60))
        raise
    finally:
        close(context)


def test_under_kip848_the_member_outlives_the_broker_restart_and_keeps_its_partitions(tmp_path):
    """group_protocol consumer (KIP-848) with the brokers' defaults (45 s session): the member's
    id and epoch are stored in the group's log, so the restarted coordinator loads the member
    with a fresh session and the stage carries on as the same member without losing its
    partitions (no static id is needed for that: the stage sets none under KIP-848). Readiness
    as above: 503 for the whole outage, 200 only once a new producer works."""
    seen, context = restart_under_stage(tmp_path, down_s=DEV_BROKER_RESTART_S, partitions=2, groups=4,
                                        # the member keeps its partitions, so the open groups'
                                        # deadlines (held while the broker is away) are due the
                                        # moment it is back, before the feeder completes them
                                        settings={"group_protocol": "consumer", "group_timeout_ms": 300_000})
    stage, broker, cfg = context["stage"], context["broker"], context["cfg"]
    try:
        timeline = "\n".join(seen.timeline())
        assert seen.exit_code is None, f"the stage exited (rc {seen.exit_code})\n{timeline}\n{stage.tail(60)}"
        during = seen.answers(seen.stopped, seen.ready)
        unready = [t for t, status, _ in during if status == 503]
        assert unready and [a for a in during if a[0] >= unready[0] and a[1] != 503] == [], timeline
        reachable = seen.first("brokers reachable", after=seen.ready)
        assert reachable is not None, timeline
        ready_again = [t for t, status, _ in seen.answers(unready[0], float("inf")) if status == 200]
        assert ready_again and ready_again[0] > reachable, timeline
        assert seen.readiness[-1][1] == 200, seen.readiness[-3:]

        # the same member throughout: never lost its partitions, never fenced by the coordinator
        assert seen.first("session lost") is None, f"the member lost its partitions\n{timeline}\n{stage.tail(60)}"
        group = re.escape(cfg.group_id)
        # Kafka 4.4's coordinator: "[GroupId g] Member m fenced from the group because the member
        # session expired." / "... left the consumer group."
        assert not re.search(rf"\[GroupId {group}\] Member \S+ (?:fenced from|left) the", seen.broker_log), timeline

        _every_group_once_then_stopped(seen, context, timeline)
    except BaseException:
        print(stage.tail(80))
        print(broker.log_tail(60))
        raise
    finally:
        close(context)


def _every_group_once_then_stopped(seen, context, timeline: str) -> None:
    """Both tests' end: every group published exactly once, the figure, a clean SIGTERM."""
    stage, broker, cfg = context["stage"], context["broker"], context["cfg"]
    assert_exactly_once(read_outputs(broker.bootstrap, context["topics"]), context["groups"], cfg.finalize, N)
    print(f"\n{timeline}\nevery waiting group published {seen.recovered_s:.1f}s after the broker was ready")
    assert stage.terminate(60) == 0, stage.tail()
