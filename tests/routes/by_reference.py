"""Stage calls' routes by reference in tests: RouteChunk records on the route topic first, then
the StagedCall naming them (claim-check order), built on stage.staging.route_refs and
stage.client.records only (no producer SDK)."""

from __future__ import annotations

import copy

from stage.staging.route_refs import ChunkRef, RouteReference, chunk_value, split_payload
from stage.wire import STAGED_ROUTES_TOPIC


def route_chunks(value: dict, chunk_bytes: int) -> list[dict]:
    """The RouteChunk values of an inline StagedCall value's routes, in payload order."""
    data = value["routed_experts"]["data"]
    pieces = split_payload(data, chunk_bytes)
    return [chunk_value(value["group_id"], value["staging_key"], i, len(pieces), piece)
            for i, piece in enumerate(pieces)]


def reference(value: dict, chunks: list[dict], offsets: list[int], *, partition: int,
              topic: str = STAGED_ROUTES_TOPIC) -> RouteReference:
    routes = value["routed_experts"]
    return RouteReference(topic, partition, routes["dtype"], tuple(routes["shape"]),
                          tuple(ChunkRef(o, len(c["data"]), c["sha256"]) for o, c in zip(offsets, chunks)))


def by_reference(value: dict, ref: RouteReference | dict) -> dict:
    """The StagedCall value with its routes replaced by ``ref`` (the boundary stays inline)."""
    out = copy.copy(value)
    out["routed_experts"] = None
    out["routes_ref"] = ref.to_value() if isinstance(ref, RouteReference) else ref
    return out


def offline(value: dict, *, partition: int = 0, chunk_bytes: int = 64, first_offset: int = 10,
            topic: str = STAGED_ROUTES_TOPIC) -> tuple[dict, list[dict]]:
    """(by-reference value, its chunks) as if the chunks had landed at consecutive offsets."""
    chunks = route_chunks(value, chunk_bytes)
    offsets = list(range(first_offset, first_offset + len(chunks)))
    return by_reference(value, reference(value, chunks, offsets, partition=partition, topic=topic)), chunks


class ChunkWriter:
    """Produces chunks to the route topic and returns where each landed (claim-check: the
    caller produces the StagedCall only after this returns)."""

    def __init__(self, producer, topic: str, codec) -> None:
        self.producer, self.topic, self.codec = producer, topic, codec

    def write(self, group_id: str, chunks: list[dict]) -> list[tuple[int, int]]:
        landed: list = [None] * len(chunks)

        def done(index):
            def on_delivery(err, msg):
                assert err is None, err
                landed[index] = (msg.partition(), msg.offset())
            return on_delivery

        for i, chunk in enumerate(chunks):
            self.producer.produce(self.topic, key=group_id.encode(), value=self.codec.encode(chunk),
                                  on_delivery=done(i))
        assert self.producer.flush(30) == 0
        return landed

    def stage(self, value: dict, chunk_bytes: int) -> dict:
        """Write ``value``'s routes as chunks; the by-reference StagedCall value naming them."""
        chunks = route_chunks(value, chunk_bytes)
        landed = self.write(value["group_id"], chunks)
        partitions = {p for p, _ in landed}
        assert len(partitions) == 1, landed
        return by_reference(value, reference(value, chunks, [o for _, o in landed],
                                             partition=partitions.pop(), topic=self.topic))
