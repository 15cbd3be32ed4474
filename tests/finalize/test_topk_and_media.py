"""Sampler top-k (spec §2 guard 14, §4.2 columns) and VLM media (spec §2 guard 13, §6)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from stage.finalize import (
    MEDIA_FIELDS,
    InMemoryTokenSource,
    Reassembler,
    ReassemblyConfig,
    pad_group,
    pad_group_media,
)
from stage.finalize.source import StagedMedia, TopK
from tests.finalize.factory import (
    PATCH,
    TOPK,
    CallSpec,
    Group,
    SpySource,
    golden_specs,
    image,
    stage_rollout,
    topk_for,
    video,
)

TOPK_CONFIG = dict(top_logprobs=TOPK)
MEDIA_CONFIG = dict(capture_media=True, media_patch_size=PATCH)


# --- top-k -------------------------------------------------------------------------------------


def test_sampler_topk_published():
    """§9 rollout_reassembler 5."""
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", golden_specs(topk=True))
    spy = SpySource(source)
    out = Group().add("a", staged.receipt_json(), 1.0).add("b", None).run(
        Reassembler(spy, ReassemblyConfig(**TOPK_CONFIG)))
    assert spy.fetch_calls[0][1] == {"include_route_fragments": False, "include_topk": True}
    valid, placeholder = out.rows
    assert valid.valid
    ids, lps = valid.generation_topk_ids, valid.generation_topk_logprobs
    assert ids.dtype == torch.int32 and lps.dtype == torch.float32
    assert ids.shape == lps.shape == (7, TOPK)
    carried = [0, 1, 4]
    assert (ids[carried] == 0).all() and (lps[carried] == 0).all()
    c1, c2 = topk_for(1, 2), topk_for(2, 2)
    assert ids[[2, 3]].tolist() == c1.ids.tolist() and ids[[5, 6]].tolist() == c2.ids.tolist()
    assert lps[[2, 3]].tolist() == c1.logprobs.tolist() and lps[[5, 6]].tolist() == c2.logprobs.tolist()
    assert (ids[[2, 3, 5, 6]] != 0).all()
    assert placeholder.generation_topk_ids.shape == (1, TOPK)
    assert placeholder.generation_topk_ids.dtype == torch.int32
    assert (placeholder.generation_topk_ids == 0).all() and (placeholder.generation_topk_logprobs == 0).all()
    t = pad_group(out)
    assert t["generation_topk_ids"].dtype == torch.int32 and t["generation_topk_ids"].shape == (2, 7, TOPK)
    assert t["generation_topk_logprobs"].dtype == torch.float32
    assert torch.equal(t["generation_topk_ids"][0], ids)
    assert (t["generation_topk_ids"][1] == 0).all() and (t["generation_topk_logprobs"][1] == 0).all()


def test_topk_one_row_short_is_topk_length_mismatch():
    """§9 rollout_reassembler 6."""
    source = InMemoryTokenSource()
    specs = golden_specs(topk=True)
    short = topk_for(2, 2)
    specs[1].topk = TopK(ids=short.ids[:1], logprobs=short.logprobs[:1])
    staged = stage_rollout(source, "a", specs)
    out = Reassembler(source, ReassemblyConfig(**TOPK_CONFIG)).finalize_rollout("a", staged.receipt_json(),
                                                                                  reward=0.5)
    assert out.rejection_reason == "topk_length_mismatch:c2"
    assert out.staging_keys == ["a/c1", "a/c2"] and out.reward == 0.5


@pytest.mark.parametrize("which", ["ids", "logprobs"])
def test_topk_width_or_one_column_mismatch(which):
    source = InMemoryTokenSource()
    specs = golden_specs(topk=True)
    good = topk_for(1, 2)
    wide = topk_for(1, 2, k=TOPK + 1)
    specs[0].topk = TopK(ids=wide.ids if which == "ids" else good.ids,
                         logprobs=wide.logprobs if which == "logprobs" else good.logprobs)
    staged = stage_rollout(source, "a", specs)
    out = Reassembler(source, ReassemblyConfig(**TOPK_CONFIG)).finalize_rollout("a", staged.receipt_json(),
                                                                                  reward=0.0)
    assert out.rejection_reason == "topk_length_mismatch:c1"


def test_row_staged_without_topk_is_missing_staging_row():
    """§9 rollout_reassembler 7."""
    source = InMemoryTokenSource()
    specs = golden_specs(topk=True)
    specs[1].topk = None
    staged = stage_rollout(source, "a", specs)
    out = Reassembler(source, ReassemblyConfig(**TOPK_CONFIG)).finalize_rollout("a", staged.receipt_json(),
                                                                                  reward=0.0)
    assert out.rejection_reason.startswith("missing_staging_row:")
    assert "a/c2" in out.rejection_reason and "top-k" in out.rejection_reason


def test_topk_off_ignores_staged_topk():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", golden_specs(topk=True))
    row = Group().add("a", staged.receipt_json()).run(Reassembler(source)).rows[0]
    assert row.valid and row.generation_topk_ids is None and row.generation_topk_logprobs is None


# --- media -------------------------------------------------------------------------------------


def media_specs(c1=None, c2=None, dead=None):
    specs = [CallSpec("c1", None, [10, 11], [12, 13], media=c1),
             CallSpec("dead", "c1", [14], [15], media=dead),
             CallSpec("c2", "c1", [20], [21, 22], media=c2)]
    return specs


def test_chain_media_concatenated_in_chain_order_and_read_after_verification():
    source = InMemoryTokenSource()
    first, second = image(2, value=0.5), image(1, value=0.75)
    staged = stage_rollout(source, "a", media_specs(c1=first, c2=second, dead=image(3)), terminal="c2")
    spy = SpySource(source)
    out = Group().add("a", staged.receipt_json()).add("b", None).run(
        Reassembler(spy, ReassemblyConfig(**MEDIA_CONFIG)))
    valid, placeholder = out.rows
    assert valid.valid, valid.rejection_reason
    assert spy.media_calls == [["a/c1", "a/c2"]]          # one batched read, chain calls only
    media = valid.media
    assert set(media) == {"pixel_values", "imgs_sizes", "num_frames"}
    assert media["pixel_values"].shape == (3, 3 * PATCH * PATCH)          # leading 1 squeezed
    assert media["pixel_values"][:, 0].tolist() == [0.5, 0.5, 0.75]
    assert media["imgs_sizes"].dtype == torch.int32
    assert media["imgs_sizes"].tolist() == [[PATCH, 2 * PATCH], [PATCH, PATCH]]
    assert media["num_frames"].dtype == torch.int32 and media["num_frames"].tolist() == [1, 1]
    # the placeholder: an empty logical row of the same layout (NeMo RL's empty_rows_like)
    assert {k: (tuple(v.shape), v.dtype) for k, v in placeholder.media.items()} == {
        "pixel_values": ((0, 3 * PATCH * PATCH), torch.float32), "imgs_sizes": ((0, 2), torch.int32),
        "num_frames": ((0,), torch.int32)}
    assert out.metrics["finalize/media_row_rate"] == 1.0


def test_video_frames_concatenate():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", media_specs(c1=video(2), c2=video(3)), terminal="c2")
    row = Group().add("a", staged.receipt_json()).run(Reassembler(source, ReassemblyConfig(**MEDIA_CONFIG))).rows[0]
    assert row.valid
    assert row.media["num_frames"].tolist() == [2, 3]
    assert row.media["pixel_values"].shape == (5, 3 * PATCH * PATCH)


def test_media_row_rate_counts_valid_rows_with_media():
    source = InMemoryTokenSource()
    with_media = stage_rollout(source, "a", media_specs(c2=image(1)), terminal="c2")
    without = stage_rollout(source, "b", golden_specs())
    out = (Group().add("a", with_media.receipt_json()).add("b", without.receipt_json()).add("c", None)
           .run(Reassembler(source, ReassemblyConfig(**MEDIA_CONFIG))))
    assert [r.valid for r in out.rows] == [True, True, False]
    assert out.metrics["finalize/media_row_rate"] == 0.5
    assert out.rows[0].media["pixel_values"].shape == (1, 3 * PATCH * PATCH)
    for text_or_placeholder in out.rows[1:]:                        # empty logical rows
        assert [v.shape[0] for v in text_or_placeholder.media.values()] == [0, 0, 0]


def test_mixed_image_and_video_calls_are_rejected_before_any_media_read():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", media_specs(c1=image(1), c2=video(2)), terminal="c2")
    spy = SpySource(source)
    out = Reassembler(spy, ReassemblyConfig(**MEDIA_CONFIG)).finalize_rollout("a", staged.receipt_json(), reward=0.0)
    assert out.rejection_reason == "media_chain_incompatible:mixed image and video calls"
    assert spy.media_calls == []


def test_invalid_media_columns():
    source = InMemoryTokenSource()
    bad = image(1)
    bad = type(bad)(imgs=bad.imgs, imgs_sizes=np.array([[PATCH + 1, PATCH]], dtype=np.int32))
    staged = stage_rollout(source, "a", media_specs(c1=bad), terminal="c2")
    out = Reassembler(source, ReassemblyConfig(**MEDIA_CONFIG)).finalize_rollout("a", staged.receipt_json(), reward=0.0)
    assert out.rejection_reason == f"invalid_media_columns:media imgs_sizes must be divisible by the patch size {PATCH}"
    assert out.staging_keys == ["a/c1", "a/dead", "a/c2"]


def test_media_that_cannot_concatenate_is_media_chain_incompatible():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", media_specs(c1=image(1, dtype=np.float16), c2=image(1)), terminal="c2")
    out = Reassembler(source, ReassemblyConfig(**MEDIA_CONFIG)).finalize_rollout("a", staged.receipt_json(), reward=0.0)
    assert out.rejection_reason == "media_chain_incompatible:media chain mixes pixel dtypes ['float16', 'float32']"


def test_rejected_rollout_never_moves_pixels():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", media_specs(c1=image(1)), terminal="c2")
    receipt = staged.receipt_json()
    receipt["manifest"][0]["digest"] = "0" * 64
    spy = SpySource(source)
    out = Reassembler(spy, ReassemblyConfig(**MEDIA_CONFIG)).finalize_rollout("a", receipt, reward=0.0)
    assert out.rejection_reason.startswith("rebuild_failed:wrong_digest")
    assert spy.media_calls == []


def test_media_off_ignores_staged_media():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", media_specs(c1=image(1)), terminal="c2")
    spy = SpySource(source)
    out = Group().add("a", staged.receipt_json()).run(Reassembler(spy))
    assert out.rows[0].valid and out.rows[0].media is None
    assert spy.media_calls == []
    assert out.metrics["finalize/media_row_rate"] == 0.0


# --- group media fields (spec §6 _media_fields_for_group, §4.2) ---------------------------------


def mixed_media_group(source):
    """[image rollout, text rollout, video rollout, placeholder], as issue 12 describes it."""
    img = stage_rollout(source, "a", media_specs(c1=image(2, value=0.5), c2=image(1, value=0.75)), terminal="c2")
    text = stage_rollout(source, "b", golden_specs())
    vid = stage_rollout(source, "c", media_specs(c1=video(2, value=0.25), c2=video(3, value=0.125)), terminal="c2")
    return Group().add("a", img.receipt_json()).add("b", text.receipt_json()).add("c", vid.receipt_json()) \
        .add("d", None)


def test_group_media_fields_give_one_logical_row_per_sample():
    source = InMemoryTokenSource()
    out = mixed_media_group(source).run(Reassembler(source, ReassemblyConfig(**MEDIA_CONFIG)))
    assert [r.valid for r in out.rows] == [True, True, True, False]
    width = 3 * PATCH * PATCH
    shapes = [{k: tuple(v.shape) for k, v in row.media.items()} for row in out.rows]
    assert shapes == [
        {"pixel_values": (3, width), "imgs_sizes": (2, 2), "num_frames": (2,)},
        {"pixel_values": (0, width), "imgs_sizes": (0, 2), "num_frames": (0,)},      # text rollout
        {"pixel_values": (5, width), "imgs_sizes": (5, 2), "num_frames": (2,)},
        {"pixel_values": (0, width), "imgs_sizes": (0, 2), "num_frames": (0,)}]      # placeholder
    assert out.rows[2].media["num_frames"].tolist() == [2, 3]
    assert out.metrics["finalize/media_row_rate"] == 2 / 3

    t = pad_group(out)
    assert t["pixel_values"].shape == (8, width) and t["pixel_values"].dtype == torch.float32
    assert t["pixel_values"][:, 0].tolist() == [0.5, 0.5, 0.75, 0.25, 0.25, 0.125, 0.125, 0.125]
    assert t["imgs_sizes"].dtype == torch.int32
    assert t["imgs_sizes"].tolist() == [[PATCH, 2 * PATCH], [PATCH, PATCH]] + [[PATCH, PATCH]] * 5
    assert t["num_frames"].dtype == torch.int32 and t["num_frames"].tolist() == [1, 1, 2, 3]
    assert t["pixel_values__row_counts"].tolist() == [3, 0, 5, 0]
    assert t["imgs_sizes__row_counts"].tolist() == [2, 0, 5, 0]
    assert t["num_frames__row_counts"].tolist() == [2, 0, 2, 0]
    assert all(t[f"{name}__row_counts"].dtype == torch.int64 for name in MEDIA_FIELDS)
    for name in MEDIA_FIELDS:  # the counts split the concatenation back into the rows
        parts = torch.split(t[name], t[f"{name}__row_counts"].tolist())
        for part, row in zip(parts, out.rows):
            assert torch.equal(part, row.media[name])


def test_text_only_group_with_media_capture_has_no_media_fields():
    source = InMemoryTokenSource()
    text = stage_rollout(source, "a", golden_specs())
    out = Group().add("a", text.receipt_json()).add("b", None).run(Reassembler(source, ReassemblyConfig(**MEDIA_CONFIG)))
    assert [r.media for r in out.rows] == [None, None]
    assert not {k for k in pad_group(out) if k.startswith(("pixel_values", "imgs_sizes", "num_frames"))}


def test_pad_group_media_takes_rows_without_media_as_empty_and_refuses_mismatched_layouts():
    row = {"pixel_values": torch.ones(2, 12), "imgs_sizes": torch.ones(1, 2, dtype=torch.int32),
           "num_frames": torch.ones(1, dtype=torch.int32)}
    t = pad_group_media([None, row, None], "cpu")   # rows of an older stage: None beside media rows
    assert t["pixel_values"].shape == (2, 12) and t["pixel_values__row_counts"].tolist() == [0, 2, 0]
    assert pad_group_media([None, None], "cpu") == {}
    wide = {**row, "pixel_values": torch.ones(1, 13)}
    with pytest.raises(ValueError, match=r"media field pixel_values: row 1 has shape \[1, 13\], "
                                         r"the group's rows are \[\*, 12\]"):
        pad_group_media([row, wide], "cpu")
    with pytest.raises(ValueError, match="media field num_frames: row 1 has shape"):
        pad_group_media([row, {**row, "num_frames": torch.tensor(3, dtype=torch.int32)}], "cpu")


def test_group_metrics_of_the_mixed_media_group_do_not_depend_on_the_receipt_form():
    source = InMemoryTokenSource()
    group = mixed_media_group(source)
    fin = Reassembler(source, ReassemblyConfig(**MEDIA_CONFIG))
    as_dicts = group.run(fin).metrics
    group.receipts = [None if r is None else json.dumps(r) for r in group.receipts]
    as_text = group.run(fin).metrics
    for key, value in as_dicts.items():
        if not key.startswith("row_assembly/"):
            assert as_text[key] == value, key
    assert as_text["finalize/token_in_rate"] == pytest.approx(5 / 8)


def test_bfloat16_pixels_stay_bfloat16_through_the_chain():
    """numpy has no bfloat16: StagedMedia carries the bit patterns and the row gets bfloat16."""
    def bf16_image(patches, value):
        pixels = torch.full((1, patches, 3 * PATCH * PATCH), value, dtype=torch.bfloat16)
        return StagedMedia.of(pixels, np.array([[PATCH, PATCH * patches]], dtype=np.int32))

    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", media_specs(c1=bf16_image(2, 0.5), c2=bf16_image(1, -1.25)),
                           terminal="c2")
    out = Group().add("a", staged.receipt_json()).add("b", None).run(
        Reassembler(source, ReassemblyConfig(**MEDIA_CONFIG)))
    valid, placeholder = out.rows
    assert valid.valid, valid.rejection_reason
    assert valid.media["pixel_values"].dtype == torch.bfloat16
    assert valid.media["pixel_values"][:, 0].tolist() == [0.5, 0.5, -1.25]
    assert placeholder.media["pixel_values"].dtype == torch.bfloat16
    assert pad_group(out)["pixel_values"].dtype == torch.bfloat16


def test_chain_mixing_bfloat16_and_float16_pixels_is_rejected():
    source = InMemoryTokenSource()
    bf16 = StagedMedia.of(torch.zeros(1, 1, 3 * PATCH * PATCH, dtype=torch.bfloat16),
                          np.array([[PATCH, PATCH]], dtype=np.int32))
    staged = stage_rollout(source, "a", media_specs(c1=image(1, dtype=np.float16), c2=bf16), terminal="c2")
    row = Reassembler(source, ReassemblyConfig(**MEDIA_CONFIG)).finalize_rollout(
        "a", staged.receipt_json(), reward=0.0)
    assert not row.valid and "bfloat16" in row.rejection_reason and "float16" in row.rejection_reason


# --- non-finite values: nothing NaN or infinite reaches a published row ---------------------


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
def test_non_finite_topk_logprobs_reject_the_rollout(bad):
    """No digest binds the top-k columns: a NaN or -inf there would be published in a valid row."""
    source = InMemoryTokenSource()
    specs = golden_specs(topk=True)
    lps = specs[1].topk.logprobs.copy()
    lps[1, 2] = bad
    specs[1].topk = TopK(ids=specs[1].topk.ids, logprobs=lps)
    staged = stage_rollout(source, "a", specs)
    out = Group().add("a", staged.receipt_json(), 1.0).add("b", None).run(
        Reassembler(source, ReassemblyConfig(**TOPK_CONFIG)))
    assert out.rows[0].rejection_reason == "non_finite_value:generation_topk_logprobs"
    assert all(torch.isfinite(row.generation_topk_logprobs).all() for row in out.rows)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, "bfloat16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_pixels_reject_the_rollout(dtype, bad):
    pixels = np.full((1, 2, 3 * PATCH * PATCH), 0.5, dtype=np.float32)
    pixels[0, 1, 3] = bad
    sizes = np.array([[PATCH, 2 * PATCH]], dtype=np.int32)
    media = (StagedMedia.of(torch.from_numpy(pixels).to(torch.bfloat16), sizes) if dtype == "bfloat16"
             else StagedMedia(imgs=pixels.astype(dtype), imgs_sizes=sizes))
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", media_specs(c1=media), terminal="c2")
    row = Reassembler(source, ReassemblyConfig(**MEDIA_CONFIG)).finalize_rollout(
        "a", staged.receipt_json(), reward=0.0)
    assert row.rejection_reason == "non_finite_value:pixel_values"


def test_large_finite_pixels_are_kept():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", media_specs(c1=image(2, dtype=np.float16, value=65504.0)),
                           terminal="c2")
    row = Reassembler(source, ReassemblyConfig(**MEDIA_CONFIG)).finalize_rollout(
        "a", staged.receipt_json(), reward=0.0)
    assert row.valid, row.rejection_reason


@pytest.mark.parametrize("reward", [1e308, float("inf"), float("nan")])
def test_a_reward_beyond_float32_is_a_placeholder_without_it(reward):
    """The library path (the stage's decoder already refuses such receipts): total_reward is a
    float32, so the row cannot keep it; the placeholder publishes 0."""
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", golden_specs())
    out = Group().add("a", staged.receipt_json(), reward).add("b", None, 0.5).run(
        Reassembler(source, ReassemblyConfig()))
    assert out.rows[0].rejection_reason == "non_finite_value:total_reward"
    assert [row.total_reward for row in out.rows] == [0.0, 0.5]


def test_a_loss_multiplier_beyond_float32_rejects_every_valid_row():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "a", golden_specs())
    out = Group().add("a", staged.receipt_json(), 1.0).add("b", None).run(
        Reassembler(source, ReassemblyConfig()), loss_multiplier=1e308)
    assert [row.rejection_reason for row in out.rows] == ["non_finite_value:sample_mask", "missing_receipt"]
    assert [row.sample_mask for row in out.rows] == [0.0, 0.0]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_token_logprobs_never_reach_a_row(value):
    """Refused by the contract when the staged snapshot is built from the wire record, before
    any row exists (pinned here: this is why rows need no check of their own for them)."""
    from stage.client import staged_call_from_record
    from stage.decode import staged_row
    from stage.wire import pack_tensor

    staged = stage_rollout(None, "a", golden_specs())
    value_record = staged_call_from_record("grp", staged.calls["c2"].record)
    logprobs = np.array([0.0, value, -0.4], dtype=np.float32)
    value_record["generation_log_probs_delta"] = pack_tensor(logprobs)
    with pytest.raises(ValueError, match="finite"):
        staged_row(value_record)
