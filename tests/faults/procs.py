"""Helpers for the fault tests: the stage as a real OS process (so kill -9 is a real kill -9),
a read_committed watcher of the published summaries, and the exactly-once assertions."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import yaml
from confluent_kafka import Consumer, KafkaError, TopicPartition

from stage.finalize import ReassemblyConfig
from stage.config.model import ENV_PREFIX, StageConfig
from stage.wire import AvroCodec, TopicNames
from tests.integration.harness import GroupSpec, expected_rows, read_all, rows_by_group

ROOT = Path(__file__).resolve().parents[2]
ROWS = AvroCodec("CanonicalRow")
SUMMARY = AvroCodec("GroupSummary")
LEDGER = AvroCodec("LedgerEntry")
FAULT_ENV = "ROLLOUT_REASSEMBLER_FAULT"
_NOISE = "has no boundary route"   # the synthetic calls carry no boundary routes: one warning each
_ASSIGNED = re.compile(r"assigned partitions \[([0-9, ]*)\]")


def write_config(cfg: StageConfig, path: Path) -> Path:
    """The StageConfig as the YAML file ``python -m stage run --config`` loads."""
    path.write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=True))
    return path


class StageProcess:
    """``python -m stage run --config <yaml>`` as a child process; stdout+stderr go to a file."""

    def __init__(self, cfg: StageConfig, workdir: Path, name: str, *, fault: str | None = None,
                 fault_env_direct: bool = False, arm_file: Path | None = None,
                 log_level: str = "INFO", extra_env: dict[str, str] | None = None) -> None:
        """``fault``: a crash point ``<point>:<n>``. By default it is armed through
        tests/faults/launch.py (which can also arm the fault on a trigger file);
        ``fault_env_direct=True`` sets that variable for ``python -m stage run`` itself;
        ``arm_file``: the fault is armed only once that file exists (launcher only);
        ``extra_env``: variables for the process (settings that must not be in the YAML: secrets)."""
        self.name = name
        self.config_path = write_config(cfg, workdir / f"{name}.yaml")
        self.log_path = workdir / f"{name}.log"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(ENV_PREFIX) and k != "KAFKA_BOOTSTRAP_SERVERS"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra_env or {})
        command = [sys.executable, "-m", "stage", "run", "--config", str(self.config_path),
                   "--log-level", log_level]
        if fault and fault_env_direct:
            env[FAULT_ENV] = fault
        elif fault:
            env["STAGE_TEST_FAULT"] = fault
            if arm_file is not None:
                env["STAGE_TEST_FAULT_ARM_FILE"] = str(arm_file)
            command = [sys.executable, "-m", "tests.faults.launch", "--config", str(self.config_path),
                       "--log-level", log_level]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    # -- state -------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 40) -> str:
        """The last lines of the log, without librdkafka chatter and per-call route warnings."""
        text = [line for line in self.log().splitlines()
                if not line.startswith("%") and _NOISE not in line][-lines:]
        return f"--- {self.name} (pid {self.pid}, rc {self.returncode}) log tail ---\n" + "\n".join(text)

    def assignments(self) -> list[list[int]]:
        """Every ``assigned partitions [...]`` the process logged (incremental, cooperative)."""
        return [[int(p) for p in m.group(1).replace(" ", "").split(",") if p]
                for m in _ASSIGNED.finditer(self.log())]

    def assigned(self) -> set[int]:
        return {p for a in self.assignments() for p in a}

    # -- control -----------------------------------------------------------------------------
    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if not self.alive():
                raise AssertionError(f"{self.name} exited (rc {self.returncode}) while waiting for "
                                     f"{what}\n{self.tail()}")
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.tail()}")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout}s\n{self.tail()}") from None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def terminate(self, timeout: float = 45.0) -> int:
        """SIGTERM (graceful shutdown), then wait; rc 0 expected."""
        self.signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill(self) -> None:
        """SIGKILL (kill -9) and reap. Only this child's pid is signalled."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        self.kill()
        self._log.close()


