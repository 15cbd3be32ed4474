"""Calls whose routes were staged by reference (StagedCall.routes_ref): the stage checks the
reference completely, keeps it (never a route byte), rejects a rollout whose reference is
unusable with a precise reason, and names the chunks in the row's RoutePlan."""

import copy

import numpy as np
import pytest

from stage.buffer import PartitionBuffer, Position
from stage.client import receipt_event, staged_call_from_record
from stage.decode import InputLimits, staged_item, staged_row
from stage.decode.receipts import receipt_item
from stage.decode.staged import DECODED_OVERHEAD_BYTES
from stage.finalize import ReassemblyConfig
from stage.finalize import reasons as R
from stage.routes import RouteDimsCache
from stage.runtime.task.finalize_task import finalize_and_encode
from stage.staging.route_refs import RouteReference
from stage.wire import OUTPUT_RECORDS, AvroCodec, TopicNames, pack_tensor, unpack_tensor
from stage.workload import WorkloadConfig, generate
from tests.routes.by_reference import offline

CODEC = AvroCodec("StagedCall")
TOPICS = TopicNames()


def _call_value(seed=1):
    wl = generate(WorkloadConfig(groups=1, group_size=1, turns=(2, 2), seed=seed, route_layers=3,
                                 route_topk=2))
    call = wl.rollouts[0].calls[-1]            # a child: fragment and boundary route
    return staged_call_from_record("g", call.record)


def _row(value, *, partition=0, keep=True, limits=InputLimits()):
    data = CODEC.encode(value)
    item = staged_item(CODEC.decode(data), Position(TOPICS.staged_calls, partition, 0, 0), len(data),
                       limits, keep_routes=keep)
    return item, staged_row(item.payload, limits, partition=partition)


@pytest.mark.parametrize("keep", [True, False])
def test_a_call_by_reference_keeps_its_reference_and_no_route_bytes(keep):
    inline = _call_value()
    value, chunks = offline(inline, chunk_bytes=40)
    assert len(chunks) > 2
    item, row = _row(value, keep=keep)
    assert item.nbytes == len(CODEC.encode(value)) + DECODED_OVERHEAD_BYTES
    assert row.routes is None and row.released_route_len is None
    assert row.route_ref == RouteReference.from_value(value["routes_ref"], max_chunk_bytes=40)
    assert row.routed_len == value["delta_len"] == row.route_ref.shape[0]
    assert row.route_encoding == inline["route_encoding"] == 1
    _item, kept = _row(inline)
    assert np.array_equal(row.boundary_routes, kept.boundary_routes)   # the boundary stays inline
    assert row.extras_metadata_json == kept.extras_metadata_json
    assert row.snapshot.to_json() == kept.snapshot.to_json()


def _ref(value):
    return value["routes_ref"]


