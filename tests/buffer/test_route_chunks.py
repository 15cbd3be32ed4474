"""Direct router replay with routes staged by reference: the route chunks are buffered per group
by (staging_key, offset), a group is complete once every chunk its calls reference is in, and
finalization joins and checks them: the rows are the inline path's, byte for byte. A chunk that
is missing, duplicated, conflicting or corrupt rejects its rollout with the reason (never a halt
or a crash); one nobody references is dropped with its group, counted."""

from __future__ import annotations

import pytest

from stage.buffer import ADDED, DUPLICATE, REPLAYED, PartitionBuffer, Position
from stage.buffer.spill import SpillStore
from stage.decode import DecodeError, InputLimits
from stage.finalize import ReassemblyConfig
from stage.publish.records import GroupContext, ledger_record
from stage.routes import RouteDimsCache
from stage.runtime.state.inputs import RECEIPTS, STAGED_CALLS, STAGED_ROUTES
from stage.runtime.task.finalize_task import finalize_and_encode
from stage.wire import AvroCodec, TopicNames
from tests.buffer.by_reference import split_call
from tests.integration.harness import expected_rows, make_group

TOPICS = TopicNames()
CODECS = {n: AvroCodec(n) for n in ("StagedCall", "ReceiptEvent", "RouteChunk", "CanonicalRow", "RoutePlan",
                                    "GroupSummary", "LedgerEntry")}
DIRECT = ReassemblyConfig(router_replay=True, defer_routes=False, route_layers=2, route_topk=2)
LIMITS = InputLimits()
GROUP = "g-ref"


class Traffic:
    """One group of ``n`` rollouts staged by reference on partition 0: each call's routes in
    chunks of ``chunk_bytes`` at consecutive route-topic offsets, written before the call."""

    def __init__(self, n: int = 2, calls: int = 2, chunk_bytes: int = 16, seed: int = 5) -> None:
        self.spec = make_group(GROUP, n, calls=calls, seed=seed)
        self.chunks: list[tuple[int, dict]] = []     # (route-topic offset, RouteChunk value)
        self.staged: list[dict] = []
        offset = 0
        for value in self.spec.staged:
            chunks, reference = split_call(value, chunk_bytes)
            offsets = list(range(offset, offset + len(chunks)))
            offset += len(chunks)
            self.chunks += list(zip(offsets, chunks))
            self.staged.append(reference(TOPICS.staged_routes, 0, offsets))
        self.chunks_per_call = {c["count"] for _o, c in self.chunks}

    def next_chunk_offset(self) -> int:
        return self.chunks[-1][0] + 1


def new_buffer(spill=None) -> PartitionBuffer:
    return PartitionBuffer(0, receipts_topic=TOPICS.receipts, staged_topic=TOPICS.staged_calls,
                           group_timeout_ms=60_000, late_retention_ms=1000, spill=spill,
                           routes_topic=TOPICS.staged_routes)


def add(buffer, kind, offset: int, value: dict, *, spill: bool = False) -> str:
    """One record through the runtime's input table, as intake feeds it (direct mode)."""
    raw = CODECS[kind.record].encode(value)
    item = kind.item(CODECS[kind.record].decode(raw), Position(kind.topic(TOPICS), 0, offset, 1), len(raw),
                     LIMITS, True)
    outcome = kind.add(buffer, item, 1)
    if spill and outcome == ADDED:
        assert kind.spill(buffer, item, raw)
    return outcome


def feed(buffer, traffic: Traffic, *, chunks=None, spill: bool = False) -> None:
    for offset, value in (traffic.chunks if chunks is None else chunks):
        add(buffer, STAGED_ROUTES, offset, value, spill=spill)
    for offset, value in enumerate(traffic.staged):
        add(buffer, STAGED_CALLS, offset, value, spill=spill)
    for offset, value in enumerate(traffic.spec.receipts):
        add(buffer, RECEIPTS, offset, value)


def finalize(group, why: str = "complete"):
    return finalize_and_encode(group, why, 0, config=DIRECT, dims_cache=RouteDimsCache(), codecs=CODECS,
                               topics=TOPICS, limits=LIMITS, now_ms=lambda: 42)


def rows(out) -> list[dict]:
    return [CODECS["CanonicalRow"].decode(value) for topic, value in out.records
            if topic == TOPICS.canonical_rows]


def test_a_group_waits_for_every_referenced_chunk_and_then_is_complete():
    traffic = Traffic()
    assert min(traffic.chunks_per_call) > 1              # every call in several chunks
    buffer = new_buffer()
    last_offset, last = traffic.chunks[-1]
    feed(buffer, traffic, chunks=traffic.chunks[:-1])
    [group] = buffer.groups.values()
    assert group.missing_chunks() == {(last["staging_key"], last_offset)}
    assert buffer.take_ready(2, None)[0] == []                    # staged calls and receipts all in
    assert add(buffer, STAGED_ROUTES, last_offset, last) == ADDED
    [(taken, why)] = buffer.take_ready(2, None)[0]
    assert taken is group and why == "complete"


