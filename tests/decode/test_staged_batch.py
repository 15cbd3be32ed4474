"""staged_rows converts a rollout's records together: a row it returns is exactly the row
staged_row returns, a record it cannot vouch for comes back None, and a fetch through the
buffer's token source fails exactly as converting the records one at a time does."""

import copy
import dataclasses

import numpy as np
import pytest

from stage.buffer import Position
from stage.client import staged_call_from_record
from stage.decode import staged_item, staged_row
from stage.decode.staged_batch import staged_rows
from stage.runtime.task.source import BufferTokenSource
from stage.wire import AvroCodec, pack_tensor
from stage.workload import WorkloadConfig, generate

CODEC = AvroCodec("StagedCall")


def _records(seed=0, groups=2):
    wl = generate(WorkloadConfig(groups=groups, group_size=2, turns=(3, 5), route_layers=2, route_topk=2,
                                 retry_rate=0.3, side_call_rate=0.5, topk=0, seed=seed))
    return [[CODEC.decode(CODEC.encode(staged_call_from_record(r.group_id, c.record))) for c in r.calls]
            for r in wl.rollouts]


def _same(a, b) -> bool:
    return (a.snapshot.to_json() == b.snapshot.to_json() and a.route_encoding == b.route_encoding
            and a.routed_len == b.routed_len and a.extras_metadata_json == b.extras_metadata_json
            and np.array_equal(a.routes, b.routes) and np.array_equal(a.boundary_routes, b.boundary_routes))


def test_clean_records_all_convert_together_to_the_rows_staged_row_gives():
    for rollout in _records():
        rows = staged_rows(rollout)
        assert all(row is not None for row in rows)
        assert all(_same(row, staged_row(record)) for row, record in zip(rows, rollout))


def _flip_token(r):
    data = bytearray(r["token_ids_delta"]["data"])
    data[0] ^= 1
    r["token_ids_delta"] = dict(r["token_ids_delta"], data=bytes(data))


