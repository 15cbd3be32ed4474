"""Property tests of verify_and_linearize (spec section 4) over random valid rollouts.

Valid rollouts must linearize to a row recomputed here from the builder's *inputs*; any
single tampering must be rejected with the exact code, class and (for most) message.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stage.contract import (
    CallRecord,
    RebuildError,
    ReceiptVerificationError,
    RolloutReceipt,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    verify_and_linearize,
)
from stage.contract.producer import RolloutBuilder

from . import reference as ref
from .strategies import (
    U64_MAX,
    fields_of,
    replace,
    rollouts,
    with_list_columns,
)

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
MORE = settings(SETTINGS, max_examples=120)

# ``None``: hypothesis picks numpy columns (the verifier's packed path) or Python lists (the
# per-row path) for every example.
any_rollout = rollouts(list_columns=None)
multi_call = rollouts(min_calls=2, list_columns=None)
with_off_chain = rollouts(min_off_chain=1, list_columns=None)
long_chain = rollouts(min_chain=2, list_columns=None)


def H(tag: str) -> str:
    return hashlib.sha256(tag.encode()).hexdigest()


# --- expected row, recomputed from the builder's inputs ------------------------------------

def expected_row(r) -> dict:
    token_ids, mask, logprobs, spans, links, commitments = [], [], [], [], [], []
    for call_id in r.chain:
        c = r.calls[call_id]
        start = len(token_ids)
        token_ids += c.prompt_delta + c.generated
        mask += [0.0] * len(c.prompt_delta) + [1.0] * len(c.generated)
        logprobs += [0.0] * len(c.prompt_delta) + list(c.logprobs)
        spans.append([call_id, start, len(token_ids), c.weight_version])
        links.append([call_id, len(c.prompt_delta), len(c.generated)])
        commitments.append([call_id, 1, ref.extras_digest(c.extras)])
    return {
        "rollout_id": r.rollout_id,
        "token_ids": token_ids,
        "token_mask": mask,
        "logprobs": logprobs,
        "model_call_ids": list(r.chain),
        "prompt_len": len(r.calls[r.chain[0]].prompt_delta),
        "weight_versions": [r.calls[c].weight_version for c in r.chain],
        "weight_version_spans": spans,
        "link_spans": links,
        "extras_commitments": commitments,
    }


def bits(values) -> list[bytes]:
    """Exact doubles, sign of zero included."""
    return [struct.pack(">d", float(v)) for v in values]


def assert_row(row, expected: dict) -> None:
    got = row.to_json()
    assert bits(got.pop("logprobs")) == bits(expected["logprobs"])
    assert bits(got.pop("token_mask")) == bits(expected["token_mask"])
    assert got == {k: v for k, v in expected.items() if k not in ("logprobs", "token_mask")}
    assert row.token_ids.dtype == np.uint64
    assert row.call_ids == expected["model_call_ids"]


def expect_error(receipt, snapshots, cls, code, message=None):
    with pytest.raises(ReceiptVerificationError) as info:
        verify_and_linearize(receipt, snapshots)
    error = info.value
    assert type(error) is cls, f"{type(error).__name__}: {error}"
    assert error.code == code, str(error)
    assert str(error) == f"{code}: {error.detail}"
    if message is not None:
        assert str(error) == message
    return error


# --- record surgery --------------------------------------------------------------------------

def is_list_snapshot(s) -> bool:
    return isinstance(s.token_ids_delta, list)


def restage(snapshot, **changes):
    """Re-stage a snapshot with changed fields and a *consistent* digest (computed by the
    reference encoder); the result passes model validation."""
    values = {**fields_of(snapshot), **changes}
    values.pop("digest")
    plain = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in values.items()}
    out = StagedCallBaseSnapshot(**values, digest=ref.staging_digest(**plain))
    return with_list_columns(out) if is_list_snapshot(snapshot) else out


def sync_row(receipt, index: int, snapshot):
    """A validated receipt whose manifest row ``index`` matches the (re-staged) snapshot."""
    manifest = [CallRecord(**fields_of(row)) for row in receipt.manifest]
    row = fields_of(manifest[index])
    for name in ("parent_call_id", "mode", "prev_len", "delta_len", "cum_len", "weight_version",
                 "digest", "extras_digest", "chain_hash", "cumulative_hash"):
        row[name] = getattr(snapshot, name)
    manifest[index] = CallRecord(**row)
    return RolloutReceipt(**{**fields_of(receipt), "manifest": manifest})


def with_snapshot(snapshots, index: int, snapshot) -> list:
    out = list(snapshots)
    out[index] = snapshot
    return out


def column(snapshot, name) -> list:
    value = getattr(snapshot, name)
    return value.tolist() if isinstance(value, np.ndarray) else list(value)


def set_column(snapshot, name, values):
    """A construct-copy with one column replaced, in the snapshot's own representation."""
    if is_list_snapshot(snapshot):
        return replace(snapshot, **{name: list(values)})
    dtype = np.uint64 if name == "token_ids_delta" else np.float64
    return replace(snapshot, **{name: np.array(values, dtype=dtype)})


