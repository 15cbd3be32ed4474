"""Network faults between one stage replica and the brokers (Toxiproxy; tests/faults/net/), with a
second replica, a steady feed and a concurrent read_committed verifier: every test fails on a
lost, duplicated, torn or content-changed group or an aborted read (scenario.NetRun.finish).

Schedules are seeded (the seed is in the test id and in every failure message); the long run:
``python -m tests.faults.net.network_run`` (docs/guarantees.md, Network faults).
"""

from __future__ import annotations

import pytest

from tests.faults.net import faults
from tests.faults.net.events import events
from tests.faults.net.scenario import NetRun

SESSION_S = 6.0   # tests.integration.harness.stage_config's session.timeout.ms
SEEDS = pytest.mark.parametrize("seed", [1], ids=lambda s: f"seed={s}")


def _report(run: NetRun, verdict) -> None:
    for ep in run.episodes:
        print(f"[seed {run.seed}] {ep.line()}")
    for replica, proc in run.procs.items():
        print(f"[seed {run.seed}] replica {replica}: {events(proc.log())}")
    print(f"[seed {run.seed}] verifier: {verdict.counts()}")


def _no_exit_no_traceback(run: NetRun) -> None:
    # docs/operations.md, exit codes: a running stage never exits for an outage, however long
    for ep in run.episodes:
        assert not ep.exits, f"[{run.context}] a replica exited during {ep.line()}"
    assert not run.tracebacks(), f"[{run.context}] unhandled errors: {run.tracebacks()}"


@SEEDS
def test_a_replica_cut_from_every_broker_past_its_session_is_a_harmless_zombie(net, tmp_path, seed):
    with NetRun(net, tmp_path, seed) as run:
        zombie = run.rng.choice(net.clients)
        heir = next(c for c in net.clients if c != zombie)
        run.episode(faults.hold, zombie, net.node_ids, SESSION_S + run.rng.uniform(4, 10))
        # the heir took the zombie's partition while it was cut off
        assert run.procs[heir].assigned() == {0, 1}, f"[{run.context}] no takeover\n{run.procs[heir].tail()}"
        _no_exit_no_traceback(run)
        verdict = run.finish()
        _report(run, verdict)
