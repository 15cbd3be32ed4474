"""Two fuzz classes of issue 29 and what must hold for each (run by tests/fuzz/test_fuzz_dims_spill.py).

``learned_dims``: direct router replay with learned (L, K) (none configured) where one rollout of
a group is replaced by one whose routes have odd dims (beyond the learned bound, or merely
other), sometimes beside a rollout that staged no routes. Must hold, beyond the general
invariants: the odd rollout over the bound is rejected as ``route_assembly:fragment_dims_limit``;
no row but its own (and one-token placeholders) is shaped in its dims; nothing is shaped beyond
the bound; the stage never agrees on the odd dims.

``spilled_bit_flips``: valid traffic through a stage that spills every staged call to disk, then
bits flipped (or a segment cut short) in live spilled records before finalization. Must hold:
with nothing flipped the rows are those of a stage that spilled nothing; with flips, a partition
either publishes exactly those rows or halts with the ``spill`` cause, never rejects the input
nor publishes a changed value.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stage.buffer import PartitionBuffer
from stage.buffer.spill import SpillStore
from stage.client.producer import ReceiptEmitter, RolloutStager
from stage.finalize import ReassemblyConfig
from stage.routes import MAX_LEARNED_ROUTE_SLOTS
from tests.fuzz.driver import Driver
from tests.fuzz.invariants import Violation, _rows, check
from tests.fuzz.traffic import PARTITIONS, RECEIPTS, STAGED, Record, Wire, valid_traffic, workload_config

POOL = 48
OVER_BOUND = ((1024, 64), (4096, 1), (64, 33), (2049, 1))
WITHIN_BOUND = ((32, 16), (5, 3), (1, 1), (2048, 1))
DIMS_LIMIT = "route_assembly:fragment_dims_limit"


@dataclass
class DimsCase:
    wires: list[Wire]
    honest: tuple[int, int]
    odd: tuple[int, int]
    odd_rollout: str
    note: str


def _rollout_wires(rng: random.Random, group_id: str, rollout_id: str, emitter: ReceiptEmitter, index: int,
                   *, dims: tuple[int, int] | None, tokens: int) -> list[Wire]:
    """One rollout of one call (``tokens`` tokens) staged through the SDK: its staged call and its
    receipt, routes of ``dims`` (int8; none when None)."""
    half = max(1, tokens // 2)
    prompt = [rng.randrange(1, 5000) for _ in range(half)]
    generated = [rng.randrange(1, 5000) for _ in range(max(1, tokens - half))]
    routes = None
    if dims is not None:
        routes = np.random.default_rng(rng.randrange(1 << 30)).integers(
            0, 16, (len(prompt) + len(generated), *dims), dtype=np.int8)
    stager = RolloutStager(None, group_id, rollout_id)
    prepared = stager.prepare("c0", prompt_delta=prompt, generated=generated,
                              generated_logprobs=[-0.5] * len(generated), weight_version=1,
                              routed_experts=routes, route_dtype="int8")
    receipt = emitter.event(index, stager.receipt("c0"), reward=0.5)
    return [Record(STAGED, group_id, prepared.value).wire(note=f"{rollout_id}: routes {dims}"),
            Record(RECEIPTS, group_id, receipt).wire(note=f"{rollout_id}: receipt")]


def learned_dims(rng: random.Random) -> DimsCase:
    traffic = valid_traffic(workload_config(rng.randrange(POOL), routes=True, media=False, topk=False))
    honest = traffic.routes
    receipts = [r for r in traffic.records if r.role == RECEIPTS]
    target = rng.choice(receipts).value
    group_id, size = target["group_id"], target["group_size"]
    emitter = ReceiptEmitter(None, group_id=group_id, group_size=size, prompt_idx=target["prompt_idx"])
    odd = rng.choice(OVER_BOUND if rng.random() < 0.5 else WITHIN_BOUND + ((honest[0] + 1, honest[1]),))
    replaced = {target["rollout_id"]}
    odd_id = f"{group_id}-odd"
    extra = _rollout_wires(rng, group_id, odd_id, emitter, target["rollout_index"], dims=odd,
                           tokens=rng.randint(1, 4))
    note = f"rollout {target['rollout_index']} of {group_id} (N={size}) with routes {odd}"
    others = [r.value for r in receipts if r.value["group_id"] == group_id and r.value is not target]
    if others and rng.random() < 0.5:   # a sibling that staged no routes, as long as the case allows
        sibling = rng.choice(others)
        replaced.add(sibling["rollout_id"])
        extra += _rollout_wires(rng, group_id, f"{group_id}-plain", emitter, sibling["rollout_index"],
                                dims=None, tokens=rng.randint(20, 400))
        note += f", rollout {sibling['rollout_index']} without routes"
    kept = [r.wire() for r in traffic.records if r.value.get("rollout_id") not in replaced]
    wires = kept + extra
    if rng.random() < 0.3:   # any order across topics and groups
        rng.shuffle(wires)
    return DimsCase(wires, honest, odd, odd_id, note)


def check_dims(case: DimsCase, result, driver: Driver) -> list[Violation]:
    out = check(result, driver)
    topics = driver.cfg.topics
    over = case.odd[0] * case.odd[1] > MAX_LEARNED_ROUTE_SLOTS
    for published in result.published:
        for row in _rows(published, topics):
            where = f"group {published.group_id} row {row['row_index']} ({case.note})"
            routes = row.get("routed_experts")
            mine = row["rollout_id"] == case.odd_rollout
            if mine and over and row["rejection_reason"] != DIMS_LIMIT:
                out.append(Violation(None, f"{where}: routes over the bound, rejection "
                                           f"{row['rejection_reason']!r}, expected {DIMS_LIMIT!r}"))
            if routes is None:
                continue
            dims = tuple(routes["shape"][1:])
            if dims[0] * dims[1] > MAX_LEARNED_ROUTE_SLOTS:
                out.append(Violation(None, f"{where}: shaped {dims}, beyond the learned bound"))
            elif not mine and row["input_lengths"] > 1 and dims != case.honest:
                out.append(Violation(None, f"{where}: a {row['input_lengths']}-token row of another "
                                           f"rollout shaped {dims}, not the model's {case.honest}"))
    agreed = driver.runtime.dims_cache.dims
    if agreed not in (None, case.honest):
        out.append(Violation(None, f"the stage agreed on {agreed}, not the model's {case.honest} ({case.note})"))
    return out


# -- spilled payloads with bit flips --------------------------------------------------------

@dataclass
class SpillCase:
    wires: list[Wire]
    flips: int            # records to damage (0: none)
    seed: int


def spilled_bit_flips(rng: random.Random) -> SpillCase:
    traffic = valid_traffic(workload_config(rng.randrange(POOL)))
    return SpillCase([r.wire() for r in traffic.records], rng.choice((0, 1, 1, 2, 3)), rng.randrange(1 << 30))


class SpillDriver(Driver):
    """The fuzz driver with every staged call spilled (the stage over its memory cap) to a
    private directory, and a hook that damages spilled records once, before finalization."""

    def __init__(self, finalize: ReassemblyConfig | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="fuzz-spill-"))
        super().__init__(finalize, max_buffered_bytes=1, spill_dir=str(self.root))
        self.damage = None        # (rng, count) for the next run
        self.damaged: list[str] = []

    def _reset(self) -> None:
        for buffer in self.runtime.buffers.values():
            buffer.close()
        super()._reset()
        for p in range(PARTITIONS):
            state = self.runtime.partitions.get(p)
            state.buffer.spill = SpillStore(self.root / f"p{p}", max_bytes=1 << 30)
        self.damaged = []

    def _intake(self, wire, offsets, now: int, measure_memory: bool):
        self.runtime.intake._room = -1    # the stage holds its cap: every staged call spills
        return super()._intake(wire, offsets, now, measure_memory)

    def _finalize_ready(self, result, now: int) -> int:
        if self.damage is not None:
            rng, count = self.damage
            self.damage = None
            self._damage(rng, count)
        return super()._finalize_ready(result, now)

    def _damage(self, rng: random.Random, count: int) -> None:
        live = [item.payload for buffer in self.runtime.buffers.values() for group in buffer.groups.values()
                for item in group.staged.values() if item.spilled]
        for ref in rng.sample(live, min(count, len(live))):
            with open(ref.path, "r+b") as f:
                if rng.random() < 0.15:   # cut short: the record's tail is gone
                    f.truncate(ref.offset + rng.randrange(ref.length))
                    self.damaged.append(f"{ref.path}@{ref.offset} cut")
                    continue
                for _ in range(rng.randint(1, 3)):
                    at = ref.offset + rng.randrange(ref.length)
                    f.seek(at)
                    byte = f.read(1)
                    if not byte:
                        continue
                    f.seek(at)
                    f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
                    self.damaged.append(f"{ref.path}@{at}")

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def rows_by_group(result, topics) -> dict[str, list[bytes]]:
    """Each published group's CanonicalRow (and RoutePlan) records, as published."""
    keep = (topics.canonical_rows, topics.route_plans)
    return {p.group_id: [blob for t, blob in p.outputs.records if t in keep] for p in result.published}


