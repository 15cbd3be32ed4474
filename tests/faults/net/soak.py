"""The soak: one pair of stage replicas for an hour under a schedule of faults, the verifier on.

    PYTHONPATH=$PWD .venv/bin/python -m tests.faults.net.soak --minutes 60 [--seed 7] [--group-protocol consumer]

Unlike tests.faults.net.network_run (a fresh topic set and fresh replicas per seed), one topic
set, one read_committed verifier and one pair of replicas (each replaced only when the schedule
kills it) live for the whole run, so what accumulates over an hour shows: memory, ledger and
offsets, librdkafka state across many outages. The feed never stops (a group every 0.3 s, its
records spread over it). Every 20-60 s of quiet, one event, seeded:

- a network fault drawn as tests.faults.net.network_run draws one (``pick_fault``: a replica cut
  from every broker past its session, connections refused, its transaction coordinator held,
  delayed or slowed, latency, reset / slow close / slicer, a bandwidth limit);
- kill -9 of a replica, restarted 5-20 s later with the same transactional id;
- a broker killed (SIGKILL) and started again 10-30 s later (replication 3, min ISR 2).

After each event: every group fed so far published (the heal -> published time is printed), and
one line with the replicas' RSS. At the end the replicas stop (SIGTERM, rc 0) and the checks of the
suite run over everything fed: no aborted read, no torn group, none lost, none duplicated, rows
equal the library's. Exits 1 on the first failed check. docs/guarantees.md carries a report.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from tests.faults.net.cluster import ProxiedCluster
from tests.faults.net.diagnose import diagnose
from tests.faults.net.events import events
from tests.faults.net.network_run import fault_class, pick_fault, summary
from tests.faults.net.scenario import N, PACE_S, PUBLISH_TIMEOUT_S, NetRun
from tests.faults.net.toxiproxy import BINARY, Toxiproxy
from tests.faults.procs import StageProcess
from tests.faults.protocols import PROTOCOLS

from stage.bench.machine import machine_line


SOAK_DEADLINE_MS = 20_000


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Soak:
    def __init__(self, run: NetRun, cluster: ProxiedCluster, rng: random.Random) -> None:
        self.run, self.cluster, self.rng = run, cluster, rng
        self.restarts = {r: 0 for r in cluster.clients}
        self.events: list[tuple[str, float]] = []       # (kind, heal -> all published seconds)

    def quiet(self, seconds: float) -> None:
        """Feed at the suite's pace for ``seconds`` (the trickle spreads each group's records)."""
        self.run.feed(max(1, int(seconds / PACE_S)))
        time.sleep(seconds)

    def settle(self, since: float, what: str) -> float:
        """Every group fed so far published; seconds from ``since`` to the last waiting one."""
        run = self.run
        run.trickle.drain(60)
        waiting = set(run.trickle.fed) - run.verifier.published()
        run.wait_published(PUBLISH_TIMEOUT_S, what)
        last = max((run.verifier.first_seen[g] for g in waiting), default=since)
        return max(0.0, last - since)

    def network(self) -> str:
        run, cluster = self.run, self.cluster
        replica, fault, nodes, held = pick_fault(run, cluster)
        ep = run.episode(fault, replica, nodes, held)
        if ep.exits:
            raise AssertionError(f"[{run.context}] a replica exited: {ep.line()}")
        seen = run.readiness[replica].seen if replica in run.readiness else []
        if seen and seen[-1][1] != 200:
            # the other replica publishes everything, so a replica alive but never ready again
            # (a consumer that librdkafka fenced for good once left one so) shows only here
            raise AssertionError(f"[{run.context}] replica {replica} not ready 30s after the heal: "
                                 f"{seen[-1]}; {ep.line()}")
        self.events.append((fault_class(ep, cluster), ep.heal_to_published_s))
        return ep.line()

    def kill_replica(self) -> str:
        run, rng = self.run, self.rng
        replica = rng.choice(self.cluster.clients)
        run.procs[replica].kill()
        down = rng.uniform(5, 20)
        self.quiet(down)
        self.restarts[replica] += 1
        run.procs[replica] = StageProcess(run.cfgs[replica], run.workdir,
                                          f"replica-{replica}-{self.restarts[replica]}",
                                          log_level=run.log_level)
        back = time.time()
        took = self.settle(back, f"after replica {replica} was restarted")
        # the restarted replica a member again before the next event (a SIGTERM while it is
        # still importing ends it with -15, before its handler is installed)
        run.wait_ready(120)
        self.events.append(("kill -9 of a replica", took))
        return f"kill -9 of replica {replica}, restarted {down:.1f}s later: all published {took:.1f}s after the restart"

    def kill_broker(self) -> str:
        rng = self.rng
        node = rng.choice(self.cluster.kraft.nodes)
        node.kill()
        down = rng.uniform(10, 30)
        self.quiet(down)
        node.start()
        back = time.time()
        took = self.settle(back, f"after broker {node.node_id} was restarted")
        self.events.append(("broker kill -9", took))
        return f"broker {node.node_id} killed, started {down:.1f}s later: all published {took:.1f}s after its start"

    def memory(self) -> str:
        return ", ".join(f"{r} {rss_mib(p.pid):.0f} MiB" for r, p in self.run.procs.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="no new event starts after this long")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--group-protocol", choices=("classic", "consumer"), default="classic")
    parser.add_argument("--log-level", default="INFO", help="the replicas' log level (DEBUG to chase a stall)")
    parser.add_argument("--hold-on-failure", type=float, default=0.0, metavar="SECONDS",
                        help="on a failed check, keep the cluster and replicas this long for a look")
    args = parser.parse_args(argv)
    # SIGTERM or SIGINT (which a shell's background job ignores by default) end the run
    # through its cleanup: the brokers, Toxiproxy and the replicas stop
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    if not BINARY.is_file():
        print(f"{BINARY} is missing: run `make toxiproxy`", file=sys.stderr)
        return 2
    print(machine_line(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="soak-"))
    toxiproxy = Toxiproxy(BINARY, root / "toxiproxy.log")
    cluster = ProxiedCluster(root, toxiproxy)
    rng = random.Random(args.seed)
    protocol = PROTOCOLS["kip848" if args.group_protocol == "consumer" else "classic"]
    started = time.monotonic()
    memory: list[str] = []
    try:
        cluster.start()
        print(f"cluster at {cluster.bootstrap}; logs in {root}; group_protocol {args.group_protocol}", flush=True)
        (root / "run").mkdir()
        # deadlines above what a broker kill holds back: acks=all writes to the partitions a
        # killed broker followed wait until the controller fences it (6 s here) and the ISR
        # shrinks; with the suite's 5 s deadline one receipt held 8 s became a placeholder
        with NetRun(cluster, root / "run", args.seed, log_level=args.log_level, group_timeout_ms=SOAK_DEADLINE_MS,
                    **protocol) as run:
            soak = Soak(run, cluster, rng)
            try:
                report(soak, run, started, args.minutes, rng, memory)
            except AssertionError as error:
                print(f"FAILED: {error}", flush=True)   # first: a hold may end in a signal
                folder = diagnose(run, cluster, root / "diagnosis")
                print(f"diagnosis (metrics, stacks, open transactions, group, stable offsets) in {folder}",
                      flush=True)
                if args.hold_on_failure:
                    print(f"holding the cluster {args.hold_on_failure:.0f}s (bootstrap {cluster.bootstrap})",
                          flush=True)
                    time.sleep(args.hold_on_failure)
                raise
    finally:
        cluster.discard()
        toxiproxy.stop()
    return 0


def report(soak: Soak, run: NetRun, started: float, minutes: float, rng: random.Random, memory: list) -> None:
    """The schedule, then the final checks and the report."""
    cluster = soak.cluster
    memory.append(soak.memory())
    print(f"  0.0 min: {len(run.groups)} groups fed; RSS {memory[-1]}", flush=True)
    while time.monotonic() - started < minutes * 60:
        soak.quiet(rng.uniform(20, 60))
        kind = rng.choices(["network", "replica", "broker"], weights=[6, 2, 2])[0]
        line = {"network": soak.network, "replica": soak.kill_replica, "broker": soak.kill_broker}[kind]()
        memory.append(soak.memory())
        print(f"  {(time.monotonic() - started) / 60:.1f} min: {line}; {len(run.groups)} groups fed, "
              f"{len(run.verifier.published())} published; RSS {memory[-1]}", flush=True)
    verdict = run.finish()
    if run.tracebacks():
        raise AssertionError(f"[{run.context}] unhandled errors: {run.tracebacks()}")
    print(f"done in {(time.monotonic() - started) / 60:.1f} min: {len(run.groups)} groups "
          f"({len(run.groups) * N} receipts), {len(soak.events)} events; verifier {verdict.counts()}", flush=True)
    print("replicas: " + "; ".join(f"{r}: {events(p.log())}" for r, p in run.procs.items()))
    print(f"restarts by the schedule: {soak.restarts}; RSS first {memory[0]}, last {memory[-1]}")
    by_kind: dict[str, list[float]] = {}
    for kind, took in soak.events:
        by_kind.setdefault(kind, []).append(took)
    for kind, values in sorted(by_kind.items()):
        print(f"  {kind}: {len(values)} events; to all published {min(values):.1f}-{max(values):.1f}s")
    for name, eps in sorted({fault_class(ep, cluster): [e for e in run.episodes if fault_class(e, cluster) == fault_class(ep, cluster)]
                             for ep in run.episodes}.items()):
        print(f"  {name}: {summary(eps)}")


if __name__ == "__main__":
    sys.exit(main())
