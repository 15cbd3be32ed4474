"""The verifier's hot path: no Python function call per row, and exactly the per-row decisions.

A helper called for each row in each phase (and a generator resumed for each) was a measurable
share of verification on cores without AVX-512 (issue 31). The first tests count Python-level
calls, which do not depend on the machine: a rollout of 64 calls must take exactly as many as
one of 9. The others check that the packed path (numpy columns) decides exactly as the per-row
path for Python-list columns does, whatever is changed.
"""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage.contract import StagedCallBaseSnapshot, verify_and_linearize
from stage.contract.constants import COMPARED_FIELDS, VERSION_FIELDS
from stage.contract.producer import RolloutBuilder

from . import reference as ref
from .strategies import fields_of, replace, replace_manifest_row, rollouts, with_list_columns

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def python_calls(fn) -> int:
    """Python function calls made while ``fn`` runs: every frame entered, comprehensions and
    each resumption of a generator included (the profiler's "call" events; C calls are not)."""
    count = 0

    def hook(_frame, event, _arg):
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def rollout(calls: int, *, retries: bool = True):
    """A multi-turn chain, with an abandoned retry every 8 calls (off-chain rows to skip)."""
    rng = np.random.default_rng(calls)
    builder = RolloutBuilder(f"r{calls}")
    parent = None
    for i in range(calls):
        kwargs = dict(prompt_delta=rng.integers(0, 151_000, 16), generated=rng.integers(0, 151_000, 16),
                      generated_logprobs=-rng.random(16), weight_version=3 + i // 4)
        if retries and parent is not None and i % 8 == 0:
            builder.stage(f"c{i}-retry", parent_call_id=parent, **kwargs)
        builder.stage(f"c{i}", parent_call_id=parent, **kwargs)
        parent = f"c{i}"
    return builder.receipt(parent), builder.snapshots()


@pytest.mark.parametrize("digests_verified", [False, True], ids=["digests", "digests-verified"])
def test_python_calls_do_not_grow_with_the_rows(digests_verified):
    counts = {}
    for calls in (9, 64):   # 1 and 7 off-chain rows
        receipt, snapshots = rollout(calls)
        verify_and_linearize(receipt, snapshots, digests_verified=digests_verified)  # warm caches
        counts[calls] = python_calls(
            lambda: verify_and_linearize(receipt, snapshots, digests_verified=digests_verified))
    # fewer than one Python call per added row (c15662c: 139 -> 814); a few calls may come from
    # elsewhere in the process (a gc callback another test's library registered) in a full run
    assert counts[64] - counts[9] < 64 - 9, counts


def test_a_chain_without_off_chain_rows_takes_as_few_calls():
    counts = {}
    for calls in (2, 7, 40):
        receipt, snapshots = rollout(calls, retries=False)
        verify_and_linearize(receipt, snapshots)
        counts[calls] = python_calls(lambda: verify_and_linearize(receipt, snapshots))
    assert max(counts.values()) - min(counts.values()) < 40 - 2, counts   # not one a row


# --- the batched checks decide exactly as the row-by-row ones ---------------------------------
# Python-list columns never take the batched path, so the same input with list columns is the
# reference: any field changed on either side (values, types, NaN, unhashable) must end in the
# same row or the same error, class and text.

def outcome(receipt, snapshots, **kwargs):
    try:
        return "row", verify_and_linearize(receipt, snapshots, **kwargs).to_json()
    except Exception as error:  # noqa: BLE001 - the outcome compared, whatever it is
        return type(error).__name__, str(error)


_NAN = float("nan")
_ODD = [lambda v: _NAN, lambda v: [v], lambda v: np.array([v, v])]   # NaN, unhashable, no truth value
_CHANGES = {
    int: [lambda v: v + 1, lambda v: v - 1, float, lambda v: True, str, lambda v: None,
          lambda v: 1 << 64, *_ODD],
    str: [lambda v: v + "x", lambda v: "", str.upper, lambda v: None, lambda v: 7,
          lambda v: "\ud800", *_ODD],
    type(None): [lambda v: "", lambda v: "x", lambda v: 0, *_ODD],
}
_FIELDS = (*COMPARED_FIELDS, *VERSION_FIELDS)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollouts(max_calls=5), st.data())
def test_a_changed_field_has_the_row_by_row_outcome(r, data):
    snapshots, receipt = list(r.snapshots), r.receipt
    k = data.draw(st.integers(0, len(snapshots) - 1), label="row")
    side = data.draw(st.sampled_from(["snapshot", "manifest", "both", "receipt"]), label="side")
    if side == "receipt":
        name = data.draw(st.sampled_from(["rollout_id", *VERSION_FIELDS]), label="field")
        old = getattr(receipt, name)
        receipt = replace(receipt, **{name: data.draw(st.sampled_from(_CHANGES[type(old)]))(old)})
    else:
        extra = ["rollout_id"] if side == "snapshot" else ["staging_key"] if side == "manifest" else []
        name = data.draw(st.sampled_from([*_FIELDS, *extra]), label="field")
        owner = snapshots[k] if side != "manifest" else receipt.manifest[k]
        old = getattr(owner, name)
        new = data.draw(st.sampled_from(_CHANGES[type(old)]))(old)
        if side != "manifest":
            snapshots[k] = replace(snapshots[k], **{name: new})
        if side != "snapshot":
            receipt = replace_manifest_row(receipt, k, **{name: new})
    expected = outcome(receipt, [with_list_columns(s) for s in snapshots])
    assert outcome(receipt, snapshots) == expected


@SETTINGS
@given(rollouts(max_calls=5), st.data())
def test_strided_and_big_endian_columns_give_the_same_row(r, data):
    expected = outcome(r.receipt, r.snapshots)
    k = data.draw(st.integers(0, len(r.snapshots) - 1))
    s = r.snapshots[k]
    ids, mask = s.token_ids_delta, s.token_mask_delta
    strided = np.repeat(ids, 2)[::2]          # a view with a stride: not one buffer
    changed = data.draw(st.sampled_from([
        {"token_ids_delta": strided}, {"token_ids_delta": ids.astype(">u8")},
        {"token_mask_delta": np.repeat(mask, 2)[::2]}]))
    snapshots = list(r.snapshots)
    snapshots[k] = replace(s, **changed)
    assert outcome(r.receipt, snapshots) == expected


def test_a_negative_zero_carry_mask_is_hashed_with_its_sign():
    """-0.0 == 0.0 is a valid carry mask whose float32 image is 0x80000000, not 0: a producer
    that staged it has a digest over that image, and both paths must recompute exactly it."""
    builder = RolloutBuilder("neg0")
    builder.stage("a", parent_call_id=None, prompt_delta=[5, 6], generated=[7],
                  generated_logprobs=[-0.5], weight_version=1)
    (snapshot,) = builder.snapshots()
    receipt = builder.receipt("a")
    mask = np.array([-0.0, 0.0, 1.0])
    values = {**fields_of(snapshot), "token_mask_delta": mask}
    values.pop("digest")
    plain = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in values.items()}
    digest = ref.staging_digest(**plain)
    assert digest != snapshot.digest    # the sign bit is in the hashed image
    restaged = StagedCallBaseSnapshot(**values, digest=digest)
    receipt = replace_manifest_row(receipt, 0, digest=digest)
    got = outcome(receipt, [restaged])
    assert got == outcome(receipt, [with_list_columns(restaged)])
    assert got[0] == "row" and struct.pack(">d", got[1]["token_mask"][0]) == struct.pack(">d", -0.0)