class SummaryWatcher:
    """A read_committed reader of the GroupSummary topic that accumulates what is visible, so
    the test can wait for groups to be published without knowing the stage's internals."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"watch-{uuid.uuid4().hex}",
                                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                  "isolation.level": "read_committed", "enable.partition.eof": False})
        partitions = self.consumer.list_topics(topic, timeout=10).topics[topic].partitions
        self.consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        self.seen: Counter = Counter()

    def poll(self, seconds: float = 0.2) -> None:
        for msg in self.consumer.consume(1000, seconds):
            if msg.error():
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    raise AssertionError(f"summary watcher: {msg.error()}")
                continue
            self.seen[SUMMARY.decode(msg.value())["group_id"]] += 1

    def wait_for(self, group_ids, timeout: float, procs=(), what: str = "groups published") -> None:
        """Until every id in ``group_ids`` has a committed summary; ``procs`` must stay alive."""
        wanted = set(group_ids)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if wanted <= set(self.seen):
                return
            for proc in procs:
                if not proc.alive():
                    raise AssertionError(f"{proc.name} exited (rc {proc.returncode}) while waiting for "
                                         f"{what}; missing {sorted(wanted - set(self.seen))}\n{proc.tail()}")
        tails = "\n".join(p.tail() for p in procs)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; missing "
                             f"{sorted(wanted - set(self.seen))}\n{tails}")

    def close(self) -> None:
        self.consumer.close()


@dataclasses.dataclass
class Published:
    summaries: list
    rows: list
    ledger: list   # (key, value or None)


def read_outputs(bootstrap: str, topics: TopicNames, isolation: str = "read_committed") -> Published:
    summaries = [SUMMARY.decode(m.value())
                 for m in read_all(bootstrap, topics.finalized_groups, isolation=isolation, timeout=30)]
    rows = [ROWS.decode(m.value())
            for m in read_all(bootstrap, topics.canonical_rows, isolation=isolation, timeout=30)]
    ledger = [(m.key().decode(), None if m.value() is None else LEDGER.decode(m.value()))
              for m in read_all(bootstrap, topics.stage_ledger, isolation=isolation, timeout=30)]
    return Published(summaries, rows, ledger)


def assert_exactly_once(out: Published, groups: list[GroupSpec], finalize: ReassemblyConfig,
                        n: int) -> None:
    """Every group published exactly once (one summary, one ledger entry, N rows with distinct
    sample ids), none lost, nothing unexpected, and the rows equal the library's."""
    wanted = {g.group_id for g in groups}
    per_summary = Counter(s["group_id"] for s in out.summaries)
    assert set(per_summary) == wanted, (
        f"lost: {sorted(wanted - set(per_summary))}; unexpected: {sorted(set(per_summary) - wanted)}")
    twice = {g: c for g, c in per_summary.items() if c != 1}
    assert not twice, f"groups with more than one committed GroupSummary: {twice}"
    for s in out.summaries:
        assert s["outcome"] == "complete" and s["valid_rows"] == n and s["total_rows"] == n, (
            s["group_id"], s["outcome"], s["valid_rows"], s["total_rows"], s["rejections"], s["drop_reason"])
    sample_ids = Counter(r["sample_id"] for r in out.rows)
    dup = {k: v for k, v in sample_ids.items() if v > 1}
    assert not dup, f"duplicate sample_ids among committed rows: {dup}"
    by_group = rows_by_group(out.rows)
    assert set(by_group) == wanted, f"rows lost for {sorted(wanted - set(by_group))}"
    for spec in groups:
        got = by_group[spec.group_id]
        assert [r["sample_id"] for r in got] == [f"{spec.group_id}_g{i}" for i in range(n)]
        assert got == expected_rows(spec, finalize), f"rows of {spec.group_id} differ from the library's"
    ledger_entries = Counter(key for key, value in out.ledger if value is not None)
    assert set(ledger_entries) == wanted, f"ledger entries missing for {sorted(wanted - set(ledger_entries))}"
    assert all(c == 1 for c in ledger_entries.values()), f"ledger entries written twice: {ledger_entries}"


class Trickle:
    """Feeds groups from a background thread at a steady pace, each group's records spread out
    (staged calls, then half the receipts, then the rest), so that at any moment some groups
    are partly buffered: a rebalance or a kill then lands on half-joined groups."""

    def __init__(self, bootstrap: str, topics: TopicNames, pace_s: float = 0.25) -> None:
        from tests.integration.harness import Feeder
        self.feeder = Feeder(bootstrap, topics)
        self.pace_s = pace_s
        self._queue: list = []
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.fed: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True, name="trickle")
        self._thread.start()

    def add(self, groups) -> None:
        with self._lock:
            self._queue.extend(groups)
            self._idle.clear()

    def _run(self) -> None:
        step = self.pace_s / 3
        try:
            while not self._stop.is_set():
                with self._lock:
                    spec = self._queue.pop(0) if self._queue else None
                    if spec is None:
                        self._idle.set()
                if spec is None:
                    time.sleep(0.02)
                    continue
                half = len(spec.receipts) // 2
                for part in (lambda: self.feeder.staged(spec),
                             lambda: self.feeder.receipts(spec, spec.receipts[:half]),
                             lambda: self.feeder.receipts(spec, spec.receipts[half:])):
                    part()
                    self.feeder.flush()
                    time.sleep(step)
                self.fed.append(spec.group_id)
        except BaseException as error:  # noqa: BLE001 - surfaced by drain()
            self.error = error
            self._idle.set()

    def drain(self, timeout: float) -> None:
        """Wait until every added group is fully produced."""
        if not self._idle.wait(timeout):
            raise AssertionError(f"the feeder did not drain within {timeout}s")
        if self.error is not None:
            raise AssertionError(f"the feeder failed: {self.error!r}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.feeder = None   # release the producer before the broker goes away
