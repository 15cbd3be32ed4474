"""DeferredRouteFetcher on spans staged by reference, without a broker: a reference is checked
completely before anything is fetched or allocated (invalid_reference), chunks join into the
call's routes whatever order they arrive in, a chunk of another call is a mismatch, and a
corrupt chunk is found by its SHA-256 once the extras digest fails."""

import copy

import numpy as np

from stage.client import staged_call_from_record
from stage.client.route_fetch import DeferredRouteFetcher, RouteChunkError, _Joining, ref_key
from stage.routes.fragment import verify_route_fragment_integrity
from stage.wire import AvroCodec, unpack_tensor
from stage.workload import WorkloadConfig, generate
from tests.routes.by_reference import offline

L, K = 3, 2
CHUNKS = AvroCodec("RouteChunk")


def _fetcher(**kwargs) -> DeferredRouteFetcher:
    return DeferredRouteFetcher("127.0.0.1:1", dims=(L, K), **kwargs)   # never contacted


def _span(chunk_bytes=40):
    wl = generate(WorkloadConfig(groups=1, group_size=1, turns=(2, 2), seed=5, route_layers=L, route_topk=K))
    inline = staged_call_from_record("g", wl.rollouts[0].calls[-1].record)
    value, chunks = offline(inline, chunk_bytes=chunk_bytes)
    span = {"staging_key": value["staging_key"], "carry_len": 0, "generation_len": value["delta_len"],
            "staged_route_len": value["delta_len"], "extras_digest_version": 1,
            "extras_digest": value["extras_digest"], "boundary_token_index": None,
            "repair_previous_token": False, "fragment": None,
            "chunks": {"reference": value["routes_ref"], "route_encoding": value["route_encoding"],
                       "extras_metadata_json": value["extras_metadata_json"],
                       "boundary": value["routed_experts_boundary"]}}
    plan = {"group_id": "g", "sample_id": "g_g0", "row_index": 0, "schema_version": 3,
            "staging_partition": "rollouts.staged-calls", "spans": [span],
            "cleanup_staging_keys": [value["staging_key"]], "expected_token_length": value["delta_len"]}
    return plan, span, inline, chunks


def _bad(mutate):
    plan, span, _inline, _chunks = _span()
    plan = copy.deepcopy(plan)
    mutate(plan["spans"][0])
    return plan


def test_an_unusable_reference_fails_its_row_before_anything_is_fetched():
    cases = [
        lambda s: s["chunks"]["reference"].update(shape=[s["staged_route_len"] + 1, L, K]),
        lambda s: s["chunks"]["reference"]["chunks"][0].update(length=10**9),
        lambda s: s["chunks"].update(route_encoding=0),
        lambda s: s["chunks"].update(boundary={"dtype": "int8", "shape": [2, L, K], "data": bytes(2 * L * K)}),
        lambda s: s.update(fragment={"topic": "t", "partition": 0, "offset": 1}),
    ]
    fetcher = _fetcher()
    for mutate in cases:
        out = fetcher.routes(_bad(mutate))
        assert out.eq(-1).all()
    assert fetcher.failures == {"invalid_reference": len(cases)}
    assert not fetcher._reached and fetcher.chunks_fetched == 0      # no broker was asked
    plan, _span_, _inline, _chunks = _span()
    small = _fetcher(max_fragment_bytes=10)
    assert small.routes(plan).eq(-1).all() and small.failures == {"invalid_reference": 1}


def _join(span, chunk_values, order):
    fetcher = _fetcher()
    plan = {"group_id": "g"}
    want = fetcher.want_of(plan, span)
    key = ref_key(span)
    joins, fresh = {key: _Joining(want)}, {}
    seen = []
    for index in order:
        fetcher._take_chunk(CHUNKS.encode(chunk_values[index]), f"@{index}", [(key, index)], joins, fresh,
                            lambda k, entry: seen.append(k))
    return fetcher, fresh.get(key), seen


def test_chunks_join_into_the_calls_routes_in_any_arrival_order():
    plan, span, inline, chunks = _span()
    assert len(chunks) >= 3
    want = unpack_tensor(inline["routed_experts"])
    for order in (range(len(chunks)), reversed(range(len(chunks)))):
        fetcher, entry, seen = _join(span, chunks, list(order))
        assert seen == [ref_key(span)]                        # handed over once, when complete
        assert np.array_equal(entry.fragment.routes.numpy(), want)
        assert str(entry.fragment.routes.dtype) == f"torch.{inline['routed_experts']['dtype']}"
        assert verify_route_fragment_integrity(type("S", (), {"extras_digest_version": 1,
                                                              "extras_digest": span["extras_digest"]}),
                                               entry.fragment)
        assert fetcher.corrupt_chunks(entry) == []
    # one chunk: its bytes are the routes, no join
    _plan, one, inline1, chunks1 = _span(chunk_bytes=1 << 20)
    assert len(chunks1) == 1
    _fetcher_, entry, _ = _join(one, chunks1, [0])
    assert np.array_equal(entry.fragment.routes.numpy(), unpack_tensor(inline1["routed_experts"]))


def test_a_chunk_of_another_call_or_index_is_a_mismatch_and_a_flipped_byte_is_named():
    plan, span, _inline, chunks = _span()
    other = dict(chunks[1], staging_key="g-r9/c9")
    _f, entry, seen = _join(span, [chunks[0], other, *chunks[2:]], range(len(chunks)))
    assert isinstance(entry, RouteChunkError) and entry.reason == "chunk_mismatch" and seen == []
    assert "belongs to 'g'/'g-r9/c9'" in str(entry)
    swapped = [chunks[1], chunks[0], *chunks[2:]]
    _f, entry, _ = _join(span, swapped, range(len(chunks)))
    assert isinstance(entry, RouteChunkError) and entry.reason == "chunk_mismatch"

    data = bytearray(chunks[2]["data"])
    data[0] ^= 0x40
    flipped = [*chunks[:2], dict(chunks[2], data=bytes(data)), *chunks[3:]]
    fetcher, entry, _ = _join(span, flipped, range(len(chunks)))
    assert not isinstance(entry, Exception)     # the declared digest is intact: joined
    offset = span["chunks"]["reference"]["chunks"][2]["offset"]
    assert fetcher.corrupt_chunks(entry) == [f"chunk 2 at rollouts.staged-routes[0]@{offset}"]
    failure, _fragments = fetcher._fragments_for(plan, {ref_key(span): entry})
    assert failure.startswith("chunk_corrupt:") and f"@{offset}" in failure


def test_the_plain_chunk_reader_agrees_with_the_codec_and_refuses_what_it_refuses():
    from stage.client.route_fetch import plain_route_chunk
    _plan, _span_, _inline, chunks = _span()
    for chunk in chunks + [dict(chunks[0], index=-3, count=2**31 - 1, group_id="é" * 70)]:
        blob = CHUNKS.encode(chunk)
        fast = plain_route_chunk(blob)
        assert {**fast, "data": bytes(fast["data"])} == CHUNKS.decode(blob)
        assert isinstance(fast["data"], memoryview) and fast["data"].obj is blob   # a view, no copy
    blob = CHUNKS.encode(chunks[0])
    for bad in (blob[:-1], blob + b"\0", b"\x01", b"", b"\xff" * 12, blob[:2] + b"\xff\xfe" + blob[4:]):
        assert plain_route_chunk(bad) is None