def test_chunks_read_after_their_calls_and_receipts_complete_the_group_too():
    traffic = Traffic()
    buffer = new_buffer()
    feed(buffer, traffic, chunks=[])
    assert buffer.take_ready(2, None)[0] == []
    for offset, value in reversed(traffic.chunks):               # reordered, and after the calls
        add(buffer, STAGED_ROUTES, offset, value)
    assert len(buffer.take_ready(2, None)[0]) == 1


@pytest.mark.parametrize("chunk_bytes", [16, 1 << 20], ids=["several-chunks", "one-chunk"])
@pytest.mark.parametrize("spill", [False, True], ids=["in-memory", "spilled"])
def test_by_reference_rows_are_the_inline_paths_byte_for_byte(tmp_path, spill, chunk_bytes):
    traffic = Traffic(n=3, calls=3, chunk_bytes=chunk_bytes)
    assert (traffic.chunks_per_call == {1}) == (chunk_bytes > 64)
    buffer = new_buffer(SpillStore(tmp_path / "p0", max_bytes=1 << 30) if spill else None)
    feed(buffer, traffic, spill=spill)
    if spill:
        assert all(c.spilled for c in buffer.groups[GROUP].chunks.values())
    [(group, why)] = buffer.take_ready(2, None)[0]
    out = finalize(group, why)
    assert out.error is None and out.rejections == [] and out.valid_rows == 3
    assert rows(out) == expected_rows(traffic.spec, DIRECT)
    assert buffer.mark_published(GROUP, 3) == 0


def _rejection(out, index: int = 0) -> str:
    [reason] = [r for r in out.rejections if r]
    assert out.error is None and out.valid_rows == out.total_rows - 1
    return reason


def test_a_lost_chunk_rejects_its_rollout_at_the_deadline_naming_the_chunk():
    traffic = Traffic()
    buffer = new_buffer()
    lost_offset, lost = traffic.chunks[1]
    feed(buffer, traffic, chunks=[c for c in traffic.chunks if c[0] != lost_offset])
    [group] = buffer.groups.values()
    ready, _ = buffer.take_ready(group.deadline_ms, None)
    [(group, why)] = ready
    assert why == "deadline"
    reason = _rejection(finalize(group, why))
    assert reason.startswith("missing_staging_row") and f"@{lost_offset}" in reason
    assert f"route chunk {lost['index']} of {lost['staging_key']}" in reason


def test_a_duplicated_chunk_is_read_at_the_offset_its_reference_names_and_the_other_is_dropped():
    traffic = Traffic()
    buffer = new_buffer()
    offset, chunk = traffic.chunks[0]
    again = traffic.next_chunk_offset()
    # a producer retry wrote the chunk a second time, differently damaged: the reference names the first
    feed(buffer, traffic, chunks=[*traffic.chunks, (again, {**chunk, "data": bytes(len(chunk["data"]))})])
    assert add(buffer, STAGED_ROUTES, offset, chunk) == DUPLICATE        # the same record read twice
    [(group, why)] = buffer.take_ready(2, None)[0]
    out = finalize(group, why)
    assert out.rejections == [] and rows(out) == expected_rows(traffic.spec, DIRECT)
    assert buffer.mark_published(GROUP, 3) == 1                          # the unreferenced copy, counted
    assert add(buffer, STAGED_ROUTES, again, chunk) == "late"            # after publication: skipped


def _damaged(traffic: Traffic, which: int, **changes) -> list:
    return [(o, {**c, **changes}) if i == which else (o, c) for i, (o, c) in enumerate(traffic.chunks)]


def test_a_corrupt_chunk_rejects_its_rollout_as_invalid_naming_the_chunk():
    traffic = Traffic()
    offset, chunk = traffic.chunks[2]
    data = bytearray(chunk["data"])
    data[0] ^= 0x01                           # its bytes changed, its declared digest did not
    buffer = new_buffer()
    feed(buffer, traffic, chunks=_damaged(traffic, 2, data=bytes(data)))
    [(group, why)] = buffer.take_ready(2, None)[0]
    reason = _rejection(finalize(group, why))
    assert reason.startswith("invalid_staging_row") and "corrupt" in reason and f"offset {offset}" in reason