def check_spill(case: SpillCase, reference, plain, flipped, driver: SpillDriver) -> list[Violation]:
    """``reference``: the case spilled, nothing damaged; ``plain``: a stage that spilled nothing;
    ``flipped``: spilled and damaged."""
    topics = driver.cfg.topics
    out = [Violation(None, f"undamaged: {v}") for v in check(reference, driver)]
    expected = rows_by_group(plain, topics)
    if rows_by_group(reference, topics) != expected:
        out.append(Violation(None, "spilled groups publish other rows than in memory"))
    for partition, why in flipped.halted.items():
        if not case.flips or not why.split(": ", 1)[-1].startswith("finalize_error: spill: SpillReadError"):
            out.append(Violation(None, f"partition {partition} halted: {why[:300]}"))
    out += [Violation(None, text) for text in flipped.raised]
    published = {p.group_id for p in flipped.published}
    for group in plain.published:
        if group.partition not in flipped.halted and group.group_id not in published:
            out.append(Violation(None, f"group {group.group_id} of partition {group.partition} "
                                       "(not halted) was not published"))
    for group_id, rows in rows_by_group(flipped, topics).items():
        if rows != expected.get(group_id):
            out.append(Violation(None, f"group {group_id}: published rows differ from the undamaged "
                                       f"run's after {driver.damaged[:4]}"))
    return out
