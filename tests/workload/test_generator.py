"""The synthetic workload: seeded and replayable, agentic in shape, and every injected fault
leads to the rejection it is declared to cause (checked through the library, no Kafka)."""

import dataclasses

import numpy as np
import pytest

from stage.client import staged_call_from_record
from stage.contract import verify_and_linearize
from stage.decode import staged_row
from stage.demo.checks import recompute_group
from stage.cli.demo import FAULT_NAMES
from stage.finalize import ReassemblyConfig
from stage.routes import ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD
from stage.wire import AvroCodec, WireError
from stage.workload import (
    GARBAGE,
    LATE_RECEIPT,
    MISSING_RECEIPT,
    MISSING_STAGED,
    POISONED_RECEIPT,
    ROLLOUT_FAULTS,
    TAMPERED_DIGEST,
    TAMPERED_TOKENS,
    FaultRates,
    WorkloadConfig,
    generate,
    generate_group,
)
from stage.workload.faults import tamper_staged_value

TOPIC = "demo.rollouts.staged-calls"
CONFIG = ReassemblyConfig(router_replay=True, top_logprobs=2, capture_media=True,
                          staging_partition=TOPIC)
BASE = WorkloadConfig(groups=12, group_size=4, turns=(2, 4), retry_rate=0.3, side_call_rate=0.4,
                      version_bump_rate=0.3, media_rate=0.3, topk=2, seed=3)


def _digests(workload):
    return [(c.record.digest, c.record.extras_digest) for r in workload.rollouts for c in r.calls]


def test_same_seed_same_workload_other_seed_other_workload():
    faulty = dataclasses.replace(BASE, faults=FaultRates.uniform(0.1))
    a, b = generate(faulty), generate(faulty)
    assert _digests(a) == _digests(b)
    assert [(r.fault, r.fault_call, r.reward) for r in a.rollouts] == [(r.fault, r.fault_call, r.reward)
                                                                       for r in b.rollouts]
    assert [g.garbage for g in a.groups] == [g.garbage for g in b.groups]
    assert _digests(generate(dataclasses.replace(faulty, seed=4))) != _digests(a)
    # groups are independent streams: one group regenerates alone, identically
    assert _digests(type(a)(faulty, [generate_group(faulty, 5)])) == _digests(type(a)(faulty, [a.groups[5]]))


def _traffic(workload):
    """Every call's identity, tokens, version and faults: the workload less its routes."""
    return [(r.rollout_id, r.fault, r.fault_call, r.reward, c.model_call_id, c.parent_call_id,
             c.weight_version, c.prompt_delta.tobytes(), c.generated.tobytes(), c.logprobs.tobytes())
            for r in workload.rollouts for c in r.calls]


def test_routes_do_not_change_the_traffic_the_same_seed_draws():
    # bench e2e's deferred anchor is "the same workload without routes": with routes drawn from
    # the rollout's main stream, a workload with routes and one without were other rollouts
    faulty = dataclasses.replace(BASE, faults=FaultRates.uniform(0.1))
    with_routes = generate(dataclasses.replace(faulty, route_layers=4, route_topk=2))
    other_dims = generate(dataclasses.replace(faulty, route_layers=6, route_topk=3, route_dtype="int8"))
    without = generate(dataclasses.replace(faulty, route_layers=0))
    assert _traffic(with_routes) == _traffic(without) == _traffic(other_dims)
    assert all(c.routed_experts is None for r in without.rollouts for c in r.calls)
    assert all(c.routed_experts is not None and c.routed_experts.shape[1:] == (6, 3)
               for r in other_dims.rollouts for c in r.calls)
    # the routes themselves still depend on the seed
    reseeded = generate(dataclasses.replace(faulty, route_layers=4, route_topk=2, seed=4))
    assert [c.routed_experts.tobytes() for r in reseeded.rollouts for c in r.calls][:3] != \
        [c.routed_experts.tobytes() for r in with_routes.rollouts for c in r.calls][:3]


def test_rollouts_are_agentic_chains_with_retries_side_calls_and_mixed_versions():
    workload = generate(BASE)
    roles = {c.role for r in workload.rollouts for c in r.calls}
    assert roles == {"chain", "retry", "side"}
    versions = set()
    for rollout in workload.rollouts:
        calls = {c.model_call_id: c for c in rollout.calls}
        chain = [c for c in rollout.calls if c.role == "chain"]
        assert 2 <= len(chain) <= 4 and rollout.terminal == chain[-1].model_call_id
        assert chain[0].parent_call_id is None and chain[0].record.mode == "text"
        for parent, child in zip(chain, chain[1:]):
            assert child.parent_call_id == parent.model_call_id and child.record.mode == "token_in"
            assert child.record.prev_len == parent.record.cum_len
            index = child.record.extras[ROUTED_EXPERTS_BOUNDARY_INDEX_FIELD]
            assert index == parent.record.cum_len - 1 and child.routed_experts_boundary.shape == (1, 4, 2)
        for call in rollout.calls:
            assert call.routed_experts.shape == (call.record.delta_len, 4, 2)
            assert call.topk.ids.shape == (len(call.generated), 2)
            if call.role == "retry":   # an abandoned sibling of the chain call that replaced it
                twin = calls[call.model_call_id[:-1]]
                assert twin.parent_call_id == call.parent_call_id and twin.role == "chain"
            versions.add(call.weight_version)
        # the receipt names every call; the verifier linearizes the terminal chain only
        row = verify_and_linearize(rollout.receipt, [c.record.base_snapshot() for c in rollout.calls])
        assert row.model_call_ids == [c.model_call_id for c in chain]
        assert np.array_equal(row.token_ids, np.concatenate(
            [np.concatenate([c.prompt_delta, c.generated]) for c in chain]))
    assert len(versions) >= 3
    media = [r for r in workload.rollouts if r.calls[0].media is not None]
    assert 0 < len(media) < len(workload.rollouts)
    # a group shares its prompt
    for group in workload.groups:
        prompts = {tuple(r.calls[0].prompt_delta) for r in group.rollouts}
        assert len(prompts) == 1


