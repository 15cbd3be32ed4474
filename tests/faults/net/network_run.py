"""The long network fault schedule: ``python -m tests.faults.net.network_run --seeds 12 --minutes 30``.

One Toxiproxy server and one 3-broker KRaft cluster (tests/faults/net/cluster.py) for the whole
run; per seed, a fresh topic set, two replicas, the verifier and a seeded series of fault
episodes (every class of the CI suite), then the checks of the CI tests (scenario.NetRun.finish:
lost, duplicated, content, torn, aborted reads). Prints one line per episode (the fault, heal ->
every waiting group published, exits) and the verifier's counts per seed; exits 1 on the first
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


def schedule(run: NetRun, cluster: ProxiedCluster, episodes: int) -> None:
    rng = run.rng
    for _ in range(episodes):
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
    finally:
        cluster.discard()
        toxiproxy.stop()
    print(f"done in {(time.monotonic() - started) / 60:.1f} min: {totals['episodes']} episodes, "
          f"{totals['groups']} groups, {totals['seen']} committed records read by the verifier, "
          f"{totals['aborted_in_log']} aborted records in the logs, 0 lost / duplicated / torn / aborted "
          f"reads; heal -> all published: max {max(heal_times, default=0):.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
