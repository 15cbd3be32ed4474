"""One run of the network fault suite: two stage replicas (each its own transactional id and
its own proxies) on a 2-partition topic set, a steady feed, the verifier, and fault episodes.

An episode: the fault set on one replica's proxies, groups fed while it lasts, the heal, then
every group fed so far published. What it measured: heal -> every waiting group (fed before the
heal, unpublished at the heal) visible to the verifier.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka.admin import AdminClient

from stage.brokers.kraft import free_port
from stage.finalize import ReassemblyConfig
from stage.runtime.kafka.topics import create_topics
from tests.faults.net.cluster import ProxiedCluster
from tests.faults.net.verifier import Verdict, Verifier
from tests.faults.outage import Readiness
from tests.faults.procs import StageProcess, Trickle, assert_exactly_once, read_outputs
from tests.integration.harness import make_group, stage_config, unique_topics

N = 2
FINALIZE = ReassemblyConfig()
PACE_S = 0.3             # one group fed every PACE_S (its records spread over it)
PUBLISH_TIMEOUT_S = 150  # after a heal: bounded by session, stuck-transaction and back-off timers


@dataclass
class Episode:
    fault: str
    replica: str
    nodes: list
    held_s: float
    waiting: int = 0                 # groups fed before the heal and unpublished at it
    heal_to_published_s: float = 0.0
    exits: dict = field(default_factory=dict)    # replica -> rc, where one exited
    # the faulted replica's /readyz from the fault to the end of the episode: (wall time, status, body)
    readiness: list = field(default_factory=list)
    began: float = 0.0
    healed: float = 0.0

    def unready(self, until: float | None = None) -> list[tuple[float, str]]:
        """(time, why) of every 503 from the fault's start (to ``until``)."""
        return [(t, body.strip()) for t, status, body in self.readiness
                if status == 503 and (until is None or t < until)]

    def ready_after_heal_s(self) -> float | None:
        """The first 200 at or after the heal, seconds after it (None: none yet)."""
        return next((t - self.healed for t, status, _ in self.readiness
                     if status == 200 and t >= self.healed), None)

    def readiness_line(self) -> str:
        unready = self.unready()
        if not unready:
            return "/readyz 200 throughout"
        t, why = unready[0]
        after = self.ready_after_heal_s()
        return (f"/readyz 503 {t - self.began:+.1f}s after the fault ({why[:70]}), 200 "
                + ("never" if after is None else f"{after:+.1f}s after the heal"))

    def line(self) -> str:
        return (f"{self.fault} on {self.replica} -> brokers {self.nodes} for {self.held_s:.1f}s: "
                f"{self.waiting} waiting, heal -> all published {self.heal_to_published_s:.1f}s; "
                f"{self.readiness_line()}" + (f", exits {self.exits}" if self.exits else ""))


