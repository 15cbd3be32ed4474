"""The long network fault schedule: ``python -m tests.faults.net.network_run --seeds 12 --minutes 30``.

One Toxiproxy server and one 3-broker KRaft cluster (tests/faults/net/cluster.py) for the whole
run; per seed, a fresh topic set, two replicas, the verifier and a seeded series of fault
episodes (every class of the CI suite), then the checks of the CI tests (scenario.NetRun.finish:
lost, duplicated, content, torn, aborted reads). Prints one line per episode (the fault, heal ->
every waiting group published, the faulted replica's first 503 on /readyz after the fault began
and why, its first 200 after the heal, exits), the verifier's counts per seed, and per fault
class the ranges of those figures at the end; exits 1 on the first
failed check, with the seed in the message. Stops starting seeds once ``--minutes`` have passed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tests.faults.net import faults
from tests.faults.net.cluster import ProxiedCluster
from tests.faults.net.events import events
from tests.faults.net.scenario import NetRun
from tests.faults.net.toxiproxy import BINARY, Toxiproxy

SESSION_S = 6.0


def pick_fault(run: NetRun, cluster: ProxiedCluster):
    """One seeded draw from every fault class of the suite: (replica, fault, nodes, held_s)."""
    rng = run.rng
    replica = rng.choice(cluster.clients)
    coordinator = cluster.transaction_coordinator(run.cfgs[replica].transactional_id)
    one = [rng.choice(cluster.node_ids)]
    fault, nodes, held = rng.choice([
        (faults.hold, cluster.node_ids, SESSION_S + rng.uniform(2, 14)),
        (faults.refuse, cluster.node_ids, rng.uniform(2, 20)),
        (faults.hold, [coordinator], rng.uniform(3, 15)),
        (faults.delay, [coordinator], rng.uniform(3, 15)),
        (faults.latency(rng.randint(100, 3000), rng.randint(0, 1000)), cluster.node_ids, rng.uniform(4, 12)),
        (faults.latency(rng.randint(1000, 6000), 500), [coordinator], rng.uniform(4, 12)),
        (faults.reset_peer(rng.randint(0, 1000), rng.uniform(0.2, 1.0)), cluster.node_ids, rng.uniform(3, 10)),
        (faults.slow_close(rng.randint(500, 5000)), cluster.node_ids, rng.uniform(3, 10)),
        (faults.slicer(rng.randint(8, 256), 8, rng.randint(10, 1000)), cluster.node_ids, rng.uniform(3, 10)),
        (faults.bandwidth(rng.randint(1, 16)), one, rng.uniform(4, 12)),
    ])
    return replica, fault, nodes, held


def schedule(run: NetRun, cluster: ProxiedCluster, episodes: int) -> None:
    for _ in range(episodes):
        replica, fault, nodes, held = pick_fault(run, cluster)
        ep = run.episode(fault, replica, nodes, held)
        print(f"  seed {run.seed} episode {len(run.episodes)}: {ep.line()}", flush=True)
        if ep.exits:
            raise AssertionError(f"[{run.context}] a replica exited: {ep.line()}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--first-seed", type=int, default=100)
    parser.add_argument("--episodes", type=int, default=3, help="fault episodes per seed")
    parser.add_argument("--minutes", type=float, default=30.0, help="no new seed starts after this long")
    args = parser.parse_args(argv)
    if not BINARY.is_file():
        print(f"{BINARY} is missing: run `make toxiproxy`", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="network-run-"))
    toxiproxy = Toxiproxy(BINARY, root / "toxiproxy.log")
    cluster = ProxiedCluster(root, toxiproxy)
    started, totals = time.monotonic(), {"episodes": 0, "groups": 0, "seen": 0, "aborted_in_log": 0}
    heal_times: list[float] = []
    by_class: dict[str, list] = {}
    try:
        cluster.start()
        print(f"cluster at {cluster.bootstrap}; logs in {root}", flush=True)
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            if time.monotonic() - started > args.minutes * 60:
                break
            workdir = root / f"seed-{seed}"
            workdir.mkdir()
            with NetRun(cluster, workdir, seed) as run:
                schedule(run, cluster, args.episodes)
                verdict = run.finish()
                if run.tracebacks():
                    raise AssertionError(f"[{run.context}] unhandled errors: {run.tracebacks()}")
                print(f"  seed {seed}: {len(run.groups)} groups; verifier {verdict.counts()}; "
                      + "; ".join(f"{r}: {events(p.log())}" for r, p in run.procs.items()), flush=True)
            totals["episodes"] += len(run.episodes)
            totals["groups"] += len(run.groups)
            totals["seen"] += verdict.seen
            totals["aborted_in_log"] += verdict.aborted_in_log
            heal_times += [ep.heal_to_published_s for ep in run.episodes]
            for ep in run.episodes:
                by_class.setdefault(fault_class(ep, cluster), []).append(ep)
    finally:
        cluster.discard()
        toxiproxy.stop()
    print(f"done in {(time.monotonic() - started) / 60:.1f} min: {totals['episodes']} episodes, "
          f"{totals['groups']} groups, {totals['seen']} committed records read by the verifier, "
          f"{totals['aborted_in_log']} aborted records in the logs, 0 lost / duplicated / torn / aborted "
          f"reads; heal -> all published: max {max(heal_times, default=0):.1f}s")
    for name, eps in sorted(by_class.items()):
        print(f"  {name}: {summary(eps)}")
    return 0


def fault_class(ep, cluster: ProxiedCluster) -> str:
    kind = ep.fault.split(" (")[0].split(" ")[0]
    return f"{kind} ({'every broker' if len(ep.nodes) == len(cluster.node_ids) else 'one broker'})"


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.1f}-{max(values):.1f}s" if len(values) > 1 else f"{values[0]:.1f}s"


def summary(eps: list) -> str:
    """Ranges over episodes of one class: heal -> all published, /readyz 503 after the fault,
    /readyz 200 after the heal (of the episodes where it turned 503)."""
    unready = [ep.unready()[0][0] - ep.began for ep in eps if ep.unready()]
    ready = [after for ep in eps if ep.unready() and (after := ep.ready_after_heal_s()) is not None]
    return (f"{len(eps)} episodes; heal -> all published {_span([ep.heal_to_published_s for ep in eps])}; "
            f"/readyz 503 in {len(unready)} of them, {_span(unready)} after the fault began, 200 again "
            f"{_span(ready)} after the heal")


if __name__ == "__main__":
    sys.exit(main())
