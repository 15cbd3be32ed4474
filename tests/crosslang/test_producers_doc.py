"""docs/producers.md states values a producer in another language builds against: its worked
example (section 8) and its murmur2 table (section 1) must be what the stage's own code computes
and accepts."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from stage.client import RolloutStager, staged_call_from_record
from stage.contract.digests import _encode_extras
from stage.finalize import GroupFinalizer, InMemoryTokenSource, ReassemblyConfig
from stage.publish.records import row_record
from stage.wire import unpack_tensor
from stage.wire.partitioner import murmur2, partition_for

DOC = Path(__file__).resolve().parents[2] / "docs" / "producers.md"


def worked_example() -> dict[str, str]:
    block = DOC.read_text().split("# worked example", 1)[1].split("```", 1)[0]
    return dict(line.split(" = ", 1) for line in block.splitlines()[1:] if line)


def stage_example() -> RolloutStager:
    """The rollout of section 8, as its prose describes it, through the stage's own SDK."""
    stager = RolloutStager(None, "g-doc", "g-doc-r0")
    routes = np.array([[[1, 2]], [[3, 4]], [[5, 6]], [[7, 8]], [[-1, -1]]], dtype=np.int8)
    stager.prepare("c0", prompt_delta=[1, 2, 3], generated=[4, 5], generated_logprobs=[-0.5, -0.25],
                   weight_version=7, routed_experts=routes, route_dtype="int8")
    routes = np.array([[[9, 10]], [[11, 12]], [[-1, -1]]], dtype=np.int8)
    stager.prepare("c1", parent_call_id="c0", prompt_delta=[6], generated=[7, 8],
                   generated_logprobs=[-1.0, -0.125], weight_version=8, routed_experts=routes,
                   routed_experts_boundary=np.array([[[13, 14]]], dtype=np.int8), route_dtype="int8")
    return stager


def test_the_worked_example_is_what_the_stage_computes():
    stager = stage_example()
    computed = {}
    for call_id, call in stager.builder.calls.items():
        record, extras = call.record, call.record.extras
        out = [b"\x01"]
        _encode_extras(extras, out)
        computed.update({f"{call_id}.{name}": str(value) for name, value in (
            ("prev_len", record.prev_len), ("delta_len", record.delta_len), ("cum_len", record.cum_len),
            ("extras_digest", record.extras_digest), ("chain_hash", record.chain_hash),
            ("cumulative_hash", record.cumulative_hash), ("digest", record.digest),
            ("extras_payload", b"".join(out).hex()))})
        computed.update({f"{call_id}.{key}": value for key, value in extras.items()
                         if key in ("routed_experts", "routed_experts_boundary")})
        value = staged_call_from_record("g-doc", record)          # the wire value the SDK sends
        computed[f"{call_id}.extras_metadata_json"] = value["extras_metadata_json"]
    assert worked_example() == computed


def test_the_worked_example_row_is_what_the_doc_says():
    """Verified and assembled by the stage's finalizer: the boundary repairs index 4."""
    stager = stage_example()
    source = InMemoryTokenSource()
    for call in stager.builder.calls.values():
        source.stage(call.record)
    group = GroupFinalizer(source, ReassemblyConfig(router_replay=True)).finalize_group(
        "g-doc", ["g-doc-r0"], [stager.receipt("c1").to_json()], [1.0], mask_sample=[False],
        fallback_weight_version=0, prompt_idx=0)
    row = row_record(group.rows[0])
    assert row["valid"], row["rejection_reason"]
    assert unpack_tensor(row["input_ids"]).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert unpack_tensor(row["routed_experts"])[:, 0, :].tolist() == [
        [1, 2], [3, 4], [5, 6], [7, 8], [13, 14], [9, 10], [11, 12], [-1, -1]]
    text = " ".join(DOC.read_text().split())
    assert "`routed_experts` `[[1,2],[3,4],[5,6],[7,8],[13,14],[9,10],[11,12],[-1,-1]]`" in text


def test_the_murmur2_table_is_the_contracts_partitioner():
    rows = re.findall(r"^\| `([^`]*)`(?: \(bytes [^)]*\))? \| (-?\d+) \| `([0-9a-f]{8})` \| (\d+) \| (\d+) \|$",
                      DOC.read_text(), flags=re.M)
    assert len(rows) == 8
    for key, signed, unsigned, of3, of12 in rows:
        data = key.encode()
        assert murmur2(data) == int(signed) and murmur2(data) & 0xFFFFFFFF == int(unsigned, 16)
        assert (partition_for(data, 3), partition_for(data, 12)) == (int(of3), int(of12))
