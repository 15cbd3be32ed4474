"""The compiled loops (stage._native) against the Python loops they replace, output for output.

``PackedRows.try_pack``'s column checks, ``PackedRows.call_digests`` and the chain walk of
``verify._linearize`` run in Rust when the extension is built; their Python loops stay as the fallback and are the reference here. Every
test runs the same input through both and requires the same result: the same digest or None
per row (None sends a row to the exact path, which raises Gym's error in Gym's order), the same
LinearizedRow or the same error, class and text. Inputs: Gym's published vectors, random valid
rollouts, and rollouts with one field changed to an odd value (unicode and surrogate ids, wrong
types and lengths, malformed hex digests, parents after their children).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stage.contract.linearized as linearized_module
import stage.contract.packed as packed_module
import stage.contract.verify as verify_module
from stage.contract import RolloutReceipt, StagedCallBaseSnapshot, verify_and_linearize
from stage.contract.native import native
from stage.contract.packed import PackedRows
from stage.contract.producer import RolloutBuilder

from . import reference as ref
from .strategies import fields_of, replace, replace_manifest_row, rollouts

pytestmark = pytest.mark.skipif(native is None, reason="stage._native is not built (test_native_required)")

VECTORS = Path(__file__).parents[1] / "conformance" / "vectors"
EXTENDED = json.loads((VECTORS / "gym_extended_vectors.json").read_text())
GOLDEN = json.loads((VECTORS / "gym_golden_vectors.json").read_text())
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class python_loops:
    """Within the block, the verifier and the pack run their Python loops."""

    def __enter__(self):
        self.saved = packed_module._native, verify_module._native, linearized_module._native
        packed_module._native = verify_module._native = linearized_module._native = None

    def __exit__(self, *_exc):
        packed_module._native, verify_module._native, linearized_module._native = self.saved


def outcome(receipt, snapshots, **kwargs):
    try:
        return "row", verify_and_linearize(receipt, snapshots, **kwargs).to_json()
    except Exception as error:  # noqa: BLE001 - the outcome compared, whatever it is
        return type(error).__name__, str(error)


def both_outcomes(receipt, snapshots, **kwargs):
    compiled = outcome(receipt, snapshots, **kwargs)
    with python_loops():
        python = outcome(receipt, snapshots, **kwargs)
    return compiled, python


def digests_both(snapshots):
    """Both loops' call digests over one pack of ``snapshots`` (None: the rows do not pack)."""
    pack = PackedRows.try_pack(snapshots)
    if pack is None:
        return None, None
    return pack.call_digests(snapshots), pack.python_call_digests(snapshots)


def reference_digest(snapshot) -> str | None:
    """The spec's digest of a row with plain values (tests/contract/reference.py), or None
    where the reference cannot encode it."""
    values = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in fields_of(snapshot).items()}
    names = ("rollout_id", "model_call_id", "parent_call_id", "mode", "prev_len", "delta_len",
             "cum_len", "weight_version", "token_ids_delta", "token_mask_delta",
             "generation_log_probs_delta", "extras_digest", "chain_hash", "cumulative_hash")
    try:
        return ref.staging_digest(**{k: values[k] for k in names})
    except (TypeError, ValueError, OverflowError, KeyError):
        return None


# --- Gym's vectors ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", EXTENDED["verify_cases"], ids=lambda case: case["name"])
@pytest.mark.parametrize("digests_verified", [False, True], ids=["digests", "digests-verified"])
def test_gym_verify_cases(case, digests_verified):
    receipt = RolloutReceipt.from_json(case["receipt"])
    snapshots = [StagedCallBaseSnapshot.from_json(s) for s in case["snapshots"]]
    compiled, python = both_outcomes(receipt, snapshots, digests_verified=digests_verified)
    assert compiled == python
    if not digests_verified:
        expect = case["expect"]
        assert compiled == (("row", expect["ok"]) if "ok" in expect else
                            (expect["error"]["class"], expect["error"]["message"]))