class NetRun:
    """``with NetRun(...) as run: run.episode(...); verdict = run.finish()``; ``seed`` in
    every failure message (``context``)."""

    def __init__(self, cluster: ProxiedCluster, workdir: Path, seed: int, *, log_level: str = "INFO",
                 **overrides) -> None:
        self.cluster, self.workdir, self.seed = cluster, Path(workdir), seed
        self.log_level = log_level
        self.rng = random.Random(seed)
        self.toxiproxy = cluster.toxiproxy
        self.topics = unique_topics()
        self.cfgs = {r: stage_config(cluster.bootstrap_for(r), self.topics,
                                     transactional_id=f"tx-{self.topics.receipts}-{r}",
                                     **{"metrics_port": free_port(), **overrides})
                     for r in cluster.clients}
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
        create_topics(admin, self.cfgs["a"], partitions=2, replication=3)
        self.groups: list = []
        self.episodes: list[Episode] = []
        self.procs: dict[str, StageProcess] = {}
        self.readiness: dict[str, Readiness] = {}
        self.trickle = self.verifier = None

    @property
    def context(self) -> str:
        return f"seed {self.seed}, topics {self.topics.receipts}, logs in {self.workdir}"

    def __enter__(self) -> "NetRun":
        try:
            self.toxiproxy.reset()
            self.verifier = Verifier(self.cluster.bootstrap, self.topics)
            self.trickle = Trickle(self.cluster.bootstrap, self.topics, pace_s=PACE_S)
            for replica, cfg in self.cfgs.items():
                self.procs[replica] = StageProcess(cfg, self.workdir, f"replica-{replica}",
                                                   log_level=self.log_level)
                if cfg.metrics_port:
                    self.readiness[replica] = Readiness(cfg.metrics_port)
            self.feed(6)
            self.wait_published(120, "the first groups")
            # both replicas members and ready before any fault: a replica still starting when
            # its fault begins is cut off while it has nothing (CI saw a zombie test's replica
            # take 15 s to start under load, the fault land on its start-up, and its /readyz
            # say "no partitions assigned" instead of "brokers unreachable")
            self.wait_ready(120)
        except BaseException as error:   # `with` calls __exit__ only after __enter__ returned
            self.__exit__(type(error), error, error.__traceback__)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.toxiproxy.reset()
        if self.trickle:
            self.trickle.close()
        if self.verifier:
            self.verifier.close()
        for proc in self.procs.values():
            if exc[0] is not None:
                print(proc.tail(60))
            proc.close()
        for readiness in self.readiness.values():
            readiness.close()

    # -- feeding and waiting -------------------------------------------------------------------
    def feed(self, count: int) -> None:
        start = len(self.groups)
        specs = [make_group(f"s{self.seed}-g{i}", N, seed=self.seed * 100_003 + i, routes=None)
                 for i in range(start, start + count)]
        self.groups.extend(specs)
        self.trickle.add(specs)

    def wait_ready(self, timeout: float) -> None:
        """Every replica's /readyz answering 200 (a member holding a partition, its ledger
        loaded, publishing working)."""
        deadline = time.monotonic() + timeout
        while True:
            unready = [r for r, readiness in self.readiness.items() if not readiness.seen or readiness.seen[-1][1] != 200]
            if not unready:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(self.procs[r].tail(30) for r in unready)
                raise AssertionError(f"[{self.context}] replicas {unready} not ready after {timeout}s; "
                                     f"exits {self.exits()}\n{tails}")
            time.sleep(0.2)

    def exits(self) -> dict:
        return {r: p.returncode for r, p in self.procs.items() if not p.alive()}

    def wait_published(self, timeout: float, what: str, ids=None) -> None:
        wanted = {g.group_id for g in self.groups} if ids is None else set(ids)
        deadline = time.monotonic() + timeout
        while not wanted <= self.verifier.published():
            if time.monotonic() > deadline:
                missing = sorted(wanted - self.verifier.published())
                tails = "\n".join(p.tail(30) for p in self.procs.values())
                raise AssertionError(f"[{self.context}] {what}: {len(missing)} groups unpublished after "
                                     f"{timeout}s: {missing[:10]}; exits {self.exits()}\n{tails}")
            if self.trickle.error is not None:
                raise AssertionError(f"[{self.context}] the feeder failed: {self.trickle.error!r}")
            time.sleep(0.1)

    # -- one fault episode ---------------------------------------------------------------------
    def episode(self, fault, replica: str, nodes: list, held_s: float) -> Episode:
        ep = Episode(fault.__name__, replica, list(nodes), held_s)
        self.feed(max(1, int(held_s / PACE_S)))
        ep.began = time.time()
        fault(self.toxiproxy, self.cluster, replica, nodes)
        time.sleep(held_s)
        self.toxiproxy.reset()
        healed = ep.healed = time.time()
        self.trickle.drain(60)
        fed = set(self.trickle.fed)
        waiting = fed - self.verifier.published()
        ep.waiting = len(waiting)
        self.wait_published(PUBLISH_TIMEOUT_S, f"after the heal of {ep.line()}")
        last = max((self.verifier.first_seen[g] for g in waiting), default=healed)
        ep.heal_to_published_s = max(0.0, last - healed)
        ep.exits = self.exits()
        if replica in self.readiness:
            self._ready_again(replica, healed, 30)
            ep.readiness = self.readiness[replica].between(ep.began, float("inf"))
        self.episodes.append(ep)
        return ep

    def _ready_again(self, replica: str, healed: float, timeout: float) -> None:
        """Wait (bounded) for the replica's /readyz to answer 200 after the heal, so the episode
        records when it did (a replica that holds no partition answers 503 for that reason)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = self.readiness[replica].seen
            if seen and seen[-1][1] == 200 and seen[-1][0] > healed:
                return
            time.sleep(0.25)

    # -- the end -------------------------------------------------------------------------------
    def finish(self) -> Verdict:
        """Every group published, the replicas stopped (SIGTERM), the checks: the verifier's
        (aborted reads, torn groups) and exactly-once on the final committed output."""
        self.trickle.drain(60)
        self.wait_published(PUBLISH_TIMEOUT_S, "the last groups")
        for replica, proc in self.procs.items():
            if proc.alive():
                rc = proc.terminate(60)
                assert rc == 0, f"[{self.context}] replica {replica} stopped with rc {rc}\n{proc.tail()}"
        verdict = self.verifier.verdict(N)
        assert verdict.ok, f"[{self.context}] {verdict.counts()}: {verdict.problems()}"
        try:
            assert_exactly_once(read_outputs(self.cluster.bootstrap, self.topics), self.groups, FINALIZE, N)
        except AssertionError as error:
            raise AssertionError(f"[{self.context}] {error}") from None
        return verdict

    def tracebacks(self) -> dict:
        """Replica -> its log's first traceback, where it logged one (an unhandled error)."""
        out = {}
        for replica, proc in self.procs.items():
            log = proc.log()
            if "Traceback (most recent call last)" in log:
                at = log.index("Traceback (most recent call last)")
                out[replica] = log[at:at + 3000]
        return out
