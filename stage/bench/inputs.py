"""Benchmark inputs: a workload profile's groups as the encoded input records the stage reads.

Every benchmark runs a named profile (``stage.workload.profiles``): ``toy`` keeps each command
quick, ``agentic-moe`` is N=16 rollouts of ~64 calls and 32k tokens on average with 48x8 routes.
Groups come one at a time from the seeded generator (a group of agentic-moe is ~0.5 M tokens and
0.2-0.4 GB of routes), clean (no faults), encoded as the SDK would send them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field

from stage.client.records import receipt_event, staged_call_from_record, staged_call_value
from stage.client.records import staged_row_from_envelopes
from stage.contract import RouteEnvelope
from stage.routes import ROUTED_EXPERTS_FIELD
from stage.wire import AvroCodec
from stage.workload import FaultRates, WorkloadConfig, describe, generate_group, profile

STAGED, RECEIPTS = "staged_calls", "receipts"
# Staged calls with their routes inline, as these inputs are encoded, reach ~7.8 MB at frontier
# sizes (a 4.4k-token call at 40x22 int16), at the default record cap (8,000,000 bytes,
# stage.wire.DEFAULT_MAX_RECORD_BYTES), and direct-mode rows of 128k tokens carry 100-225 MB of
# routes; producers stage routes by reference and rows over the cap go in parts. The benchmarks
# that read these encodings (finalize, fetch, wire, and e2e / memory with --route-staging inline)
# measure work, not those limits: they give their codecs and brokers this one. ``bench e2e`` and
# ``bench memory`` write routes by reference by default (stage.bench.e2e.by_reference: the SDK's
# producer chunks them), every record within the default cap.
BENCH_MAX_RECORD_BYTES = 512 << 20


@dataclass(eq=False)
class GroupInputs:
    group_id: str
    records: list[tuple[str, bytes]]      # (topic role, value): staged calls, then receipts
    rollouts: int
    calls: int
    chain_tokens: int                     # the rows' tokens (every rollout is clean)
    route_bytes: int                      # staged route payload bytes (fragments + boundaries)
    route_bytes_by_dtype: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(value) for _role, value in self.records)


def bench_profile(name: str, **overrides) -> WorkloadConfig:
    """The named profile, fault-free (a benchmark measures the clean path)."""
    return profile(name, faults=FaultRates(), **overrides)


def staged_value(group_id: str, call) -> dict:
    """The StagedCall value the SDK sends for a generated call (routes from the arrays)."""
    extras = call.staged.extras
    if extras is not None and isinstance(extras.get(ROUTED_EXPERTS_FIELD), RouteEnvelope):
        row = staged_row_from_envelopes(call.staged.snapshot, extras, media=call.media, topk=call.topk)
        return staged_call_value(group_id, row)
    return staged_call_from_record(group_id, call.record, media=call.media, topk=call.topk)


def group_inputs(cfg: WorkloadConfig, index: int, codecs: dict | None = None) -> GroupInputs:
    codecs = codecs or {"StagedCall": AvroCodec("StagedCall"), "ReceiptEvent": AvroCodec("ReceiptEvent")}
    group = generate_group(cfg, index)
    staged, receipts, calls, tokens, route_bytes = [], [], 0, 0, 0
    by_dtype: dict[str, int] = {}
    for rollout in group.rollouts:
        for call in rollout.calls:
            value = staged_value(group.group_id, call)
            staged.append((STAGED, codecs["StagedCall"].encode(value)))
            calls += 1
            for name in ("routed_experts", "routed_experts_boundary"):
                if value[name] is not None:
                    size = len(value[name]["data"])
                    route_bytes += size
                    by_dtype[value[name]["dtype"]] = by_dtype.get(value[name]["dtype"], 0) + size
            if call.role == "chain":
                tokens += call.record.delta_len
        receipts.append((RECEIPTS, codecs["ReceiptEvent"].encode(receipt_event(
            group_id=group.group_id, rollout_id=rollout.rollout_id, rollout_index=rollout.rollout_index,
            group_size=group.group_size, prompt_idx=group.prompt_idx, reward=rollout.reward,
            receipt=rollout.receipt))))
    return GroupInputs(group.group_id, staged + receipts, group.group_size, calls, tokens, route_bytes,
                       by_dtype)


def profile_groups(cfg: WorkloadConfig, groups: int, *, first: int = 0) -> Iterator[GroupInputs]:
    codecs = {"StagedCall": AvroCodec("StagedCall", max_record_bytes=BENCH_MAX_RECORD_BYTES),
              "ReceiptEvent": AvroCodec("ReceiptEvent")}
    for index in range(first, first + groups):
        yield group_inputs(cfg, index, codecs)


def profile_line(name: str, cfg: WorkloadConfig) -> str:
    """What every benchmark prints first: the profile and its sizes."""
    return describe(cfg, name)


def median_of(samples: list[dict]) -> dict:
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


def fixed_group(*, n: int = 8, calls: int = 32, tokens: int = 512, layers: int = 48, topk: int = 8,
                dtype: str = "int16", seed: int = 0, group_id: str = "bench") -> GroupInputs:
    """``n`` rollouts of ``calls`` chained calls of ``tokens`` delta tokens (half carry, half
    generated) with delta-aligned routes, staged through the SDK (the benchmarks' fixed group)."""
    import numpy as np

    from stage.client import ReceiptEmitter, RolloutStager
    rng = np.random.default_rng(seed)
    codecs = {"StagedCall": AvroCodec("StagedCall", max_record_bytes=BENCH_MAX_RECORD_BYTES),
              "ReceiptEvent": AvroCodec("ReceiptEvent")}
    emitter = ReceiptEmitter(None, group_id=group_id, group_size=n, prompt_idx=0)
    staged, receipts, route_bytes = [], [], 0
    for r in range(n):
        stager = RolloutStager(None, group_id, f"{group_id}_r{r}")
        parent = None
        for c in range(calls):
            carry, gen = tokens // 2, tokens - tokens // 2
            routes = rng.integers(0, 128, (tokens, layers, topk)).astype(dtype) if layers else None
            prepared = stager.prepare(
                f"c{c}", parent_call_id=parent, prompt_delta=rng.integers(0, 151_000, carry),
                generated=rng.integers(0, 151_000, gen), generated_logprobs=-rng.random(gen),
                weight_version=5, routed_experts=routes, route_dtype=dtype)
            staged.append((STAGED, codecs["StagedCall"].encode(prepared.value)))
            route_bytes += 0 if routes is None else routes.nbytes
            parent = f"c{c}"
        receipts.append((RECEIPTS, codecs["ReceiptEvent"].encode(
            emitter.event(r, stager.receipt(parent), reward=1.0))))
    return GroupInputs(group_id, staged + receipts, n, n * calls, n * calls * tokens, route_bytes,
                       {dtype: route_bytes} if layers else {})