def fresh_id(r) -> str:
    return max(r.order, key=len) + "~fresh"


# --- valid rollouts ----------------------------------------------------------------------------

@MORE
@given(any_rollout)
def test_valid_rollout_linearizes_to_the_independent_recomputation(r):
    expected = expected_row(r)
    row = verify_and_linearize(r.receipt, r.snapshots)
    assert_row(row, expected)
    # Builder cross-checks against the reference encoders: every staged digest (on and off
    # the chain), the terminal chain's running chain hash and the terminal's cumulative hash.
    for snapshot in r.snapshots:
        plain = {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                 for k, v in fields_of(snapshot).items()}
        assert snapshot.digest == ref.staging_digest(**plain)
    running = None
    for call_id in r.chain:
        running = ref.chain_hash(running, r.calls[call_id].delta)
        assert r.receipt.manifest[r.index(call_id)].chain_hash == running
    terminal = r.receipt.manifest[r.index(r.terminal)]
    assert terminal.cumulative_hash == ref.hash_token_ids(expected["token_ids"])
    # weight-version spans tile the row; the prompt is the root's carry only
    spans = row.weight_version_spans
    assert spans[0].start == 0 and spans[-1].end == len(row.token_ids)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    assert row.prompt_len == row.link_spans[0][1]


@SETTINGS
@given(any_rollout)
def test_representation_and_wire_round_trip_do_not_change_the_row(r):
    expected = expected_row(r)
    # numpy columns (packed path) and Python lists (per-row path)
    assert_row(verify_and_linearize(r.receipt, [with_list_columns(s) for s in r.snapshots]),
               expected)
    # full StagedCallRecords (a subclass, extras ignored by the verifier)
    records = [r.builder.calls[c].record for c in r.order]
    assert_row(verify_and_linearize(r.receipt, records), expected)
    # JSON text -> validating loaders -> verifier
    receipt = RolloutReceipt.from_json(r.receipt.to_json_text())
    snapshots = [StagedCallBaseSnapshot.from_json(s.to_json_text().encode()) for s in r.snapshots]
    assert receipt == r.receipt
    assert_row(verify_and_linearize(receipt, snapshots), expected)


@SETTINGS
@given(any_rollout)
def test_verifier_does_not_mutate_its_inputs(r):
    receipt_before = r.receipt.to_json()
    snapshots_before = [s.to_json() for s in r.snapshots]
    verify_and_linearize(r.receipt, r.snapshots)
    verify_and_linearize(r.receipt, iter(r.snapshots))  # any iterable
    assert r.receipt.to_json() == receipt_before
    assert [s.to_json() for s in r.snapshots] == snapshots_before


# --- receipt gate (phase A) ------------------------------------------------------------------

@SETTINGS
@given(any_rollout, st.sampled_from(["attributed", "attributed_no_terminal", "unattributed"]),
       st.sampled_from([None, "", "worker_capture_failed", "unresolved_parent"]))
def test_poisoned_and_failed_receipts_are_rejected(r, state, reason):
    base = {**fields_of(r.receipt), "capture_poisoned": True, "failure_reason": reason}
    if state == "attributed_no_terminal":
        base["terminal_model_call_id"] = None
    if state == "unattributed":
        assume(reason is not None)
        base.update(terminal_model_call_id=None, terminal_selection=None)
    receipt = RolloutReceipt(**base)  # one of the legal poisoned states (spec 2.9 b/c)
    if reason is not None:  # failure_reason is checked first, "" included
        expect_error(receipt, r.snapshots, ReceiptVerificationError, "rollout_failed",
                     f"rollout_failed: {reason}")
    else:
        expect_error(receipt, r.snapshots, ReceiptVerificationError, "capture_poisoned",
                     "capture_poisoned: receipt marks token capture as poisoned")


