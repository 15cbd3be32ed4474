"""``RolloutStager.stage`` of a 2,048-token call with 48x8 routes (issue 26 target: <= 2 ms),
routes by reference (chunks + the deferred StagedCall) next to inline, against base64 + SHA-256 of
the same route bytes (what the Gym extras digest cannot avoid). Per call: the time the caller
waits (wall clock of ``stage()`` + ``poll(0)``, median and fastest), and the CPU of the whole
process per call (``time.process_time`` over all calls: the SDK's helper thread that hashes the
chunks is counted, librdkafka's own threads too when ``--bootstrap`` is given). Prints ratios,
asserts nothing.

    PYTHONPATH=$PWD .venv/bin/python -m tests.client.bench_route_staging [--bootstrap HOST:PORT]

Without ``--bootstrap`` the records go to an in-process producer that acknowledges every record
at the next poll (the SDK's own work: digests, encoding, chunking, the delivery callbacks and the
deferred StagedCall); with it, to a real broker through librdkafka (topics must exist:
``rollout-reassembler topics create``)."""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

import numpy as np
import pybase64

from stage.client import RolloutStager, StagingProducer
from tests.client.fakes import FakeProducer


class NullProducer(FakeProducer):
    """Acknowledges at the next poll and keeps no record (no memory growth over many calls)."""

    def produce(self, topic, key=None, value=None, headers=None, on_delivery=None):
        super().produce(topic, key, value, headers, on_delivery)
        self.records.clear()


def measure(producer: StagingProducer, dtype: str, tokens: int, layers: int, k: int,
            calls: int) -> tuple[list[float], float]:
    rng = np.random.default_rng(0)
    stager = RolloutStager(producer, "bench-g", f"bench-{dtype}-{producer.routes_by_reference}-{time.time_ns()}")
    stager.stage("c0", prompt_delta=rng.integers(0, 151_000, 64), generated=rng.integers(0, 151_000, 16),
                 generated_logprobs=-rng.random(16), weight_version=1,
                 routed_experts=rng.integers(0, 128, (80, layers, k)).astype(dtype), route_dtype=dtype)
    seconds, cpu = [], 0.0
    for i in range(calls):
        half = tokens // 2
        kwargs = dict(prompt_delta=rng.integers(0, 151_000, half), generated=rng.integers(0, 151_000, tokens - half),
                      generated_logprobs=-rng.random(tokens - half), weight_version=1,
                      routed_experts=rng.integers(0, 128, (tokens, layers, k)).astype(dtype),
                      routed_experts_boundary=rng.integers(0, 128, (1, layers, k)).astype(dtype), route_dtype=dtype)
        started, cpu_started = time.perf_counter(), time.process_time()
        stager.stage(f"c{i + 1}", parent_call_id=f"c{i}", **kwargs)
        producer.poll(0)        # serves the chunks' callbacks: the deferred StagedCall is produced here
        seconds.append(time.perf_counter() - started)
        cpu += time.process_time() - cpu_started
    producer.flush(60)
    producer.close()
    return seconds, cpu / calls


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=24)
    args = parser.parse_args()
    layers, k = 48, 8
    print(f"stage() of a {args.tokens}-token call with {layers}x{k} routes: wall median (fastest) of {args.calls} "
          f"calls, process CPU a call ({'broker ' + args.bootstrap if args.bootstrap else 'in-process producer'}); "
          f"load {os.getloadavg()[0]:.2f}")
    for dtype in ("int8", "int16"):
        raw = np.zeros((args.tokens, layers, k), dtype).tobytes()
        anchors = [_timed(lambda: hashlib.sha256(pybase64.b64encode(raw)).digest()) for _ in range(20)]
        anchor = statistics.median(anchors)
        row = []
        for by_reference in (True, False):
            producer = (StagingProducer(args.bootstrap, routes_by_reference=by_reference) if args.bootstrap
                        else StagingProducer(producer=NullProducer(), routes_by_reference=by_reference))
            seconds, cpu = measure(producer, dtype, args.tokens, layers, k, args.calls)
            median = statistics.median(seconds)
            row.append(f"{'by reference' if by_reference else 'inline'} {median * 1e3:.2f} ({min(seconds) * 1e3:.2f}) ms "
                       f"(x{median / anchor:.2f} of the anchor), CPU {cpu * 1e3:.2f} ms")
        print(f"  {dtype} ({len(raw) / 1e6:.2f} MB of routes): " + "; ".join(row)
              + f"; anchor base64 + SHA-256 {anchor * 1e3:.2f} ({min(anchors) * 1e3:.2f}) ms")
    return 0


def _timed(fn) -> float:
    started = time.thread_time()
    fn()
    return time.thread_time() - started


if __name__ == "__main__":
    raise SystemExit(main())
