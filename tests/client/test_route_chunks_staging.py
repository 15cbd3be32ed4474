"""stage.client.route_staging, without Kafka: a chunk record encoded from a view is the codec's
encoding of the full value, the size a reference adds to a staged call is bounded as the
producer's pre-produce check assumes, and what cannot be chunked is refused with the reason."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from stage.client.route_staging import ROUTE_CHUNK_ROOM, ChunkEncoder, RoutePayload, reference_bytes, route_chunk_size
from stage.client import RolloutStager
from stage.staging.route_refs import DEFAULT_ROUTE_CHUNK_BYTES, MAX_ROUTE_CHUNKS
from stage.wire import AvroCodec, WireError


def test_a_chunk_encoded_from_a_view_is_the_codecs_encoding_of_the_full_value():
    codec = AvroCodec("RouteChunk")
    encoder = ChunkEncoder(codec)
    payload = np.arange(300_000, dtype=np.int16).tobytes()
    view = memoryview(payload)[1000:201_000]
    record, digest = encoder.encode("g-é", "g-é-r0/c3", 2, 5, view)
    assert digest == hashlib.sha256(payload[1000:201_000]).hexdigest()
    want = {"group_id": "g-é", "staging_key": "g-é-r0/c3", "index": 2, "count": 5, "sha256": digest,
            "data": payload[1000:201_000]}
    assert record == codec.encode(want) and codec.decode(record) == want
    small = AvroCodec("RouteChunk", max_record_bytes=100_000)
    with pytest.raises(WireError, match="over max_record_bytes=100000: lower route_chunk_bytes"):
        ChunkEncoder(small).encode("g", "g-r0/c0", 0, 1, view)
    with pytest.raises(ValueError, match="RouteChunk codec"):
        ChunkEncoder(AvroCodec("StagedCall"))


def test_a_reference_adds_at_most_reference_bytes_to_its_call():
    codec = AvroCodec("StagedCall")
    call = RolloutStager(None, "g", "r").prepare(
        "c0", prompt_delta=[1, 2], generated=[3], generated_logprobs=[-0.5], weight_version=0,
        routed_experts=np.zeros((3, 2, 2), np.int16)).value
    call = {**call, "routed_experts": None, "routes_ref": None}
    bare = len(codec.encode(call))
    for chunks in (1, 7, MAX_ROUTE_CHUNKS):
        topic = "a-long-prefix-of-some-deployment." * 3 + "rollouts.staged-routes"
        ref = {"topic": topic, "partition": 2 ** 31 - 1, "dtype": "int32", "shape": [2 ** 62, 2 ** 62, 2 ** 62],
               "chunks": [{"offset": 2 ** 63 - 1 - chunks + i, "length": 2 ** 62, "sha256": "f" * 64}
                          for i in range(chunks)]}
        grown = len(codec.encode({**call, "routes_ref": ref})) - bare
        assert 0 < grown <= reference_bytes(topic, chunks)


def test_chunk_sizes_leave_room_under_the_record_cap():
    assert route_chunk_size(64 << 20) == DEFAULT_ROUTE_CHUNK_BYTES
    assert route_chunk_size(1 << 20) == (1 << 20) - ROUTE_CHUNK_ROOM
    assert route_chunk_size(1 << 20, 1000) == 1000
    with pytest.raises(ValueError, match="must be <= 983040"):
        route_chunk_size(1 << 20, 983_041)
    with pytest.raises(ValueError, match="leaves no room"):
        route_chunk_size(ROUTE_CHUNK_ROOM)
    with pytest.raises(ValueError, match="positive int"):
        route_chunk_size(1 << 20, 0)


def test_routes_that_cannot_go_by_reference_are_refused_with_the_reason():
    good = {"dtype": "int16", "shape": [4, 2, 2], "data": bytes(32)}
    assert RoutePayload.of(good, 4).data.nbytes == 32
    for tensor, delta_len, words in (({**good, "dtype": "uint8"}, 4, "dtype must be one of"),
                                     (good, 5, r"\[delta_len=5, L, K\]"),
                                     ({**good, "shape": [4, 2]}, 4, "shape must be"),
                                     ({**good, "data": bytes(31)}, 4, "holds 31 bytes")):
        with pytest.raises(WireError, match=words):
            RoutePayload.of(tensor, delta_len)
    many = RoutePayload.of({"dtype": "int8", "shape": [MAX_ROUTE_CHUNKS + 1, 1, 1],
                            "data": bytes(MAX_ROUTE_CHUNKS + 1)}, MAX_ROUTE_CHUNKS + 1)
    assert len(many.pieces(2)) == MAX_ROUTE_CHUNKS // 2 + 1
    with pytest.raises(WireError, match="raise route_chunk_bytes"):
        many.pieces(1)


def _large_routed_call(rng, tokens=2048):
    """A call whose 48x8 int16 routes (1.5 MiB) are over ChunkHasher.MIN_BYTES."""
    half = tokens // 2
    return dict(prompt_delta=rng.integers(0, 999, half), generated=rng.integers(0, 999, tokens - half),
                generated_logprobs=-rng.random(tokens - half), weight_version=1,
                routed_experts=rng.integers(-1, 128, (tokens, 48, 8)).astype(np.int16))


def test_stage_hashes_the_chunks_on_the_helper_thread_and_they_carry_the_right_digests(monkeypatch):
    import threading

    from stage.client import StagingProducer
    from stage.client import route_staging
    from tests.client.fakes import FakeProducer

    threads = []
    real = route_staging.chunk_sha256
    monkeypatch.setattr(route_staging, "chunk_sha256",
                        lambda data: threads.append(threading.current_thread().name) or real(data))
    fake = FakeProducer()
    producer = StagingProducer(producer=fake, route_chunk_bytes=600_000)
    stager = RolloutStager(producer, "g", "r")
    kwargs = _large_routed_call(np.random.default_rng(3))
    row = stager.stage("c0", **kwargs)
    producer.close()
    assert threads and all(name.startswith("route-chunk-sha256") for name in threads)   # not the caller
    chunk_codec, staged_codec = AvroCodec("RouteChunk"), AvroCodec("StagedCall")
    chunks = [chunk_codec.decode(m.value()) for m in fake.records if m.topic() == producer.topics.staged_routes]
    call = staged_codec.decode(next(m.value() for m in fake.records if m.topic() == producer.topics.staged_calls))
    raw = kwargs["routed_experts"].astype("<i2").tobytes()
    assert [len(c["data"]) for c in chunks] == [600_000, 600_000, len(raw) - 1_200_000]
    assert b"".join(c["data"] for c in chunks) == raw
    assert [c["sha256"] for c in chunks] == [hashlib.sha256(c["data"]).hexdigest() for c in chunks] \
        == [r["sha256"] for r in call["routes_ref"]["chunks"]]
    assert call["extras_digest"] == row.extras_digest


def test_while_the_helper_is_busy_or_the_routes_are_small_the_caller_hashes():
    import threading

    from stage.client.route_staging import ChunkHasher

    hasher = ChunkHasher()
    payload = np.arange(400_000, dtype=np.int16).tobytes()
    want = [hashlib.sha256(payload[i:i + 300_000]).hexdigest() for i in range(0, len(payload), 300_000)]
    assert hasher.start(payload, 300_000)() == want             # on the helper
    hasher._busy.acquire()                                     # as if another call's chunks were hashing
    try:
        digests = hasher.start(payload, 300_000)
        assert hasher._pool._work_queue.qsize() == 0               # nothing handed over, nothing queued
        assert digests() == want
    finally:
        hasher._busy.release()
    small = payload[:ChunkHasher.MIN_BYTES - 2]
    assert hasher.start(small, 300_000)() == [hashlib.sha256(small).hexdigest()]
    hasher.close()
    assert hasher.start(payload, 300_000)() == want              # a closed hasher starts a new helper
    hasher.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("route-chunk-sha256")]
