"""Staged calls moved to routes by reference, as a producer stages them (claim-check order:
the chunks first, then the call naming them by offset): used by the direct-mode tests."""

from __future__ import annotations

from stage.staging.route_refs import chunk_value, split_payload


def split_call(value: dict, chunk_bytes: int) -> tuple[list[dict], callable]:
    """A StagedCall value with inline routes -> (its RouteChunk values, ``reference(topic,
    partition, offsets)`` -> the StagedCall value naming them at those offsets)."""
    tensor = value["routed_experts"]
    pieces = split_payload(tensor["data"], chunk_bytes)
    chunks = [chunk_value(value["group_id"], value["staging_key"], i, len(pieces), piece)
              for i, piece in enumerate(pieces)]

    def reference(topic: str, partition: int, offsets) -> dict:
        ref = {"topic": topic, "partition": partition, "dtype": tensor["dtype"], "shape": list(tensor["shape"]),
               "chunks": [{"offset": o, "length": len(c["data"]), "sha256": c["sha256"]}
                          for o, c in zip(offsets, chunks)]}
        return {**value, "routed_experts": None, "routes_ref": ref}

    return chunks, reference
