"""Network faults between one stage replica and the brokers (Toxiproxy; tests/faults/net/), with a
second replica, a steady feed and a concurrent read_committed verifier: every test fails on a
lost, duplicated, torn or content-changed group or an aborted read (scenario.NetRun.finish),
under both consumer group protocols (tests/faults/protocols.py).

Schedules are seeded (the seed is in the test id and in every failure message); the long run:
``python -m tests.faults.net.network_run`` (docs/guarantees.md, Network faults).
"""

from __future__ import annotations

import time

import pytest

from tests.faults.net import faults
from tests.faults.net.events import events
from tests.faults.net.scenario import NetRun
from tests.faults.protocols import PROTOCOLS

SESSION_S = 6.0   # stage_config's session.timeout.ms; the brokers' for KIP-848 (tests/faults/protocols.py)
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
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_a_replica_cut_from_every_broker_past_its_session_is_a_harmless_zombie(net, tmp_path, seed, protocol):
    with NetRun(net, tmp_path, seed, **PROTOCOLS[protocol]) as run:
        zombie = run.rng.choice(net.clients)
        heir = next(c for c in net.clients if c != zombie)
        ep = run.episode(faults.hold, zombie, net.node_ids, SESSION_S + run.rng.uniform(4, 10))
        # the heir took the zombie's partition while it was cut off
        assert run.procs[heir].assigned() == {0, 1}, f"[{run.context}] no takeover\n{run.procs[heir].tail()}"
        # the zombie said so while it was cut off: not ready because no broker answers (not
        # merely once its session was gone), and ready again after the heal
        assert any("brokers unreachable" in why for _, why in ep.unready(until=ep.healed)), \
            f"[{run.context}] {ep.readiness_line()}\n{run.procs[zombie].tail()}"
        assert ep.ready_after_heal_s() is not None, f"[{run.context}] {ep.readiness_line()}"
        _finish(run)


@SEEDS
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_latency_spikes_and_jitter_on_one_replica_and_its_transaction_coordinator(net, tmp_path, seed, protocol):
    with NetRun(net, tmp_path, seed, **PROTOCOLS[protocol]) as run:
        replica = run.rng.choice(net.clients)
        base = run.rng.randint(200, 1200)
        run.episode(faults.latency(base, base // 2), replica, net.node_ids, run.rng.uniform(6, 10))
        coordinator = net.transaction_coordinator(run.cfgs[replica].transactional_id)
        spike = run.rng.randint(2000, 5000)
        run.episode(faults.latency(spike, spike // 4), replica, [coordinator], run.rng.uniform(6, 10))
        _finish(run)


@SEEDS
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("cut", [faults.hold, faults.delay], ids=["dropped", "delivered-late"])
def test_a_replica_cut_from_its_transaction_coordinator_while_it_commits(net, tmp_path, seed, cut, protocol):
    with NetRun(net, tmp_path, seed, **PROTOCOLS[protocol]) as run:
        replica = run.rng.choice(net.clients)
        tx_id = run.cfgs[replica].transactional_id
        coordinator = net.transaction_coordinator(tx_id)
        # the computed coordinator is the one that initialized the replica's producer; the replica
        # may still be initializing it (the first groups can all go through the other replica)
        assert _logged_within(net.kraft.node(coordinator), tx_id, 60), \
            f"[{run.context}] broker {coordinator} never initialized {tx_id}: is it the coordinator?"
        run.episode(cut, replica, [coordinator], run.rng.uniform(5, 12))
        _finish(run)


@SEEDS
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_connections_reset_slowly_closed_and_sliced(net, tmp_path, seed, protocol):
    with NetRun(net, tmp_path, seed, **PROTOCOLS[protocol]) as run:
        for fault in (faults.reset_peer(run.rng.randint(0, 500), run.rng.uniform(0.3, 1.0)),
                      faults.slow_close(run.rng.randint(1000, 5000)),
                      faults.slicer(run.rng.randint(16, 128), 8, run.rng.randint(50, 500))):
            run.episode(fault, run.rng.choice(net.clients), net.node_ids, run.rng.uniform(4, 8))
        _finish(run)


@SEEDS
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_a_bandwidth_limit_on_one_broker(net, tmp_path, seed, protocol):
    with NetRun(net, tmp_path, seed, **PROTOCOLS[protocol]) as run:
        replica, broker = run.rng.choice(net.clients), run.rng.choice(net.node_ids)
        run.episode(faults.bandwidth(run.rng.randint(1, 8)), replica, [broker], run.rng.uniform(6, 10))
        _finish(run)


def _logged_within(node, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while text not in node.log_tail(20_000):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _finish(run) -> None:
    """Every test's end: no replica exited or logged a traceback, then the verifier's verdict."""
    _no_exit_no_traceback(run)
    _report(run, run.finish())
