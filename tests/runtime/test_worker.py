"""finalize_and_encode, the stage's path from a taken group to its encoded records, without a
broker: no input halts a partition (rejections with named reasons, N rows still published),
rows over max_record_bytes are split into parts the reader reassembles, and only the causes
stage.finalize.failures lists come back as ``error`` (the runtime halts on those)."""

from __future__ import annotations

import pytest
import torch

from stage.buffer import COMPLETE, PartitionBuffer, Position
from stage.client import GroupAssembler
from stage.config.model import StageConfig
from stage.decode import InputLimits, receipt_item, staged_item
from stage.finalize import GroupFinalizer, InMemoryTokenSource, ReassemblyConfig
from stage.finalize.failures import HALT_CAUSES
from stage.publish.records import STAGING_KEYS_OMITTED
from stage.routes import RouteDimsCache
from stage.runtime.loop import build_codecs
from stage.runtime.task.finalize_task import finalize_and_encode
from stage.wire import DEFAULT_MAX_RECORD_BYTES, AvroCodec
from tests.integration.harness import expected_rows, make_group

RECEIPTS, STAGED = AvroCodec("ReceiptEvent"), AvroCodec("StagedCall")
ROWS, SUMMARY = AvroCodec("CanonicalRow"), AvroCodec("GroupSummary")
NOW = 1_000_000


def taken(spec, staged=None):
    """The group as the runtime hands it to a worker: records decoded from their wire bytes,
    buffered, taken complete."""
    cfg = StageConfig()
    buffer = PartitionBuffer(0, receipts_topic=cfg.topics.receipts, staged_topic=cfg.topics.staged_calls,
                             group_timeout_ms=60_000, late_retention_ms=0)
    for offset, value in enumerate(spec.staged if staged is None else staged):
        data = STAGED.encode(value)
        pos = Position(cfg.topics.staged_calls, 0, offset, NOW)
        assert buffer.add_staged(staged_item(STAGED.decode(data), pos, len(data)), NOW) == "added"
    for offset, value in enumerate(spec.receipts):
        data = RECEIPTS.encode(value)
        pos = Position(cfg.topics.receipts, 0, offset, NOW)
        assert buffer.add_receipt(receipt_item(RECEIPTS.decode(data), pos, len(data)), NOW) == "added"
    ready, _ = buffer.take_ready(NOW)
    assert [why for _, why in ready] == [COMPLETE]
    return ready[0][0]


def run(group, finalize=ReassemblyConfig(), *, codecs=None, max_record_bytes=DEFAULT_MAX_RECORD_BYTES):
    cfg = StageConfig(max_record_bytes=max_record_bytes, finalize=finalize)
    return finalize_and_encode(group, COMPLETE, 0, config=cfg.finalize, dims_cache=RouteDimsCache(),
                               codecs=codecs or build_codecs(cfg), topics=cfg.topics,
                               limits=InputLimits(), now_ms=lambda: NOW)


def published(out, topic_suffix):
    return [value for topic, value in out.records if topic.endswith(topic_suffix)]


def rows_of(out):
    """The published rows through the trainer-side assembler (parts reassembled)."""
    assembler = GroupAssembler()
    groups = [g for blob in published(out, "canonical-rows")
              if (g := assembler.add_row(ROWS.decode(blob), blob)) is not None]
    assert len(groups) == 1, assembler.counts
    return groups[0]


def summary_of(out):
    (blob,) = published(out, "finalized-groups")
    return SUMMARY.decode(blob)


# --- input never halts ----------------------------------------------------------------------


def test_metadata_nested_1000_levels_deep_rejects_its_rollout_and_the_group_is_published():
    """The call digest does not cover extras_metadata_json: every digest stays valid, and
    json.loads raised RecursionError, which halted the partition."""
    spec = make_group("deep", 2, seed=1, routes=None)
    staged = [dict(value) for value in spec.staged]
    staged[1]["extras_metadata_json"] = '{"a":' + "[" * 1000 + "]" * 1000 + "}"
    out = run(taken(spec, staged))
    assert out.error is None
    group = rows_of(out)
    assert group.rejections == [(0, "invalid_staging_row:extras_metadata_json nests 1001 levels deep, "
                                    "more than 64")]
    assert group.valid_rows == 1 and group.group_size == 2


