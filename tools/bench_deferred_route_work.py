"""What routes staged by reference cost the stage in deferred router replay, without a broker.

``--groups`` agentic-moe groups, each call's routes moved out of its StagedCall into a
``routes_ref`` (chunks of ``DEFAULT_ROUTE_CHUNK_BYTES`` at made-up offsets, real digests: the
records the stage reads when the SDK stages by reference). Per group, CPU time
(``time.process_time``, so other processes on a shared machine count less than in wall time)
of the stage's own work on those records: intake (decode + buffer) and ``finalize_and_encode``,

* ``deferred``: router replay deferred, the configuration issue 26 measures;
* ``no routes``: the anchor, the same groups generated without routes (the generator draws
  routes from a stream of their own: same rollouts, calls and tokens), router replay off, as
  ``bench e2e``'s anchor;
* ``by reference, replay off``: the by-reference records under router replay off (no plan built
  or published), which shows what the records themselves cost over the plain ones;

in the order anchor, deferred, deferred, anchor (best of ``--repeats`` each), and their ratio
(issue 26: end to end >= 0.9 of the workload without routes). Then the route parts measured
apart on the same group: every reference checked (``stage.decode.staged.route_reference``),
every boundary read, every RoutePlan record encoded (the stage's writer and the general codec),
every plan's JSON size (the metric). ``--profile FILE`` writes a cProfile of the deferred runs.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_deferred_route_work.py --groups 2
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import time

from stage.bench import pipeline as P
from stage.bench.inputs import RECEIPTS, GroupInputs, bench_profile, profile_groups
from stage.bench.machine import machine_line
from stage.decode import InputLimits
from stage.decode.staged import _route_tensors, route_reference
from stage.runtime.malloc import tune_malloc
from stage.staging.route_refs import DEFAULT_ROUTE_CHUNK_BYTES, ChunkRef, RouteReference, chunk_sha256, split_payload
from stage.wire import TopicNames


def by_reference(inputs: GroupInputs, codec) -> GroupInputs:
    """The group's records as staged by reference (offsets made up, digests real)."""
    topic, records, offset = TopicNames().staged_routes, [], 0
    for role, value in inputs.records:
        if role != RECEIPTS:
            record = codec.decode(value)
            routes = record["routed_experts"]
            if routes is not None:
                chunks = []
                for piece in split_payload(routes["data"], DEFAULT_ROUTE_CHUNK_BYTES):
                    chunks.append(ChunkRef(offset, len(piece), chunk_sha256(piece)))
                    offset += 1
                record["routed_experts"] = None
                record["routes_ref"] = RouteReference(topic, 0, routes["dtype"], tuple(routes["shape"]),
                                                      tuple(chunks)).to_value()
                value = codec.encode(record)
        records.append((role, value))
    return GroupInputs(inputs.group_id, records, inputs.rollouts, inputs.calls, inputs.chain_tokens,
                       inputs.route_bytes)


def cpu_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        started = time.process_time()
        fn()
        best = min(best, time.process_time() - started)
    return best * 1e3


def stage_work(inputs: GroupInputs, codec_map: dict, mode: str):
    _buffer, group = P.intake(inputs, codec_map, keep_routes=False)
    return P.finalize(group, mode, codec_map)


def parts(inputs: GroupInputs, codec_map: dict, repeats: int) -> dict:
    """The route parts of the deferred work on this group, each timed alone."""
    from stage.publish import outputs
    from stage.routes import encoded_route_plan_size_bytes
    try:
        from stage.publish.plan_writer import encode_plan
    except ImportError:     # the code before the writer (a before/after run)
        encode_plan = None
    plan_records, plans = [], []
    real = outputs.plan_record

    def spy(row, *args):
        record = real(row, *args)
        plan_records.append(record)
        plans.append(row.route_plan)
        return record

    outputs.plan_record = spy
    try:
        stage_work(inputs, codec_map, "deferred")
    finally:
        outputs.plan_record = real
    staged = [codec_map["StagedCall"].decode(v) for role, v in inputs.records if role != RECEIPTS]
    limits = InputLimits(route_topic=TopicNames().staged_routes)
    codec = codec_map["RoutePlan"]
    writer = {} if encode_plan is None else {
        "plans encoded (writer)": cpu_ms(lambda: [encode_plan(codec, r) for r in plan_records], repeats)}
    return {
        "spans": sum(len(p.spans) for p in plans),
        "references checked": cpu_ms(lambda: [route_reference(r, limits, partition=0) for r in staged], repeats),
        "boundaries read": cpu_ms(lambda: [_route_tensors(r, limits) for r in staged], repeats),
        **writer,
        "plans encoded (codec)": cpu_ms(lambda: [codec.encode(r) for r in plan_records], repeats),
        "plan JSON sizes, validated again": cpu_ms(lambda: [encoded_route_plan_size_bytes(p) for p in plans], repeats),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile")
    args = parser.parse_args()
    tune_malloc()       # as the command line does for the stage
    codec_map = P.codecs()
    print(f"# {machine_line()}\n# load {os.getloadavg()[0]:.2f} at start; CPU ms, best of {args.repeats}")
    profiler = cProfile.Profile() if args.profile else None
    plain_groups = profile_groups(bench_profile("agentic-moe", groups=args.groups, route_layers=0), args.groups)
    for inputs, plain in zip(profile_groups(bench_profile("agentic-moe", groups=args.groups), args.groups),
                             plain_groups):
        assert plain.chain_tokens == inputs.chain_tokens and plain.calls == inputs.calls
        ref = by_reference(inputs, codec_map["StagedCall"])
        runs = []
        for mode in ("no-routes", "deferred", "deferred", "no-routes"):
            if profiler and mode == "deferred":
                profiler.enable()
            work = (lambda: stage_work(plain, codec_map, mode)) if mode == "no-routes" else \
                (lambda: stage_work(ref, codec_map, mode))
            runs.append((mode, cpu_ms(work, args.repeats)))
            if profiler:
                profiler.disable()
        anchor = sum(ms for mode, ms in runs if mode == "no-routes") / 2
        deferred = sum(ms for mode, ms in runs if mode == "deferred") / 2
        replay_off = cpu_ms(lambda: stage_work(ref, codec_map, "no-routes"), args.repeats)
        print(f"{inputs.group_id}: {inputs.chain_tokens:,} tokens, {inputs.calls:,} calls; no routes "
              f"{anchor:.1f} ms, deferred {deferred:.1f} ms: ratio {anchor / deferred:.3f} "
              f"(runs {', '.join(f'{ms:.1f}' for _m, ms in runs)}); by reference, replay off {replay_off:.1f} ms")
        print("  " + "; ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in parts(ref, codec_map, args.repeats).items()))
    if profiler:
        profiler.dump_stats(args.profile)
    print(f"# load {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
