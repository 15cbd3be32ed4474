"""A group whose staged calls were spilled to disk, finalized as the stage finalizes it
(``finalize_and_encode``): the same rows as from memory, and a record that does not come back
as it was written halts the partition (``finalize_error: spill``: the disk's fault, the records
are re-read from Kafka after a restart), where a flipped bit used to reject a valid rollout as
if its input were at fault (issue 29 item 6)."""

from __future__ import annotations

import pytest

from stage.buffer import PartitionBuffer, Position
from stage.buffer.spill import SpillStore
from stage.client import receipt_event, staged_call_from_record
from stage.decode import InputLimits, staged_item
from stage.decode.receipts import receipt_item
from stage.finalize import ReassemblyConfig
from stage.routes import RouteDimsCache
from stage.runtime.steps.intake import SPILLED_ITEM_BYTES
from stage.runtime.task.finalize_task import finalize_and_encode
from stage.wire import AvroCodec, TopicNames
from stage.workload import WorkloadConfig, generate

TOPICS = TopicNames()
CODECS = {n: AvroCodec(n) for n in ("StagedCall", "ReceiptEvent", "CanonicalRow", "RoutePlan",
                                    "GroupSummary", "LedgerEntry")}
CONFIG = ReassemblyConfig(router_replay=True, route_layers=3, route_topk=2, top_logprobs=3,
                          capture_media=True, media_patch_size=2, staging_partition=TOPICS.staged_calls)


def _group():
    wl = generate(WorkloadConfig(groups=1, group_size=2, turns=(2, 2), seed=11, route_layers=3,
                                 route_topk=2, topk=3, media_rate=1.0, media_patch_size=2))
    return wl.groups[0]


def _buffered(tmp_path, spill: bool):
    buffer = PartitionBuffer(0, receipts_topic=TOPICS.receipts, staged_topic=TOPICS.staged_calls,
                             group_timeout_ms=60_000, late_retention_ms=1000,
                             spill=SpillStore(tmp_path / "p0", max_bytes=1 << 30))
    group = _group()
    offset, refs = 0, []
    for rollout in group.rollouts:
        for record, call in rollout.staged_records():
            value = CODECS["StagedCall"].encode(staged_call_from_record(group.group_id, record, media=call.media,
                                                                        topk=call.topk))
            item = staged_item(CODECS["StagedCall"].decode(value), Position(TOPICS.staged_calls, 0, offset, 1),
                               len(value))
            buffer.add_staged(item, 1)
            if spill:
                assert buffer.spill_staged(item, value, SPILLED_ITEM_BYTES)
                refs.append(item.payload)
            offset += 1
        event = CODECS["ReceiptEvent"].encode(receipt_event(
            group_id=group.group_id, rollout_id=rollout.rollout_id, rollout_index=rollout.rollout_index,
            group_size=group.group_size, prompt_idx=group.prompt_idx, reward=rollout.reward,
            receipt=rollout.emitted_receipt()))
        buffer.add_receipt(receipt_item(CODECS["ReceiptEvent"].decode(event),
                                        Position(TOPICS.receipts, 0, offset, 1), len(event)), 1)
        offset += 1
    return buffer.groups[group.group_id], refs


def _finalize(state):
    return finalize_and_encode(state, "complete", 0, config=CONFIG, dims_cache=RouteDimsCache(),
                               codecs=CODECS, topics=TOPICS, limits=InputLimits(), now_ms=lambda: 42)


def _rows(out):
    return [r for t, r in out.records if t == TOPICS.canonical_rows]


def test_a_spilled_group_publishes_the_rows_it_would_from_memory(tmp_path):
    kept, _ = _buffered(tmp_path / "memory", spill=False)
    spilled, refs = _buffered(tmp_path / "disk", spill=True)
    from_memory, from_disk = _finalize(kept), _finalize(spilled)
    assert from_memory.error is None and from_disk.error is None and refs
    assert from_disk.valid_rows == from_memory.valid_rows == 2
    assert _rows(from_disk) == _rows(from_memory)


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_a_flipped_bit_in_a_spilled_record_halts_the_partition_instead_of_rejecting_the_rollout(tmp_path, where):
    state, refs = _buffered(tmp_path, spill=True)
    ref = refs[len(refs) // 2]
    position = ref.offset + int(ref.length * where)
    with open(ref.path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ 0x10]))
    out = _finalize(state)
    assert out.error is not None and out.error.startswith("finalize_error: spill: SpillReadError"), \
        (out.error, out.rejections)
    assert "checksum mismatch" in out.error and out.records == []