def test_direct_replay_without_routes_or_dims_is_published_as_dropped_not_halted():
    spec = make_group("noroutes", 2, seed=2, routes=None)
    out = run(taken(spec), ReassemblyConfig(router_replay=True))
    assert out.error is None and out.outcome == "dropped"
    summary = summary_of(out)
    assert [r["reason"] for r in summary["rejections"]] == ["route_dims_unknown"] * 2
    assert published(out, "canonical-rows") == []


def test_direct_replay_without_routes_publishes_n_rows_with_the_configured_dims():
    spec = make_group("noroutes", 2, seed=2, routes=None)
    out = run(taken(spec), ReassemblyConfig(router_replay=True, route_layers=4, route_topk=2))
    assert out.error is None and out.outcome == COMPLETE
    group = rows_of(out)
    assert group.valid_rows == 2
    assert all(row.routed_experts.shape[1:] == (4, 2) and (row.routed_experts == -1).all()
               for row in group.rows)


def test_a_row_over_max_record_bytes_is_published_in_parts_and_reassembles_exactly():
    """Direct mode at L=16, K=8 costs 256 route bytes a token (int16): a 12-call rollout of 87
    tokens is 22 KB of routes, over a 16 KiB cap; every staged call is under it. (Before, the
    WireError "over max_record_bytes" halted the partition.)"""
    config = ReassemblyConfig(router_replay=True, route_layers=16, route_topk=8)
    spec = make_group("long", 2, calls=12, seed=3, routes=(16, 8))
    cap = 16 << 10
    out = run(taken(spec), config, max_record_bytes=cap)
    assert out.error is None
    blobs = published(out, "canonical-rows")
    parts = [ROWS.decode(blob)["row_part"] for blob in blobs]
    assert len(blobs) > 2 and all(len(blob) <= cap for blob in blobs)
    assert all(p is not None and p["count"] >= 2 for p in parts)
    group = rows_of(out)
    expected = library_rows(spec, config)
    assert [r.sample_id for r in group.rows] == ["long_g0", "long_g1"] and group.valid_rows == 2
    for row, want in zip(group.rows, expected):
        for name in ("input_ids", "generation_logprobs", "token_mask", "prompt_ids_for_adv",
                     "routed_experts"):
            assert torch.equal(getattr(row, name), getattr(want, name)), name
        assert row.input_lengths == want.input_lengths
    tensors = group.tensors()
    assert tensors["routed_experts"].shape == (2, max(r.input_lengths for r in expected), 16, 8)
    assert summary_of(out)["total_rows"] == 2


def test_a_128k_token_agentic_rollout_with_48x8_routes_is_published_in_parts_at_the_default_cap():
    """Real size, default max_record_bytes (8,000,000, managed Kafka's): 64 calls, ~129k tokens,
    Qwen3-30B-A3B router replay (48 layers x top-8, int16 in the row: ~99 MB of routes, 13 parts)."""
    config = ReassemblyConfig(router_replay=True, route_layers=48, route_topk=8)
    spec = make_group("agentic", 1, calls=64, seed=6, routes=(48, 8), prompt=(2048, 1024),
                      generated=1000)
    out = run(taken(spec), config)
    assert out.error is None
    blobs = published(out, "canonical-rows")
    assert len(blobs) >= 13 and all(len(blob) <= DEFAULT_MAX_RECORD_BYTES for blob in blobs)
    group = rows_of(out)
    (row,), (want,) = group.rows, library_rows(spec, config)
    assert group.valid_rows == 1 and row.input_lengths == want.input_lengths > 128_000
    assert row.routed_experts.shape == (want.input_lengths, 48, 8)
    for name in ("input_ids", "generation_logprobs", "token_mask", "routed_experts"):
        assert torch.equal(getattr(row, name), getattr(want, name)), name


