"""The trainer-side reader without a broker: group assembly by group id, de-duplication by
sample id, padding to NeMo RL's training tensors, offsets safe to commit."""

import numpy as np
import pytest
import torch

from stage.client import GroupAssembler, route_plan_from_record, row_from_record
from stage.contract import encode_routed_experts
from stage.contract.producer import RolloutBuilder
from stage.finalize import GroupFinalizer, InMemoryTokenSource, ReassemblyConfig, pad_group
from stage.publish.records import plan_record, row_record
from stage.routes import encode_route_plan
from stage.wire import AvroCodec

L, K = 2, 2
ROWS = AvroCodec("CanonicalRow")


def finalized_group(config=ReassemblyConfig(router_replay=True), group_id="grp", n=3):
    """n rollouts of different lengths (so padding matters); the last one has no receipt."""
    rng = np.random.default_rng(5)
    source = InMemoryTokenSource()
    ids, receipts = [], []
    for i in range(n - 1):
        builder = RolloutBuilder(f"{group_id}-r{i}")
        parent = None
        for c in range(i + 1):
            carry, gen = (4 if parent is None else 2), 3 + i
            staged = builder.stage(f"c{c}", parent_call_id=parent, prompt_delta=rng.integers(1, 99, carry),
                                   generated=rng.integers(1, 99, gen), generated_logprobs=-rng.random(gen),
                                   weight_version=7 + c, extras={"routed_experts": encode_routed_experts(
                                       rng.integers(0, 30, (carry + gen, L, K)), "int8")})
            source.stage(staged.record)
            parent = f"c{c}"
        ids.append(builder.rollout_id)
        receipts.append(builder.receipt(parent).to_json())
    ids.append(f"{group_id}-r{n - 1}")
    receipts.append(None)
    group = GroupFinalizer(source, config).finalize_group(
        group_id, ids, receipts, [1.0, 0.5, 0.0][:n], mask_sample=[False] * n,
        fallback_weight_version=0, prompt_idx=3)
    encoded = [ROWS.encode(row_record(row)) for row in group.rows]
    return group, encoded


def test_rows_in_any_order_with_duplicates_make_one_group_exactly_once():
    group, encoded = finalized_group()
    assembler = GroupAssembler()
    arrivals = [2, 0, 2, 1, 0]          # row 2 twice before the group completes, row 0 once after
    done = [assembler.add_row(ROWS.decode(encoded[i]), encoded[i]) for i in arrivals]
    assert done[:3] == [None] * 3 and done[4] is None
    out = done[3]
    assert [r.sample_id for r in out.rows] == ["grp_g0", "grp_g1", "grp_g2"]
    assert out.valid_rows == 2 and out.rejections == [(2, "missing_receipt")]
    assert assembler.counts["duplicates"] == 2 and assembler.counts["groups"] == 1
    # a copy arriving after completion is recognised, never a second group
    assert assembler.add_row(ROWS.decode(encoded[1]), encoded[1]) is None
    assert assembler.counts["duplicates"] == 3 and not assembler.pending


def test_a_duplicate_with_other_content_is_a_conflict_and_the_first_copy_wins():
    group, encoded = finalized_group()
    assembler = GroupAssembler()
    first = ROWS.decode(encoded[0])
    other = dict(first, total_reward=99.0)
    assert assembler.add_row(first, encoded[0]) is None
    assert assembler.add_row(other, ROWS.encode(other)) is None
    assembler.add_row(ROWS.decode(encoded[1]), encoded[1])
    out = assembler.add_row(ROWS.decode(encoded[2]), encoded[2])
    assert assembler.counts["conflicts"] == 1 and out.rows[0].total_reward == first["total_reward"]
    late_other = dict(ROWS.decode(encoded[2]), rollout_id="impostor")
    assert assembler.add_row(late_other, ROWS.encode(late_other)) is None
    assert assembler.counts["conflicts"] == 2


def test_records_that_contradict_their_group_are_refused():
    _, encoded = finalized_group()
    assembler = GroupAssembler()
    record = ROWS.decode(encoded[0])
    assert assembler.add_row(dict(record, sample_id="grp_g1")) is None
    assert assembler.add_row(dict(record, row_index=5, sample_id="grp_g5")) is None
    assembler.add_row(ROWS.decode(encoded[1]))
    assert assembler.add_row(dict(ROWS.decode(encoded[2]), group_size=4)) is None
    assert assembler.counts["invalid"] == 3 and len(assembler.pending["grp"].rows) == 1