@SETTINGS
@given(any_rollout, st.data())
def test_gate_codes_on_unvalidated_receipts(r, data):
    which = data.draw(st.sampled_from(["schema", "digest", "extras", "unpoisoned_failure",
                                       "empty", "no_terminal", "absent_terminal"]))
    cases = {
        "schema": ({"schema_version": 3}, ReceiptVerificationError, "unsupported_schema",
                   "unsupported_schema: receipt schema 3"),
        "digest": ({"digest_version": 1}, ReceiptVerificationError, "unsupported_digest",
                   "unsupported_digest: receipt digest 1"),
        "extras": ({"extras_digest_version": 2}, ReceiptVerificationError,
                   "unsupported_extras_digest", "unsupported_extras_digest: receipt extras digest 2"),
        "unpoisoned_failure": ({"failure_reason": "x"}, ReceiptVerificationError,
                               "rollout_failed", "rollout_failed: x"),
        "empty": ({"manifest": []}, ReceiptVerificationError, "empty_manifest",
                  "empty_manifest: successful receipt has no committed calls"),
        "no_terminal": ({"terminal_model_call_id": None}, RebuildError, "missing_terminal",
                        "missing_terminal: successful receipt has no terminal call"),
        "absent_terminal": ({"terminal_model_call_id": fresh_id(r)}, RebuildError,
                            "missing_terminal",
                            f"missing_terminal: terminal call {fresh_id(r)} is absent"),
    }
    changes, cls, code, message = cases[which]
    snapshots = [] if which == "empty" else r.snapshots
    expect_error(replace(r.receipt, **changes), snapshots, cls, code, message)


def test_argument_types():
    b = RolloutBuilder("R")
    b.stage("a", parent_call_id=None, prompt_delta=[1], generated=[2], generated_logprobs=[-0.5],
            weight_version=1)
    receipt, snapshots = b.receipt("a"), b.snapshots()
    with pytest.raises(TypeError, match="^receipt must be a RolloutReceipt$"):
        verify_and_linearize(receipt.to_json(), snapshots)
    with pytest.raises(TypeError, match="^snapshots must contain StagedCallBaseSnapshot values$"):
        verify_and_linearize(receipt, [snapshots[0].to_json()])
    # a RebuildError is a ReceiptVerificationError is a ValueError
    assert issubclass(RebuildError, ReceiptVerificationError)
    assert issubclass(ReceiptVerificationError, ValueError)


# --- phase B: manifest index and row binding --------------------------------------------------

@SETTINGS
@given(multi_call, st.data())
def test_swapped_manifest_order_is_snapshot_order_mismatch(r, data):
    i, j = sorted(data.draw(st.lists(st.integers(0, len(r.order) - 1), min_size=2, max_size=2,
                                     unique=True)))
    manifest = list(r.receipt.manifest)
    manifest[i], manifest[j] = manifest[j], manifest[i]
    receipt = RolloutReceipt.from_json({**r.receipt.to_json(),
                                        "manifest": [m.to_json() for m in manifest]})
    row = manifest[i]
    expect_error(receipt, r.snapshots, ReceiptVerificationError, "snapshot_order_mismatch",
                 f"snapshot_order_mismatch: key {row.staging_key} expected {row.model_call_id}, "
                 f"received {r.snapshots[i].model_call_id}")
    # the same with the snapshots swapped instead of the manifest
    snapshots = list(r.snapshots)
    snapshots[i], snapshots[j] = snapshots[j], snapshots[i]
    expect_error(r.receipt, snapshots, ReceiptVerificationError, "snapshot_order_mismatch")


@SETTINGS
@given(any_rollout, st.data())
def test_dropped_or_extra_snapshot_is_row_count_mismatch(r, data):
    n = len(r.order)
    drop = data.draw(st.integers(0, n - 1))
    expect_error(r.receipt, r.snapshots[:drop] + r.snapshots[drop + 1:], ReceiptVerificationError,
                 "row_count_mismatch", f"row_count_mismatch: {n - 1} snapshots for {n} manifest rows")
    expect_error(r.receipt, r.snapshots + [r.snapshots[drop]], ReceiptVerificationError,
                 "row_count_mismatch", f"row_count_mismatch: {n + 1} snapshots for {n} manifest rows")


@SETTINGS
@given(multi_call, st.data())
def test_duplicates(r, data):
    i, j = sorted(data.draw(st.lists(st.integers(0, len(r.order) - 1), min_size=2, max_size=2,
                                     unique=True)))
    # a repeated snapshot
    expect_error(r.receipt, with_snapshot(r.snapshots, j, r.snapshots[i]), ReceiptVerificationError,
                 "duplicate_snapshot", "duplicate_snapshot: model_call_id values are not unique")
    # a repeated staging key (reachable with a validated receipt: keys are opaque)
    body = r.receipt.to_json()
    body["manifest"][j]["staging_key"] = body["manifest"][i]["staging_key"]
    expect_error(RolloutReceipt.from_json(body), r.snapshots, ReceiptVerificationError,
                 "duplicate_staging_key", "duplicate_staging_key: staging keys are not unique")
    # a repeated manifest row (only without validation)
    manifest = list(r.receipt.manifest)
    manifest[j] = manifest[i]
    expect_error(replace(r.receipt, manifest=manifest), r.snapshots, ReceiptVerificationError,
                 "duplicate_manifest_row", "duplicate_manifest_row: model_call_id values are not unique")


