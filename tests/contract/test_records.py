"""Wire records (spec section 2): field rules, every model-validator message, JSON form."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stage.contract import (
    EMPTY_EXTRAS_DIGEST,
    CallRecord,
    CaptureAdmission,
    CommitCoords,
    ManifestFailure,
    RolloutManifest,
    RolloutReceipt,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
    StageResult,
    WireValidationError,
    default_staging_key,
    staging_key,
)
from stage.contract.producer import RolloutBuilder

from . import reference as ref

D1, D2, D3 = "11" * 32, "22" * 32, "33" * 32


def model_error(cls, **values) -> WireValidationError:
    with pytest.raises(WireValidationError) as info:
        cls(**values)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.model == cls.__name__
    return error


def assert_rule(cls, message, **values):
    """A model-level rule fired with Gym's exact text."""
    error = model_error(cls, **values)
    assert error.field is None, f"field error {error.field}: {error.reason}"
    assert error.reason == message
    assert str(error) == f"{cls.__name__}: {message}"


def assert_field(cls, field, **values):
    error = model_error(cls, **values)
    assert error.field == field, f"{error.field}: {error.reason}"
    assert str(error).startswith(f"{cls.__name__}.{field}: ")
    return error


# --- valid payloads ----------------------------------------------------------------------------

def _builder() -> RolloutBuilder:
    b = RolloutBuilder("R")
    b.stage("a", parent_call_id=None, prompt_delta=[100, 101, 102], generated=[200, 201],
            generated_logprobs=[-0.5, -1.0], weight_version=5,
            extras={"routed_experts": "nrlre1:int16:2x1x2:AQACAAMABAA="})
    b.stage("b", parent_call_id="a", prompt_delta=[300, 301], generated=[400],
            generated_logprobs=[-0.125], weight_version=6, admitted_at=12.5)
    return b


def root_snapshot() -> dict:
    return _builder().calls["a"].record.base_snapshot().to_json()


def child_snapshot() -> dict:
    return _builder().calls["b"].record.base_snapshot().to_json()


def root_record() -> dict:
    return _builder().calls["a"].record.to_json()


def call_row(call="b") -> dict:
    return _builder().calls[call].manifest_row.to_json()


def receipt_json() -> dict:
    return _builder().receipt("b").to_json()


def redigest(fields: dict) -> dict:
    """Give ``fields`` a digest that matches its (float) contents, via the reference encoder."""
    out = dict(fields)
    out["digest"] = ref.staging_digest(**out)
    return out


def coords(**changes) -> dict:
    base = dict(rollout_id="R", model_call_id="b", parent_call_id="a", prev_len=5, delta_len=3,
                cum_len=8, weight_version=6, disposition="staged", digest=D1,
                extras_digest=EMPTY_EXTRAS_DIGEST, staging_key="R/b", chain_hash=D2,
                cumulative_hash=D3)
    base.update(changes)
    return base


def failed_coords(**changes) -> dict:
    base = dict(rollout_id="R", model_call_id="b", parent_call_id="a", prev_len=5, delta_len=0,
                cum_len=5, weight_version=6, disposition="capture_failed")
    base.update(changes)
    return base


def admission(**changes) -> dict:
    base = dict(rollout_id="R", model_call_id="b", parent_call_id="a", prev_len=2,
                mode="token_in", required_prefix_token_ids=[1, 2], staging_chain=[],
                parent_chain_hash=D1)
    base.update(changes)
    return base


# --- declaration order of the JSON form (spec 2.1-2.9) -------------------------------------------

VERSIONS = ["schema_version", "digest_version", "extras_digest_version"]
ORDER = {
    CaptureAdmission: ["schema_version", "rollout_id", "model_call_id", "parent_call_id",
                       "prev_len", "mode", "required_prefix_token_ids", "staging_chain",
                       "parent_chain_hash"],
    StagedCallBaseSnapshot: [*VERSIONS, "rollout_id", "model_call_id", "parent_call_id", "mode",
                             "prev_len", "delta_len", "cum_len", "weight_version", "digest",
                             "token_ids_delta", "token_mask_delta", "generation_log_probs_delta",
                             "extras_digest", "chain_hash", "cumulative_hash"],
    StageResult: ["schema_version", "ok", "staging_key", "error"],
    CommitCoords: [*VERSIONS, "rollout_id", "model_call_id", "parent_call_id", "prev_len",
                   "delta_len", "cum_len", "weight_version", "disposition", "digest",
                   "extras_digest", "staging_key", "chain_hash", "cumulative_hash"],
    CallRecord: [*VERSIONS, "model_call_id", "parent_call_id", "prev_len", "delta_len", "cum_len",
                 "weight_version", "digest", "extras_digest", "staging_key", "mode", "chain_hash",
                 "cumulative_hash", "response_id", "admitted_at", "output_fingerprint",
                 "continuation_fingerprint", "fingerprint_version"],
    ManifestFailure: ["schema_version", "model_call_id", "reason"],
    RolloutManifest: ["schema_version", "rollout_id", "records", "failures"],
    RolloutReceipt: [*VERSIONS, "rollout_id", "reward", "terminal_model_call_id", "manifest",
                     "capture_poisoned", "failure_reason", "terminal_selection",
                     "terminal_attribution_reason"],
}
ORDER[StagedCallRecord] = [*ORDER[StagedCallBaseSnapshot], "extras"]
ORDER[StagedCallSnapshot] = ORDER[StagedCallRecord]