def test_gym_staged_call_vectors():
    vectors = [*EXTENDED["staged_calls"], {**GOLDEN["staged_call"], "digest": GOLDEN["staged_call_digest"]}]
    snapshots = [StagedCallBaseSnapshot.from_json(v) for v in vectors]
    for snapshot, vector in zip(snapshots, vectors):
        compiled, python = digests_both([snapshot])
        assert compiled == python == [vector["digest"]]
    compiled, python = digests_both(snapshots)   # one pack: rows at offsets into shared columns
    assert compiled == python == [v["digest"] for v in vectors]


# --- random valid rollouts ------------------------------------------------------------------

@SETTINGS
@given(rollouts(max_calls=8))
def test_random_rollouts(r):
    compiled, python = digests_both(r.snapshots)
    assert compiled == python == [s.digest for s in r.snapshots]
    for verified in (False, True):
        compiled, python = both_outcomes(r.receipt, r.snapshots, digests_verified=verified)
        assert compiled == python and compiled[0] == "row"


@SETTINGS
@given(rollouts(max_calls=8, min_calls=2), st.data())
def test_selected_rows_of_a_larger_pack(r, data):
    """The stage verifies on ``select``ed rows of its group's pack: offsets into columns that
    hold other rows too."""
    rows = data.draw(st.lists(st.integers(0, len(r.snapshots) - 1), min_size=1, unique=True))
    pack = PackedRows.try_pack(r.snapshots).select(rows)
    chosen = [r.snapshots[i] for i in rows]
    assert pack.call_digests(chosen) == pack.python_call_digests(chosen) == [s.digest for s in chosen]
    compiled, python = both_outcomes(r.receipt, r.snapshots,
                                     packed=PackedRows.try_pack(r.snapshots).select(range(len(r.snapshots))))
    assert compiled == python


# --- one field changed to an odd value ------------------------------------------------------------

class Text(str):
    """A str subclass: the exact-type checks refuse it."""


class Int(int):
    """An int subclass: the exact-type checks refuse it."""


_HEX = "ab" * 32
_IDS = ["é", "日本語-呼び出し", "🙂", "a\x00b", "\ud800", "x\udfff", "", " ", Text("c"), 7, None,
        b"c", "a" * 300]
_INTS = [0, 1, -1, 2**64 - 1, 2**64, 2**70, -(2**64), True, False, Int(3), 3.0, "3", None]
_DIGESTS = [_HEX.upper(), _HEX[:63], _HEX + "a", "g" * 64, " " + _HEX[1:], _HEX[:62] + " a",
            _HEX[:63] + "\n", "é" * 64, "\ud800" * 64, Text(_HEX), _HEX.encode(), None, 0, "",
            "0" * 64, "f" * 64]
_CHANGES = {
    "rollout_id": _IDS, "model_call_id": _IDS, "parent_call_id": [*_IDS],
    "mode": ["text", "token_in", "TEXT", "tex", Text("text"), "\ud800", None, 1],
    "prev_len": _INTS, "delta_len": _INTS, "cum_len": _INTS, "weight_version": _INTS,
    "schema_version": [1, 3, True, Int(2), 2.0, None], "digest_version": [1, 3, True, Int(2), 2.0],
    "extras_digest_version": [0, 2, True, Int(1), 1.0],
    "extras_digest": _DIGESTS, "chain_hash": _DIGESTS, "cumulative_hash": _DIGESTS,
}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollouts(max_calls=6), st.data())
def test_a_changed_field_gives_the_same_digests_and_outcome(r, data):
    snapshots = list(r.snapshots)
    k = data.draw(st.integers(0, len(snapshots) - 1), label="row")
    name = data.draw(st.sampled_from(sorted(_CHANGES)), label="field")
    new = data.draw(st.sampled_from(_CHANGES[name]), label="value")
    snapshots[k] = replace(snapshots[k], **{name: new})
    compiled, python = digests_both(snapshots)
    assert compiled == python
    if compiled is not None and compiled[k] is not None:
        assert compiled[k] == reference_digest(snapshots[k])   # a row it hashes, hashed right
    receipt = r.receipt
    if data.draw(st.booleans(), label="manifest too") and name != "rollout_id":
        receipt = replace_manifest_row(receipt, k, **{name: new})
    assert outcome(receipt, snapshots) == both_outcomes(receipt, snapshots)[1]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollouts(max_calls=6), st.data())
