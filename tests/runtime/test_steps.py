"""Each step of the loop on its own, with two or three fakes (tests/runtime/fakes.py) and no
broker: deadlines take ready groups and hold for an unavailable input, assignment assigns every
input's partition alongside the lead one and seeks back to the committed offsets, ledger loads
give a partition its buffer and marks, intake puts back what it cannot read yet, and
publication assembles outputs, dead letters and tombstones into one batch."""

from collections import Counter
from concurrent.futures import Future
from threading import Event
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaException, TopicPartition

from stage.config.model import StageConfig
from stage.finalize import ReassemblyConfig
from stage.publish.deadletters import DeadLetter
from stage.runtime.kafka.clients import Clients
from stage.runtime.kafka.ledger import LedgerState
from stage.runtime.state.partition import Partitions
from stage.runtime.state.pauses import REGISTRY
from stage.runtime.steps.assignment import Assignment
from stage.runtime.steps.deadlines import Deadlines
from stage.runtime.steps.intake import Intake
from stage.runtime.steps.loads import LedgerLoads
from stage.runtime.steps.outcomes import Rewind
from stage.runtime.steps.publication import Publication
from tests.fuzz.driver import Driver
from tests.fuzz.traffic import valid_traffic, workload_config
from tests.runtime.fakes import Consumer, Message, NeverLoads, Probe, Publisher, StartOffsets, stats_fake

CFG = StageConfig(bootstrap_servers="127.0.0.1:1")
TOPICS = (CFG.topics.receipts, CFG.topics.staged_calls)


def _complete_group(complete=True):
    """A partition whose buffer holds one group, complete or missing a receipt (filled by the
    runtime's own intake)."""
    driver = Driver(ReassemblyConfig())
    driver._reset()
    offsets = Counter()
    records = valid_traffic(workload_config(3, routes=False, media=False, groups=1)).records
    if not complete:
        records.remove([r for r in records if r.role == "receipts"][-1])
    for record in records:
        driver._intake(record.wire(), offsets, 1_000, measure_memory=False)
    [state] = [s for s in driver.runtime.partitions if s.open_groups]
    return driver.runtime.partitions, state


def _deadlines(parts, probe):
    clients = Clients(consumer=Consumer(), probe=probe, start_offsets=StartOffsets())
    return Deadlines(topics=TOPICS, hold_max_ms=60_000, partitions=parts, clients=clients,
                     stats=SimpleNamespace(inc=lambda *a, **k: None, observe=lambda *a: None))


def test_deadlines_take_a_complete_group_with_its_partitions_epoch():
    parts, state = _complete_group()
    ready, moved = _deadlines(parts, Probe()).take_ready(2_000, {})
    [work] = ready
    assert work.epoch == state.epoch and work.group.partition == state.number and moved == set()
    assert not state.buffer.take_ready(2_000, None)[0]          # taken once


def test_deadlines_of_a_halted_partition_are_not_taken():
    parts, state = _complete_group()
    ready, _moved = _deadlines(parts, Probe()).take_ready(2_000, {state.number: frozenset({"halted"})})
    assert ready == []


def test_a_due_deadline_waits_while_an_input_partition_does_not_answer():
    parts, state = _complete_group(complete=False)      # only its deadline can take it
    [group] = state.buffer.groups.values()
    probe = Probe()
    probe.available = lambda topic, partition: topic != TOPICS[1]
    probe.why_unavailable = lambda topic, partition: "no leader"
    steps = _deadlines(parts, probe)
    due = group.deadline_ms + 1
    assert steps.take_ready(due, {})[0] == [] and "no leader" in steps.held[state.number]
    probe.available = lambda topic, partition: True
    [work] = steps.take_ready(due, {})[0]
    assert work.why == "deadline" and steps.held == {}


def test_assignment_takes_every_input_partition_alongside_the_lead_one_and_seeks_back():
    parts, consumer = Partitions(), Consumer(committed=7)
    clients = Clients(consumer=consumer, probe=Probe())
    assignment = Assignment(CFG, partitions=parts, clients=clients, stats=stats_fake())
    lead = [TopicPartition(TOPICS[0], p) for p in (0, 3)]
    assert assignment.add(lead) == [0, 3] and parts.numbers() == [0, 3]
    assignment.assign(consumer, lead)
    assert consumer.assigned == {(t, p) for t in TOPICS for p in (0, 3)}
    assert sorted(clients.probe.tracked) == sorted((t, p) for t in TOPICS for p in (0, 3))
    assignment.seek_committed()
    assert sorted(c[1:] for c in consumer.calls) == sorted((t, p, 7) for t in TOPICS for p in (0, 3))
    assert assignment.remove(consumer, [TopicPartition(TOPICS[0], 0)]) == {0}
    assert parts.numbers() == [3] and consumer.assigned == {(t, 3) for t in TOPICS}


