"""The only broker restarted under a running stage, observed from outside: what both the fault
test (tests/faults/test_broker_restart.py) and the recovery benchmark
(``python -m tests.faults.restart_bench``) run.

The stage is a real process with the settings it is given (the benchmark and the test use the
defaults but for the addresses); the broker is the README's dev broker (stage.brokers.kraft,
single node, its data kept across the restart). What is recorded, each on the wall clock: the
broker stopped and ready again, every /readyz answer (polled every 0.25 s), the moment each
group's summary became visible to a read_committed reader, and the stage's own log lines.
"""

from __future__ import annotations

import datetime
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from stage.brokers.kraft import KraftBroker, free_port
from stage.config.model import StageConfig
from tests.faults.procs import StageProcess, SummaryWatcher
from tests.integration.harness import Feeder, make_group, setup_topics, unique_topics

N = 4
# The stage's log lines that mark the events of a recovery (a regex each; the first match of a
# line after the broker stopped is what the timeline shows).
EVENTS = {
    "brokers down seen": r"brokers unreachable",
    "session lost": r"lost partitions",
    "transaction stuck": r"publication stuck in",
    "transaction outcome": r"transaction (committed|aborted|outcome)",
    "assigned again": r"assigned partitions \[\d",
    "brokers reachable": r"brokers reachable again",
    "producer replaced": r"new producer ready",
    "rewind": r"rewinding every partition",
}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


class Readiness:
    """/readyz polled every 0.25 s on a thread: (wall time, status, body)."""

    def __init__(self, port: int) -> None:
        self.url, self.seen, self._stop = f"http://127.0.0.1:{port}/readyz", [], threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            try:
                with urllib.request.urlopen(self.url, timeout=1) as answer:
                    status, body = answer.status, answer.read().decode()
            except urllib.error.HTTPError as error:
                status, body = error.code, error.read().decode()
            except OSError:
                continue
            self.seen.append((time.time(), status, body))

    def between(self, start: float, end: float) -> list[tuple[float, int, str]]:
        return [answer for answer in list(self.seen) if start <= answer[0] < end]

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)


@dataclass
class Restart:
    """What one restart looked like (wall-clock times, seconds since the epoch)."""

    stopped: float = 0.0                 # the broker was told to stop
    ready: float = 0.0                   # it answered metadata again
    fed: float = 0.0                     # the producers' records after it were all acknowledged
    broker_log: str = ""                 # what the broker logged after its restart
    published: dict = field(default_factory=dict)   # group id -> first seen committed
    readiness: list = field(default_factory=list)   # (time, status, body)
    log_events: list = field(default_factory=list)  # (time, event, line) after the stop
    exit_code: int | None = None         # None: the stage was still running at the end

    @property
    def recovered_s(self) -> float:
        """Seconds from the broker being ready to the last group published."""
        return max(self.published.values()) - self.ready

    def answers(self, start: float, end: float) -> list[tuple[float, int, str]]:
        return [a for a in self.readiness if start <= a[0] < end]

    def first(self, event: str, after: float = 0.0) -> float | None:
        return next((t for t, name, _line in self.log_events if name == event and t >= after), None)

    def timeline(self) -> list[str]:
        """Human-readable: each event with its seconds since the stop and since ready."""
        rows = [(self.stopped, "broker stopped"), (self.ready, "broker ready")]
        seen = set()
        for t, name, _line in self.log_events:
            if name not in seen:
                seen.add(name)
                rows.append((t, name))
        rows += _readiness_changes(self.readiness, self.stopped)
        if self.published:
            rows.append((min(self.published.values()), "first group published"))
            rows.append((max(self.published.values()), "last group published"))
        if self.fed:
            rows.append((self.fed, "the producers flushed every record"))
        return [f"{t - self.stopped:7.1f}s after stop {t - self.ready:+7.1f}s vs ready  {what}"
                for t, what in sorted(rows)]


def _readiness_changes(answers, since: float) -> list[tuple[float, str]]:
    out, last = [], None
    for t, status, body in answers:
        if t < since - 1:
            continue
        if status != last:
            out.append((t, f"/readyz {status}: {body[:90]}"))
            last = status
    return out


def log_events(log: str, since: float) -> list[tuple[float, str, str]]:
    """(time, event, line) for the stage's log lines that mark an event, at or after ``since``."""
    out = []
    for line in log.splitlines():
        stamp = _STAMP.match(line)
        if stamp is None:
            continue
        t = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if t < since:
            continue
        for name, pattern in EVENTS.items():
            if re.search(pattern, line):
                out.append((t, name, line))
    return out


