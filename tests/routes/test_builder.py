"""build_route_plan: span construction, boundary repair, legacy warning, rejection reasons."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pytest

from stage.contract import ExtrasCommitment
from stage.routes import (
    LEGACY_BOUNDARY_WARNING,
    RoutePlanBuildError,
    build_route_plan,
    decode_route_plan,
    encode_route_plan,
)
from tests.routes.factory import DIGEST, PARTITION

OTHER_DIGEST = "cd" * 32


@dataclass
class Rec:  # the CallRecord fields the builder reads
    staging_key: str
    delta_len: int
    prev_len: int
    mode: str


def inputs(**overrides):
    """Root c1 (carry 2, gen 2) + child c2 (carry 1, gen 2) + an off-chain retry c9."""
    args = dict(
        staging_partition=PARTITION,
        link_spans=[("c1", 2, 2), ("c2", 1, 2)],
        records_by_call={
            "c1": Rec("r/c1", 4, 0, "text"),
            "c2": Rec("r/c2", 3, 4, "token_in"),
            "c9": Rec("r/c9", 2, 4, "token_in"),
        },
        routed_len_by_call={"c1": 4, "c2": 3, "c9": 2},
        extras_commitments=[ExtrasCommitment("c1", 1, DIGEST), ExtrasCommitment("c2", 1, OTHER_DIGEST)],
        boundary_index_by_call={"c2": 3},
        cleanup_staging_keys=["r/c1", "r/c9", "r/c2"],
        expected_token_length=7,
    )
    args.update(overrides)
    return args


def test_boundary_repair_plan(caplog):
    with caplog.at_level(logging.WARNING):
        plan = build_route_plan(**inputs())
    assert not caplog.records
    root, child = plan.spans
    assert (root.staging_key, root.carry_len, root.generation_len, root.staged_route_len) == ("r/c1", 2, 2, 4)
    assert (root.boundary_token_index, root.repair_previous_token) == (None, False)
    assert (child.staging_key, child.boundary_token_index, child.repair_previous_token) == ("r/c2", 3, True)
    assert (root.extras_digest, child.extras_digest) == (DIGEST, OTHER_DIGEST)
    assert plan.cleanup_staging_keys == ("r/c1", "r/c9", "r/c2")  # whole manifest, off-chain too
    assert (plan.schema_version, plan.expected_token_length) == (3, 7)
    assert decode_route_plan(encode_route_plan(plan)) == plan


def test_legacy_child_without_index_warns_and_does_not_repair(caplog):
    with caplog.at_level(logging.WARNING, logger="stage.routes"):
        plan = build_route_plan(**inputs(boundary_index_by_call={}))
    assert plan.spans[1].repair_previous_token is False
    assert plan.spans[1].boundary_token_index is None
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == LEGACY_BOUNDARY_WARNING % "c2"
    assert record.getMessage().startswith("Legacy captured call c2 has no boundary route; retaining")


def test_no_warning_when_child_staged_no_routes(caplog):
    with caplog.at_level(logging.WARNING):
        plan = build_route_plan(**inputs(boundary_index_by_call=None, routed_len_by_call={"c1": 4, "c2": 0}))
    assert plan.spans[1].staged_route_len == 0
    assert not caplog.records


def test_v2_builder_ignores_boundary(caplog):
    with caplog.at_level(logging.WARNING):
        plan = build_route_plan(**inputs(schema_version=2))
    assert not caplog.records
    assert plan.schema_version == 2
    assert all(s.boundary_token_index is None and not s.repair_previous_token for s in plan.spans)
    assert "boundary_token_index" not in encode_route_plan(plan)["spans"][1]


def test_numpy_routed_len_is_stored_as_int():
    plan = build_route_plan(**inputs(routed_len_by_call={"c1": np.int64(4), "c2": np.int64(3)}))
    assert type(plan.spans[0].staged_route_len) is int


def reason_of(**overrides) -> str:
    with pytest.raises(RoutePlanBuildError) as info:
        build_route_plan(**inputs(**overrides))
    assert str(info.value) == info.value.reason
    return info.value.reason


def test_reason_duplicate_span():
    assert reason_of(link_spans=[("c1", 2, 2), ("c1", 1, 2)]) == "duplicate_route_span:c1"


@pytest.mark.parametrize(
    "overrides",
    [
        {"records_by_call": {"c1": Rec("r/c1", 4, 0, "text")}},
        {"routed_len_by_call": {"c1": 4}},
        {"extras_commitments": [ExtrasCommitment("c1", 1, DIGEST)]},
    ],
    ids=["no-record", "not-fetched", "no-commitment"],
)
def test_reason_span_identity(overrides):
    assert reason_of(**overrides) == "route_span_identity:c2"


@pytest.mark.parametrize("routed_len", [-1, 999, 2, True, "3", None])
def test_reason_routed_len(routed_len):
    assert reason_of(routed_len_by_call={"c1": 4, "c2": routed_len}) == "routed_len_mismatch:c2"


def test_reason_generation_and_carry_spans():
    assert reason_of(link_spans=[("c1", 2, 2), ("c2", 0, 4)]) == "route_generation_span_mismatch:c2"
    assert reason_of(link_spans=[("c1", 2, 2), ("c2", 1, -1)]) == "route_generation_span_mismatch:c2"
    assert reason_of(link_spans=[("c1", 2, 2), ("c2", -1, 2)]) == "route_carry_span_mismatch:c2"


@pytest.mark.parametrize(
    "overrides,call",
    [
        ({"boundary_index_by_call": {"c2": 2}}, "c2"),  # not position - 1
        ({"boundary_index_by_call": {"c2": True}}, "c2"),
        ({"boundary_index_by_call": {"c1": 0}}, "c1"),  # root: position 0 (and text mode)
        ({"routed_len_by_call": {"c1": 4, "c2": 0}}, "c2"),  # index staged but no routes
        ({"records_by_call": {"c1": Rec("r/c1", 4, 0, "text"), "c2": Rec("r/c2", 3, 4, "text")}}, "c2"),
        ({"records_by_call": {"c1": Rec("r/c1", 4, 0, "text"), "c2": Rec("r/c2", 3, 3, "token_in")}}, "c2"),
    ],
    ids=["wrong-index", "bool-index", "root", "no-routes", "text-mode", "prev-len"],
)
def test_reason_boundary_index(overrides, call):
    assert reason_of(**overrides) == f"route_boundary_index_mismatch:{call}"


def test_reason_span_length():
    assert reason_of(expected_token_length=8) == "route_span_length_mismatch"


def test_reason_invalid_plan():
    assert reason_of(cleanup_staging_keys=["r/c1"]) == (
        "invalid_route_plan:route_plan.spans[1] key 'r/c2' is outside cleanup_staging_keys"
    )
    bad_digest = [ExtrasCommitment("c1", 1, DIGEST.upper()), ExtrasCommitment("c2", 1, OTHER_DIGEST)]
    assert reason_of(extras_commitments=bad_digest) == (
        "invalid_route_plan:route_plan.spans[0].extras_digest must be a lowercase SHA-256 hex digest"
    )


def test_index_without_adjacent_generation_is_kept_but_not_repaired():
    # A child that generated nothing keeps its staged index but must not repair its parent.
    plan = build_route_plan(**inputs(link_spans=[("c1", 2, 2), ("c2", 3, 0)]))
    assert (plan.spans[1].boundary_token_index, plan.spans[1].repair_previous_token) == (3, False)