def test_a_loaded_ledger_gives_the_partition_its_buffer_published_groups_and_marks():
    parts = Partitions()
    parts.add(2)
    loads = LedgerLoads(CFG, pool=NeverLoads(), ledger_codec=None, partitions=parts,
                        clients=Clients(start_offsets=StartOffsets()), stop=Event())
    loads.start(2)
    state = parts.get(2)
    assert state.loading and loads.loading == [2] and loads.finish() == []
    entry = {"max_receipt_offset": 4, "max_staged_offset": 11, "published_at_ms": 5}
    state.load.set_result(LedgerState(groups={"g": entry},
                                      dead_letter_offsets={"receipts": 6, "staged_calls": -1}))
    assert loads.finish() == [2] and not state.loading
    assert "g" in state.buffer.published
    assert state.dead_letter_marks.snapshot() == {TOPICS[0]: 6, TOPICS[1]: -1}


def test_a_failed_ledger_load_is_retried_under_a_new_epoch():
    parts = Partitions()
    parts.add(0)
    loads = LedgerLoads(CFG, pool=NeverLoads(), ledger_codec=None, partitions=parts,
                        clients=Clients(), stop=Event())
    loads.start(0)
    state = parts.get(0)
    before = state.epoch
    state.load.set_exception(RuntimeError("broker down"))
    assert loads.finish() == [] and state.loading and state.epoch != before


def _intake(parts, consumer, resolver=None):
    return Intake(topics=CFG.topics, codecs={}, limits=None, keep_routes=False, partitions=parts,
                  resolver=resolver, clients=Clients(consumer=consumer, probe=Probe()), stats=stats_fake())


def test_intake_puts_back_a_loading_partitions_records_and_the_rest_of_its_batch():
    parts, consumer = Partitions(), Consumer()
    parts.add(1).load = Future()
    intake = _intake(parts, consumer)
    taken = intake.batch([Message(TOPICS[0], 1, 5, b"g", b"x"), Message(TOPICS[0], 1, 6, b"g", b"y")], 0)
    assert taken.dead_letters == [] and consumer.calls == [("seek", TOPICS[0], 1, 5)]


def test_a_failed_seek_is_a_rewind():
    parts, consumer = Partitions(), Consumer()
    parts.add(1).load = Future()

    def refuse(tp):
        raise KafkaException("erroneous state")

    consumer.seek = refuse
    with pytest.raises(Rewind):
        _intake(parts, consumer).batch([Message(TOPICS[0], 1, 5, b"g", b"x")], 0)


def test_publication_puts_outputs_dead_letters_and_tombstones_in_one_batch():
    parts = Partitions()
    publisher = Publisher()
    flight = SimpleNamespace(in_flight=False, publisher=publisher, nbytes=0)
    stats = SimpleNamespace(inc=lambda *a, **k: None, observe=lambda *a: None)
    pub = Publication(CFG, flight=flight, ledger_codec=SimpleNamespace(encode=repr),
                      clock=SimpleNamespace(now_ms=lambda: 9), partitions=parts, stats=stats)
    out = SimpleNamespace(partition=0, group_id="g", records=[(CFG.topics.canonical_rows, b"row")],
                          ledger_value=b"ledger", ready_at=0.0)
    pub.offer([out])
    pub.offer_dead_letters([DeadLetter(TOPICS[1], 0, 3, b"k", b"v", [], "bad", "invalid",
                                       marks={TOPICS[1]: 3})])
    pub.tombstones.put(0, (CFG.topics.stage_ledger, 0, b"old", None, None))
    outputs, batch = pub._next_batch(Consumer(), force=False)
    topics = [record[0] for record in batch.records]
    assert outputs == [out] and pub.queued == 0 and batch.group_metadata == "group-metadata"
    assert topics == [CFG.topics.canonical_rows, CFG.topics.stage_ledger, CFG.topics.dead_letter,
                      CFG.topics.stage_ledger, CFG.topics.stage_ledger]
    assert "'max_staged_offset': 3" in batch.records[3][3] and "'max_receipt_offset': -1" in batch.records[3][3]