def valid_instances():
    return {
        CaptureAdmission: CaptureAdmission(**admission()),
        StagedCallBaseSnapshot: StagedCallBaseSnapshot(**child_snapshot()),
        StagedCallRecord: StagedCallRecord(**root_record()),
        StagedCallSnapshot: StagedCallSnapshot(**root_record()),
        StageResult: StageResult(ok=True, staging_key="R/b"),
        CommitCoords: CommitCoords(**coords()),
        CallRecord: CallRecord(**call_row()),
        ManifestFailure: ManifestFailure(model_call_id="c", reason="unresolved_parent"),
        RolloutManifest: RolloutManifest(rollout_id="R", records=[call_row("a"), call_row("b")],
                                         failures=[{"model_call_id": "c",
                                                    "reason": "unresolved_parent"}]),
        RolloutReceipt: RolloutReceipt(**receipt_json()),
    }


@pytest.mark.parametrize("cls", list(ORDER), ids=lambda c: c.__name__)
def test_to_json_key_order_is_declaration_order(cls):
    instance = valid_instances()[cls]
    dumped = instance.to_json()
    assert list(dumped) == ORDER[cls]
    # the text form keeps the order too, and properties are not serialized
    assert list(json.loads(instance.to_json_text())) == ORDER[cls]


@pytest.mark.parametrize("cls", list(ORDER), ids=lambda c: c.__name__)
def test_from_json_accepts_dict_str_and_bytes(cls):
    instance = valid_instances()[cls]
    text = instance.to_json_text()
    for payload in (instance.to_json(), text, text.encode("utf-8"), json.dumps(instance.to_json())):
        loaded = cls.from_json(payload)
        assert type(loaded) is cls
        assert loaded == instance
        assert loaded.to_json() == instance.to_json()


@pytest.mark.parametrize("cls", list(ORDER), ids=lambda c: c.__name__)
def test_extra_keys_are_rejected(cls):
    body = valid_instances()[cls].to_json()
    body["unexpected"] = None
    error = model_error(cls, **body)
    assert error.field == "unexpected"
    with pytest.raises(WireValidationError):
        cls.from_json(json.dumps(body))


@pytest.mark.parametrize("payload", ["[]", "1", '"x"', "null", b"[1,2]"])
def test_from_json_requires_an_object(payload):
    with pytest.raises(WireValidationError) as info:
        CallRecord.from_json(payload)
    assert info.value.field is None


def test_extras_key_is_forbidden_on_base_snapshot():
    assert_field(StagedCallBaseSnapshot, "extras", **child_snapshot(), extras=None)


def test_staging_key_property_and_default_key():
    snapshot = StagedCallBaseSnapshot(**child_snapshot())
    assert snapshot.staging_key == "R/b" == default_staging_key("R", "b") == staging_key("R", "b")
    for bad in (("", "b"), ("R", "")):
        with pytest.raises(ValueError, match="^rollout_id and model_call_id must be non-empty$"):
            default_staging_key(*bad)


# --- versions ----------------------------------------------------------------------------------------

DIGEST_MODELS = [StagedCallBaseSnapshot, StagedCallRecord, CommitCoords, CallRecord, RolloutReceipt]