def test_lengths_and_columns_that_do_not_join(r, data):
    """Lengths off by one against the packed column, and a row's cum_len off its parent's."""
    snapshots = list(r.snapshots)
    k = data.draw(st.integers(0, len(snapshots) - 1), label="row")
    s = snapshots[k]
    change = data.draw(st.sampled_from([
        {"delta_len": s.delta_len + 1}, {"delta_len": s.delta_len - 1},
        {"cum_len": s.cum_len + 1}, {"prev_len": s.prev_len + 1},
        {"prev_len": s.prev_len + 1, "cum_len": s.cum_len + 1},
        {"token_ids_delta": s.token_ids_delta[:-1]},
        {"token_mask_delta": np.zeros_like(s.token_mask_delta)},
        {"token_mask_delta": s.token_mask_delta[::-1].copy()},
        {"generation_log_probs_delta": s.generation_log_probs_delta + 1.0}]))
    snapshots[k] = replace(s, **change)
    compiled, python = digests_both(snapshots)
    assert compiled == python
    for side in ("snapshot", "both"):
        receipt = r.receipt
        if side == "both" and set(change) <= {"delta_len", "cum_len", "prev_len"}:
            receipt = replace_manifest_row(receipt, k, **change)
        assert outcome(receipt, snapshots) == both_outcomes(receipt, snapshots)[1]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollouts(max_calls=6, min_chain=2), st.data())
def test_chain_failures_are_named_at_the_same_row(r, data):
    """A manifest chain hash changed, or a chain row's mask reordered or all carry: the walk
    stops at the same row for the same reason."""
    receipt, snapshots = r.receipt, list(r.snapshots)
    row = r.index(data.draw(st.sampled_from(r.chain), label="chain row"))
    how = data.draw(st.sampled_from(["chain_hash", "mask_order", "all_carry"]), label="how")
    if how == "chain_hash":
        receipt = replace_manifest_row(receipt, row, chain_hash=data.draw(st.sampled_from(
            ["0" * 64, _HEX.upper(), Text(receipt.manifest[row].chain_hash), None])))
    else:
        mask = snapshots[row].token_mask_delta.copy()
        mask = mask[::-1].copy() if how == "mask_order" else np.zeros_like(mask)
        snapshots[row] = replace(snapshots[row], token_mask_delta=mask,
                                 generation_log_probs_delta=np.zeros_like(mask))
    for verified in (False, True):
        compiled, python = both_outcomes(receipt, snapshots, digests_verified=verified)
        assert compiled == python


def test_parents_listed_after_their_children_and_shared_ids():
    """Parent texts are looked up before their own rows are seen; ids reused across rows."""
    builder = RolloutBuilder("r-ü")
    parent = None
    for i, call_id in enumerate(["p", "日本", "\u00e9", "e\u0301", "🙂🙂"]):
        builder.stage(call_id, parent_call_id=parent, prompt_delta=[i + 1, i + 2], generated=[9],
                      generated_logprobs=[-0.5], weight_version=i)
        parent = call_id
    order = ["🙂🙂", "e\u0301", "\u00e9", "日本", "p"]
    receipt, snapshots = builder.receipt(parent, order=order), builder.snapshots(order)
    compiled, python = digests_both(snapshots)
    assert compiled == python == [s.digest for s in snapshots]
    compiled, python = both_outcomes(receipt, snapshots)
    assert compiled == python and compiled[0] == "row"


def test_bad_inputs_to_the_module_raise_instead_of_reading_out_of_bounds():
    builder = RolloutBuilder("r")
    builder.stage("a", parent_call_id=None, prompt_delta=[1], generated=[2], generated_logprobs=[-1.0],
                  weight_version=0)
    snapshots = builder.snapshots()
    pack = PackedRows.try_pack(snapshots)
    args = (packed_module._HEAD, snapshots, pack.token_be, pack.mask_f32, pack.lp_f32)
    with pytest.raises(ValueError):
        native.call_digests(*args, [0], [3])            # past the columns
    with pytest.raises(ValueError):
        native.call_digests(*args, [0, 0], [2, 2])      # one start and end per row
    with pytest.raises((BufferError, ValueError)):
        native.call_digests(packed_module._HEAD, snapshots, np.zeros(8)[::2], pack.mask_f32,
                            pack.lp_f32, [0], [2])      # not contiguous
    with pytest.raises(ValueError):
        native.chain_walk(b"d", [snapshots[0].chain_hash], pack.token_be, [1], pack.starts,
                          pack.ends, pack.order_ok, pack.carry)   # no row 1


