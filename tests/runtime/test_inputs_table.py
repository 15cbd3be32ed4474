"""The input table follows the mode: direct router replay reads the route topic as a third
co-partitioned input (assigned alongside the lead partition, decoded, buffered, in the ledger and
the committed offsets); deferred router replay and router replay off read two inputs and never
assign the route topic."""

from __future__ import annotations

from threading import Event

import pytest
from confluent_kafka import TopicPartition

from stage.buffer import PartitionBuffer
from stage.buffer.spill import SpillStore
from stage.config.model import StageConfig
from stage.decode import InputLimits
from stage.finalize import ReassemblyConfig
from stage.runtime.kafka.clients import Clients
from stage.runtime.kafka.ledger import LedgerState
from stage.runtime.state.inputs import input_kinds, input_topics
from stage.runtime.state.memory import WORKING_SET, finalize_reserve
from stage.runtime.state.partition import DeadLetterMarks, Partitions
from stage.runtime.steps.assignment import Assignment
from stage.runtime.steps.intake import Intake
from stage.runtime.steps.loads import LedgerLoads
from stage.runtime.steps.outcomes import Budget
from stage.staging.route_refs import chunk_value
from stage.wire import AvroCodec
from tests.runtime.fakes import Consumer, Message, NeverLoads, Probe, StartOffsets, stats_fake

DIRECT = ReassemblyConfig(router_replay=True, defer_routes=False, route_layers=2, route_topk=2)
MODES = {
    "direct": DIRECT,
    "deferred": ReassemblyConfig(router_replay=True, defer_routes=True),
    "replay-off": ReassemblyConfig(),
}


def _cfg(mode: str) -> StageConfig:
    return StageConfig(bootstrap_servers="127.0.0.1:1", finalize=MODES[mode])


@pytest.mark.parametrize("mode", MODES)
def test_the_table_has_the_route_chunks_in_direct_mode_only(mode):
    cfg = _cfg(mode)
    kinds = input_kinds(cfg)
    roles = [kind.role for kind in kinds]
    expected = ["receipts", "staged_calls"] + (["staged_routes"] if mode == "direct" else [])
    assert roles == expected
    if mode == "direct":
        routes = kinds[2]
        assert routes.record == "RouteChunk" and routes.ledger_field == "max_route_offset"
        assert routes.spills and not routes.lead
    assert (cfg.topics.staged_routes in input_topics(cfg.topics, kinds)) == (mode == "direct")


@pytest.mark.parametrize("mode", MODES)
def test_the_route_partition_is_assigned_alongside_the_lead_one_in_direct_mode_only(mode):
    cfg = _cfg(mode)
    clients = Clients(consumer=Consumer(), probe=Probe())
    steps = Assignment(cfg, partitions=Partitions(), clients=clients, stats=stats_fake())
    lead = [TopicPartition(cfg.topics.receipts, 3)]
    steps.add(lead)
    steps.assign(clients.consumer, lead)
    expected = {(cfg.topics.receipts, 3), (cfg.topics.staged_calls, 3)}
    if mode == "direct":
        expected.add((cfg.topics.staged_routes, 3))
    assert clients.consumer.assigned == expected
    assert set(clients.probe.tracked) == expected            # its deadlines wait for it too
    steps.remove(clients.consumer, lead)
    assert clients.consumer.assigned == set()


@pytest.mark.parametrize("mode", MODES)
def test_intake_decodes_route_chunks_in_direct_mode_only(mode):
    cfg = _cfg(mode)
    intake = Intake(topics=cfg.topics, codecs={}, limits=None, keep_routes=cfg.finalize.direct_routes,
                    partitions=Partitions(), resolver=None, clients=Clients(), stats=stats_fake(),
                    kinds=input_kinds(cfg))
    assert (cfg.topics.staged_routes in intake.kinds) == (mode == "direct")


@pytest.mark.parametrize("mode", MODES)
def test_a_loaded_partition_reads_the_route_offsets_of_its_ledger_in_direct_mode_only(mode):
    cfg = _cfg(mode)
    parts = Partitions()
    parts.add(2)
    loads = LedgerLoads(cfg, pool=NeverLoads(), ledger_codec=None, partitions=parts,
                        clients=Clients(start_offsets=StartOffsets()), stop=Event())
    loads.start(2)
    state = parts.get(2)
    old = {"max_receipt_offset": 4, "max_staged_offset": 11, "published_at_ms": 5}   # before the field
    new = {**old, "max_route_offset": 30}
    state.load.set_result(LedgerState(groups={"old": old, "new": new},
                                      dead_letter_offsets={"receipts": 6, "staged_calls": -1, "staged_routes": 9}))
    assert loads.finish() == [2]
    routes = cfg.topics.staged_routes
    buffer = state.buffer
    if mode == "direct":
        assert buffer.routes_topic == routes
        assert buffer.published["old"].max_offsets[routes] == -1
        assert buffer.published["new"].max_offsets[routes] == 30
        assert state.dead_letter_marks.snapshot()[routes] == 9
    else:
        assert buffer.routes_topic is None and routes not in buffer.published["new"].max_offsets
        assert routes not in state.dead_letter_marks.snapshot()


