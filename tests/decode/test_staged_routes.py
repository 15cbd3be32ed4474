"""A stage that never reads route payloads releases them at intake: finalization sees exactly
what it would have seen (rows, plans, rejections and their texts, in the same order), and the
buffer counts what it still holds."""

import copy
import gc
import tracemalloc

import numpy as np
import pytest

from stage.buffer import PartitionBuffer, Position
from stage.client import receipt_event, staged_call_from_record
from stage.decode import InputLimits, staged_item, staged_row
from stage.decode.receipts import receipt_item
from stage.decode.staged import DECODED_OVERHEAD_BYTES, RELEASED_ROUTES, ReleasedRoutes
from stage.finalize import ReassemblyConfig
from stage.routes import RouteDimsCache
from stage.runtime.task.finalize_task import finalize_and_encode
from stage.wire import OUTPUT_RECORDS, AvroCodec, TopicNames, pack_tensor
from stage.workload import FaultRates, WorkloadConfig, generate
from stage.workload.faults import tamper_staged_value

CODEC = AvroCodec("StagedCall")
TOPICS = TopicNames()
POS = Position(TOPICS.staged_calls, 0, 0, 0)


def _decoded(value: dict) -> tuple[dict, int]:
    data = CODEC.encode(value)
    return CODEC.decode(data), len(data)


def _call_value(seed=1, **changes):
    wl = generate(WorkloadConfig(groups=1, group_size=1, turns=(2, 2), seed=seed, route_layers=3,
                                 route_topk=2))
    call = wl.rollouts[0].calls[-1]            # a child: fragment and boundary route
    value = staged_call_from_record("g", call.record)
    value.update(changes)
    return value


def _rows(value):
    """(kept, released) staged_row outcomes of one wire value: the row, or the error text."""
    out = []
    for keep in (True, False):
        record, size = _decoded(value)
        item = staged_item(record, POS, size, keep_routes=keep)
        try:
            out.append(staged_row(item.payload))
        except ValueError as error:
            out.append(f"{type(error).__mro__[-3].__name__}: {error}")
    return out


def test_a_released_row_is_the_kept_row_without_the_payload():
    kept, released = _rows(_call_value())
    assert kept.routes is not None and kept.boundary_routes is not None
    assert released.routes is None and released.boundary_routes is None
    assert released.routed_len == kept.routed_len == kept.snapshot.delta_len
    assert released.route_encoding == kept.route_encoding == 1
    assert released.boundary_token_index() == kept.boundary_token_index() is not None
    assert released.snapshot.to_json() == kept.snapshot.to_json()
    assert released.extras_metadata_json == kept.extras_metadata_json
    with pytest.raises(KeyError, match="released at intake"):
        released.fragment()   # a direct-mode finalizer could never use it by mistake


def _bad_routes(value, mutate):
    value = copy.deepcopy(value)
    mutate(value)
    return value