@SETTINGS
@given(any_rollout, st.data())
def test_changed_ids(r, data):
    k = data.draw(st.integers(0, len(r.order) - 1))
    call_id, other = r.order[k], fresh_id(r)
    # a snapshot naming a call the manifest does not have
    expect_error(r.receipt, with_snapshot(r.snapshots, k, replace(r.snapshots[k], model_call_id=other)),
                 ReceiptVerificationError, "snapshot_identity_mismatch",
                 f"snapshot_identity_mismatch: snapshot {other} is not in the manifest")
    # a manifest row renamed: its snapshot is now the stranger
    expect_error(replace(r.receipt, manifest=[
                     replace(m, model_call_id=other) if i == k else m
                     for i, m in enumerate(r.receipt.manifest)]),
                 r.snapshots, ReceiptVerificationError, "snapshot_identity_mismatch",
                 f"snapshot_identity_mismatch: snapshot {call_id} is not in the manifest")


@SETTINGS
@given(any_rollout, st.data(), st.booleans())
def test_wrong_rollout(r, data, restaged):
    k = data.draw(st.integers(0, len(r.order) - 1))
    other = r.rollout_id + "-other"
    s = r.snapshots[k]
    bad = restage(s, rollout_id=other) if restaged else replace(s, rollout_id=other)
    expect_error(r.receipt, with_snapshot(r.snapshots, k, bad), ReceiptVerificationError,
                 "wrong_rollout", f"wrong_rollout: snapshot {r.order[k]} belongs to {other}")


@MORE
@given(any_rollout, st.data())
def test_manifest_field_mutations_are_wrong_field(r, data):
    k = data.draw(st.integers(0, len(r.order) - 1))
    row = r.receipt.manifest[k]
    name = data.draw(st.sampled_from(["prev_len", "delta_len", "cum_len", "weight_version",
                                      "mode", "digest", "extras_digest", "chain_hash",
                                      "cumulative_hash", "parent_call_id"]))
    old = getattr(row, name)
    if name in ("prev_len", "delta_len", "cum_len", "weight_version"):
        new = (old + data.draw(st.integers(1, 3))) % (U64_MAX + 1)
    elif name == "mode":
        new = "text" if old == "token_in" else "token_in"
    elif name == "parent_call_id":
        new = data.draw(st.sampled_from([None, fresh_id(r), *r.order]))
        assume(new != old)
    else:
        new = H(f"tampered {name} {old}")
    receipt = replace(r.receipt, manifest=[replace(m, **{name: new}) if i == k else m
                                           for i, m in enumerate(r.receipt.manifest)])
    expect_error(receipt, r.snapshots, ReceiptVerificationError, f"wrong_{name}",
                 f"wrong_{name}: call {row.model_call_id}: snapshot {old!r}, manifest {new!r}")
    # the same change on the snapshot side (not re-digested): the comparison still fires first
    s = r.snapshots[k]
    expect_error(r.receipt, with_snapshot(r.snapshots, k, replace(s, **{name: new})),
                 ReceiptVerificationError, f"wrong_{name}",
                 f"wrong_{name}: call {row.model_call_id}: snapshot {new!r}, manifest {old!r}")


@SETTINGS
@given(any_rollout, st.data())
def test_version_fields_must_agree_three_ways(r, data):
    k = data.draw(st.integers(0, len(r.order) - 1))
    name, bad = data.draw(st.sampled_from([("schema_version", 3), ("digest_version", 1),
                                           ("extras_digest_version", 2)]))
    good = {"schema_version": 2, "digest_version": 2, "extras_digest_version": 1}[name]
    call_id = r.order[k]
    expect_error(r.receipt, with_snapshot(r.snapshots, k, replace(r.snapshots[k], **{name: bad})),
                 ReceiptVerificationError, f"wrong_{name}",
                 f"wrong_{name}: call {call_id}: snapshot={bad}, manifest={good}, receipt={good}")
    receipt = replace(r.receipt, manifest=[replace(m, **{name: bad}) if i == k else m
                                           for i, m in enumerate(r.receipt.manifest)])
    expect_error(receipt, r.snapshots, ReceiptVerificationError, f"wrong_{name}",
                 f"wrong_{name}: call {call_id}: snapshot={good}, manifest={bad}, receipt={good}")


# --- phase B: digest recomputation --------------------------------------------------------------

@MORE
@given(any_rollout, st.data())
def test_flipped_token_is_corrupt_digest(r, data):
    # any row, on or off the chain: every row's digest is recomputed (step 8)
    k = data.draw(st.integers(0, len(r.order) - 1))
    s = r.snapshots[k]
    ids = column(s, "token_ids_delta")
    p = data.draw(st.integers(0, len(ids) - 1))
    ids[p] ^= data.draw(st.sampled_from([1, 1 << 32, 1 << 63]))
    expect_error(r.receipt, with_snapshot(r.snapshots, k, set_column(s, "token_ids_delta", ids)),
                 ReceiptVerificationError, "corrupt_digest",
                 f"corrupt_digest: call {r.order[k]}: staged digest mismatch")