@pytest.mark.parametrize("cls", list(ORDER), ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad", [1, 3, "2", True, None, 2.5])
def test_schema_version_other_than_2_is_rejected(cls, bad):
    body = valid_instances()[cls].to_json()
    body["schema_version"] = bad
    assert_field(cls, "schema_version", **body)


@pytest.mark.parametrize("cls", DIGEST_MODELS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("field,bad", [("digest_version", 1), ("digest_version", 3),
                                       ("digest_version", True), ("digest_version", "2"),
                                       ("extras_digest_version", 2),
                                       ("extras_digest_version", 0),
                                       ("extras_digest_version", True),
                                       ("extras_digest_version", "1")])
def test_digest_versions_other_than_2_and_1_are_rejected(cls, field, bad):
    body = valid_instances()[cls].to_json()
    body[field] = bad
    assert_field(cls, field, **body)


@pytest.mark.parametrize("cls", list(ORDER), ids=lambda c: c.__name__)
def test_versions_may_be_omitted(cls):
    instance = valid_instances()[cls]
    body = instance.to_json()
    for name in VERSIONS:
        body.pop(name, None)
    loaded = cls(**body)
    assert loaded == instance
    assert loaded.schema_version == 2


def test_receipt_manifest_rows_report_their_index():
    body = receipt_json()
    body["manifest"][1]["prev_len"] = True
    error = model_error(RolloutReceipt, **body)
    assert error.field is not None and error.field.startswith("manifest")
    assert "prev_len" in error.field and "1" in error.field


# --- field types -------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["prev_len", "delta_len", "cum_len", "weight_version"])
@pytest.mark.parametrize("bad", [True, False, 1.0, "1", None, -1])
def test_strict_nonnegative_ints(field, bad):
    assert_field(StagedCallBaseSnapshot, field, **{**child_snapshot(), field: bad})
    assert_field(CallRecord, field, **{**call_row(), field: bad})
    assert_field(CommitCoords, field, **{**coords(), field: bad})


@pytest.mark.parametrize("bad", [True, 1.0, "1", -1])
def test_strict_ints_elsewhere(bad):
    assert_field(CallRecord, "fingerprint_version", **{**call_row(), "fingerprint_version": bad})
    assert_field(CaptureAdmission, "prev_len", **admission(prev_len=bad))


@pytest.mark.parametrize("bad", [[True], [1.0], ["1"], [None], 5, "12"])
def test_strict_int_lists(bad):
    body = child_snapshot()
    body["token_ids_delta"] = bad
    assert_field(StagedCallBaseSnapshot, "token_ids_delta", **body)
    assert_field(CaptureAdmission, "required_prefix_token_ids",
                 **admission(required_prefix_token_ids=bad))


@pytest.mark.parametrize("field", ["token_mask_delta", "generation_log_probs_delta"])
@pytest.mark.parametrize("bad", [[True, False, True], ["0.0", "0.0", "1.0"],
                                 [None, 0.0, 1.0], [math.nan, 0.0, 1.0], [math.inf, 0.0, 1.0],
                                 0.0])
def test_strict_float_columns(field, bad):
    body = child_snapshot()
    body[field] = bad
    assert_field(StagedCallBaseSnapshot, field, **body)


def test_ints_are_coerced_to_float_in_float_columns():
    body = redigest({**child_snapshot(), "generation_log_probs_delta": [0.0, 0.0, -1.0]})
    as_ints = {**body, "token_mask_delta": [0, 0, 1], "generation_log_probs_delta": [0, 0, -1]}
    snapshot = StagedCallBaseSnapshot.from_json(json.dumps(as_ints))
    dumped = snapshot.to_json()
    assert dumped["token_mask_delta"] == [0.0, 0.0, 1.0]
    assert all(type(x) is float for x in dumped["token_mask_delta"])
    assert all(type(x) is float for x in dumped["generation_log_probs_delta"])
    assert snapshot == StagedCallBaseSnapshot(**body)
    row = CallRecord(**{**call_row(), "admitted_at": 5})
    assert row.admitted_at == 5.0 and type(row.admitted_at) is float


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, True, "5"])
def test_admitted_at_is_a_finite_strict_float(bad):
    assert_field(CallRecord, "admitted_at", **{**call_row(), "admitted_at": bad})


@pytest.mark.parametrize("field", ["digest", "extras_digest", "chain_hash", "cumulative_hash"])
@pytest.mark.parametrize("bad", [("ab" * 32).upper(), "aB" * 32, D1[:-1], D1 + "1", D1 + "\n",
                                 "\n" + D1[1:], "g" * 64, None, 7, ""])
def test_digest_hex(field, bad):
    assert_field(StagedCallBaseSnapshot, field, **{**child_snapshot(), field: bad})
    assert_field(CallRecord, field, **{**call_row(), field: bad})


@pytest.mark.parametrize("bad", ["", 5, None, b"R"])
def test_identifiers_are_non_empty_strict_strings(bad):
    assert_field(StagedCallBaseSnapshot, "rollout_id", **{**child_snapshot(), "rollout_id": bad})
    assert_field(CallRecord, "response_id", **{**call_row(), "response_id": bad})
    assert_field(RolloutReceipt, "rollout_id", **{**receipt_json(), "rollout_id": bad})


def test_identifiers_have_no_charset_restriction():
    for call_id in ("a/b", "été", "\U0001f600", " ", "x" * 1000):
        admission_ok = CaptureAdmission(rollout_id=call_id, model_call_id=call_id, mode="text")
        assert admission_ok.model_call_id == call_id


@pytest.mark.parametrize("field", ["rollout_id", "model_call_id", "mode", "prev_len", "delta_len",
                                   "cum_len", "weight_version", "digest", "token_ids_delta",
                                   "token_mask_delta", "generation_log_probs_delta",
                                   "chain_hash", "cumulative_hash"])
def test_required_snapshot_fields(field):
    body = child_snapshot()
    del body[field]
    assert_field(StagedCallBaseSnapshot, field, **body)


@pytest.mark.parametrize("field", ["model_call_id", "prev_len", "delta_len", "cum_len",
                                   "weight_version", "digest", "extras_digest", "staging_key",
                                   "chain_hash", "cumulative_hash", "response_id"])
