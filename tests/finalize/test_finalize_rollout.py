"""finalize_rollout: the golden row and every guard of spec §2, in order, with exact reasons.

Guards that receipt validation normally makes unreachable are reached with
``Record.construct`` receipts, hand-built dict receipts, or rows ``put`` into the in-memory
source with tampered snapshots; the few that no in-memory source can produce use a
``SpySource`` that rewrites the fetched items (a misbehaving TokenSource).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from stage.contract import CallRecord, RolloutReceipt, StagedCallBaseSnapshot
from stage.finalize import (
    InMemoryTokenSource,
    Reassembler,
    ReassemblyConfig,
    StagedRow,
    bucket_of,
)
from tests.finalize.factory import (
    GOLDEN_LOGPROBS,
    GOLDEN_MASK,
    GOLDEN_TOKENS,
    CallSpec,
    SpySource,
    golden_specs,
    stage_rollout,
)


def finalizer(source=None, **config):
    return Reassembler(source if source is not None else InMemoryTokenSource(), ReassemblyConfig(**config))


def assert_rejected(out, reason: str, keys, reward: float = 0.75):
    assert out.valid is False
    assert out.rejection_reason == reason
    assert out.staging_keys == list(keys)
    assert out.reward == reward
    assert len(out.token_ids) == 0 and len(out.token_mask) == 0 and len(out.logprobs) == 0
    assert out.prompt_len == 0
    assert out.routed_experts is None and out.route_plan is None


@pytest.fixture
def golden():
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "r0", golden_specs())
    return source, staged


# --- success ----------------------------------------------------------------------------------


def test_golden_row_reproduced_exactly(golden):
    """§9 rollout_reassembler 1: the worked example, (min_wv, max_wv) = (4, 4)."""
    source, staged = golden
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(), reward=1.0)
    assert out.valid and out.rejection_reason is None
    assert out.token_ids.tolist() == GOLDEN_TOKENS
    assert out.token_mask.tolist() == GOLDEN_MASK
    assert out.logprobs.tolist() == GOLDEN_LOGPROBS
    assert out.prompt_len == 2
    assert [tuple(s) for s in out.link_spans] == [("c1", 2, 2), ("c2", 1, 2)]
    assert (out.min_wv, out.max_wv) == (4, 4)
    assert out.staging_keys == ["r0/c1", "r0/c2"]
    assert out.reward == 1.0
    assert out.route_plan is None and out.routed_experts is None   # router replay off
    assert source.fetches == 1                                       # one batched base read


def test_receipt_object_and_json_text_are_accepted(golden):
    source, staged = golden
    fin = finalizer(source)
    assert fin.finalize_rollout("r0", staged.receipt(), reward=0.0).valid
    assert fin.finalize_rollout("r0", staged.receipt().to_json_text(), reward=0.0).valid


def test_weight_versions_cover_every_manifest_row_including_off_chain():
    source = InMemoryTokenSource()
    specs = [
        CallSpec("c1", None, [1, 2], [3], weight_version=5),
        CallSpec("dead", "c1", [4], [5], weight_version=2),     # abandoned retry, off-chain
        CallSpec("c2", "c1", [6], [7], weight_version=8),
    ]
    staged = stage_rollout(source, "r0", specs, terminal="c2")
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(), reward=0.0)
    assert out.valid
    assert out.token_ids.tolist() == [1, 2, 3, 6, 7]
    assert (out.min_wv, out.max_wv) == (2, 8)
    assert out.staging_keys == ["r0/c1", "r0/dead", "r0/c2"]


# --- guards 1-8 ------------------------------------------------------------------------------


def test_missing_receipt(golden):
    source, _ = golden
    out = finalizer(source).finalize_rollout("r0", None, reward=0.75)
    assert_rejected(out, "missing_receipt", [])
    assert source.fetches == 0


def test_unpoisoned_empty_manifest_is_invalid_receipt(golden):
    source, staged = golden
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(manifest=[]), reward=0.75)
    assert out.rejection_reason.startswith("invalid_receipt:")
    assert "terminal_model_call_id is absent from the receipt manifest" in out.rejection_reason
    assert_rejected(out, out.rejection_reason, [])
    assert source.fetches == 0


@pytest.mark.parametrize("receipt", ["not json", b"\xff", 42, [], {"rollout_id": "r0", "bogus": 1}])
def test_unparsable_receipts_are_invalid_receipt(golden, receipt):
    source, _ = golden
    out = finalizer(source).finalize_rollout("r0", receipt, reward=0.75)
    assert bucket_of(out.rejection_reason) == "invalid_receipt"
    assert_rejected(out, out.rejection_reason, [])


def test_identity_mismatch_carries_all_keys_and_reads_nothing(golden):
    source, staged = golden
    out = finalizer(source).finalize_rollout("other", staged.receipt_json(), reward=0.75)
    assert_rejected(out, "identity_mismatch:r0", ["r0/c1", "r0/c2"])
    assert source.fetches == 0


def test_identity_is_checked_before_failure_and_poison(golden):
    source, staged = golden
    receipt = staged.receipt_json(capture_poisoned=True, failure_reason="boom",
                                  terminal_model_call_id=None, terminal_selection=None)
    out = finalizer(source).finalize_rollout("other", receipt, reward=0.75)
    assert out.rejection_reason == "identity_mismatch:r0"


def test_poisoned_empty_manifest_is_rollout_failed(golden):
    source, staged = golden
    receipt = staged.receipt_json(manifest=[], capture_poisoned=True, failure_reason="missing_terminal_row",
                                  terminal_model_call_id=None, terminal_selection=None)
    out = finalizer(source).finalize_rollout("r0", receipt, reward=0.75)
    assert_rejected(out, "rollout_failed:missing_terminal_row", [])


def test_failure_reason_wins_over_poison_and_carries_keys(golden):
    source, staged = golden
    receipt = staged.receipt_json(capture_poisoned=True, failure_reason="worker_capture_failed")
    out = finalizer(source).finalize_rollout("r0", receipt, reward=0.75)
    assert_rejected(out, "rollout_failed:worker_capture_failed", ["r0/c1", "r0/c2"])
    assert source.fetches == 0


def test_capture_poisoned(golden):
    source, staged = golden
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(capture_poisoned=True), reward=0.75)
    assert_rejected(out, "capture_poisoned", ["r0/c1", "r0/c2"])
    assert source.fetches == 0


def test_duplicate_staging_key_dedupes_keys():
    source = InMemoryTokenSource()
    specs = golden_specs()
    specs[1].staging_key = "r0/c1"          # two manifest rows name one staged row
    staged = stage_rollout(source, "r0", specs)
    assert [r["staging_key"] for r in staged.receipt_json()["manifest"]] == ["r0/c1", "r0/c1"]
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    assert_rejected(out, "duplicate_staging_key", ["r0/c1"])
    assert source.fetches == 0


def test_duplicate_manifest_call_id_via_unvalidated_receipt(golden):
    source, staged = golden
    receipt = staged.receipt()
    first = receipt.manifest[0]
    twin = CallRecord.construct(**{**first.to_json(), "staging_key": "r0/twin"})
    tampered = RolloutReceipt.construct(**{**receipt.to_json(), "manifest": [first, twin]})
    out = finalizer(source).finalize_rollout("r0", tampered, reward=0.75)
    assert_rejected(out, "duplicate_manifest_call_id", ["r0/c1", "r0/twin"])
    assert source.fetches == 0


def test_ghost_keys_are_missing_staging_row_with_quoted_key_error():
    staged = stage_rollout(None, "r0", golden_specs())
    out = finalizer(InMemoryTokenSource()).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    # str(KeyError(msg)) is repr(msg): the message contains ' quotes, so repr uses " quotes.
    assert_rejected(out, "missing_staging_row:\"staged rows missing: requested 2 keys from 'staging', "
                         "got 0 rows\"", ["r0/c1", "r0/c2"])


def test_one_missing_row_is_missing_staging_row():
    source = InMemoryTokenSource("parts")
    specs = golden_specs()
    specs[1].stage = False
    staged = stage_rollout(source, "r0", specs)
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    assert out.rejection_reason == ("missing_staging_row:\"staged rows missing: requested 2 keys from "
                                    "'parts', got 1 rows\"")


def test_staged_row_under_a_foreign_key_is_missing_staging_row(golden):
    source, staged = golden
    source.rows["r0/c2"] = source.rows["r0/c1"]
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    assert_rejected(out, "missing_staging_row:'staged row identity mismatch: requested r0/c2, got r0/c1'",
                    ["r0/c1", "r0/c2"])


@pytest.mark.parametrize("metadata, detail", [
    (b"[1]", "extras_metadata_json must encode an object or null"),
    (b'{"routed_experts_boundary_index":-1}', "malformed routed_experts_boundary_index: -1"),
    # 1,000 levels: json.loads would raise RecursionError (the call digest does not cover this text)
    (b'{"a":' + b"[" * 1000 + b"]" * 1000 + b"}", "extras_metadata_json nests 1001 levels deep, more than 64"),
    (b'{"a":"' + b"[" * 1000 + b'"}', None),   # brackets inside a string are not nesting
])
def test_malformed_staged_row_is_invalid_staging_row(golden, metadata, detail):
    source, staged = golden
    source.put(replace(source.rows["r0/c2"], extras_metadata_json=metadata))
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    if detail is None:   # parses: the untouched digests still bind the row
        assert out.valid, out.rejection_reason
        return
    assert_rejected(out, f"invalid_staging_row:{detail}", ["r0/c1", "r0/c2"])


# --- guards 9-11 -----------------------------------------------------------------------------


def test_swapped_manifest_keys_are_call_id_mismatch():
    """Row c1's manifest entry names c2's staged row (and vice versa): the fetch succeeds,
    each fetched row matches its requested key, but belongs to the other call."""
    source = InMemoryTokenSource()
    specs = golden_specs()
    specs[0].staging_key, specs[1].staging_key = "r0/c2", "r0/c1"
    staged = stage_rollout(source, "r0", specs)
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    assert_rejected(out, "call_id_mismatch:c1", ["r0/c2", "r0/c1"])


def test_fetched_item_with_another_key_is_staging_key_mismatch(golden):
    source, staged = golden

    def rewrite(items):
        return [items[0], replace(items[1], staging_key="r0/elsewhere")]

    out = finalizer(SpySource(source, rewrite)).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    assert_rejected(out, "staging_key_mismatch:c2", ["r0/c1", "r0/c2"])


def test_duplicate_fetched_call_id(golden):
    source, staged = golden

    def rewrite(items):  # a source that answers with one row too many
        return [*items, items[0]]

    out = finalizer(SpySource(source, rewrite)).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    assert_rejected(out, "duplicate_fetched_call_id", ["r0/c1", "r0/c2"])


# --- guard 12: verify_and_linearize ------------------------------------------------------------


def test_zeroed_manifest_digests_are_rebuild_failed_wrong_digest(golden):
    source, staged = golden
    receipt = staged.receipt_json()
    for row in receipt["manifest"]:
        row["digest"] = "0" * 64
    out = finalizer(source).finalize_rollout("r0", receipt, reward=0.75)
    digest = staged.calls["c1"].record.digest
    assert_rejected(out, f"rebuild_failed:wrong_digest: call c1: snapshot {digest!r}, manifest {'0' * 64!r}",
                    ["r0/c1", "r0/c2"])


def test_chain_hash_extending_a_fabricated_parent_is_rebuild_failed():
    """§9 rollout_reassembler 17: c2 is self-consistent (its digest verifies) but its chain
    hash extends a different c1 than the one staged and named by the manifest."""
    source = InMemoryTokenSource()
    real = stage_rollout(None, "r0", golden_specs())
    fake_specs = golden_specs()
    fake_specs[0].generated = [98, 99]          # same lengths, different tokens
    fake = stage_rollout(None, "r0", fake_specs)
    source.stage(fake.calls["c1"].record)
    source.stage(real.calls["c2"].record)
    receipt = fake.receipt_json()
    receipt["manifest"][1] = real.calls["c2"].manifest_row.to_json()
    out = finalizer(source).finalize_rollout("r0", receipt, reward=0.75)
    assert out.rejection_reason == ("rebuild_failed:chain_hash_mismatch: call c2 does not extend its "
                                    "parent's staged chain")
    assert out.staging_keys == ["r0/c1", "r0/c2"]


def test_tampered_snapshot_tokens_are_rebuild_failed(golden):
    """A staged row whose tokens changed but whose digest did not (put unvalidated)."""
    source, staged = golden
    snap = source.rows["r0/c1"].snapshot
    values = {name: getattr(snap, name) for name, _p, _d in StagedCallBaseSnapshot.FIELDS}
    values["token_ids_delta"] = np.array([10, 11, 12, 14], dtype=np.uint64)
    source.put(replace(source.rows["r0/c1"], snapshot=StagedCallBaseSnapshot.construct(**values)))
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    assert out.rejection_reason == "rebuild_failed:corrupt_digest: call c1: staged digest mismatch"


def test_middle_call_without_generation_is_rebuild_failed_empty_generation():
    source = InMemoryTokenSource()
    specs = [CallSpec("c1", None, [1, 2], [3]), CallSpec("c2", "c1", [4, 5], []),
             CallSpec("c3", "c2", [6], [7])]
    staged = stage_rollout(source, "r0", specs)
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    assert out.rejection_reason == "rebuild_failed:empty_generation: call c2 contains no policy-generated token"


def test_rejection_bucket_is_the_prefix():
    assert bucket_of("rebuild_failed:wrong_digest: call c1: x") == "rebuild_failed"
    assert bucket_of("missing_staging_row:'a: b'") == "missing_staging_row"
    assert bucket_of("capture_poisoned") == "capture_poisoned"
    assert bucket_of(None) == "unknown"


def test_finalize_rollout_never_raises_for_a_broken_source(golden):
    """KeyError/ValueError/TypeError from the source become rejections, in that mapping."""
    _, staged = golden

    class Broken:
        def __init__(self, error):
            self.error = error

        def fetch_for_finalization(self, keys, **kw):
            raise self.error

    fin = lambda err: finalizer(Broken(err)).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    assert fin(KeyError("gone")).rejection_reason == "missing_staging_row:'gone'"
    assert fin(TypeError("bad column")).rejection_reason == "invalid_staging_row:bad column"
    assert fin(ValueError("digest does not match staged call contents")).rejection_reason == \
        "invalid_staging_row:digest does not match staged call contents"


def test_staged_row_put_directly_finalizes(golden):
    """StagedRow built by hand (the stage's storage form) is enough for the source."""
    source, staged = golden
    fresh = InMemoryTokenSource()
    for key, row in source.rows.items():
        fresh.put(StagedRow(snapshot=row.snapshot))
    assert fresh.rows.keys() == source.rows.keys()
    assert finalizer(fresh).finalize_rollout("r0", staged.receipt_json(), reward=0.0).valid


def test_token_id_beyond_int64_is_invalid_staging_row():
    """Not a NeMo RL guard: a verified uint64 token id that int64 training tensors cannot hold."""
    source = InMemoryTokenSource()
    staged = stage_rollout(source, "r0", [CallSpec("c1", None, [2**63], [5])])
    out = finalizer(source).finalize_rollout("r0", staged.receipt_json(), reward=0.75)
    assert_rejected(out, "invalid_staging_row:token id exceeds int64 range", ["r0/c1"])
    ok = stage_rollout(source, "r1", [CallSpec("c1", None, [2**63 - 1], [5])])
    assert finalizer(source).finalize_rollout("r1", ok.receipt_json(), reward=0.0).token_ids.tolist() == [2**63 - 1, 5]