# --- binding rows to the manifest (verify._bind_rows' common case) --------------------------------

_NAN = float("nan")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollouts(max_calls=6, min_calls=2), st.data())
def test_a_binding_failure_has_the_same_outcome(r, data):
    """Whatever breaks the binding of rows to the manifest (ids, keys, order, the rollout, a
    field compared, a version, the digest), the compiled check hands it to the loops."""
    receipt, snapshots = r.receipt, list(r.snapshots)
    n = len(snapshots)
    k, j = data.draw(st.integers(0, n - 1), label="row"), data.draw(st.integers(0, n - 1), label="other")
    record = receipt.manifest[k]
    how = data.draw(st.sampled_from([
        "swap", "drop", "extra", "not_a_snapshot", "dup_manifest_id", "dup_key", "key_subclass",
        "id_subclass", "receipt_rollout", "snapshot_rollout", "nan_field", "nan_version",
        "version_float", "digest", "manifest_digest", "manifest_tuple"]), label="how")
    if how == "swap":
        snapshots[k], snapshots[j] = snapshots[j], snapshots[k]
    elif how == "drop":
        snapshots.pop(k)
    elif how == "extra":
        snapshots.append(snapshots[k])
    elif how == "not_a_snapshot":
        snapshots[k] = record
    elif how == "dup_manifest_id":
        receipt = replace_manifest_row(receipt, k, model_call_id=receipt.manifest[j].model_call_id)
    elif how == "dup_key":
        receipt = replace_manifest_row(receipt, k, staging_key=receipt.manifest[j].staging_key)
    elif how == "key_subclass":
        receipt = replace_manifest_row(receipt, k, staging_key=Text(record.staging_key))
    elif how == "id_subclass":
        receipt = replace_manifest_row(receipt, k, model_call_id=Text(record.model_call_id))
        snapshots[k] = replace(snapshots[k], model_call_id=Text(record.model_call_id))
    elif how == "receipt_rollout":
        receipt = replace(receipt, rollout_id=data.draw(st.sampled_from([Text(receipt.rollout_id), "other", "\ud800"])))
    elif how == "snapshot_rollout":
        snapshots[k] = replace(snapshots[k], rollout_id=receipt.rollout_id + "x")
    elif how == "nan_field":   # the same NaN object on both sides: equal in a tuple comparison
        snapshots[k] = replace(snapshots[k], weight_version=_NAN)
        receipt = replace_manifest_row(receipt, k, weight_version=data.draw(st.sampled_from([_NAN, float("nan")])))
    elif how == "nan_version":   # ... but not in a chained comparison
        snapshots[k] = replace(snapshots[k], schema_version=_NAN)
        receipt = replace_manifest_row(receipt, k, schema_version=_NAN)
    elif how == "version_float":
        snapshots[k] = replace(snapshots[k], digest_version=2.0)
    elif how == "digest":
        snapshots[k] = replace(snapshots[k], digest="0" * 64)
        receipt = replace_manifest_row(receipt, k, digest="0" * 64)
    elif how == "manifest_digest":
        receipt = replace_manifest_row(receipt, k, digest=Text(record.digest))
        snapshots[k] = replace(snapshots[k], digest=Text(record.digest))
    else:
        receipt = replace(receipt, manifest=tuple(receipt.manifest))
    for verified in (False, True):
        compiled, python = both_outcomes(receipt, snapshots, digests_verified=verified)
        assert compiled == python


# --- packing: the column checks, images and mask shapes ---------------------------------------

_PACKED = ("starts", "ends", "lengths", "carry", "order_ok", "token_be", "mask_f32", "lp_f32",
           "tokens", "masks", "logprobs")