@pytest.mark.parametrize("deferred", [False, True], ids=["direct", "deferred"])
def test_every_output_of_a_frontier_group_fits_the_default_cap(deferred):
    """Issue 26 item 4: at frontier route dims (40 layers x top-22, int16: 1,760 B a token) a
    ~21k-token rollout is ~38 MB of routes; every record the stage writes for its group (rows
    or row parts, plans, the summary, the ledger entry) is at most the default cap."""
    config = ReassemblyConfig(router_replay=True, defer_routes=deferred, route_layers=40, route_topk=22)
    spec = make_group("frontier", 2, calls=16, seed=7, routes=(40, 22), prompt=(2048, 1024), generated=256)
    out = run(taken(spec), config)
    assert out.error is None and out.outcome == COMPLETE
    sizes = {topic.rsplit(".", 1)[-1]: [] for topic, _ in out.records}
    for topic, value in out.records:
        sizes[topic.rsplit(".", 1)[-1]].append(len(value))
    assert all(size <= DEFAULT_MAX_RECORD_BYTES for values in sizes.values() for size in values), sizes
    assert len(out.ledger_value) <= DEFAULT_MAX_RECORD_BYTES
    assert set(sizes) == {"canonical-rows", "finalized-groups", *(["route-plans"] if deferred else [])}
    assert len(sizes["canonical-rows"]) == (2 if deferred else 2 * 5)    # direct: 5 parts a row
    assert rows_of(out).valid_rows == 2


@pytest.mark.parametrize("dims", [(48, 8), (40, 22)], ids=["agentic-moe", "frontier"])
@pytest.mark.parametrize("cap", [DEFAULT_MAX_RECORD_BYTES, 983_040], ids=["managed", "1MiB-broker"])
def test_a_128k_token_direct_row_in_parts_under_each_documented_cap(cap, dims):
    """docs/operations.md's figures: a 130,560-token row with direct routes in row parts under
    the default cap and under the one for a broker at Apache Kafka's 1 MiB default; printed."""
    config = ReassemblyConfig(router_replay=True, route_layers=dims[0], route_topk=dims[1])
    spec = make_group("long", 1, calls=64, seed=6, routes=dims, prompt=(2048, 1024), generated=1000)
    out = run(taken(spec), config, max_record_bytes=cap)
    blobs = published(out, "canonical-rows")
    assert out.error is None and all(len(blob) <= cap for blob in blobs)
    (row,) = rows_of(out).rows
    assert row.input_lengths == 130_560 and row.routed_experts.shape == (130_560, *dims)
    print(f"\n{dims[0]}x{dims[1]} int16, max_record_bytes {cap:,}: {len(blobs)} row parts, "
          f"{sum(map(len, blobs)) / 1e6:.1f} MB")


def library_rows(spec, config):
    """The rows the finalizer library computes from the same records (no wire, no stage)."""
    source = InMemoryTokenSource()
    for record in spec.records.values():
        source.stage(record)
    n = len(spec.receipts)
    return GroupFinalizer(source, config).finalize_group(
        spec.group_id, [r["rollout_id"] for r in spec.receipts], [r["receipt"] for r in spec.receipts],
        [r["reward"] for r in spec.receipts], mask_sample=[False] * n, fallback_weight_version=0,
        prompt_idx=0).rows


def test_rows_that_fit_are_one_record_each_as_before():
    spec = make_group("small", 2, seed=4)
    out = run(taken(spec))
    blobs = published(out, "canonical-rows")
    assert [ROWS.decode(b)["row_part"] for b in blobs] == [None, None]
    assert [ROWS.decode(b) for b in blobs] == [
        {**r, "row_part": None} for r in (ROWS.decode(ROWS.encode(x)) for x in expected_rows(spec, ReassemblyConfig()))]