def test_required_call_record_fields(field):
    body = call_row()
    del body[field]
    assert_field(CallRecord, field, **body)


def test_mode_literal():
    assert_field(StagedCallBaseSnapshot, "mode", **{**child_snapshot(), "mode": "TOKEN_IN"})
    assert_field(CaptureAdmission, "mode", **admission(mode=None))
    body = admission()
    del body["mode"]
    assert_field(CaptureAdmission, "mode", **body)


# --- CaptureAdmission (2.1) --------------------------------------------------------------------------

def test_capture_admission_valid_states():
    CaptureAdmission(**admission())
    # a staging_chain admission may carry an empty inline prefix
    CaptureAdmission(**admission(required_prefix_token_ids=[], staging_chain=["R/a"]))
    root = CaptureAdmission(rollout_id="R", model_call_id="a", mode="text")
    assert root.to_json() == {
        "schema_version": 2, "rollout_id": "R", "model_call_id": "a", "parent_call_id": None,
        "prev_len": 0, "mode": "text", "required_prefix_token_ids": [], "staging_chain": [],
        "parent_chain_hash": None}
    # staging_chain holds plain str: "" is fine
    CaptureAdmission(**admission(staging_chain=["", "R/a"], required_prefix_token_ids=[]))


TEXT_RULE = "text admission must be a parentless root with no required prefix"


@pytest.mark.parametrize("values,message", [
    (admission(required_prefix_token_ids=[1, -2]), "required_prefix_token_ids must be non-negative"),
    # rule 1 comes first even for a text admission and even with other problems
    (dict(rollout_id="R", model_call_id="a", mode="text", required_prefix_token_ids=[-1]),
     "required_prefix_token_ids must be non-negative"),
    (admission(parent_call_id=None), "token_in admission requires a parent_call_id and prev_len > 0"),
    (admission(prev_len=0, required_prefix_token_ids=[]),
     "token_in admission requires a parent_call_id and prev_len > 0"),
    (admission(parent_chain_hash=None), "token_in admission requires the parent's chain hash"),
    (admission(parent_chain_hash=None, parent_call_id=None),
     "token_in admission requires a parent_call_id and prev_len > 0"),
    (admission(required_prefix_token_ids=[1]), "required_prefix_token_ids length must equal prev_len"),
    (admission(required_prefix_token_ids=[]), "required_prefix_token_ids length must equal prev_len"),
    (dict(rollout_id="R", model_call_id="a", mode="text", parent_call_id="p"), TEXT_RULE),
    (dict(rollout_id="R", model_call_id="a", mode="text", prev_len=1), TEXT_RULE),
    (dict(rollout_id="R", model_call_id="a", mode="text", required_prefix_token_ids=[1]), TEXT_RULE),
    (dict(rollout_id="R", model_call_id="a", mode="text", staging_chain=["R/x"]), TEXT_RULE),
    (dict(rollout_id="R", model_call_id="a", mode="text", parent_chain_hash=D1), TEXT_RULE),
])
def test_capture_admission_rules(values, message):
    assert_rule(CaptureAdmission, message, **values)


def test_capture_admission_field_errors_precede_rules():
    # parent_chain_hash malformed: a field error, the model rules never run
    assert_field(CaptureAdmission, "parent_chain_hash", **admission(parent_chain_hash="AB" * 32,
                                                                    parent_call_id=None))
    assert_field(CaptureAdmission, "staging_chain", **admission(staging_chain=[1]))


# --- StagedCallBaseSnapshot (2.2) -------------------------------------------------------------------

def _child(**changes) -> dict:
    return {**child_snapshot(), **changes}


def _root(**changes) -> dict:
    return {**root_snapshot(), **changes}


