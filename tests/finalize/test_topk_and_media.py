"""Sampler top-k (spec §2 guard 14, §4.2 columns) and VLM media (spec §2 guard 13, §6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stage.finalize import InMemoryTokenSource, Reassembler, ReassemblyConfig, pad_group
from stage.finalize.source import TopK
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
    assert media["imgs_sizes"].dtype == np.int32
    assert media["imgs_sizes"].tolist() == [[PATCH, 2 * PATCH], [PATCH, PATCH]]
    assert media["num_frames"].dtype == np.int32 and media["num_frames"].tolist() == [1, 1]
    assert placeholder.media is None
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
    assert out.rows[0].media is not None and out.rows[1].media is None


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