@MORE
@given(any_rollout, st.data())
def test_mask_mutations_on_the_chain(r, data):
    call_id = data.draw(st.sampled_from(r.chain))
    k = r.index(call_id)
    s = r.snapshots[k]
    mask, lps = column(s, "token_mask_delta"), column(s, "generation_log_probs_delta")
    p = data.draw(st.integers(0, len(mask) - 1))
    variant = data.draw(st.sampled_from(["flip", "half", "negative_zero"]))
    if variant == "half":
        mask[p] = 0.5
        code, detail = "invalid_snapshot", f"call {call_id}: token_mask_delta must contain only 0.0 or 1.0"
    elif variant == "negative_zero":
        assume(mask[p] == 0.0)
        mask[p] = -0.0  # equal to 0.0, but its float32 image has the sign bit: digest changes
        code, detail = "corrupt_digest", f"call {call_id}: staged digest mismatch"
    elif mask[p] == 1.0 and lps[p] != 0.0:
        mask[p] = 0.0
        code, detail = "invalid_snapshot", f"call {call_id}: prompt-carry log probabilities must be 0.0"
    else:
        mask[p] = 1.0 - mask[p]
        code, detail = "corrupt_digest", f"call {call_id}: staged digest mismatch"
    expect_error(r.receipt, with_snapshot(r.snapshots, k, set_column(s, "token_mask_delta", mask)),
                 ReceiptVerificationError, code, f"{code}: {detail}")


def _same_f32(a: float, b: float) -> bool:
    return ref.f32_bits(a) == ref.f32_bits(b)


@MORE
@given(any_rollout, st.data())
def test_logprob_mutations(r, data):
    call_id = data.draw(st.sampled_from(r.chain))
    k = r.index(call_id)
    s = r.snapshots[k]
    c = r.calls[call_id]
    carry = len(c.prompt_delta)
    lps = column(s, "generation_log_probs_delta")
    p = carry + data.draw(st.integers(0, len(c.generated) - 1))  # a generated position
    old = lps[p]

    # 1. below float32 resolution: same digest, the verifier passes and the row carries the
    #    stored double (not its float32 image)
    up, down = np.nextafter(old, np.inf), np.nextafter(old, -np.inf)
    nudged = float(up if _same_f32(float(up), old) else down)
    assert _same_f32(nudged, old) and nudged != old
    changed = with_snapshot(r.snapshots, k, set_column(s, "generation_log_probs_delta",
                                                       lps[:p] + [nudged] + lps[p + 1:]))
    assert ref.staging_digest(**{**fields_of(s), "generation_log_probs_delta":
                                 lps[:p] + [nudged] + lps[p + 1:],
                                 "token_ids_delta": column(s, "token_ids_delta"),
                                 "token_mask_delta": column(s, "token_mask_delta")}) == s.digest
    row = verify_and_linearize(r.receipt, changed)
    offset = row.weight_version_spans[r.chain.index(call_id)].start
    expected = expected_row(r)
    expected["logprobs"][offset + p] = nudged
    assert_row(row, expected)

    # 2. a change visible in float32 is corrupt_digest
    other = -0.5 if not _same_f32(-0.5, old) else -0.75
    expect_error(r.receipt, with_snapshot(r.snapshots, k, set_column(
        s, "generation_log_probs_delta", lps[:p] + [other] + lps[p + 1:])),
        ReceiptVerificationError, "corrupt_digest",
        f"corrupt_digest: call {call_id}: staged digest mismatch")

    # 3. a value that does not fit float32 is invalid_snapshot (the digest cannot be computed)
    expect_error(r.receipt, with_snapshot(r.snapshots, k, set_column(
        s, "generation_log_probs_delta", lps[:p] + [-1e39] + lps[p + 1:])),
        ReceiptVerificationError, "invalid_snapshot",
        f"invalid_snapshot: call {call_id}: generation_log_probs_delta value cannot be "
        "represented as float32: -1e+39")


@SETTINGS
@given(rollouts(list_columns=None).filter(
    lambda r: any(r.calls[c].prompt_delta for c in r.chain)), st.data())