U64_OVER = 2**64
SNAPSHOT_RULES = [
    ("parentless_prev_len", _root(prev_len=2, cum_len=7),
     "a parentless staged call must have prev_len == 0"),
    ("child_prev_len", _child(prev_len=0, cum_len=3), "a child staged call must have prev_len > 0"),
    ("parentless_mode", _root(mode="token_in"), "a parentless staged call must use text mode"),
    ("child_mode", _child(mode="text"), "a child staged call must use token_in mode"),
    ("empty_delta", _child(delta_len=0, cum_len=5, token_ids_delta=[], token_mask_delta=[],
                           generation_log_probs_delta=[]),
     "a staged call delta must contain at least one token"),
    ("negative_token", _child(token_ids_delta=[300, -1, 400]), "token_ids_delta must be non-negative"),
    ("mask_value", _child(token_mask_delta=[0.0, 0.5, 1.0]),
     "token_mask_delta must contain only 0.0 or 1.0"),
    ("mask_value_2", _child(token_mask_delta=[0.0, 0.0, 2.0]),
     "token_mask_delta must contain only 0.0 or 1.0"),
    ("carry_logprob", _child(generation_log_probs_delta=[0.0, -0.5, -0.125]),
     "prompt-carry log probabilities must be 0.0"),
    # zip stops at the shorter list: the carry rule passes, the digest precondition reports it
    ("carry_zip", _child(token_mask_delta=[0.0, 0.0], generation_log_probs_delta=[0.0, 0.0, -0.125]),
     "token IDs, masks, and log probabilities must have equal lengths"),
    ("delta_len", _child(delta_len=3, token_ids_delta=[300, 301]),
     "delta_len 3 does not match 2 token IDs"),
    ("equal_lengths", _child(generation_log_probs_delta=[0.0, 0.0, -0.125, -1.0]),
     "token IDs, masks, and log probabilities must have equal lengths"),
    ("cum_len", _child(prev_len=1, delta_len=2, cum_len=7, token_ids_delta=[300, 400],
                       token_mask_delta=[0.0, 1.0], generation_log_probs_delta=[0.0, -0.5]),
     "cum_len 7 does not equal prev_len + delta_len (3)"),
    ("u64_token", _child(token_ids_delta=[300, U64_OVER, 400]),
     "token_id must be an unsigned 64-bit integer, got 18446744073709551616"),
    ("u64_weight_version", _child(weight_version=U64_OVER),
     "weight_version must be an unsigned 64-bit integer, got 18446744073709551616"),
    ("u64_prev_len", _child(prev_len=U64_OVER, cum_len=U64_OVER + 3),
     "prev_len must be an unsigned 64-bit integer, got 18446744073709551616"),
    ("float32_overflow", _child(generation_log_probs_delta=[0.0, 0.0, -1e39]),
     "generation_log_probs_delta value cannot be represented as float32: -1e+39"),
    ("digest", _child(digest=D1), "digest does not match staged call contents"),
    ("digest_weight_version", _child(weight_version=7),
     "digest does not match staged call contents"),
    # rule order: each row breaks an earlier and a later rule; the earlier one wins
    ("order_1_10", _root(prev_len=2, cum_len=7, digest=D1),
     "a parentless staged call must have prev_len == 0"),
    ("order_2_4", _child(prev_len=0, mode="text"), "a child staged call must have prev_len > 0"),
    ("order_5_9", _child(delta_len=0), "a staged call delta must contain at least one token"),
    ("order_6_7", _child(token_ids_delta=[-1, 0, 0], token_mask_delta=[0.5, 0.0, 1.0]),
     "token_ids_delta must be non-negative"),
    ("order_6_u64", _child(token_ids_delta=[U64_OVER, -1, 0]), "token_ids_delta must be non-negative"),
    ("order_7_8", _child(token_mask_delta=[0.5, 0.0, 1.0], generation_log_probs_delta=[0.0, -1.0, 0.0]),
     "token_mask_delta must contain only 0.0 or 1.0"),
    ("order_8_9", _child(delta_len=4, generation_log_probs_delta=[-1.0, 0.0, 0.0]),
     "prompt-carry log probabilities must be 0.0"),
    ("cum_len_99", _child(cum_len=99), "cum_len 99 does not equal prev_len + delta_len (8)"),
    ("order_wv_token", _child(weight_version=U64_OVER, token_ids_delta=[U64_OVER, 0, 0]),
     "weight_version must be an unsigned 64-bit integer, got 18446744073709551616"),
    ("order_token_logprob", _child(token_ids_delta=[0, 0, U64_OVER],
                                   generation_log_probs_delta=[0.0, 0.0, -1e39]),
     "token_id must be an unsigned 64-bit integer, got 18446744073709551616"),
]


@pytest.mark.parametrize("values,message", [(v, m) for _n, v, m in SNAPSHOT_RULES],
                         ids=[n for n, _v, _m in SNAPSHOT_RULES])
def test_staged_call_base_snapshot_rules(values, message):
    assert_rule(StagedCallBaseSnapshot, message, **values)
    # the same rules (and text) hold for the full record and through the JSON loader
    assert_rule(StagedCallRecord, message, **values)
    with pytest.raises(WireValidationError) as info:
        StagedCallBaseSnapshot.from_json(json.dumps(values))
    assert info.value.reason == message


def test_snapshot_does_not_check_chain_or_cumulative_hash_against_tokens():
    # they are only bound into the digest
    body = redigest({**child_snapshot(), "chain_hash": D1, "cumulative_hash": D2})
    snapshot = StagedCallBaseSnapshot(**body)
    assert snapshot.chain_hash == D1


def test_snapshot_numpy_columns_are_accepted():
    body = child_snapshot()
    arrays = {**body, "token_ids_delta": np.array(body["token_ids_delta"], dtype=np.uint64),
              "token_mask_delta": np.array(body["token_mask_delta"]),
              "generation_log_probs_delta": np.array(body["generation_log_probs_delta"])}
    assert StagedCallBaseSnapshot(**arrays) == StagedCallBaseSnapshot(**body)


# --- StagedCallRecord (2.3) ----------------------------------------------------------------------------

