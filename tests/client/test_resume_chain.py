"""The chain logic of a resume (stage.client.resume_chain), without a broker: the rollout's calls
as the stage holds them, the longest verified chain, and a stager rehydrated on it that stages
and receipts exactly as the uninterrupted stager would."""

import numpy as np
import pytest

from stage.buffer import Position
from stage.client import RolloutStager
from stage.client.resume_chain import StagedRecord, held_calls, longest_verified, rehydrate

G, R = "g1", "g1-r0"
L, K = 2, 2


def _inputs(seed=0, turns=4):
    rng = np.random.default_rng(seed)
    out = []
    for t in range(turns):
        carry, gen = (5 if t == 0 else 2), 3
        out.append(dict(prompt_delta=rng.integers(1, 999, carry), generated=rng.integers(1, 999, gen),
                        generated_logprobs=-rng.random(gen).astype(np.float32), weight_version=3 + t,
                        routed_experts=rng.integers(0, 60, (carry + gen, L, K)),
                        routed_experts_boundary=None if t == 0 else rng.integers(0, 60, (1, L, K))))
    return out


def _prepared(stager, inputs, start=0, stop=None, parent=None):
    out = []
    for t in range(start, len(inputs) if stop is None else stop):
        out.append(stager.prepare(f"c{t}", parent_call_id=parent, **inputs[t]))
        parent = f"c{t}"
    return out


def _records(values):
    return [StagedRecord(v, Position("staged", 0, i, 1_000 + i), 100) for i, v in enumerate(values)]


def _verdict(values, rollout=R):
    candidates, dropped, conflicts = held_calls(_records(values), G, rollout)
    return longest_verified(rollout, candidates, dropped, conflicts)


def test_a_rehydrated_stager_continues_exactly_as_the_uninterrupted_one():
    inputs = _inputs()
    whole = RolloutStager(None, G, R)
    uninterrupted = _prepared(whole, inputs)
    staged = [p.value for p in uninterrupted[:2]]
    verdict = _verdict(staged)
    assert verdict.terminal.call_id == "c1" and not verdict.dropped and not verdict.conflicts
    assert np.array_equal(verdict.linearized.token_ids, whole.builder.calls["c1"].full_token_ids)
    assert verdict.linearized.weight_versions == [3, 4]
    resumed = RolloutStager.rehydrated(None, G, rehydrate(R, verdict.calls), verdict.taken_call_ids)
    rest = _prepared(resumed, inputs, start=2, parent="c1")
    for got, want in zip(rest, uninterrupted[2:]):
        assert got.value["digest"] == want.value["digest"]
        assert got.value == want.value
    assert resumed.receipt().to_json() == whole.receipt().to_json()
    with pytest.raises(ValueError, match="already staged"):
        resumed.prepare("c0", parent_call_id=None, **inputs[0])


def test_a_corrupt_call_ends_the_chain_before_it_and_its_id_stays_reserved():
    values = [p.value for p in _prepared(RolloutStager(None, G, R), _inputs())]
    ids = values[2]["token_ids_delta"]
    tampered = np.frombuffer(ids["data"], dtype=ids["dtype"]).copy()
    tampered[0] += 1
    values[2] = {**values[2], "token_ids_delta": {**ids, "data": tampered.tobytes()}}
    verdict = _verdict(values)
    assert verdict.terminal.call_id == "c1"
    assert [c.call_id for c in verdict.calls] == ["c0", "c1"]
    assert set(verdict.dropped) == {f"{R}/c2", f"{R}/c3"}
    assert "digest" in verdict.dropped[f"{R}/c2"] and "c2" in verdict.dropped[f"{R}/c3"]
    assert verdict.taken_call_ids == {"c0", "c1", "c2", "c3"}


def test_a_conflicting_second_copy_is_reported_and_the_first_kept():
    inputs = _inputs()
    values = [p.value for p in _prepared(RolloutStager(None, G, R), inputs)]
    other = _inputs(seed=7)
    regenerated = _prepared(RolloutStager(None, G, R), inputs, stop=1)[0].value   # same c0
    twin = RolloutStager(None, G, R)
    _prepared(twin, inputs, stop=1)
    copy_c1 = twin.prepare("c1", parent_call_id="c0", **other[1]).value      # c1, other tokens
    verdict = _verdict([*values[:2], copy_c1, regenerated, *values[2:]])
    assert verdict.terminal.call_id == "c3" and not verdict.dropped
    assert len(verdict.conflicts) == 1 and "staged twice with different content" in verdict.conflicts[0]
    # the stage keeps the first copy: when the conflicting copy came first, the chain stops before
    # the call, whose later copy (the one the children extend) is never held
    verdict = _verdict([values[0], copy_c1, *values[1:]])
    assert verdict.terminal.call_id == "c1" and [c.call_id for c in verdict.calls] == ["c0", "c1"]
    assert verdict.calls[1].record.value is copy_c1 and len(verdict.conflicts) == 1
    assert set(verdict.dropped) == {f"{R}/c2", f"{R}/c3"}     # they extend the copy never held
    assert "chain_hash_mismatch" in verdict.dropped[f"{R}/c2"]


def test_branches_are_kept_and_the_longest_chain_is_the_terminal():
    inputs = _inputs(turns=3)
    stager = RolloutStager(None, G, R)
    trunk = _prepared(stager, inputs)
    longer = dict(inputs[1], generated=np.arange(1, 9), generated_logprobs=-np.ones(8),
                  routed_experts=np.zeros((10, L, K), dtype=np.int64))
    branch = stager.prepare("b1", parent_call_id="c0", **longer)
    values = [trunk[0].value, branch.value, trunk[1].value, trunk[2].value]
    verdict = _verdict(values)
    assert verdict.terminal.call_id == "c2"          # cum 5+3+2+3+2+3 = 18 > 8 + 10
    assert [c.call_id for c in verdict.calls] == ["c0", "b1", "c1", "c2"]
    resumed = RolloutStager.rehydrated(None, G, rehydrate(R, verdict.calls))
    assert resumed.receipt().to_json() == stager.receipt("c2", order=["c0", "b1", "c1", "c2"]).to_json()


def test_other_rollouts_duplicates_and_undecodable_records():
    inputs = _inputs(turns=2)
    mine = [p.value for p in _prepared(RolloutStager(None, G, R), inputs)]
    theirs = [p.value for p in _prepared(RolloutStager(None, G, "g1-r1"), inputs)]
    other_group = [p.value for p in _prepared(RolloutStager(None, "g2", R), inputs)]
    broken = {**mine[1], "staging_key": f"{R}/c9", "delta_len": 0}
    verdict = _verdict([*theirs, mine[0], *other_group, mine[0], mine[1], broken])
    assert verdict.terminal.call_id == "c1" and not verdict.conflicts    # an exact copy: a duplicate
    assert list(verdict.dropped) == [f"{R}/c9"] and "dead-lettered" in verdict.dropped[f"{R}/c9"]
    assert _verdict(theirs + other_group).terminal is None


def test_a_chain_whose_root_is_absent_verifies_nothing():
    values = [p.value for p in _prepared(RolloutStager(None, G, R), _inputs(turns=3))]
    verdict = _verdict(values[1:])
    assert verdict.terminal is None and verdict.calls == []
    assert verdict.missing_parents == {"c0"}
    assert "c0" in verdict.dropped[f"{R}/c1"]