def test_carry_logprob_sign_of_zero_is_bound(r, data):
    call_id = data.draw(st.sampled_from([c for c in r.chain if r.calls[c].prompt_delta]))
    k = r.index(call_id)
    s = r.snapshots[k]
    lps = column(s, "generation_log_probs_delta")
    lps[0] = -0.0  # -0.0 == 0.0 passes the carry rule, but f32 image 80000000 != 00000000
    expect_error(r.receipt, with_snapshot(r.snapshots, k, set_column(
        s, "generation_log_probs_delta", lps)), ReceiptVerificationError, "corrupt_digest",
        f"corrupt_digest: call {call_id}: staged digest mismatch")
    lps[0] = -0.25  # a real carry log-prob breaks the precondition instead
    expect_error(r.receipt, with_snapshot(r.snapshots, k, set_column(
        s, "generation_log_probs_delta", lps)), ReceiptVerificationError, "invalid_snapshot",
        f"invalid_snapshot: call {call_id}: prompt-carry log probabilities must be 0.0")


@SETTINGS
@given(any_rollout, st.data())
def test_invalid_snapshot_preconditions(r, data):
    k = data.draw(st.integers(0, len(r.order) - 1))
    s, call_id = r.snapshots[k], r.order[k]
    which = data.draw(st.sampled_from(["u64", "short_mask", "nan", "bad_chain_hex"]))
    if which == "u64":
        ids = column(s, "token_ids_delta")
        ids[-1] = U64_MAX + 1
        bad = replace(s, token_ids_delta=ids)  # a list: numpy cannot hold it
        detail = "token_id must be an unsigned 64-bit integer, got 18446744073709551616"
    elif which == "short_mask":
        bad = set_column(s, "token_mask_delta", column(s, "token_mask_delta")[:-1])
        detail = "token IDs, masks, and log probabilities must have equal lengths"
    elif which == "nan":
        c = r.calls[call_id]
        assume(c.generated)
        lps = column(s, "generation_log_probs_delta")
        lps[-1] = float("nan")
        bad = set_column(s, "generation_log_probs_delta", lps)
        detail = "generation_log_probs_delta values must be finite Python floats, got nan"
    else:
        # chain_hash is compared with the manifest first; change both sides
        upper = s.chain_hash.upper()
        assume(upper != s.chain_hash)
        bad = replace(s, chain_hash=upper)
        r.receipt = replace(r.receipt, manifest=[replace(m, chain_hash=upper) if i == k else m
                                                 for i, m in enumerate(r.receipt.manifest)])
        detail = "chain_hash must be a lowercase SHA-256 hex digest"
    expect_error(r.receipt, with_snapshot(r.snapshots, k, bad), ReceiptVerificationError,
                 "invalid_snapshot", f"invalid_snapshot: call {call_id}: {detail}")


@MORE
@given(any_rollout, st.data())
def test_self_consistent_restaged_snapshot_is_wrong_digest(r, data):
    k = data.draw(st.integers(0, len(r.order) - 1))
    s = r.snapshots[k]
    ids = column(s, "token_ids_delta")
    p = data.draw(st.integers(0, len(ids) - 1))
    ids[p] ^= 1
    bad = restage(s, token_ids_delta=ids)  # validates: the stale chain hash is only bound
    StagedCallBaseSnapshot.from_json(bad.to_json())  # ...and it loads from the wire
    expect_error(r.receipt, with_snapshot(r.snapshots, k, bad), ReceiptVerificationError,
                 "wrong_digest",
                 f"wrong_digest: call {r.order[k]}: snapshot {bad.digest!r}, manifest {s.digest!r}")


@SETTINGS
@given(any_rollout, st.data())
def test_restaged_commitments_are_shadowed_by_wrong_digest(r, data):
    # extras_digest / chain_hash / cumulative_hash are bound by the call digest, so a
    # self-consistent snapshot that changes one of them differs first in `digest`
    k = data.draw(st.integers(0, len(r.order) - 1))
    name = data.draw(st.sampled_from(["extras_digest", "chain_hash", "cumulative_hash"]))
    s = r.snapshots[k]
    bad = restage(s, **{name: H(f"other {name}")})
    expect_error(r.receipt, with_snapshot(r.snapshots, k, bad), ReceiptVerificationError,
                 "wrong_digest")


# --- phase C: graph ------------------------------------------------------------------------------

@SETTINGS
@given(any_rollout, st.data())
def test_dropping_a_row_and_its_snapshot(r, data):
    k = data.draw(st.integers(0, len(r.order) - 1))
    dropped = r.order[k]
    manifest = [m for i, m in enumerate(r.receipt.manifest) if i != k]
    snapshots = [s for i, s in enumerate(r.snapshots) if i != k]
    orphans = [m.model_call_id for m in manifest if m.parent_call_id == dropped]
    if dropped == r.terminal:
        receipt = replace(r.receipt, manifest=manifest)  # not a valid receipt any more
    else:
        receipt = RolloutReceipt(**{**fields_of(r.receipt), "manifest": manifest})
    if not manifest:
        expect_error(receipt, snapshots, ReceiptVerificationError, "empty_manifest")
    elif orphans:  # the graph check (step 9) runs before the terminal lookup (step 10)
        expect_error(receipt, snapshots, RebuildError, "missing_parent",
                     f"missing_parent: call {orphans[0]} names absent parent {dropped}")
    elif dropped == r.terminal:
        expect_error(receipt, snapshots, RebuildError, "missing_terminal",
                     f"missing_terminal: terminal call {dropped} is absent")
    else:
        # an abandoned leaf: the row does not depend on it
        assert dropped not in r.chain
        assert_row(verify_and_linearize(receipt, snapshots), expected_row(r))