def test_staged_call_record_extras_digest_mismatch():
    body = root_record()
    assert_rule(StagedCallRecord, "extras_digest does not match extras", **{**body, "extras": None})
    assert_rule(StagedCallRecord, "extras_digest does not match extras",
                **{**body, "extras": {"routed_experts": "nrlre1:int8:2x1x2:AQIDBA=="}})
    # None and {} are different extras
    child = child_snapshot()
    StagedCallRecord(**child, extras=None)
    assert_rule(StagedCallRecord, "extras_digest does not match extras", **child, extras={})
    # 1 and 1.0 are different extras
    with_int = redigest({**child, "extras_digest": ref.extras_digest({"x": 1})})
    StagedCallRecord(**with_int, extras={"x": 1})
    assert_rule(StagedCallRecord, "extras_digest does not match extras", **with_int,
                extras={"x": 1.0})
    assert_rule(StagedCallRecord, "extras_digest does not match extras", **with_int,
                extras={"x": True})


def test_staged_call_record_base_rules_run_first():
    body = {**root_record(), "digest": D1, "extras": {"other": 1}}
    assert_rule(StagedCallRecord, "digest does not match staged call contents", **body)


@pytest.mark.parametrize("extras,message", [
    ({"x": math.nan}, "extras floats must be finite, got nan"),
    ({"x": [1.0, -math.inf]}, "extras floats must be finite, got -inf"),
    ({"x": 2**63}, "extras integer is outside signed 64-bit range: 9223372036854775808"),
    ({"x": {"y": -(2**63) - 1}},
     "extras integer is outside signed 64-bit range: -9223372036854775809"),
])
def test_staged_call_record_extras_encoder_value_errors(extras, message):
    assert_rule(StagedCallRecord, message, **child_snapshot(), extras=extras)


def test_staged_call_record_extras_keys_must_be_strings():
    assert_field(StagedCallRecord, "extras", **child_snapshot(), extras={1: "x"})
    assert_field(StagedCallRecord, "extras", **child_snapshot(), extras=[1])


@pytest.mark.parametrize("extras,message", [
    ({"x": (1, 2)}, "extras contain unsupported value type tuple"),
    ({"x": b"raw"}, "extras contain unsupported value type bytes"),
    ({"x": {1: 2}}, "extras mappings must have string keys"),
])
def test_staged_call_record_extras_type_errors_are_value_errors_with_gyms_text(extras, message):
    # Deliberate difference: Gym lets this TypeError escape raw; every loader error here is a
    # ValueError (WireValidationError) so callers handle bad input in one place.
    with pytest.raises(WireValidationError) as info:
        StagedCallRecord(**child_snapshot(), extras=extras)
    assert info.value.reason == message and info.value.field is None


def test_staged_call_snapshot_is_a_record():
    snapshot = StagedCallSnapshot(**root_record())
    assert isinstance(snapshot, StagedCallRecord) and isinstance(snapshot, StagedCallBaseSnapshot)
    assert snapshot.extras == {"routed_experts": "nrlre1:int16:2x1x2:AQACAAMABAA="}


# --- StageResult (2.4) -----------------------------------------------------------------------------------

def test_stage_result_rules():
    assert_rule(StageResult, "a successful stage result requires staging_key", ok=True)
    assert_rule(StageResult, "a failed stage result requires an error", ok=False)
    assert_rule(StageResult, "a failed stage result requires an error", ok=False, error="")
    assert_rule(StageResult, "a failed stage result requires an error", ok=False, staging_key="k")
    assert StageResult(ok=False, error="disk full").error == "disk full"
    assert StageResult(ok=True, staging_key="opaque key").staging_key == "opaque key"
    assert_field(StageResult, "staging_key", ok=True, staging_key="")
    assert_field(StageResult, "ok")


@pytest.mark.parametrize("value,expected", [(True, True), (1, True), ("true", True), ("yes", True),
                                            ("on", True), ("1", True), (False, False), (0, False),
                                            ("false", False), ("no", False), ("off", False)])
def test_stage_result_ok_is_a_lax_bool(value, expected):
    result = StageResult(ok=value, staging_key="k", error="e")
    assert result.ok is expected


@pytest.mark.parametrize("value", [2, -1, 0.5, "maybe", None, [], "2"])
def test_stage_result_ok_rejects_non_bools(value):
    assert_field(StageResult, "ok", ok=value, staging_key="k", error="e")


# --- CommitCoords (2.5) ---------------------------------------------------------------------------------

def test_commit_coords_valid_states():
    assert CommitCoords(**coords()).disposition == "staged"
    failed = CommitCoords(**failed_coords())
    assert failed.to_json()["digest"] is None
    root = CommitCoords(**coords(parent_call_id=None, prev_len=0, cum_len=3))
    assert root.parent_call_id is None
    # disposition defaults to "staged"
    body = coords()
    del body["disposition"]
    assert CommitCoords(**body).disposition == "staged"


PAYLOAD = ("digest", "extras_digest", "staging_key", "chain_hash", "cumulative_hash")
STAGED_RULE = ("staged coordinates require digest, extras_digest, staging_key, chain_hash, and "
               "cumulative_hash")


