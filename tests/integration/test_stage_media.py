"""VLM media end to end on a real broker: a group of [image rollout, text rollout, video
rollout, placeholder] staged with media, finalized by the running stage, read back through
the trainer-side reader: one logical media row per sample (empty for the text rollout and the
placeholder) and padded tensors equal to pad_group of the library's recomputation."""

import numpy as np
import pytest
import torch

from stage.client import CanonicalReader, receipt_event, staged_call_from_record
from stage.contract.producer import RolloutBuilder
from stage.finalize import (
    MEDIA_FIELDS, GroupFinalizer, InMemoryTokenSource, ReassemblyConfig, StagedMedia, pad_group,
)
from stage.wire import AvroCodec
from tests.integration.harness import (
    Feeder, GroupSpec, RunningStage, read_all, setup_topics, stage_config, unique_topics,
)

P = 2                                    # patch size
WIDTH = 3 * P * P
SUMMARY = AvroCodec("GroupSummary")
CLIENT = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500, "fetch.wait.max.ms": 20}


def _image(patches: int, value: float, dtype: torch.dtype) -> StagedMedia:
    return StagedMedia.of(torch.full((1, patches, WIDTH), value, dtype=dtype),
                          np.array([[P, P * patches]], dtype=np.int32))


def _video(frames: int, value: float, dtype: torch.dtype) -> StagedMedia:
    return StagedMedia.of(torch.full((1, frames, WIDTH), value, dtype=dtype),
                          np.array([[P, P]] * frames, dtype=np.int32), np.array([frames], dtype=np.int32))


def media_group(group_id: str, dtype: torch.dtype = torch.float16) -> tuple[GroupSpec, dict]:
    """Two-call rollouts; media rides on the root call (and on the child for the video)."""
    rng = np.random.default_rng(3)
    media = {0: (_image(2, 0.5, dtype), None), 1: (None, None),
             2: (_video(2, 0.25, dtype), _video(3, 0.75, dtype)), 3: (None, None)}
    spec, staged_media = GroupSpec(group_id, [], []), {}
    for i in range(4):
        builder = RolloutBuilder(f"{group_id}-r{i}")
        parent = None
        for c, call_media in enumerate(media[i]):
            staged = builder.stage(f"c{c}", parent_call_id=parent, prompt_delta=rng.integers(1, 999, 4 - 2 * c),
                                   generated=rng.integers(1, 999, 3), generated_logprobs=-rng.random(3),
                                   weight_version=5)
            spec.staged.append(staged_call_from_record(group_id, staged.record, media=call_media))
            spec.records[staged.record.staging_key] = staged.record
            staged_media[staged.record.staging_key] = call_media
            parent = f"c{c}"
        receipt = builder.receipt(parent, terminal_selection="heuristic" if i == 0 else "declared")
        body = receipt.to_json()
        if i == 3:
            body["capture_poisoned"] = True              # the placeholder
        spec.receipts.append(receipt_event(group_id=group_id, rollout_id=builder.rollout_id, rollout_index=i,
                                           group_size=4, prompt_idx=9, reward=float(i), receipt=body))
    return spec, staged_media


def recompute(spec: GroupSpec, staged_media: dict, config: ReassemblyConfig):
    source = InMemoryTokenSource(partition="staging")
    for key, record in spec.records.items():
        source.stage(record, media=staged_media[key])
    return GroupFinalizer(source, config).finalize_group(
        spec.group_id, [r["rollout_id"] for r in spec.receipts], [r["receipt"] for r in spec.receipts],
        [r["reward"] for r in spec.receipts], mask_sample=[False] * 4, fallback_weight_version=0, prompt_idx=9)


# bfloat16 has no numpy dtype: it crosses the wire as bit patterns and must come back bfloat16.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_mixed_media_group_reaches_the_trainer_with_one_logical_row_per_sample(kafka, dtype):
    topics = unique_topics()
    finalize = ReassemblyConfig(capture_media=True, media_patch_size=P)
    cfg = stage_config(kafka.bootstrap, topics, finalize=finalize)
    setup_topics(cfg, partitions=2)
    spec, staged_media = media_group("vlm", dtype)
    feeder = Feeder(kafka.bootstrap, topics)
    feeder.staged(spec)
    feeder.receipts(spec)
    feeder.flush()
    with RunningStage(cfg) as stage:
        stage.wait(lambda: stage.runtime.stats.total("groups_published") >= 1, 90, "publication")
    with CanonicalReader(kafka.bootstrap, topics=topics, config=CLIENT) as reader:
        (group,) = reader.read(1, timeout=60)
    want = recompute(spec, staged_media, finalize)

    assert [row.valid for row in group.rows] == [True, True, True, False]
    assert group.rows[3].rejection_reason == "capture_poisoned"
    shapes = [{name: list(row.media[name].shape) for name in MEDIA_FIELDS} for row in group.rows]
    assert shapes == [
        {"imgs_sizes": [1, 2], "num_frames": [1], "pixel_values": [2, WIDTH]},
        {"imgs_sizes": [0, 2], "num_frames": [0], "pixel_values": [0, WIDTH]},     # text rollout
        {"imgs_sizes": [5, 2], "num_frames": [2], "pixel_values": [5, WIDTH]},
        {"imgs_sizes": [0, 2], "num_frames": [0], "pixel_values": [0, WIDTH]}]     # placeholder
    ours, theirs = group.tensors(), pad_group(want)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    assert ours["pixel_values"].dtype == dtype
    assert ours["pixel_values"][:, 0].tolist() == [0.5] * 2 + [0.25] * 2 + [0.75] * 3
    assert ours["num_frames"].tolist() == [1, 2, 3]
    assert ours["pixel_values__row_counts"].tolist() == [2, 0, 5, 0]

    (summary,) = [SUMMARY.decode(m.value()) for m in read_all(kafka.bootstrap, topics.finalized_groups)]
    metrics = summary["metrics"]
    assert metrics["finalize/media_row_rate"] == 2 / 3
    assert metrics["finalize/token_in_rate"] == 0.5
    assert metrics["finalize/capture_poisoned_rollouts"] == 1.0
    assert metrics["finalize/terminal_selection_heuristic_count"] == 1.0
    for name, value in want.metrics.items():
        if not name.startswith("row_assembly/"):
            assert metrics[name] == value, name