@pytest.mark.parametrize("pad_token_id", [0, 7])
def test_padded_tensors_are_nemo_rls_and_equal_pad_group_of_the_finalizer(pad_token_id):
    group, encoded = finalized_group()
    assembler = GroupAssembler()
    out = None
    for blob in encoded:
        out = assembler.add_row(ROWS.decode(blob), blob) or out
    tensors = out.tensors(pad_token_id=pad_token_id)
    expected = pad_group(group, pad_token_id=pad_token_id)
    assert tensors.keys() == expected.keys()
    for name in expected:
        assert torch.equal(tensors[name], expected[name]), name
    lengths = tensors["input_lengths"].tolist()
    assert lengths == [r.input_lengths for r in group.rows] and lengths[2] == 1
    n, width = tensors["input_ids"].shape
    assert (n, width) == (3, max(lengths))
    for i, length in enumerate(lengths):   # padding: pad token, mask 0, routes -1
        assert tensors["input_ids"][i, length:].eq(pad_token_id).all()
        assert tensors["token_mask"][i, length:].eq(0).all()
        assert tensors["routed_experts"][i, length:].eq(-1).all()
    assert tensors["routed_experts"].shape == (3, width, L, K)
    assert tensors["sample_mask"].tolist() == [1.0, 1.0, 0.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_rows_and_tensors_land_on_the_chosen_device():
    _, encoded = finalized_group()
    assembler = GroupAssembler(device="cuda")
    out = None
    for blob in encoded:
        out = assembler.add_row(ROWS.decode(blob), blob) or out
    assert out.rows[0].input_ids.device.type == "cuda"
    assert all(t.device.type == "cuda" for t in out.tensors().values())


def test_with_plans_a_group_completes_only_when_every_row_has_its_plan():
    config = ReassemblyConfig(router_replay=True, defer_routes=True)
    group, encoded = finalized_group(config)
    plans = [plan_record(row, {}) for row in group.rows]
    assembler = GroupAssembler(with_plans=True)
    assert assembler.add_plan(plans[1]) is None       # a plan may come before its row
    for blob in encoded:
        assert assembler.add_row(ROWS.decode(blob), blob) is None
    assert assembler.add_plan(plans[0]) is None
    out = assembler.add_plan(plans[2])
    assert out is not None and [p["row_index"] for p in out.plans] == [0, 1, 2]
    for plan, row in zip(out.plans, group.rows):
        assert encode_route_plan(route_plan_from_record(plan)) == encode_route_plan(row.route_plan)


def test_committable_offsets_hold_incomplete_groups():
    _, a = finalized_group(group_id="a")
    _, b = finalized_group(group_id="b")
    assembler = GroupAssembler()
    order = [(a, 0, 10), (b, 0, 11), (a, 1, 12), (a, 2, 13), (b, 1, 14)]
    for blobs, index, offset in order:
        assembler.add_row(ROWS.decode(blobs[index]), blobs[index], ("rows", 0, offset))
    assert assembler.lowest_pending_offsets() == {("rows", 0): 11}  # group a done, b holds 11


def test_row_from_record_round_trips_every_column():
    config = ReassemblyConfig(router_replay=True, top_logprobs=0)
    group, encoded = finalized_group(config)
    row = row_from_record(ROWS.decode(encoded[1]))
    want = group.rows[1]
    for name in ("input_ids", "generation_logprobs", "token_mask", "prompt_ids_for_adv", "routed_experts"):
        assert torch.equal(getattr(row, name), getattr(want, name)), name
    assert (row.sample_id, row.valid, row.weight_version, row.group_max_wv) == \
        (want.sample_id, want.valid, want.weight_version, want.group_max_wv)



def media_group():
    """[image rollout (float16), text rollout, video rollout, missing receipt]."""
    from tests.finalize.factory import PATCH, CallSpec, Group, golden_specs, image, stage_rollout, video
    source = InMemoryTokenSource()
    img = stage_rollout(source, "img", [CallSpec("c1", None, [1, 2], [3], media=image(2, dtype=np.float16))])
    text = stage_rollout(source, "txt", golden_specs())
    vid = stage_rollout(source, "vid", [CallSpec("c1", None, [4], [5, 6], media=video(3, dtype=np.float16))])
    group = Group("m").add("img", img.receipt_json()).add("txt", text.receipt_json()) \
        .add("vid", vid.receipt_json()).add("gone", None)
    return group.run(GroupFinalizer(source, ReassemblyConfig(capture_media=True, media_patch_size=PATCH)))


def test_media_group_rows_round_trip_and_pad_to_the_finalizers_media_tensors():
    group = media_group()
    encoded = [ROWS.encode(row_record(row)) for row in group.rows]
    records = [ROWS.decode(blob) for blob in encoded]
    assert [r["pixel_values"]["shape"] for r in records] == [[2, 12], [0, 12], [3, 12], [0, 12]]
    assert all(r["pixel_values"]["dtype"] == "float16" for r in records)   # empty rows keep the dtype
    assembler = GroupAssembler()
    out = [assembler.add_row(rec, blob) for rec, blob in zip(records, encoded)][-1]
    ours, theirs = out.tensors(), pad_group(group)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    assert ours["pixel_values"].shape == (5, 12) and ours["pixel_values"].dtype == torch.float16
    assert ours["num_frames"].tolist() == [1, 3] and ours["num_frames__row_counts"].tolist() == [1, 0, 1, 0]


def test_rows_of_an_older_stage_without_empty_media_rows_still_pad():
    group = media_group()
    records = [row_record(row) for row in group.rows]
    for record in records[1:2] + records[3:]:          # text row and placeholder published null
        record.update(pixel_values=None, imgs_sizes=None, num_frames=None)
    rows = [row_from_record(ROWS.decode(ROWS.encode(r))) for r in records]
    assert rows[1].media is None
    t = pad_group(type(group)(**{**group.__dict__, "rows": rows}))
    assert t["pixel_values__row_counts"].tolist() == [2, 0, 3, 0]
    assert torch.equal(t["pixel_values"], pad_group(group)["pixel_values"])


def test_media_with_a_wrong_layout_is_refused_by_name():
    record = row_record(media_group().rows[0])
    record["num_frames"] = {"dtype": "int64", "shape": [1], "data": bytes(8)}
    with pytest.raises(ValueError, match="num_frames"):
        row_from_record(record)


# --- the reader's limits follow one setting, the stage's max_record_bytes --------------------


@pytest.mark.parametrize("max_record_bytes", [1 << 20, 64 << 20, 1_000_000_000 - (1 << 20)])
def test_every_reader_limit_follows_max_record_bytes(monkeypatch, max_record_bytes):
    """The stage accepts max_record_bytes up to ~953 MiB; the reader and the route fetcher decoded
    with a fixed 64 MiB cap and fetched with fixed 64 MiB limits."""
    import stage.client.reader as reader_module
    import stage.client.route_fetch as fetch_module
    from stage.config.model import StageConfig
    from stage.runtime.kafka.clients import consumer_config

    class Captured:
        confs = []

        def __init__(self, conf):
            self.confs.append(conf)

        def assign(self, *_):
            pass

        def subscribe(self, *args, **kwargs):
            pass

        def list_topics(self, *args, **kwargs):   # the reader's first contact
            return None

    monkeypatch.setattr(reader_module, "Consumer", Captured)
    monkeypatch.setattr(fetch_module, "Consumer", Captured)
    reader = reader_module.CanonicalReader("b:9092", group_id="t", route_plans=True,
                                           max_record_bytes=max_record_bytes)
    fetcher = fetch_module.DeferredRouteFetcher("b:9092", dims=(2, 2), max_record_bytes=max_record_bytes)
    stage = consumer_config(StageConfig(max_record_bytes=max_record_bytes))
    for conf in Captured.confs:
        for name in ("fetch.max.bytes", "max.partition.fetch.bytes", "receive.message.max.bytes"):
            assert conf[name] == stage[name], name
    assert {codec.max_record_bytes for _, codec in reader.codecs.values()} == {max_record_bytes}
    assert fetcher.codec.max_record_bytes == max_record_bytes


def test_a_complete_group_whose_rows_cannot_be_built_is_never_handed_out_and_holds_the_position():
    """It was logged, dropped and finished: the position moved past it."""
    from stage.client.stream import GroupStream

    group, encoded = finalized_group()
    stream = GroupStream()
    tp = ("rows", 0)
    stream.assigned(tp, None)
    broken = ROWS.decode(encoded[1])
    broken["input_ids"] = dict(broken["input_ids"], data=broken["input_ids"]["data"][:-1])
    for offset, record in enumerate([ROWS.decode(encoded[0]), broken, ROWS.decode(encoded[2])]):
        stream.offer("rows", tp, 10 + offset, record, None)
    unusable = stream.end_batch()
    assert unusable[0] == "grp" and unusable[1] == ("rows", 0, 10) and "input_ids" in unusable[2]
    assert stream.next_group() is None
    assert stream.position().offsets() == {tp: 10}
