"""Valid input traffic, as the SDK produces it: a seeded synthetic workload (stage.workload)
staged through ``RolloutStager.prepare`` and announced through ``ReceiptEmitter.event``
(stage.client), without a broker. The fuzz suite mutates this traffic.

A ``Wire`` is one input record as it reaches the stage: topic role, key, value bytes and,
when a routing fault put it elsewhere, the partition (None: the contract's partitioner).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from functools import lru_cache

from stage.client.producer import ReceiptEmitter, RolloutStager
from stage.wire import AvroCodec
from stage.workload import generator as G

RECEIPTS, STAGED = "receipts", "staged_calls"
PARTITIONS = 2   # of each input topic
CODECS = {RECEIPTS: AvroCodec("ReceiptEvent", budget=False),
          STAGED: AvroCodec("StagedCall", budget=False)}
_SCHEMAS = {RECEIPTS: "ReceiptEvent", STAGED: "StagedCall"}


@dataclass(frozen=True)
class Wire:
    role: str                       # RECEIPTS | STAGED
    key: bytes | None
    value: bytes | None
    partition: int | None = None    # None: where the contract's partitioner puts the key
    phase: int = 0                  # 1: produced after the first round of publication (late)
    note: str = ""                  # what a mutation did to it

    def but(self, **changes) -> "Wire":
        return replace(self, **changes)


@dataclass
class Record:
    """A valid record before encoding: its Avro dict (mutations edit it, then encode)."""

    role: str
    group_id: str
    value: dict

    def wire(self, note: str = "", **changes) -> Wire:
        return Wire(self.role, self.group_id.encode(), encode(self.role, self.value), note=note,
                    **changes)


@dataclass
class Traffic:
    """One scenario's valid records, in the order producers would send them."""

    records: list[Record]
    group_sizes: dict[str, int] = field(default_factory=dict)
    routes: tuple[int, int] | None = None


def encode(role: str, value: dict) -> bytes:
    return CODECS[role].encode(value)


def schema_of(role: str) -> str:
    return _SCHEMAS[role]


def workload_config(seed: int, *, routes: bool | None = None, media: bool | None = None,
                    topk: bool | None = None, groups: int | None = None) -> G.WorkloadConfig:
    """A small workload: 1-2 groups of 1-4 rollouts of 1-3 turns of a few tokens, with MoE
    routes, media and top-k drawn from the seed unless forced."""
    rng = random.Random(seed)
    with_routes = rng.random() < 0.6 if routes is None else routes
    return G.WorkloadConfig(
        groups=rng.randint(1, 2) if groups is None else groups, group_size=rng.randint(1, 4),
        turns=(1, rng.randint(1, 3)), prompt_tokens=(3, 16), turn_tokens=(1, 6),
        generated_tokens=(1, 12), retry_rate=0.2, side_call_rate=0.2, version_bump_rate=0.3,
        route_layers=rng.choice((1, 2, 3)) if with_routes else 0, route_topk=rng.choice((1, 2)),
        num_experts=16, boundary_routes=rng.random() < 0.7,
        media_rate=(0.5 if rng.random() < 0.2 else 0.0) if media is None else (1.0 if media else 0.0),
        media_patch_size=2, topk=(3 if rng.random() < 0.2 else 0) if topk is None else (3 if topk else 0),
        vocab_size=5000, seed=seed, group_prefix=f"fz{rng.randrange(1 << 16):04x}-")


@lru_cache(maxsize=256)
def _traffic(config: G.WorkloadConfig) -> tuple:
    workload = G.generate(config)
    records: list[Record] = []
    sizes = {}
    for group in workload.groups:
        sizes[group.group_id] = group.group_size
        emitter = ReceiptEmitter(None, group_id=group.group_id, group_size=group.group_size,
                                 prompt_idx=group.prompt_idx)
        for rollout in group.rollouts:
            stager = RolloutStager(None, group.group_id, rollout.rollout_id)
            for call in rollout.calls:
                prepared = stager.prepare(call.model_call_id, **call.stage_kwargs(config.route_dtype))
                records.append(Record(STAGED, group.group_id, prepared.value))
            receipt = stager.receipt(rollout.terminal)
            records.append(Record(RECEIPTS, group.group_id,
                                  emitter.event(rollout.rollout_index, receipt, reward=rollout.reward)))
    return tuple(records), sizes, config.routes


def valid_traffic(config: G.WorkloadConfig) -> Traffic:
    """The SDK's records of ``config`` (cached per config; each call gets fresh dicts)."""
    records, sizes, routes = _traffic(config)
    return Traffic([Record(r.role, r.group_id, _copy(r.value)) for r in records], dict(sizes), routes)


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