def _validated_call(rollout_id, call_id, parent, prev_len, delta, mask, lps, *, parent_chain=None,
                    weight_version=0):
    """A validated snapshot + manifest row with arbitrary lineage (no builder)."""
    fields = dict(schema_version=2, digest_version=2, extras_digest_version=1,
                  rollout_id=rollout_id, model_call_id=call_id, parent_call_id=parent,
                  mode="text" if parent is None else "token_in", prev_len=prev_len,
                  delta_len=len(delta), cum_len=prev_len + len(delta),
                  weight_version=weight_version, token_ids_delta=delta, token_mask_delta=mask,
                  generation_log_probs_delta=lps, extras_digest=ref.extras_digest(None),
                  chain_hash=ref.chain_hash(parent_chain, delta),
                  cumulative_hash=H(f"cumulative {call_id}"))
    digest = ref.staging_digest(**fields)
    snapshot = StagedCallBaseSnapshot(**fields, digest=digest)
    row = CallRecord(**{k: fields[k] for k in (
        "model_call_id", "parent_call_id", "prev_len", "delta_len", "cum_len", "weight_version",
        "extras_digest", "mode", "chain_hash", "cumulative_hash")}, digest=digest,
        staging_key=f"{rollout_id}/{call_id}", response_id=f"resp-{call_id}")
    return snapshot, row


def _receipt(rollout_id, rows, terminal):
    return RolloutReceipt(rollout_id=rollout_id, manifest=rows, terminal_model_call_id=terminal,
                          terminal_selection="declared")


def test_parent_length_mismatch():
    a, ra = _validated_call("R", "a", None, 0, [1, 2, 3, 4, 5], [0.0, 0.0, 0.0, 1.0, 1.0],
                            [0.0, 0.0, 0.0, -0.5, -1.0])
    b, rb = _validated_call("R", "b", "a", 4, [7, 8], [0.0, 1.0], [0.0, -0.5],
                            parent_chain=a.chain_hash)
    expect_error(_receipt("R", [ra, rb], "b"), [a, b], RebuildError, "parent_length_mismatch",
                 "parent_length_mismatch: call b starts at 4, parent ends at 5")


def test_lineage_cycle_is_caught_from_the_earlier_row():
    a, ra = _validated_call("R", "a", None, 0, [1, 2], [0.0, 1.0], [0.0, -0.5])
    x, rx = _validated_call("R", "x", "y", 5, [9], [1.0], [-0.5])
    y, ry = _validated_call("R", "y", "x", 3, [7, 8], [0.0, 1.0], [0.0, -0.5])
    expect_error(_receipt("R", [ra, rx, ry], "a"), [a, x, y], RebuildError, "lineage_cycle",
                 "lineage_cycle: cycle reaches call x")


# --- phase C: chain, masks, cumulative hash -------------------------------------------------------

@SETTINGS
@given(any_rollout, st.data())
def test_wrong_chain_hash_on_both_sides_is_chain_hash_mismatch(r, data):
    call_id = data.draw(st.sampled_from(r.chain))
    k = r.index(call_id)
    bad = restage(r.snapshots[k], chain_hash=H(f"forged chain {call_id}"))
    expect_error(sync_row(r.receipt, k, bad), with_snapshot(r.snapshots, k, bad), RebuildError,
                 "chain_hash_mismatch",
                 f"chain_hash_mismatch: call {call_id} does not extend its parent's staged chain")


@SETTINGS
@given(long_chain, st.data())
def test_consistently_restaged_ancestor_breaks_the_childs_chain(r, data):
    position = data.draw(st.integers(0, len(r.chain) - 2))
    call_id, child = r.chain[position], r.chain[position + 1]
    k = r.index(call_id)
    s = r.snapshots[k]
    ids = column(s, "token_ids_delta")
    ids[data.draw(st.integers(0, len(ids) - 1))] ^= 1
    parent_chain = (r.receipt.manifest[r.index(r.chain[position - 1])].chain_hash
                    if position else None)
    prefix = [t for c in r.chain[:position] for t in r.calls[c].delta]
    bad = restage(s, token_ids_delta=ids, chain_hash=ref.chain_hash(parent_chain, ids),
                  cumulative_hash=ref.hash_token_ids(prefix + ids))
    expect_error(sync_row(r.receipt, k, bad), with_snapshot(r.snapshots, k, bad), RebuildError,
                 "chain_hash_mismatch",
                 f"chain_hash_mismatch: call {child} does not extend its parent's staged chain")