# -3.4028235e38 rounds to float32's largest finite value, -3.4028236e38 past it (to -inf)
_VALUES = [0.0, -0.0, 1.0, -1.0, 0.5, -0.25, float("nan"), float("inf"), -float("inf"), -1e-50,
           -5e-324, -3.4028235e38, -3.4028236e38, -1e300, 2.0]


def _pack_attributes(snapshots):
    pack = PackedRows.try_pack(snapshots)
    if pack is None:
        return None
    out = {}
    for name in _PACKED:
        value = getattr(pack, name)
        out[name] = (value.dtype.str, value.tobytes()) if isinstance(value, np.ndarray) else value
    out["token_rows"] = [bytes(row) for row in pack.token_rows]
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollouts(max_calls=6), st.data())
def test_packing_checks_and_images_are_the_same(r, data):
    """Masks and log-probs changed position by position (signed zeros, NaN, infinities, values
    that overflow float32, masks outside {0, 1}, generation before carry): the same pack or the
    same refusal."""
    snapshots = list(r.snapshots)
    for _ in range(data.draw(st.integers(0, 3), label="changes")):
        k = data.draw(st.integers(0, len(snapshots) - 1), label="row")
        s = snapshots[k]
        mask, lps = s.token_mask_delta.copy(), s.generation_log_probs_delta.copy()
        i = data.draw(st.integers(0, len(mask) - 1), label="position")
        column = data.draw(st.sampled_from(["mask", "lp", "both"]), label="column")
        if column in ("mask", "both"):
            mask[i] = data.draw(st.sampled_from(_VALUES), label="mask value")
        if column in ("lp", "both"):
            lps[i] = data.draw(st.sampled_from(_VALUES), label="lp value")
        snapshots[k] = replace(s, token_mask_delta=mask, generation_log_probs_delta=lps)
    compiled = _pack_attributes(snapshots)
    with python_loops():
        python = _pack_attributes(snapshots)
    assert compiled == python
    assert outcome(r.receipt, snapshots) == both_outcomes(r.receipt, snapshots)[1]


def test_output_objects_are_built_alike():
    """linearized.build_all: the same frozen objects, field dicts and all."""
    from stage.contract import linearized
    columns = (["a", "b", "c"], [0, 5, 9], [5, 9, 12], [1, 2**64 - 1, 0])
    compiled = linearized.build_all(linearized.WeightVersionSpan, *columns)
    with python_loops():
        python = linearized.build_all(linearized.WeightVersionSpan, *columns)
    assert compiled == python and [vars(x) for x in compiled] == [vars(x) for x in python]
    assert all(type(x) is linearized.WeightVersionSpan for x in compiled)
    assert linearized.build_all(linearized.ExtrasCommitment, [], [], []) == []
    with pytest.raises(Exception):   # frozen, as a dataclass instance made by __init__
        compiled[0].start = 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollouts(max_calls=8, min_chain=2), st.data())
def test_the_gathered_chain_and_its_cumulative_hash(r, data):
    """The chain's columns gathered and hashed in one call: the same arrays (dtype and bytes),
    and a wrong cumulative hash or an all-carry chain refused the same way."""
    receipt, snapshots = r.receipt, list(r.snapshots)
    how = data.draw(st.sampled_from(["as is", "cumulative", "cumulative_subclass"]), label="how")
    terminal = r.index(r.terminal)
    if how == "cumulative":
        receipt = replace_manifest_row(receipt, terminal, cumulative_hash="0" * 64)
    elif how == "cumulative_subclass":
        receipt = replace_manifest_row(receipt, terminal,
                                       cumulative_hash=Text(receipt.manifest[terminal].cumulative_hash))
    compiled, python = both_outcomes(receipt, snapshots)
    assert compiled == python
    if compiled[0] == "row":
        row = verify_and_linearize(receipt, snapshots)
        with python_loops():
            reference = verify_and_linearize(receipt, snapshots)
        for name in ("token_ids", "token_mask", "logprobs"):
            ours, theirs = getattr(row, name), getattr(reference, name)
            assert ours.dtype == theirs.dtype and ours.tobytes() == theirs.tobytes(), name
