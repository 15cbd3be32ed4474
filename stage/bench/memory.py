"""``rollout-reassembler bench memory``: the stage's resident memory against its cap.

The stage runs as its own process (``rollout-reassembler run``) with ``max_buffered_bytes`` set
to ``--cap``; its RSS (/proc/<pid>/status) and its ``held_bytes`` / ``buffered_bytes`` gauges
are sampled every 50 ms while a workload profile's groups pass through it:

- ``--open all``: every group's staged calls first, then every receipt (all groups open at
  once: the buffer cannot complete any group until the receipts arrive);
- ``--open streaming``: group after group, each complete before the next starts.

The inputs are written by the SDK's producer with routes by reference by default (route chunks
first, then the staged calls naming them: every record within the stage's ``max_record_bytes``);
``route_staging="inline"`` keeps the routes inside the staged calls (a profile's then need a
larger ``--max-record-bytes``).

Printed: the idle RSS (started, partitions assigned, nothing consumed), the peak RSS, their
difference against the cap (target: at most 1.5x), the peak of what the stage counts as held,
and the bytes the input carried.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

from confluent_kafka import Consumer

from stage.bench.e2e import StageProcess, _config, _topics, by_reference
from stage.bench.inputs import RECEIPTS, bench_profile, profile_groups, profile_line
from stage.bench.machine import machine_info, machine_line
from stage.bench.pipeline import load_average
from stage.runtime.kafka.topics import create_topics
from stage.wire import DEFAULT_MAX_RECORD_BYTES
from stage.client import StagingProducer


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"rollout_reassembler_{name} "):
            return float(line.split()[1])
    return 0.0


class Sampler:
    """RSS and the held/buffered gauges of the stage process, every ``interval_s``."""

    def __init__(self, stage: StageProcess, interval_s: float = 0.05) -> None:
        self.stage, self.interval_s = stage, interval_s
        self.peak_rss = self.peak_held = self.peak_buffered = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        metrics_every, last = 0.5, 0.0
        while not self._stop.wait(self.interval_s):
            try:
                self.peak_rss = max(self.peak_rss, _rss_bytes(self.stage.proc.pid))
            except OSError:
                return
            if time.monotonic() - last >= metrics_every:
                last = time.monotonic()
                _, text = self.stage.get("/metrics")
                self.peak_held = max(self.peak_held, _gauge(text, "held_bytes"))
                self.peak_buffered = max(self.peak_buffered, _gauge(text, "buffered_bytes"))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


def _summaries(bootstrap: str, topic: str, want: int, timeout_s: float) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-mem-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
    consumer.subscribe([topic])
    seen, deadline = 0, time.monotonic() + timeout_s
    try:
        while seen < want and time.monotonic() < deadline:
            seen += sum(1 for m in consumer.consume(100, 0.5) if not m.error())
    finally:
        consumer.close()
    return seen


def run(*, bootstrap: str | None = None, profile: str = "agentic-moe", groups: int = 4,
        routes: str = "deferred", cap: int = 512 << 20, open_mode: str = "all",
        group_size: int | None = None, as_json: bool = False, max_record_bytes: int | None = None,
        route_staging: str = "by-reference") -> int:
    from stage.bench.broker import bench_broker
    try:
        with bench_broker(bootstrap, heap="1g") as (servers, _kind):
            return _run(servers, profile, groups, routes, cap, open_mode, group_size, as_json,
                        max_record_bytes or DEFAULT_MAX_RECORD_BYTES, route_staging)
    except RuntimeError as error:
        print(f"bench memory: {error}")
        return 1


def _run(bootstrap, profile, groups, routes, cap, open_mode, group_size, as_json,
         max_record_bytes=DEFAULT_MAX_RECORD_BYTES, route_staging="by-reference") -> int:
    overrides = {} if group_size is None else {"group_size": group_size}
    workload = bench_profile(profile, **overrides)
    topics = _topics(f"mem-{uuid.uuid4().hex[:6]}")
    cfg = _config(bootstrap, topics, routes=routes, max_record_bytes=max_record_bytes).replace(
        max_buffered_bytes=cap, group_timeout_ms=600_000)
    if routes == "direct" and workload.routes:
        cfg = cfg.replace(finalize=cfg.finalize.model_copy(update={"route_layers": workload.routes[0],
                                                                  "route_topk": workload.routes[1]}))
    from confluent_kafka.admin import AdminClient
    create_topics(AdminClient({"bootstrap.servers": bootstrap}), cfg, partitions=2, replication=1,
                  min_insync_replicas=1, max_message_bytes=max(max_record_bytes, 1_000_000) + (1 << 20))
    stage = StageProcess(cfg)
    try:
        stage.wait_ready()
        time.sleep(2.0)
        idle = _rss_bytes(stage.proc.pid)
        sampler = Sampler(stage)
        sdk = StagingProducer(bootstrap, topics=topics, max_record_bytes=max_record_bytes,
                              routes_by_reference=route_staging == "by-reference",
                              config={"linger.ms": 5, "queue.buffering.max.kbytes": 1 << 20})
        held_receipts = []
        for group in profile_groups(workload, groups):
            records = group.records
            if route_staging == "by-reference":
                ((_gid, records),) = by_reference([(group.group_id, records)])
            else:
                largest = max(len(value) for _role, value in records)
                if largest > cfg.max_record_bytes:   # the stage would dead-letter it: the group never completes
                    raise RuntimeError(f"group {group.group_id} has a staged call of {largest:,} bytes (routes "
                                       f"inline), over the stage's max_record_bytes {cfg.max_record_bytes:,}; "
                                       f"run with --max-record-bytes {largest} or more")
            for role, value in records:
                if role == RECEIPTS and open_mode == "all":
                    held_receipts.append((group.group_id, value))
                elif isinstance(value, dict):
                    sdk.send_staged(group.group_id, value)
                else:
                    sdk.produce(topics.receipts if role == RECEIPTS else topics.staged_calls,
                                group.group_id, value)
            del records
            sdk.flush(600)
        for group_id, value in held_receipts:
            sdk.produce(topics.receipts, group_id, value)
        sdk.flush(600)
        input_bytes = sdk.produced_bytes
        published = _summaries(bootstrap, topics.finalized_groups, groups, 900)
        sampler.stop()
    finally:
        stage.stop()
    report = {"benchmark": "memory", "profile": profile, "routes": routes, "open": open_mode,
              "route_staging": route_staging, "max_record_bytes": max_record_bytes,
              "groups": groups, "published": published, "cap_bytes": cap, "input_bytes": input_bytes,
              "idle_rss_bytes": idle, "peak_rss_bytes": sampler.peak_rss,
              "peak_held_bytes": sampler.peak_held, "peak_buffered_bytes": sampler.peak_buffered,
              "rss_over_idle_per_cap": (sampler.peak_rss - idle) / cap, "load": load_average(),
              "machine": machine_info()}
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    mb = 1 << 20
    print(profile_line(profile, workload))
    print(machine_line(report["machine"]))
    print(f"memory: {groups} groups, routes {routes} staged {route_staging}, groups open: {open_mode}, cap (max_buffered_bytes) "
          f"{cap / mb:.0f} MiB, input {input_bytes / mb:,.0f} MiB; machine load {report['load']}")
    print(f"  idle RSS {idle / mb:,.0f} MiB, peak RSS {sampler.peak_rss / mb:,.0f} MiB: peak - idle = "
          f"{(sampler.peak_rss - idle) / mb:,.0f} MiB = {report['rss_over_idle_per_cap']:.2f}x the cap "
          f"(target <= 1.5x)")
    print(f"  peak held_bytes {sampler.peak_held / mb:,.0f} MiB, peak buffered_bytes "
          f"{sampler.peak_buffered / mb:,.0f} MiB; {published}/{groups} groups published")
    return 0 if published == groups else 1


__all__ = ["run"]
if __name__ == "__main__":
    raise SystemExit(run(groups=int(os.environ.get("GROUPS", "4"))))
