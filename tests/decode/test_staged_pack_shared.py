"""The group pass's packed columns reach the verifier: each rollout of a group is verified on
its rows of the pack its staged calls were converted with (no second ``try_pack``), with the
same result as packing them again; a pack of other rows is never used."""

import numpy as np
import pytest

from stage.bench.verify import build_rollout
from stage.buffer import Position
from stage.client import staged_call_from_record
from stage.contract import verify_and_linearize
from stage.contract.packed import PackedRows
from stage.decode import staged_item
from stage.finalize.rollout import RolloutFinalizer
from stage.runtime.task.source import BufferTokenSource
from stage.wire import AvroCodec
from stage.workload import WorkloadConfig, generate

CODEC = AvroCodec("StagedCall")


def _group(seed=3):
    wl = generate(WorkloadConfig(groups=1, group_size=3, turns=(3, 5), route_layers=0,
                                 retry_rate=0.3, side_call_rate=0.5, topk=0, seed=seed))
    staged = {}
    for rollout in wl.rollouts:
        for c in rollout.calls:
            record = CODEC.decode(CODEC.encode(staged_call_from_record(rollout.group_id, c.record)))
            item = staged_item(record, Position("staged", 0, len(staged), 0), 100)
            staged[item.staging_key] = item
    return wl.rollouts, staged


def _row_fields(row):
    return (row.token_ids.tolist(), row.token_mask.tolist(), row.logprobs.tolist(), row.prompt_len,
            row.model_call_ids, row.weight_versions, row.link_spans,
            [(s.model_call_id, s.extras_digest) for s in row.extras_commitments])


def test_a_groups_rollouts_are_verified_on_the_group_pass_pack(monkeypatch):
    rollouts, staged = _group()
    packs = []
    original = PackedRows.try_pack.__func__

    def counted(cls, snapshots):
        packs.append(len(snapshots))
        return original(cls, snapshots)

    monkeypatch.setattr(PackedRows, "try_pack", classmethod(counted))
    finalizer = RolloutFinalizer(BufferTokenSource(staged, partition_name="staged"))
    outs = [finalizer.finalize_rollout(r.rollout_id, r.receipt, reward=1.0) for r in rollouts]
    assert all(out.valid for out in outs)
    assert packs == [len(staged)]   # the group pass only: no rollout packed its rows again
    monkeypatch.undo()
    again = RolloutFinalizer(BufferTokenSource(_group()[1], partition_name="staged"))
    for rollout, out in zip(rollouts, outs):   # the same rows as a finalizer that packs per rollout
        want = verify_and_linearize(rollout.receipt, [c.record.base_snapshot() for c in rollout.calls])
        assert out.token_ids.tolist() == want.token_ids.astype(np.int64).tolist()
        assert out.logprobs.tolist() == want.logprobs.tolist()
        assert again.finalize_rollout(rollout.rollout_id, rollout.receipt, reward=1.0).valid


def test_packed_rows_hands_out_a_view_of_exactly_the_fetched_snapshots():
    rollouts, staged = _group()
    source = BufferTokenSource(staged, partition_name="staged")
    keys = [r.staging_key for r in rollouts[1].receipt.manifest]
    fetched = source.fetch_for_finalization(keys)
    view = source.packed_rows(keys)
    snapshots = [f.snapshot for f in fetched]
    assert view is not None and view.packs(snapshots)
    fresh = PackedRows.try_pack(snapshots)
    for i in range(len(keys)):
        assert bytes(view.token_rows[i]) == bytes(fresh.token_rows[i])
        assert view.tokens[view.row(i)].tolist() == fresh.tokens[fresh.row(i)].tolist()
        assert view.mask_f32[view.row(i)].tobytes() == fresh.mask_f32[fresh.row(i)].tobytes()
        assert view.lp_f32[view.row(i)].tobytes() == fresh.lp_f32[fresh.row(i)].tobytes()
    assert (view.carry, view.order_ok, view.lengths) == (fresh.carry, fresh.order_ok, fresh.lengths)
    assert source.packed_rows(keys + ["no/such-key"]) is None


@pytest.mark.parametrize("digests_verified", [False, True])
def test_verify_on_a_selected_pack_equals_verify_on_its_own(digests_verified):
    receipt, snapshots = build_rollout(calls=12, root_prompt=64, carry=16, generated=32)
    other_receipt, other = build_rollout(calls=5, root_prompt=32, carry=8, generated=16, seed=4)
    group = PackedRows.try_pack(other + snapshots)   # another rollout's rows first, as in a group
    view = group.select(list(range(len(other), len(other) + len(snapshots))))
    want = verify_and_linearize(receipt, snapshots, digests_verified=digests_verified)
    got = verify_and_linearize(receipt, snapshots, digests_verified=digests_verified, packed=view)
    assert _row_fields(got) == _row_fields(want)
    # a pack of other rows (or of copies of these) is ignored: the rows are packed again
    wrong = group.select(list(range(len(snapshots))))
    assert _row_fields(verify_and_linearize(receipt, snapshots, packed=wrong)) == _row_fields(want)


def test_a_tampered_row_fails_the_same_way_on_a_selected_pack():
    receipt, snapshots = build_rollout(calls=6, root_prompt=64, carry=16, generated=32)
    ids = snapshots[3].token_ids_delta.copy()
    ids[0] ^= 1
    snapshots[3].token_ids_delta = ids
    view = PackedRows.try_pack(snapshots).select(list(range(len(snapshots))))
    with pytest.raises(Exception) as own:
        verify_and_linearize(receipt, snapshots)
    with pytest.raises(Exception) as shared:
        verify_and_linearize(receipt, snapshots, packed=view)
    assert (type(shared.value), str(shared.value)) == (type(own.value), str(own.value))


def test_bench_verifys_stage_path_verifies_the_same_row():
    from stage.bench.verify import stage_path
    receipt, snapshots = build_rollout(calls=9, root_prompt=64, carry=16, generated=32)
    assert _row_fields(stage_path(receipt, snapshots)()) == _row_fields(verify_and_linearize(receipt, snapshots))