MUTATIONS = {
    "tampered token": _flip_token,
    "digest": lambda r: r.update(digest="0" * 64),
    "uppercase digest": lambda r: r.update(digest=r["digest"].upper()),
    "chain hash": lambda r: r.update(chain_hash="1" * 64),
    "empty call id": lambda r: r.update(model_call_id=""),
    "schema version": lambda r: r.update(schema_version=3),
    "mode": lambda r: r.update(mode="token_in" if r["mode"] == "text" else "text"),
    "prev_len": lambda r: r.update(prev_len=r["prev_len"] + 1),
    "mask value": lambda r: r.update(token_mask_delta=pack_tensor(np.full(r["delta_len"], 0.5, np.float32))),
    "carried logprob": lambda r: r.update(generation_log_probs_delta=pack_tensor(np.full(r["delta_len"], -1.0, np.float32))),
    "huge logprob": lambda r: r.update(generation_log_probs_delta=pack_tensor(np.full(r["delta_len"], -1e39))),
    "short column": lambda r: r.update(token_mask_delta=pack_tensor(np.zeros(r["delta_len"] - 1, np.float32))),
    "route encoding": lambda r: r.update(route_encoding=9),
    "routes misaligned": lambda r: r.update(routed_experts=pack_tensor(np.zeros((r["delta_len"] + 1, 2, 2), np.int16))),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_bad_record_comes_back_none_and_the_others_are_unaffected(name):
    rollout = _records(seed=1, groups=1)[0]
    bad = copy.deepcopy(rollout)
    MUTATIONS[name](bad[1])
    with pytest.raises(ValueError):
        staged_row(bad[1])
    rows = staged_rows(bad)
    assert rows[1] is None
    for i, (row, record) in enumerate(zip(rows, bad)):
        if row is not None:
            assert _same(row, staged_row(record)), i


def _source(records):
    staged = {}
    for i, record in enumerate(records):
        item = staged_item(record, Position("staged", 0, i, 0), 100)
        staged[item.staging_key] = item
    return BufferTokenSource(staged, partition_name="staged")


def _one_at_a_time(records, keys):
    """What the source did before converting together: staged_row per key, in order."""
    by_key = {f"{r['rollout_id']}/{r['model_call_id']}": r for r in records}
    try:
        rows = [staged_row(by_key[k]) if k in by_key else None for k in keys]
    except ValueError as error:
        return f"ValueError: {error}"
    if any(row is None for row in rows):
        return "KeyError"
    return [row.snapshot.digest for row in rows]


@pytest.mark.parametrize("bad_at, second", [(0, None), (3, "digest"), (2, "mode"), (4, None)])
def test_a_fetch_fails_with_the_first_error_in_key_order(bad_at, second):
    rollout = copy.deepcopy(_records(seed=2, groups=1)[0])
    keys = [f"{r['rollout_id']}/{r['model_call_id']}" for r in rollout]
    MUTATIONS["tampered token"](rollout[bad_at % len(rollout)])
    if second is not None:
        MUTATIONS[second](rollout[(bad_at + 1) % len(rollout)])
    want = _one_at_a_time(rollout, keys)
    try:
        got = [f.snapshot.digest for f in _source(rollout).fetch_for_finalization(keys)]
    except ValueError as error:
        got = f"ValueError: {error}"
    assert got == want and isinstance(want, str)
    missing = [r for i, r in enumerate(rollout) if i != 0]   # a missing row and a bad one: the bad one
    try:
        _source(missing).fetch_for_finalization(keys)
    except KeyError:
        outcome = "KeyError"
    except ValueError:
        outcome = "ValueError"
    assert outcome == ("ValueError" if bad_at % len(rollout) != 0 else "KeyError")


def _group(seed=3):
    """Two rollouts' records of one group, and each rollout's staging keys."""
    rollouts = _records(seed=seed, groups=1)
    return ([r for rollout in rollouts for r in rollout],
            [[f"{r['rollout_id']}/{r['model_call_id']}" for r in rollout] for rollout in rollouts])


def test_the_first_fetch_converts_the_whole_group_in_one_pass(monkeypatch):
    import stage.runtime.task.source as source_module
    records, keys = _group()
    calls = []

    def counted(payloads, *args, **kwargs):
        calls.append(len(payloads))
        return staged_rows(payloads, *args, **kwargs)

    monkeypatch.setattr(source_module, "staged_rows", counted)
    source = _source(records)
    first = source.fetch_for_finalization(keys[0])
    assert calls == [len(records)]
    assert sorted(source.converted()) == sorted(keys[0])   # only what was fetched shows
    second = source.fetch_for_finalization(keys[1])
    assert calls == [len(records)]                         # the group pass produced them all
    by_key = {f"{r['rollout_id']}/{r['model_call_id']}": r for r in records}
    for fetched, rollout_keys in ((first, keys[0]), (second, keys[1])):
        assert [f.snapshot.to_json() for f in fetched] == \
            [staged_row(by_key[k]).snapshot.to_json() for k in rollout_keys]


def test_a_bad_record_of_one_rollout_leaves_the_others_fetch_alone():
    records, keys = _group()
    bad_key = keys[1][1]
    bad = next(r for r in records if f"{r['rollout_id']}/{r['model_call_id']}" == bad_key)
    MUTATIONS["tampered token"](bad)
    source = _source(records)
    assert [f.snapshot.digest for f in source.fetch_for_finalization(keys[0])] == _one_at_a_time(records, keys[0])
    with pytest.raises(ValueError) as error:
        source.fetch_for_finalization(keys[1])
    assert f"ValueError: {error.value}" == _one_at_a_time(records, keys[1])


def test_an_unreadable_spilled_record_fails_only_its_own_rollouts_fetch():
    records, keys = _group()
    source = _source(records)
    unreadable = keys[1][0]
    source.staged[unreadable] = dataclasses.replace(source.staged[unreadable], spilled=100)

    def load(payload):
        raise ValueError("spill file is gone")

    source.load = load
    assert [f.snapshot.digest for f in source.fetch_for_finalization(keys[0])] == _one_at_a_time(records, keys[0])
    with pytest.raises(ValueError, match="spill file is gone"):
        source.fetch_for_finalization(keys[1])