@pytest.mark.parametrize("fault", ROLLOUT_FAULTS)
def test_every_fault_causes_the_rejection_it_declares(fault):
    workload = generate(dataclasses.replace(BASE, faults=FaultRates(**{fault: 0.5})))
    faulted = [r for r in workload.rollouts if r.fault]
    assert faulted and {r.fault for r in faulted} == {fault}
    for group in workload.groups:
        assert any(r.fault is None for r in group.rollouts)  # one clean rollout per group
        result = recompute_group(group, CONFIG, staged_topic=TOPIC)
        for rollout, row in zip(group.rollouts, result.rows):
            expected = rollout.expected_rejection(TOPIC)
            if expected is None:
                assert row.valid, row.rejection_reason
            elif fault == TAMPERED_TOKENS:
                # in memory the verifier recomputes the digest; the stage, which validates each
                # staged row as it loads it from the wire, rejects it first (checked below)
                assert row.rejection_reason.startswith("rebuild_failed:corrupt_digest")
            else:
                assert expected.matches(row.rejection_reason), (row.rejection_reason, str(expected))
        assert group.expected_outcome == ("deadline" if fault in (MISSING_STAGED, LATE_RECEIPT) else "complete")


def test_tampered_tokens_on_the_wire_fail_the_stages_staged_row_check_with_the_expected_reason():
    workload = generate(dataclasses.replace(BASE, faults=FaultRates(tampered_tokens=1.0)))
    codec = AvroCodec("StagedCall")
    for rollout in [r for r in workload.rollouts if r.fault][:10]:
        call = rollout.call(rollout.fault_call)
        clean = staged_call_from_record(rollout.group_id, call.record)
        staged_row(codec.decode(codec.encode(clean)))  # the untouched value loads
        value = tamper_staged_value(clean, rollout.tamper_position, rollout.vocab_size)
        assert value["token_ids_delta"] != clean["token_ids_delta"]
        with pytest.raises(ValueError) as raised:
            staged_row(codec.decode(codec.encode(value)))
        # the finalizer turns this ValueError into invalid_staging_row:<message>
        assert rollout.expected_rejection(TOPIC).matches(f"invalid_staging_row:{raised.value}")


def test_receipt_faults_change_only_what_they_say():
    workload = generate(dataclasses.replace(BASE, faults=FaultRates(tampered_digest=0.3, poisoned_receipt=0.3,
                                                                    missing_receipt=0.2, late_receipt=0.2)))
    seen = set()
    for rollout in workload.rollouts:
        clean, emitted = rollout.receipt.to_json(), rollout.emitted_receipt()
        seen.add(rollout.fault)
        if rollout.fault is None:
            assert emitted == clean
        elif rollout.fault in (MISSING_RECEIPT, LATE_RECEIPT):
            assert emitted is None and rollout.late == (rollout.fault == LATE_RECEIPT)
        elif rollout.fault == POISONED_RECEIPT:
            assert emitted == dict(clean, capture_poisoned=True)
        else:
            assert rollout.fault == TAMPERED_DIGEST
            diff = [(a, b) for a, b in zip(clean["manifest"], emitted["manifest"]) if a != b]
            (before, after), = diff
            assert before["model_call_id"] == rollout.fault_call and after == dict(before, digest=rollout.fake_digest)
    assert seen == {None, TAMPERED_DIGEST, POISONED_RECEIPT, MISSING_RECEIPT, LATE_RECEIPT}


def test_garbage_never_decodes_as_an_input_record():
    workload = generate(dataclasses.replace(BASE, groups=40, faults=FaultRates(garbage=1.0)))
    garbage = [g for group in workload.groups for g in group.garbage]
    assert len(garbage) == 40 and {g.kind for g in garbage} == {"random", "truncated", "empty"}
    codecs = {"receipts": AvroCodec("ReceiptEvent"), "staged_calls": AvroCodec("StagedCall")}
    for g in garbage:
        with pytest.raises(WireError):
            codecs[g.topic_role].decode(g.value)
    assert workload.fault_counts()[GARBAGE] == 40


def test_fault_rates_are_validated_and_the_cli_names_them_all():
    with pytest.raises(ValueError, match="sum"):
        FaultRates(tampered_tokens=0.6, missing_receipt=0.6)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        FaultRates(garbage=1.5)
    assert FAULT_NAMES == (*ROLLOUT_FAULTS, GARBAGE)
    with pytest.raises(ValueError):
        WorkloadConfig(turns=(3, 2))