@pytest.mark.parametrize("values,message", [
    (coords(parent_call_id=None), "parentless coordinates must have prev_len == 0"),
    (coords(prev_len=0, cum_len=3), "child coordinates must have prev_len > 0"),
    (coords(cum_len=9), "cum_len must equal prev_len + delta_len"),
    *[(coords(**{name: None}), STAGED_RULE) for name in PAYLOAD],
    (coords(delta_len=0, cum_len=5), "staged coordinates require a non-empty delta"),
    *[(failed_coords(**{name: coords()[name]}),
       "capture_failed coordinates cannot carry staged payload metadata") for name in PAYLOAD],
    (failed_coords(delta_len=1, cum_len=6), "capture_failed coordinates cannot carry token deltas"),
    # order
    (coords(parent_call_id=None, cum_len=99), "parentless coordinates must have prev_len == 0"),
    (coords(prev_len=0, cum_len=99, digest=None), "child coordinates must have prev_len > 0"),
    (coords(cum_len=99, digest=None), "cum_len must equal prev_len + delta_len"),
    (coords(delta_len=0, cum_len=5, digest=None), STAGED_RULE),
    (failed_coords(delta_len=1, cum_len=6, digest=D1),
     "capture_failed coordinates cannot carry staged payload metadata"),
])
def test_commit_coords_rules(values, message):
    assert_rule(CommitCoords, message, **values)


def test_commit_coords_fields():
    body = failed_coords()
    del body["weight_version"]  # required even on capture_failed
    assert_field(CommitCoords, "weight_version", **body)
    assert_field(CommitCoords, "disposition", **coords(disposition="failed"))
    assert_field(CommitCoords, "staging_key", **coords(staging_key=""))
    assert not hasattr(CommitCoords(**coords()), "mode")


# --- CallRecord (2.6) ---------------------------------------------------------------------------------------

LENGTH_RULE = "manifest lengths must describe a non-empty contiguous delta"


@pytest.mark.parametrize("changes,message", [
    ({"delta_len": 0, "cum_len": 5}, LENGTH_RULE),
    ({"cum_len": 9}, LENGTH_RULE),
    ({"parent_call_id": None}, "a parentless manifest row must have prev_len == 0"),
    ({"prev_len": 0, "cum_len": 3}, "a child manifest row must have prev_len > 0"),
    ({"parent_call_id": None, "prev_len": 0, "cum_len": 3},
     "a parentless manifest row must use text mode"),
    ({"mode": "text"}, "a child manifest row must use token_in mode"),
    # order
    ({"delta_len": 0, "cum_len": 5, "parent_call_id": None}, LENGTH_RULE),
    ({"parent_call_id": None, "mode": "text"}, "a parentless manifest row must have prev_len == 0"),
    ({"prev_len": 0, "cum_len": 3, "mode": "text"}, "a child manifest row must have prev_len > 0"),
])
def test_call_record_rules(changes, message):
    assert_rule(CallRecord, message, **{**call_row(), **changes})


def test_call_record_defaults():
    root = call_row("a")
    del root["mode"]  # the default "token_in" is invalid for a root
    assert_rule(CallRecord, "a parentless manifest row must use text mode", **root)
    child = call_row("b")
    for name in ("mode", "admitted_at", "output_fingerprint", "continuation_fingerprint",
                 "fingerprint_version"):
        del child[name]
    row = CallRecord(**child)
    assert (row.mode, row.admitted_at, row.fingerprint_version) == ("token_in", None, 0)
    assert row.output_fingerprint is None and row.continuation_fingerprint is None
    assert not hasattr(row, "rollout_id")
    assert_field(CallRecord, "output_fingerprint", **{**call_row(), "output_fingerprint": "x"})


# --- RolloutReceipt (2.9) ---------------------------------------------------------------------------------

def _receipt(**changes) -> dict:
    return {**receipt_json(), **changes}


RECEIPT_RULES = [
    ("duplicate_ids", _receipt(manifest=[call_row("a"), call_row("b"), call_row("b")]),
     "receipt manifest contains duplicate model_call_id values"),
    ("terminal_absent", _receipt(terminal_model_call_id="zz"),
     "terminal_model_call_id is absent from the receipt manifest"),
    ("terminal_absent_empty", _receipt(manifest=[]),
     "terminal_model_call_id is absent from the receipt manifest"),
    ("unpoisoned_reason", _receipt(failure_reason="x"),
     "an unpoisoned receipt cannot carry a failure_reason"),
    ("unpoisoned_empty_reason", _receipt(failure_reason=""),
     "an unpoisoned receipt cannot carry a failure_reason"),
    ("unpoisoned_no_terminal", _receipt(terminal_model_call_id=None),
     "an unpoisoned receipt must name terminal_model_call_id and terminal_selection"),
    ("unpoisoned_no_selection", _receipt(terminal_selection=None),
     "an unpoisoned receipt must name terminal_model_call_id and terminal_selection"),
    ("terminal_without_selection", _receipt(capture_poisoned=True, terminal_selection=None,
                                            failure_reason="x"),
     "terminal_model_call_id requires a terminal_selection method"),
    ("no_attribution_no_reason", _receipt(capture_poisoned=True, terminal_selection=None,
                                          terminal_model_call_id=None),
     "a receipt with no attribution stage must be poisoned with a failure_reason"),
    # order
    ("order_dup_before_absent", _receipt(manifest=[call_row("a"), call_row("a")],
                                         terminal_model_call_id="b"),
     "receipt manifest contains duplicate model_call_id values"),
    ("order_absent_before_state", _receipt(terminal_model_call_id="zz", failure_reason="x"),
     "terminal_model_call_id is absent from the receipt manifest"),
    ("order_reason_before_terminal", _receipt(failure_reason="x", terminal_selection=None),
     "an unpoisoned receipt cannot carry a failure_reason"),
]