BAD = {
    "wrong dtype": lambda v: v.update(routed_experts=pack_tensor(np.zeros((v["delta_len"], 3, 2), np.float32))),
    "two dims": lambda v: v.update(routed_experts=pack_tensor(np.zeros((v["delta_len"], 6), np.int16))),
    "not delta aligned": lambda v: v.update(routed_experts=pack_tensor(np.zeros((v["delta_len"] + 1, 3, 2), np.int16))),
    "short data": lambda v: v["routed_experts"].update(data=v["routed_experts"]["data"][:-2]),
    "boundary rows": lambda v: v.update(routed_experts_boundary=pack_tensor(np.zeros((2, 3, 2), np.int16))),
    "boundary dtype": lambda v: v.update(routed_experts_boundary=pack_tensor(np.zeros((1, 3, 2), np.uint8))),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_route_checks_run_at_intake_and_fail_finalization_with_the_same_text(case):
    kept, released = _rows(_bad_routes(_call_value(), BAD[case]))
    assert isinstance(kept, str) and released == kept


def test_earlier_errors_still_come_first():
    # tampered tokens (digest) and bad routes: the snapshot's error wins, released or not
    tampered = tamper_staged_value(_call_value(), 0, 32_000)
    kept, released = _rows(_bad_routes(tampered, BAD["not delta aligned"]))
    assert "digest does not match staged call contents" in kept and released == kept
    kept, released = _rows(_call_value(route_encoding=7, routed_experts=None))
    assert "unknown route encoding 7" in kept and released == kept


def test_a_record_without_routes_is_left_alone():
    record, size = _decoded(_call_value(route_encoding=0, routed_experts=None,
                                        routed_experts_boundary=None, extras_metadata_json="null"))
    item = staged_item(record, POS, size, keep_routes=False)
    assert RELEASED_ROUTES not in item.payload and item.nbytes == size + DECODED_OVERHEAD_BYTES


def _held(values, keep):
    gc.collect()
    tracemalloc.start()
    items = [staged_item(CODEC.decode(data), POS, len(data), keep_routes=keep) for data in values]
    held, _peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return items, held


def test_the_buffer_counts_what_an_item_holds():
    wl = generate(WorkloadConfig(groups=2, group_size=2, route_layers=48, route_topk=8))
    values = [CODEC.encode(staged_call_from_record(r.group_id, c.record))
              for r in wl.rollouts for c in r.calls]
    for keep in (True, False):
        items, held = _held(values, keep)
        counted = sum(item.nbytes for item in items)
        assert 0.85 * held <= counted <= 1.15 * held, (keep, counted, held)
        if not keep:
            route_bytes = sum(len(v) for v in values) - counted
            assert route_bytes > 0.9 * sum(len(v) for v in values) - len(values) * DECODED_OVERHEAD_BYTES


def _buffered_group(group, keep):
    buffer = PartitionBuffer(0, receipts_topic=TOPICS.receipts, staged_topic=TOPICS.staged_calls,
                             group_timeout_ms=60_000, late_retention_ms=1000)
    receipt_codec = AvroCodec("ReceiptEvent")
    offset = route_bytes = 0
    for rollout in group.rollouts:
        for record, _call in rollout.staged_records():
            call = staged_call_from_record(group.group_id, record)
            route_bytes += sum(len(call[f]["data"]) for f in ("routed_experts", "routed_experts_boundary")
                               if call[f] is not None)
            value = CODEC.encode(call)
            buffer.add_staged(staged_item(CODEC.decode(value), Position(TOPICS.staged_calls, 0, offset, 1),
                                          len(value), keep_routes=keep), 1)
            offset += 1
        event = receipt_codec.encode(receipt_event(
            group_id=group.group_id, rollout_id=rollout.rollout_id, rollout_index=rollout.rollout_index,
            group_size=group.group_size, prompt_idx=group.prompt_idx, reward=rollout.reward,
            receipt=rollout.emitted_receipt()))
        buffer.add_receipt(receipt_item(receipt_codec.decode(event), Position(TOPICS.receipts, 0, offset, 1),
                                        len(event)), 1)
        offset += 1
    return buffer, buffer.groups[group.group_id], route_bytes


def _untimed(records, codecs):
    """The records, with the summary's timing metrics (they differ run to run) left out."""
    out = []
    for topic, value in records:
        if topic == TOPICS.finalized_groups:
            summary = codecs["GroupSummary"].decode(value)
            summary["metrics"] = {k: v for k, v in summary["metrics"].items() if not k.endswith("_ms")}
            value = summary
        out.append((topic, value))
    return out


@pytest.mark.parametrize("routes", ["deferred", "off"])
def test_released_groups_publish_byte_identical_records(routes):
    faults = FaultRates(tampered_tokens=0.15, tampered_digest=0.1, missing_staged=0.1, poisoned_receipt=0.1)
    wl = generate(WorkloadConfig(groups=6, group_size=3, route_layers=3, route_topk=2, seed=4, faults=faults))
    config = ReassemblyConfig(router_replay=routes == "deferred", defer_routes=routes == "deferred",
                              staging_partition=TOPICS.staged_calls)
    codecs = {n: AvroCodec(n) for n in OUTPUT_RECORDS}
    rejected = 0
    for group in wl.groups:
        outputs = []
        for keep in (True, False):
            buffer, state, route_bytes = _buffered_group(group, keep)
            out = finalize_and_encode(state, "complete", 0, config=config, dims_cache=RouteDimsCache(),
                                      codecs=codecs, topics=TOPICS,
                                      limits=InputLimits(), now_ms=lambda: 42)
            assert out.error is None
            outputs.append((_untimed(out.records, codecs), out.ledger_value, out.rejections, buffer.nbytes))
        (kept, kept_ledger, kept_rejections, kept_bytes), (released, ledger, rejections, held) = outputs
        assert released == kept and ledger == kept_ledger and rejections == kept_rejections
        assert held == kept_bytes - route_bytes and route_bytes > 0
        rejected += len(rejections)
    assert rejected >= 3


def test_released_routes_keep_no_reference_to_the_payload():
    record, size = _decoded(_bad_routes(_call_value(), BAD["short data"]))
    staged_item(record, POS, size, keep_routes=False)
    released = record[RELEASED_ROUTES]
    assert isinstance(released, ReleasedRoutes) and isinstance(released.error, str)
    assert record["routed_experts"] is None and record["routed_experts_boundary"] is None