@pytest.mark.parametrize("changes, says", [
    ({"staging_key": "another/call"}, "belongs to"),
    ({"index": 0}, "says it is chunk 0"),
    ({"sha256": "0" * 64}, "declares another sha256"),
], ids=["other-call", "other-index", "other-digest"])
def test_a_conflicting_chunk_at_a_referenced_offset_rejects_its_rollout(changes, says):
    traffic = Traffic()
    which = 1 if "index" in changes else 0           # chunk 1 claiming to be chunk 0
    buffer = new_buffer()
    feed(buffer, traffic, chunks=_damaged(traffic, which, **changes))
    group = buffer.groups[GROUP]
    if "staging_key" in changes:                     # held under another key: the group waits for it
        [(group, why)] = buffer.take_ready(group.deadline_ms, None)[0]
        assert why == "deadline"
        reason = _rejection(finalize(group, why))
        assert reason.startswith("missing_staging_row")
        assert buffer.mark_published(GROUP, group.deadline_ms) == 1
        return
    [(group, why)] = buffer.take_ready(2, None)[0]
    reason = _rejection(finalize(group, why))
    assert reason.startswith("invalid_staging_row") and says in reason


@pytest.mark.parametrize("where, named", [
    ({"partition": 1}, "names partition 1, the staged call is in partition 0"),
    ({"topic": "elsewhere.routes"}, "names topic 'elsewhere.routes'"),
], ids=["other-partition", "other-topic"])
def test_a_reference_to_chunks_this_partition_never_reads_rejects_its_rollout_without_waiting(where, named):
    traffic = Traffic()
    traffic.staged[0] = {**traffic.staged[0], "routes_ref": {**traffic.staged[0]["routes_ref"], **where}}
    buffer = new_buffer()
    first = traffic.staged[0]["staging_key"]          # its chunks are not here either
    feed(buffer, traffic, chunks=[(o, c) for o, c in traffic.chunks if c["staging_key"] != first])
    [(group, why)] = buffer.take_ready(2, None)[0]      # nothing to wait for: complete at once
    assert why == "complete"
    reason = _rejection(finalize(group, why))
    assert reason.startswith("invalid_staging_row") and named in reason


@pytest.mark.parametrize("changes, field", [
    ({"index": 5}, "index"), ({"count": 0}, "count"), ({"sha256": "XYZ"}, "sha256"),
    ({"data": b""}, "data"), ({"group_id": ""}, "group_id"),
])
def test_an_undecodable_chunk_is_refused_at_intake_with_its_reason(changes, field):
    _offset, chunk = Traffic().chunks[0]
    with pytest.raises(DecodeError, match=field):
        STAGED_ROUTES.item({**chunk, **changes}, Position(TOPICS.staged_routes, 0, 0, 1), 100, LIMITS, True)


def test_chunks_of_a_group_published_before_a_restart_are_replayed_not_buffered():
    traffic = Traffic()
    buffer = new_buffer()
    buffer.load_published(GROUP, {TOPICS.staged_routes: traffic.chunks[-1][0]}, 1)
    offset, chunk = traffic.chunks[0]
    assert add(buffer, STAGED_ROUTES, offset, chunk) == REPLAYED and not buffer.groups


def test_the_ledger_entry_and_the_commit_watermark_account_for_the_route_chunks():
    traffic = Traffic()
    buffer = new_buffer()
    feed(buffer, traffic)
    group = buffer.groups[GROUP]
    assert group.min_offsets[TOPICS.staged_routes] == 0
    assert buffer.committable(TOPICS.staged_routes) == 0          # the open group holds its chunks
    ctx = GroupContext(group_id=GROUP, partition=0, group_size=2, prompt_idx=0, outcome="complete",
                       first_timestamp_ms=1, last_timestamp_ms=1, max_offsets=dict(group.max_offsets),
                       staged_positions={})
    entry = ledger_record(ctx, "complete", TOPICS, 5, "d")
    assert entry["max_route_offset"] == traffic.chunks[-1][0]
    assert CODECS["LedgerEntry"].decode(CODECS["LedgerEntry"].encode(entry)) == entry
    buffer.mark_published(GROUP, 3)
    assert buffer.committable(TOPICS.staged_routes) == traffic.next_chunk_offset()


def test_of_two_faulty_calls_of_a_rollout_the_first_ones_reason_is_given():
    traffic = Traffic(n=1, calls=3)
    second = traffic.staged[1]["staging_key"]
    # the second call's chunks are lost; the first call's digest is wrong (its row fails to convert)
    traffic.staged[0] = {**traffic.staged[0], "digest": "0" * 64}
    buffer = new_buffer()
    feed(buffer, traffic, chunks=[(o, c) for o, c in traffic.chunks if c["staging_key"] != second])
    [group] = buffer.groups.values()
    [(group, why)] = buffer.take_ready(group.deadline_ms, None)[0]
    out = finalize(group, why)
    [reason] = out.rejections
    assert reason.startswith("invalid_staging_row") and "route chunk" not in reason, reason