def test_a_route_plan_over_its_cap_rejects_its_rollout_and_every_row_still_has_a_plan():
    spec = make_group("plans", 2, seed=5)
    cfg = StageConfig(finalize=ReassemblyConfig(router_replay=True, defer_routes=True))
    codecs = build_codecs(cfg)
    codecs["RoutePlan"] = AvroCodec("RoutePlan", max_record_bytes=400)   # a 3-span plan is bigger
    out = run(taken(spec), cfg.finalize, codecs=codecs)
    assert out.error is None
    group = rows_of(out)
    assert group.valid_rows == 0
    assert all(reason.startswith("unpublishable_record:RoutePlan:") and "max_record_bytes=400" in reason
               for _, reason in group.rejections)
    assert len(published(out, "route-plans")) == 2


def test_a_summary_over_its_cap_is_compacted_not_halted():
    spec = make_group("summary", 3, seed=6)
    codecs = build_codecs(StageConfig())
    full = run(taken(spec))
    size = len(published(full, "finalized-groups")[0])
    codecs["GroupSummary"] = AvroCodec("GroupSummary", max_record_bytes=size - 1)
    out = run(taken(spec), codecs=codecs)
    assert out.error is None
    summary = summary_of(out)
    assert summary["staging_keys"] == [] and summary["metrics"][STAGING_KEYS_OMITTED] == 9.0
    assert len(published(out, "canonical-rows")) == 3


def test_an_unexpected_error_in_the_group_step_rejects_every_row_and_publishes_n(monkeypatch):
    spec = make_group("boom", 2, seed=7)
    calls = []

    def attach(self, out_rows, rows):
        calls.append(len(rows))
        if len(calls) == 1:
            raise ZeroDivisionError("an input the guards did not foresee")

    monkeypatch.setattr(GroupFinalizer, "_attach_group_media", attach)
    out = run(taken(spec))
    assert out.error is None and calls == [2, 2]
    group = rows_of(out)
    assert group.rejections == [(i, "group_finalize_error:ZeroDivisionError: an input the guards did "
                                    "not foresee") for i in range(2)]


def test_an_unexpected_error_in_one_rollout_rejects_that_rollout_alone(monkeypatch):
    import stage.finalize.rollout as rollout

    spec = make_group("one", 3, seed=8)
    real = rollout.verify_and_linearize

    def verify(parsed, *args, **kwargs):
        if parsed.rollout_id.endswith("-r1"):
            raise IndexError("unforeseen")
        return real(parsed, *args, **kwargs)

    monkeypatch.setattr(rollout, "verify_and_linearize", verify)
    out = run(taken(spec))
    assert out.error is None
    assert rows_of(out).rejections == [(1, "finalize_error:IndexError: unforeseen")]


# --- the halt causes ------------------------------------------------------------------------


@pytest.mark.parametrize("error, cause", [
    (MemoryError(), "host_memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
     "host_memory"),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "device"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "device"),
])
def test_system_failures_halt_with_their_cause_named(monkeypatch, error, cause):
    def fail(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(GroupFinalizer, "_tensorize", fail)
    out = run(taken(make_group("sys", 2, seed=9)))
    assert out.error.startswith(f"finalize_error: {cause}: {type(error).__name__}")
    assert out.records == [] and out.ledger_value == b""


def test_system_failures_inside_a_rollout_are_not_swallowed_as_rejections(monkeypatch):
    import stage.finalize.rollout as rollout

    def verify(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(rollout, "verify_and_linearize", verify)
    out = run(taken(make_group("sys", 2, seed=10)))
    assert out.error.startswith("finalize_error: device: OutOfMemoryError")


def test_a_group_not_even_publishable_as_placeholders_halts_as_unpublishable(monkeypatch):
    codecs = build_codecs(StageConfig())
    codecs["LedgerEntry"] = AvroCodec("LedgerEntry", max_record_bytes=10)
    out = run(taken(make_group("stuck", 2, seed=11)), codecs=codecs)
    assert out.error.startswith("finalize_error: unpublishable: WireError")


def test_the_halt_causes_are_the_ones_the_design_doc_lists():
    from pathlib import Path

    design = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    section = design.split("## When a partition halts", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("|")[1].strip().strip("`") for line in section.splitlines()
              if line.startswith("| `")}
    assert listed == {cause.name for cause in HALT_CAUSES}
