"""Every conformance vector Gym publishes or produced (see vectors/NOTICE) must reproduce."""

import json
from pathlib import Path

import pytest

import stage.contract as c

VECTORS = Path(__file__).parent / "vectors"
GOLDEN = json.loads((VECTORS / "gym_golden_vectors.json").read_text())
EXTENDED = json.loads((VECTORS / "gym_extended_vectors.json").read_text())


def test_golden_extras_digest():
    assert c.compute_extras_digest(GOLDEN["extras"]) == GOLDEN["extras_digest"]


def test_golden_staged_call_digest():
    assert c.compute_staging_digest(**GOLDEN["staged_call"]) == GOLDEN["staged_call_digest"]


def test_empty_extras_digest_constant():
    assert c.compute_extras_digest(None) == EXTENDED["empty_extras_digest"] == c.EMPTY_EXTRAS_DIGEST


@pytest.mark.parametrize("vector", EXTENDED["extras"], ids=lambda v: json.dumps(v["extras"])[:40])
def test_extras_digest(vector):
    assert c.compute_extras_digest(vector["extras"]) == vector["digest"]


@pytest.mark.parametrize("vector", EXTENDED["hash_token_ids"], ids=lambda v: str(v["token_ids"])[:40])
def test_hash_token_ids(vector):
    assert c.hash_token_ids(vector["token_ids"]) == vector["hash"]


@pytest.mark.parametrize("vector", EXTENDED["chain_hash"], ids=lambda v: str(v["token_ids_delta"])[:40])
def test_chain_hash(vector):
    got = c.compute_chain_hash(vector["parent_chain_hash"], vector["token_ids_delta"])
    assert got == vector["chain_hash"]


@pytest.mark.parametrize("vector", EXTENDED["staged_calls"], ids=lambda v: v["model_call_id"])
def test_staged_call_digest_and_model_validation(vector):
    fields = {k: v for k, v in vector.items() if k != "digest"}
    assert c.compute_staging_digest(**fields) == vector["digest"]
    # The same record loads through the validating JSON loader and dumps back unchanged.
    snapshot = c.StagedCallBaseSnapshot.from_json(vector)
    dumped = snapshot.to_json()
    assert dumped == {k: vector[k] for k in dumped}
    assert [str(x) for x in dumped["token_mask_delta"]] == [str(x) for x in vector["token_mask_delta"]]


@pytest.mark.parametrize("vector", EXTENDED["routes"], ids=lambda v: v["envelope"][:24])
def test_route_envelopes(vector):
    assert c.encode_routed_experts(vector["values"], dtype=vector["dtype"]) == vector["envelope"]
    fragment = c.decode_routed_experts(vector["envelope"])
    assert fragment.dtype == vector["dtype"]
    assert fragment.values.tolist() == vector["values"]
    assert c.routed_experts_token_count(vector["envelope"]) == len(vector["values"])


@pytest.mark.parametrize("case", EXTENDED["verify_cases"], ids=lambda case: case["name"])
def test_verify_and_linearize(case):
    receipt = c.RolloutReceipt.from_json(case["receipt"])
    snapshots = [c.StagedCallBaseSnapshot.from_json(s) for s in case["snapshots"]]
    expect = case["expect"]
    if "ok" in expect:
        row = c.verify_and_linearize(receipt, snapshots)
        assert row.to_json() == expect["ok"]
        assert row.call_ids == row.model_call_ids
    else:
        err = expect["error"]
        with pytest.raises(c.ReceiptVerificationError) as info:
            c.verify_and_linearize(receipt, snapshots)
        assert type(info.value).__name__ == err["class"]
        assert info.value.code == err["code"]
        assert str(info.value) == err["message"]


@pytest.mark.parametrize("case", EXTENDED["verify_cases"], ids=lambda case: case["name"])
def test_records_round_trip_json(case):
    receipt = c.RolloutReceipt.from_json(json.dumps(case["receipt"]))
    assert receipt.to_json() == case["receipt"]
    for raw in case["snapshots"]:
        assert c.StagedCallBaseSnapshot.from_json(json.dumps(raw).encode()).to_json() == raw