def stage_log_since(log: str, since: float) -> str:
    """The stage's own log lines (not librdkafka's) from ``since`` on."""
    out, keep = [], False
    for line in log.splitlines():
        stamp = _STAMP.match(line)
        if stamp is not None:
            keep = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() >= since
        if keep and not line.startswith("%") and "has no boundary route" not in line:
            out.append(line)
    return "\n".join(out)


def restart_under_stage(workdir: Path, *, down_s: float, settings: dict | None = None,
                        partitions: int = 4, groups: int = 6, log=print,
                        log_level: str = "INFO") -> tuple[Restart, dict]:
    """Run the stage on a fresh dev broker, publish ``groups`` groups, leave ``groups`` open,
    stop the broker (SIGTERM, as Ctrl-C on ``rollout-reassembler broker``), start it again
    ``down_s`` seconds after the stop began, then complete the open groups and send ``groups``
    more; returns the observation and the context (broker, stage, specs, topics, config) for the
    caller's own checks. The caller stops the broker and the stage (``close(context)``)."""
    broker = KraftBroker(str(workdir / "broker"), heap="1g").start()
    port = free_port()
    topics = unique_topics()
    cfg = StageConfig(bootstrap_servers=broker.bootstrap, topics=topics, group_id=f"stage-{topics.receipts}",
                      transactional_id=f"tx-{topics.receipts}", metrics_port=port, **(settings or {}))
    setup_topics(cfg, partitions=partitions)
    before = [make_group(f"before-g{i}", N, seed=i) for i in range(groups)]
    across = [make_group(f"across-g{i}", N, seed=50 + i) for i in range(groups)]   # open over it
    after = [make_group(f"after-g{i}", N, seed=90 + i) for i in range(groups)]
    seen = Restart()
    context = dict(broker=broker, cfg=cfg, topics=topics, groups=before + across + after, stage=None,
                   readiness=None, watcher=None)
    stage = context["stage"] = StageProcess(cfg, workdir, "stage", log_level=log_level)
    stage.wait_for(lambda: stage.assigned() == set(range(partitions)), 120, "stage assigned")
    readiness = context["readiness"] = Readiness(port)
    feeder = Feeder(broker.bootstrap, topics)
    for spec in before:
        feeder.staged(spec)
        feeder.receipts(spec)
    for spec in across:                      # staged calls and half the receipts only
        feeder.staged(spec)
        feeder.receipts(spec, spec.receipts[: N // 2])
    feeder.flush()
    del feeder
    watcher = SummaryWatcher(broker.bootstrap, topics.finalized_groups)
    watcher.wait_for([g.group_id for g in before], 120, procs=[stage], what="groups before the outage")
    watcher.close()
    time.sleep(2)                            # readiness settles on "ready" before the fault

    seen.stopped = time.time()
    log(f"stopping the broker (SIGTERM); starting it again {down_s:.0f}s after")
    broker.stop()
    time.sleep(max(0.0, seen.stopped + down_s - time.time()))
    broker_log = broker.dir / "broker.log"
    restarted_at = broker_log.stat().st_size if broker_log.exists() else 0
    broker.start(timeout=180)
    seen.ready = time.time()
    log(f"broker ready again {seen.ready - seen.stopped:.1f}s after the stop")

    feeder = Feeder(broker.bootstrap, topics)
    for spec in across:
        feeder.receipts(spec, spec.receipts[N // 2:])
    for spec in after:
        feeder.staged(spec)
        feeder.receipts(spec)
    feeder.flush()
    seen.fed = time.time()
    del feeder
    watcher = context["watcher"] = SummaryWatcher(broker.bootstrap, topics.finalized_groups)
    wanted = {g.group_id for g in across + after}
    deadline = time.monotonic() + 300
    while not wanted <= set(seen.published) and time.monotonic() < deadline and stage.alive():
        watcher.poll(0.1)
        now = time.time()
        for group_id in watcher.seen:
            seen.published.setdefault(group_id, now)
    time.sleep(3)                            # readiness after the recovery, for the record
    seen.published = {g: t for g, t in seen.published.items() if g in wanted}
    seen.readiness = list(readiness.seen)
    seen.log_events = log_events(stage.log(), seen.stopped)
    seen.exit_code = stage.returncode
    if broker_log.exists():
        seen.broker_log = broker_log.read_bytes()[restarted_at:].decode(errors="replace")
    return seen, context


def close(context: dict) -> None:
    for name in ("readiness", "watcher", "stage"):
        if context.get(name) is not None:
            context[name].close()
    context["broker"].stop()