REFUSED = {
    "inline and by reference": (lambda v, inline: v.update(routed_experts=inline["routed_experts"]),
                                "inline (routed_experts) and by reference both"),
    "encoding 0": (lambda v, inline: v.update(route_encoding=0), "route_encoding 0"),
    "another topic": (lambda v, inline: _ref(v).update(topic="elsewhere"),
                      "names topic 'elsewhere', the route topic is 'rollouts.staged-routes'"),
    "another partition": (lambda v, inline: _ref(v).update(partition=1),
                          "names partition 1, the staged call is in partition 0"),
    "not delta aligned": (lambda v, inline: _ref(v).update(shape=[v["delta_len"] + 1, 3, 2]),
                          "is not delta-aligned"),
    "lengths short": (lambda v, inline: _ref(v)["chunks"][0].update(length=_ref(v)["chunks"][0]["length"] - 1),
                      "chunk lengths sum to"),
    "offsets out of order": (lambda v, inline: _ref(v)["chunks"][1].update(offset=0),
                             "is not after the previous chunk's"),
    "bad digest": (lambda v, inline: _ref(v)["chunks"][0].update(sha256="X" * 64), "not a lowercase SHA-256"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
@pytest.mark.parametrize("keep", [True, False])
def test_an_unusable_reference_fails_the_row_with_its_reason(case, keep):
    inline = _call_value()
    value, _chunks = offline(inline, chunk_bytes=40)
    value = copy.deepcopy(value)
    mutate, text = REFUSED[case]
    mutate(value, inline)
    with pytest.raises(ValueError, match="routes_ref") as error:
        _row(value, keep=keep)
    assert text in str(error.value)


def test_reference_bounds_follow_the_limits():
    value, _chunks = offline(_call_value(), chunk_bytes=40)
    with pytest.raises(ValueError, match=r"outside 1\.\.39 \(max_record_bytes\)"):
        _row(value, limits=InputLimits(max_route_chunk_bytes=39))
    with pytest.raises(ValueError, match="route values exceed 5"):
        _row(value, limits=InputLimits(max_route_values=5))
    with pytest.raises(ValueError, match="the route topic is 'mine'"):
        _row(value, limits=InputLimits(route_topic="mine"))
    ok = copy.deepcopy(value)
    ok["routes_ref"]["topic"] = "mine"
    assert _row(ok, limits=InputLimits(route_topic="mine"))[1].route_ref.topic == "mine"


# -- a group through the stage's finalization: rows, plans, rejections ------------------------
def _group_records(group, *, by_ref: bool, tamper=None):
    """Each call's StagedCall value (by reference: chunks at made-up offsets of partition 0)."""
    out, offset = [], 100
    for rollout in group.rollouts:
        calls = []
        for record, _call in rollout.staged_records():
            value = staged_call_from_record(group.group_id, record)
            if by_ref and value["routed_experts"] is not None:
                value, chunks = offline(value, chunk_bytes=50, first_offset=offset)
                offset += len(chunks) + 3
                if tamper is not None:
                    tamper(rollout.rollout_index, len(calls), value)
            calls.append(value)
        out.append((rollout, calls))
    return out


def _finalize(group, records, routes_topic=TOPICS.staged_routes):
    buffer = PartitionBuffer(0, receipts_topic=TOPICS.receipts, staged_topic=TOPICS.staged_calls,
                             group_timeout_ms=60_000, late_retention_ms=1000)
    receipt_codec = AvroCodec("ReceiptEvent")
    offset = 0
    for rollout, calls in records:
        for call in calls:
            data = CODEC.encode(call)
            buffer.add_staged(staged_item(CODEC.decode(data), Position(TOPICS.staged_calls, 0, offset, 1),
                                          len(data), keep_routes=False), 1)
            offset += 1
        event = receipt_codec.encode(receipt_event(
            group_id=group.group_id, rollout_id=rollout.rollout_id, rollout_index=rollout.rollout_index,
            group_size=group.group_size, prompt_idx=group.prompt_idx, reward=rollout.reward,
            receipt=rollout.emitted_receipt()))
        buffer.add_receipt(receipt_item(receipt_codec.decode(event), Position(TOPICS.receipts, 0, offset, 1),
                                        len(event)), 1)
        offset += 1
    config = ReassemblyConfig(router_replay=True, defer_routes=True, staging_partition=TOPICS.staged_calls)
    codecs = {n: AvroCodec(n) for n in OUTPUT_RECORDS}
    out = finalize_and_encode(buffer.groups[group.group_id], "complete", 0, config=config,
                              dims_cache=RouteDimsCache(), codecs=codecs, topics=TOPICS,
                              limits=InputLimits(), now_ms=lambda: 42)
    assert out.error is None
    decoded = {}
    for topic, value in out.records:
        name = {TOPICS.canonical_rows: "CanonicalRow", TOPICS.route_plans: "RoutePlan"}.get(topic)
        if name:
            decoded.setdefault(name, []).append(codecs[name].decode(value))
    return decoded, out


def _workload():
    return generate(WorkloadConfig(groups=1, group_size=3, turns=(2, 3), route_layers=3, route_topk=2, seed=9))


def test_plans_name_the_chunks_and_rows_equal_the_inline_groups():
    group = _workload().groups[0]
    inline, _ = _finalize(group, _group_records(group, by_ref=False))
    records = _group_records(group, by_ref=True)
    by_ref, _ = _finalize(group, records)
    assert by_ref["CanonicalRow"] == inline["CanonicalRow"]
    assert all(row["valid"] for row in by_ref["CanonicalRow"])
    staged = {c["staging_key"]: c for _rollout, calls in records for c in calls}
    spans = 0
    for plan, inline_plan in zip(by_ref["RoutePlan"], inline["RoutePlan"]):
        for span, inline_span in zip(plan["spans"], inline_plan["spans"]):
            assert {**span, "fragment": None, "chunks": None} == {**inline_span, "fragment": None, "chunks": None}
            if span["staged_route_len"] == 0:
                assert span["chunks"] is None and span["fragment"] is None
                continue
            spans += 1
            call = staged[span["staging_key"]]
            assert span["fragment"] is None and inline_span["fragment"] is not None
            chunks = span["chunks"]
            assert chunks["reference"] == call["routes_ref"]
            assert chunks["route_encoding"] == call["route_encoding"]
            assert chunks["extras_metadata_json"] == call["extras_metadata_json"]
            boundary = call["routed_experts_boundary"]
            if boundary is None:
                assert chunks["boundary"] is None
            else:
                assert np.array_equal(unpack_tensor(chunks["boundary"]), unpack_tensor(boundary))
    assert spans >= 6


def test_a_reference_to_another_partition_rejects_its_rollout_only():
    group = _workload().groups[0]

    def tamper(rollout_index, call_index, value):
        if rollout_index == 1 and call_index == 1:
            value["routes_ref"]["partition"] = 3

    rows, out = _finalize(group, _group_records(group, by_ref=True, tamper=tamper))
    valid = [row["valid"] for row in rows["CanonicalRow"]]
    assert valid == [True, False, True]
    reason = rows["CanonicalRow"][1]["rejection_reason"]
    assert reason.startswith(R.INVALID_STAGING_ROW) and "names partition 3, the staged call is in partition 0" in reason


def test_a_reference_to_another_topic_than_the_stages_route_topic_is_refused():
    group = _workload().groups[0]

    def tamper(rollout_index, call_index, value):
        if rollout_index == 2 and call_index == 0:
            value["routes_ref"]["topic"] = "rollouts.other-routes"

    rows, _out = _finalize(group, _group_records(group, by_ref=True, tamper=tamper))
    assert [row["valid"] for row in rows["CanonicalRow"]] == [True, True, False]
    assert "names topic 'rollouts.other-routes'" in rows["CanonicalRow"][2]["rejection_reason"]