@pytest.mark.parametrize("values,message", [(v, m) for _n, v, m in RECEIPT_RULES],
                         ids=[n for n, _v, _m in RECEIPT_RULES])
def test_rollout_receipt_rules(values, message):
    assert_rule(RolloutReceipt, message, **values)


@pytest.mark.parametrize("state", [
    # (a) trainable
    dict(),
    # (b) poisoned after attribution: selection set, terminal set or unset, any reason
    dict(capture_poisoned=True),
    dict(capture_poisoned=True, terminal_model_call_id=None),
    dict(capture_poisoned=True, failure_reason=""),
    dict(capture_poisoned=True, terminal_model_call_id=None, failure_reason="worker_capture_failed"),
    # (c) poisoned with no attribution
    dict(capture_poisoned=True, terminal_selection=None, terminal_model_call_id=None,
         failure_reason="unresolved_parent"),
    dict(capture_poisoned=True, terminal_selection=None, terminal_model_call_id=None,
         failure_reason="", manifest=[]),
], ids=["a", "b_terminal", "b_no_terminal", "b_empty_reason", "b_reason", "c", "c_empty"])
def test_rollout_receipt_legal_states(state):
    receipt = RolloutReceipt(**_receipt(**state))
    assert RolloutReceipt.from_json(receipt.to_json_text()) == receipt


@pytest.mark.parametrize("selection", ["declared", "response_id", "content", "heuristic"])
def test_terminal_selection_values(selection):
    assert RolloutReceipt(**_receipt(terminal_selection=selection)).terminal_selection == selection


@pytest.mark.parametrize("selection", ["explicit", "", "Declared", 1])
def test_terminal_selection_rejects_other_values(selection):
    assert_field(RolloutReceipt, "terminal_selection", **_receipt(terminal_selection=selection))


@pytest.mark.parametrize("value,expected", [(1, 1.0), (True, 1.0), ("1.5", 1.5), (-2.25, -2.25),
                                            (None, None), ("-7", -7.0), ("1e3", 1000.0)])
def test_reward_is_a_lax_float(value, expected):
    receipt = RolloutReceipt(**_receipt(reward=value))
    assert receipt.reward == expected
    assert receipt.reward is None or type(receipt.reward) is float


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "nan", "inf", "abc", [1]])
def test_reward_rejects_non_finite_and_non_numbers(value):
    assert_field(RolloutReceipt, "reward", **_receipt(reward=value))


def test_receipt_lax_bool_and_plain_str_fields():
    assert RolloutReceipt(**_receipt(capture_poisoned="true")).capture_poisoned is True
    assert RolloutReceipt(**_receipt(capture_poisoned=0)).capture_poisoned is False
    assert_field(RolloutReceipt, "capture_poisoned", **_receipt(capture_poisoned="perhaps"))
    assert_field(RolloutReceipt, "failure_reason", **_receipt(capture_poisoned=True,
                                                              failure_reason=5))
    assert_field(RolloutReceipt, "terminal_attribution_reason",
                 **_receipt(terminal_attribution_reason=5))
    assert_field(RolloutReceipt, "manifest", **_receipt(manifest={"a": 1}))


def test_records_are_mutable_without_revalidation():
    # spec 2.0: not frozen, no validate-on-assignment
    row = CallRecord(**call_row())
    row.prev_len = -5
    assert row.prev_len == -5
    snapshot = StagedCallBaseSnapshot(**child_snapshot())
    snapshot.digest = "not a digest"
    assert snapshot.digest == "not a digest"


def test_construct_skips_validation():
    row = CallRecord.construct(model_call_id="x", prev_len=-1)
    assert row.prev_len == -1 and row.mode == "token_in" and row.digest is None


@pytest.mark.parametrize("value,expected", [(1.0, True), (0.0, False)])
def test_lax_bool_accepts_float_zero_and_one(value, expected):
    assert StageResult(ok=value, staging_key="k", error="e").ok is expected
    assert RolloutReceipt.from_json(json.dumps(_receipt(capture_poisoned=value))).capture_poisoned \
        is expected