@SETTINGS
@given(any_rollout, st.data())
def test_cumulative_hash_is_checked_for_the_terminal_only(r, data):
    call_id = data.draw(st.sampled_from(r.order))
    k = r.index(call_id)
    bad = restage(r.snapshots[k], cumulative_hash=H(f"forged cumulative {call_id}"))
    receipt, snapshots = sync_row(r.receipt, k, bad), with_snapshot(r.snapshots, k, bad)
    if call_id == r.terminal:
        expect_error(receipt, snapshots, RebuildError, "cumulative_hash_mismatch",
                     f"cumulative_hash_mismatch: terminal call {call_id} cumulative hash does "
                     "not cover the linearized tokens")
    else:  # intermediate and off-chain cumulative hashes are only bound by their digests
        assert_row(verify_and_linearize(receipt, snapshots), expected_row(r))


@SETTINGS
@given(any_rollout, st.data())
def test_restaged_chain_mask_order_and_empty_generation(r, data):
    call_id = data.draw(st.sampled_from(r.chain))
    k = r.index(call_id)
    c = r.calls[call_id]
    s = r.snapshots[k]
    mask, lps = column(s, "token_mask_delta"), column(s, "generation_log_probs_delta")
    mask[-1], lps[-1] = 0.0, 0.0  # the last generated token becomes a carry after generation
    bad = restage(s, token_mask_delta=mask, generation_log_probs_delta=lps)
    receipt, snapshots = sync_row(r.receipt, k, bad), with_snapshot(r.snapshots, k, bad)
    if len(c.generated) >= 2:
        expect_error(receipt, snapshots, RebuildError, "invalid_mask_order",
                     f"invalid_mask_order: call {call_id} mask is not carry-then-generation")
    else:
        expect_error(receipt, snapshots, RebuildError, "empty_generation",
                     f"empty_generation: call {call_id} contains no policy-generated token")


# --- off-chain rows (spec 4.3 step 10) -------------------------------------------------------------

@SETTINGS
@given(with_off_chain, st.data())
def test_off_chain_rows_are_digest_checked_but_not_chain_checked(r, data):
    call_id = data.draw(st.sampled_from(r.off_chain))
    k = r.index(call_id)
    s = r.snapshots[k]
    expected = expected_row(r)
    # consistent re-stage with a forged chain hash / cumulative hash / generation-then-carry
    # mask / no generated token: none of these is checked off the chain
    mask, lps = column(s, "token_mask_delta"), column(s, "generation_log_probs_delta")
    variant = data.draw(st.sampled_from(["chain", "cumulative", "all_carry", "bad_order"]))
    if variant == "chain":
        bad = restage(s, chain_hash=H(f"forged chain {call_id}"))
    elif variant == "cumulative":
        bad = restage(s, cumulative_hash=H(f"forged cumulative {call_id}"))
    elif variant == "all_carry":
        bad = restage(s, token_mask_delta=[0.0] * len(mask),
                      generation_log_probs_delta=[0.0] * len(lps))
    else:
        n = len(mask)
        assume(n > 1)
        bad = restage(s, token_mask_delta=[1.0] * (n - 1) + [0.0],
                      generation_log_probs_delta=[-0.5] * (n - 1) + [0.0])
    assert_row(verify_and_linearize(sync_row(r.receipt, k, bad), with_snapshot(r.snapshots, k, bad)),
               expected)
    # ...but its tokens are still digest-checked
    ids = column(s, "token_ids_delta")
    ids[0] ^= 1
    expect_error(r.receipt, with_snapshot(r.snapshots, k, set_column(s, "token_ids_delta", ids)),
                 ReceiptVerificationError, "corrupt_digest",
                 f"corrupt_digest: call {call_id}: staged digest mismatch")


@SETTINGS
@given(any_rollout)
def test_records_mutated_after_validation_are_caught(r):
    # the models do not validate on assignment; the verifier recomputes digests itself
    k = r.index(r.terminal)
    s = r.snapshots[k]
    snapshot = StagedCallRecord.from_json(r.builder.calls[r.terminal].record.to_json())
    snapshot.weight_version = (s.weight_version + 1) % (U64_MAX + 1)
    snapshot.digest = s.digest
    r.receipt.manifest[k].weight_version = snapshot.weight_version
    expect_error(r.receipt, with_snapshot(r.snapshots, k, snapshot), ReceiptVerificationError,
                 "corrupt_digest", f"corrupt_digest: call {r.terminal}: staged digest mismatch")
