"""A spilled staged call holds what the buffer counts for it: digests, no bytes of its record
(issue 29 item 5); and a second copy of it is a duplicate or a conflict exactly as it would be
were the first copy in memory (item 9)."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from stage.buffer import ADDED, CONFLICT, DUPLICATE, PartitionBuffer, Position
from stage.buffer.spill import SpillStore
from stage.client import RolloutStager
from stage.decode import staged_item
from stage.finalize import StagedMedia, TopK
from stage.runtime.steps.intake import SPILLED_ITEM_BYTES
from stage.wire import AvroCodec, TopicNames, pack_tensor

CODEC = AvroCodec("StagedCall", budget=False)
S = TopicNames().staged_calls
MEDIA_BYTES = 4 << 20


def call_value(rollout: str = "r0", *, media_bytes: int = 0, topk: bool = False) -> dict:
    media = None
    if media_bytes:
        patches = media_bytes // 48               # float32 RGB patches of 2x2 pixels
        media = StagedMedia(imgs=np.full((1, patches, 12), 0.5, np.float32),
                            imgs_sizes=np.array([[2, 2 * patches]], np.int32))
    top = TopK(ids=np.arange(6, dtype=np.int32).reshape(2, 3),
               logprobs=-np.ones((2, 3), np.float32)) if topk else None
    prepared = RolloutStager(None, "g", rollout).prepare(
        "c0", prompt_delta=[1, 2, 3], generated=[4, 5], generated_logprobs=[-0.25, -0.5],
        weight_version=1, media=media, topk=top)
    return prepared.value


def make_buffer(tmp_path) -> PartitionBuffer:
    return PartitionBuffer(0, receipts_topic="r", staged_topic=S, group_timeout_ms=60_000,
                           late_retention_ms=60_000, spill=SpillStore(tmp_path / "p0", max_bytes=1 << 30))


def admit(buffer: PartitionBuffer, value: dict, offset: int, *, spill: bool) -> str:
    """What the intake step does with one record (stage.runtime.steps.intake), spilling it if asked."""
    data = CODEC.encode(value)
    item = staged_item(CODEC.decode(data), Position(S, 0, offset, 0), len(data))
    outcome = buffer.add_staged(item, 0)
    if spill and outcome == ADDED:
        assert buffer.spill_staged(item, data, SPILLED_ITEM_BYTES)
    return outcome


def test_spilled_calls_hold_no_more_than_the_buffer_counts(tmp_path):
    """Ten calls with 4 MiB of media each, all spilled: 40 MiB on disk; before, the duplicate
    fingerprint kept every media column in memory while the buffer counted 3.2 kB a call."""
    buffer = make_buffer(tmp_path)
    values = [call_value(f"r{i}", media_bytes=MEDIA_BYTES, topk=True) for i in range(10)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(10):
            assert admit(buffer, values.pop(), i, spill=True) == ADDED
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert buffer.spilled_bytes > 10 * MEDIA_BYTES
    print(f"\nheld {held / 10:.0f} B a spilled call, counted {buffer.nbytes / 10:.0f} B")
    assert held <= buffer.nbytes + 16 * 1024, (held, buffer.nbytes)


def _tokens(value: dict, change) -> dict:
    """``value`` with its token ids changed by ``change`` (an array -> array), digest kept."""
    out = dict(value)
    ids = value["token_ids_delta"]
    array = change(np.frombuffer(ids["data"], dtype=np.dtype(ids["dtype"])).copy())
    out["token_ids_delta"] = pack_tensor(array.reshape(ids["shape"]))
    return out


def _bump(array):
    array[0] += 1
    return array


SECOND_COPIES = {
    "identical": (lambda v: dict(v), DUPLICATE),
    "ids in another dtype": (lambda v: _tokens(v, lambda a: a.astype(np.uint64 if a.dtype != np.uint64
                                                                        else np.uint32)), DUPLICATE),
    "other token ids, same digest": (lambda v: _tokens(v, _bump), CONFLICT),
    "other media": (lambda v: {**v, "media": {**v["media"], "imgs_sizes": pack_tensor(
        np.array([[2, 4]], np.int32))}}, CONFLICT),
    "other top-k": (lambda v: {**v, "topk": {**v["topk"], "logprobs": pack_tensor(
        np.zeros((2, 3), np.float32))}}, CONFLICT),
    "other extras text": (lambda v: {**v, "extras_metadata_json": '{"a": "' + "x" * 200 + '"}'}, CONFLICT),
}


@pytest.mark.parametrize("spilled", [False, True], ids=["first-in-memory", "first-spilled"])
@pytest.mark.parametrize("copy", sorted(SECOND_COPIES))
def test_a_second_copy_gets_the_same_answer_whether_the_first_is_in_memory_or_spilled(tmp_path, copy, spilled):
    buffer = make_buffer(tmp_path)
    value = call_value(media_bytes=4800, topk=True)
    change, expected = SECOND_COPIES[copy]
    second = change(value)
    assert admit(buffer, value, 0, spill=spilled) == ADDED
    assert admit(buffer, second, 1, spill=False) == expected
    if expected == CONFLICT:
        assert "staged twice with different content" in buffer.last_conflict
