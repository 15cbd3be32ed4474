"""The input table follows the mode: direct router replay reads the route topic as a third
co-partitioned input (assigned alongside the lead partition, decoded, buffered, in the ledger and
the committed offsets); deferred router replay and router replay off read two inputs and never
assign the route topic."""

from __future__ import annotations

import pytest
from confluent_kafka import TopicPartition

from stage.config.model import StageConfig
from stage.finalize import ReassemblyConfig
from stage.runtime.kafka.clients import Clients
from stage.runtime.state.inputs import input_kinds, input_topics
from stage.runtime.state.partition import Partitions
from stage.runtime.steps.assignment import Assignment
from stage.runtime.steps.intake import Intake
from tests.runtime.fakes import Consumer, Probe, stats_fake

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