def _direct_intake():
    """The runtime's intake in direct mode over one loaded partition (0 of 1)."""
    cfg = _cfg("direct")
    parts = Partitions()
    state = parts.add(0)
    state.buffer = PartitionBuffer(0, receipts_topic=cfg.topics.receipts, staged_topic=cfg.topics.staged_calls,
                                   group_timeout_ms=60_000, late_retention_ms=1_000,
                                   routes_topic=cfg.topics.staged_routes)
    state.dead_letter_marks = DeadLetterMarks({t: -1 for t in input_topics(cfg.topics, input_kinds(cfg))})
    codecs = {name: AvroCodec(name) for name in ("ReceiptEvent", "StagedCall", "RouteChunk")}
    intake = Intake(topics=cfg.topics, codecs=codecs, limits=InputLimits(), keep_routes=True,
                    partitions=parts, resolver=None, clients=Clients(consumer=Consumer(), probe=Probe()),
                    stats=stats_fake(), kinds=input_kinds(cfg))
    intake.partition_count = 1
    return cfg, state, intake, codecs


def test_intake_buffers_a_route_chunk_in_its_group_and_dead_letters_an_undecodable_one():
    cfg, state, intake, codecs = _direct_intake()
    topic = cfg.topics.staged_routes
    chunk = chunk_value("g1", "g1-r0/c0", 0, 2, b"\x01\x02\x03\x04")
    bad = {**chunk, "index": 2}                         # index past its count
    taken = intake.batch([Message(topic, 0, 7, b"g1", codecs["RouteChunk"].encode(chunk)),
                          Message(topic, 0, 8, b"g1", codecs["RouteChunk"].encode(bad)),
                          Message(topic, 0, 9, b"g1", b"\x00not avro")], 1_000)
    group = state.buffer.groups["g1"]
    assert list(group.chunks) == [("g1-r0/c0", 7)] and group.min_offsets == {topic: 7}
    assert [(letter.source_offset, letter.error_class) for letter in taken.dead_letters] == [
        (8, "invalid"), (9, "undecodable")]
    assert "index" in taken.dead_letters[0].error
    assert state.dead_letter_marks.get(topic) == 9
    assert state.buffer.committable(topic) == 7         # the open group holds its chunk


def test_intake_spills_rather_than_use_the_finalize_reserve(tmp_path):
    """Room under the cap that the budget reserves for a group's finalization is not the
    intake's: a chunk that fits the room but not the room less the reserve goes to disk."""
    cfg, state, intake, codecs = _direct_intake()
    state.buffer.spill = SpillStore(tmp_path / "p0", max_bytes=1 << 20)
    topic = cfg.topics.staged_routes

    def chunk(offset, group_id):
        value = codecs["RouteChunk"].encode(chunk_value(group_id, f"{group_id}-r0/c0", 0, 1, bytes(20_000)))
        return Message(topic, 0, offset, group_id.encode(), value)

    intake.batch([chunk(1, "kept")], 1_000, Budget(room=100_000, reserve=50_000))
    intake.batch([chunk(2, "spilled")], 1_000, Budget(room=100_000, reserve=90_000))
    kept, spilled = (state.buffer.groups[g] for g in ("kept", "spilled"))
    assert kept.spilled_bytes == 0 and kept.nbytes > 20_000
    assert spilled.spilled_bytes > 20_000 and spilled.nbytes < kept.nbytes // 10   # its ids stay
    # the largest group held sizes the reserve: spilling does not shrink it
    assert state.buffer.largest_group_bytes == max(kept.nbytes, spilled.nbytes + spilled.spilled_bytes)


def test_the_finalize_reserve_is_the_largest_groups_finalization_at_most_the_cap():
    assert finalize_reserve(100, "direct", 10_000) == int(100 * (1 + WORKING_SET["direct"]))
    assert finalize_reserve(100, "deferred", 10_000) == 200
    assert finalize_reserve(10_000, "direct", 10_000) == 10_000       # a group that large spills everything
    assert finalize_reserve(0, "direct", 10_000) == 0
