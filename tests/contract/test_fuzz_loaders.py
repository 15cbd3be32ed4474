"""Fuzzing the untrusted-input surface: JSON loaders, the route envelope decoder, the extras
encoder and the verifier. Allowed outcomes only: a valid value, or the documented exception
types (ValueError, incl. WireValidationError; TypeError where documented) -- never another
exception, never a hang.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections import OrderedDict
from types import MappingProxyType

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage.contract import (
    CallRecord,
    CaptureAdmission,
    CommitCoords,
    ReceiptVerificationError,
    RolloutReceipt,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StageResult,
    WireValidationError,
    compute_extras_digest,
    decode_routed_experts,
    encode_routed_experts,
    routed_experts_token_count,
    verify_and_linearize,
)
from stage.contract.producer import RolloutBuilder

from . import reference as ref
from .strategies import U64_MAX, rollouts

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

LOADERS = [RolloutReceipt, CallRecord, StagedCallBaseSnapshot, StagedCallRecord, CommitCoords,
           CaptureAdmission, StageResult]
FIELD_NAMES = sorted({name for cls in LOADERS for name, _p, _d in cls.FIELDS})

# --- JSON-like values ---------------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2, U64_MAX, U64_MAX + 1, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, 0.5, -1e39, 1e-320]),
    st.text(max_size=8),
    st.sampled_from(["", "text", "token_in", "staged", "capture_failed", "declared", "ab" * 32,
                     "AB" * 32, "nrlre1:int8:1x1x1:AA=="]),
)
json_keys = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=6))
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(json_keys, children, max_size=5)),
    max_leaves=25)


def load(cls, payload):
    """from_json: a valid record (that round-trips) or a ValueError; anything else fails."""
    try:
        record = cls.from_json(payload)
    except ValueError as error:
        if isinstance(error, WireValidationError):
            assert error.model == cls.__name__
        return None
    assert type(record) is cls
    assert cls.from_json(record.to_json_text()) == record
    return record


# --- valid records to mutate -------------------------------------------------------------------

def _bases() -> dict:
    b = RolloutBuilder("R/ü")
    b.stage("a", parent_call_id=None, prompt_delta=[0, U64_MAX], generated=[2**63, 7],
            generated_logprobs=[-0.0, -3.4e38], weight_version=U64_MAX,
            extras={"routed_experts": encode_routed_experts(np.arange(8).reshape(4, 1, 2), "int8"),
                    "media_spans": [{"start": 0, "end": 1}], "f": 0.1, "i": -(2**63)})
    b.stage("b", parent_call_id="a", prompt_delta=[5], generated=[6],
            generated_logprobs=[-1e-50], weight_version=0, admitted_at=1.5)
    b.stage("c", parent_call_id="a", prompt_delta=[], generated=[9],
            generated_logprobs=[-0.1], weight_version=1, extras={})
    a, child = b.calls["a"], b.calls["b"]
    coords = {k: v for k, v in child.manifest_row.to_json().items()
              if k in {f for f, _p, _d in CommitCoords.FIELDS}}
    coords.update(rollout_id="R/ü", staging_key=child.manifest_row.staging_key,
                  disposition="staged")
    return {
        RolloutReceipt: b.receipt("b", order=["c", "a", "b"]).to_json(),
        CallRecord: child.manifest_row.to_json(),
        StagedCallBaseSnapshot: child.record.base_snapshot().to_json(),
        StagedCallRecord: a.record.to_json(),
        CommitCoords: coords,
        CaptureAdmission: CaptureAdmission(
            rollout_id="R", model_call_id="b", parent_call_id="a", prev_len=4, mode="token_in",
            staging_chain=["R/a"], parent_chain_hash=a.record.chain_hash).to_json(),
        StageResult: StageResult(ok=True, staging_key="R/b").to_json(),
    }


BASES = _bases()


def test_bases_are_valid():
    for cls, body in BASES.items():
        assert load(cls, body) is not None, cls.__name__


def _paths(value, prefix=()):
    """Every (container path) inside a JSON value, so mutations can reach nested rows."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:4]):
            yield from _paths(v, prefix + (i,))


def _get(value, path):
    for step in path:
        value = value[step]
    return value


@st.composite
def mutated_json(draw, base):
    body = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(body) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent, key = _get(body, path[:-1]), path[-1]
        op = draw(st.sampled_from(["drop", "add", "replace", "replace", "nudge"]))
        if op == "drop":
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif op == "add":
            if isinstance(parent, dict):
                parent[draw(json_keys)] = draw(json_values)
            else:
                parent.insert(key, draw(json_values))
        elif op == "nudge" and type(parent[key]) is int and not isinstance(parent[key], bool):
            parent[key] += draw(st.sampled_from([-1, 1, 2**64]))
        elif op == "nudge" and type(parent[key]) is float:
            parent[key] = -parent[key] if draw(st.booleans()) else parent[key] + 1.0
        else:
            parent[key] = draw(json_values)
    return body


# --- from_json ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", LOADERS, ids=lambda c: c.__name__)
@settings(FUZZ, max_examples=60)
@given(value=json_values)
def test_from_json_arbitrary_values(cls, value):
    load(cls, value)
    load(cls, json.dumps(value))  # NaN/Infinity literals when value holds non-finite floats


@pytest.mark.parametrize("cls", LOADERS, ids=lambda c: c.__name__)
@settings(FUZZ, max_examples=40)
@given(value=st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=12))
def test_from_json_arbitrary_objects_with_known_keys(cls, value):
    load(cls, value)


@pytest.mark.parametrize("cls", LOADERS, ids=lambda c: c.__name__)
@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_from_json_mutated_valid_records(cls, data):
    body = data.draw(mutated_json(BASES[cls]))
    load(cls, body)
    text = json.dumps(body)
    load(cls, text)
    load(cls, text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize("cls", LOADERS, ids=lambda c: c.__name__)
@settings(FUZZ, max_examples=40)
@given(payload=st.one_of(st.binary(max_size=64), st.text(max_size=64),
                         st.builds(lambda s: s.encode("utf-8", "surrogatepass"), st.text(max_size=32))))
def test_from_json_arbitrary_text_and_bytes(cls, payload):
    load(cls, payload)


HOSTILE = [
    "[" * 100_000,
    "{\"a\":" * 100_000,
    b"[" * 100_000,
    "[" * 5_000 + "]" * 5_000,
    "{\"extras\": " + "[" * 950 + "]" * 950 + "}",
    "NaN", "Infinity", "-Infinity", "{\"prev_len\": NaN}", "{\"reward\": Infinity}",
    "{\"admitted_at\": -Infinity}", "{\"admitted_at\": 1e999}", "{\"prev_len\": 1e999}",
    "1" * 5_000, "{\"prev_len\": " + "9" * 5_000 + "}", "{\"prev_len\": " + "9" * 4_000 + "}",
    "{\"weight_version\": -" + "9" * 100 + "}",
    b"\xff\xfe{}", b"{\"rollout_id\": \"\xff\"}", b"\xed\xa0\x80", "\"\\ud800\"",
    "{\"rollout_id\": \"\\ud800\"}", "\ud800", b"", "", " ", "{", "}", "{}", "[]", "null",
    "{\"__proto__\": 1}", "{\"a\": 1, \"a\": 2}", "\x00", "{\"\x00\": 0}",
]


@pytest.mark.parametrize("cls", LOADERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("payload", HOSTILE, ids=lambda p: repr(p)[:24])
def test_from_json_hostile_text(cls, payload):
    started = time.perf_counter()
    with pytest.raises(ValueError):
        cls.from_json(payload)
    assert time.perf_counter() - started < 2.0


def test_from_json_duplicate_keys_take_the_last_value():
    body = BASES[CallRecord]
    text = json.dumps(body)[:-1] + ", \"prev_len\": 99}"
    with pytest.raises(WireValidationError):
        CallRecord.from_json(text)


def test_deeply_nested_extras_value_is_a_value_error():
    nested = []
    for _ in range(100_000):
        nested = [nested]
    body = dict(BASES[StagedCallRecord], extras={"deep": nested})
    started = time.perf_counter()
    with pytest.raises(ValueError):
        StagedCallRecord(**body)
    with pytest.raises(ValueError):
        compute_extras_digest({"deep": nested})
    assert time.perf_counter() - started < 2.0


# --- routes ----------------------------------------------------------------------------------------

def _valid_envelopes():
    out = []
    for dtype, lo, hi in (("int8", -128, 127), ("int16", -(2**15), 2**15 - 1),
                          ("int32", -(2**31), 2**31 - 1)):
        for shape in ((1, 1, 1), (2, 1, 2), (3, 2, 3), (5, 1, 1)):
            values = np.linspace(lo, hi, num=int(np.prod(shape))).astype(np.int64).reshape(shape)
            out.append(encode_routed_experts(values, dtype=dtype))
    return out


ENVELOPES = _valid_envelopes()
envelope_like = st.builds(
    lambda magic, dtype, dims, body: f"{magic}:{dtype}:{'x'.join(dims)}:{body}",
    st.sampled_from(["nrlre1", "nrlre1", "nrlre2", "NRLRE1", ""]),
    st.sampled_from(["int8", "int16", "int32", "int64", "uint8", "", "int16:"]),
    st.lists(st.one_of(st.integers(-3, 9).map(str), st.sampled_from(
        ["+2", " 3", "1_0", "", "0x1", "1e2", "٣", "9" * 40, "99999", "2 "])), min_size=0,
        max_size=4),
    st.one_of(st.text(alphabet="ABCDEFGHabcdefgh0123456789+/=", max_size=24),
              st.text(max_size=8)))


@st.composite
def mutated_envelopes(draw):
    s = list(draw(st.sampled_from(ENVELOPES)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["replace", "insert", "delete", "truncate"]))
        i = draw(st.integers(0, max(len(s) - 1, 0)))
        if op == "replace" and s:
            s[i] = draw(st.sampled_from(list(":x=+/ A0\n-") + [draw(st.characters())]))
        elif op == "insert":
            s.insert(i, draw(st.sampled_from(list(":x=A0") + [draw(st.characters())])))
        elif op == "delete" and s:
            del s[i]
        else:
            s = s[:i]
    return "".join(s)


def _decode(payload):
    try:
        fragment = decode_routed_experts(payload)
    except ValueError:
        return None
    t, l, k = fragment.values.shape
    assert (fragment.num_tokens, fragment.num_layers, fragment.topk) == (t, l, k)
    assert min(t, l, k) > 0
    if isinstance(payload, str):
        assert fragment.dtype in ("int8", "int16", "int32")
        assert routed_experts_token_count(payload) == t
        again = decode_routed_experts(encode_routed_experts(fragment.values, fragment.dtype))
        assert np.array_equal(again.values, fragment.values)
    else:
        assert fragment.dtype == "legacy-int"
        assert fragment.values.tolist() == payload
    return fragment


@settings(FUZZ, max_examples=300)
@given(st.one_of(st.text(max_size=40), envelope_like, mutated_envelopes()))
def test_decode_routed_experts_arbitrary_strings(payload):
    started = time.perf_counter()
    _decode(payload)
    try:
        routed_experts_token_count(payload)
    except ValueError:
        pass
    assert time.perf_counter() - started < 1.0


@settings(FUZZ, max_examples=150)
@given(json_values)
def test_decode_routed_experts_arbitrary_legacy_values(payload):
    _decode(payload)


@pytest.mark.parametrize("payload", [
    "nrlre1:int8:1x1x1:" + "A" * 10_000_000,
    "nrlre1:int32:99999999x99999999x99999999:",
    "nrlre1:int32:46340x46340x1:",
    "nrlre1:int8:" + "9" * 10_000 + "x1x1:AA==",
    "nrlre1:int8:1x1x1:" + "=" * 1_000_000,
    "nrlre1:int8:1x1x1:" + ":" * 1_000_000,
    "nrlre1:int8:" + "x" * 1_000_000 + ":AA==",
])
def test_decode_routed_experts_hostile_is_fast(payload):
    started = time.perf_counter()
    with pytest.raises(ValueError):
        decode_routed_experts(payload)
    assert time.perf_counter() - started < 1.0


# --- extras digest ---------------------------------------------------------------------------------

extras_leaves = st.one_of(json_scalars, st.tuples(st.integers()), st.binary(max_size=3),
                          st.frozensets(st.integers(), max_size=2), st.just(np.int64(1)),
                          st.just(np.float64(0.5)))
extras_values = st.recursive(
    extras_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=6), children, max_size=4),
        st.dictionaries(st.one_of(st.integers(), st.text(max_size=2)), children, max_size=2)),
    max_leaves=20)


@settings(FUZZ, max_examples=300)
@given(st.one_of(extras_values, st.dictionaries(st.text(max_size=6), extras_values, max_size=5)))
def test_compute_extras_digest_arbitrary_values(value):
    try:
        digest = compute_extras_digest(value)
    except (ValueError, TypeError) as error:
        if value is not None and not isinstance(value, dict):
            assert type(error) is TypeError
            assert str(error) == f"extras must be a mapping or None, got {type(value).__name__}"
            return
        with pytest.raises(type(error)):
            ref.extras_digest(value)
        return
    assert value is None or isinstance(value, dict)
    assert digest == ref.extras_digest(value)


def test_compute_extras_digest_mappings():
    payload = {"b": 1, "a": [1.0, None, True]}
    expected = ref.extras_digest(payload)
    # any Mapping is shallow-copied to a dict at the top level
    assert compute_extras_digest(OrderedDict(reversed(list(payload.items())))) == expected
    assert compute_extras_digest(MappingProxyType(payload)) == expected
    # ...but nested values are type-checked exactly
    with pytest.raises(TypeError, match="^extras contain unsupported value type OrderedDict$"):
        compute_extras_digest({"x": OrderedDict(payload)})
    with pytest.raises(TypeError, match="^extras must be a mapping or None, got list$"):
        compute_extras_digest([1])


# --- verify_and_linearize over mutated validated records ------------------------------------------

def _plain(fields: dict) -> dict:
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in fields.items()}


@st.composite
def mutated_rollout_inputs(draw):
    r = draw(rollouts(max_calls=5, list_columns=None))
    receipt = r.receipt.to_json()
    snapshots = [s.to_json() for s in r.snapshots]
    ids = list(r.order)
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(["snapshot", "snapshot", "row", "receipt", "structure"]))
        if target == "structure":
            op = draw(st.sampled_from(["swap", "drop", "dup", "drop_both"]))
            i = draw(st.integers(0, len(snapshots) - 1))
            j = draw(st.integers(0, len(snapshots) - 1))
            if op == "swap":
                snapshots[i], snapshots[j] = snapshots[j], snapshots[i]
            elif op == "drop":
                snapshots.pop(i)
            elif op == "dup":
                snapshots.append(copy.deepcopy(snapshots[i]))
            elif isinstance(receipt.get("manifest"), list) and i < len(receipt["manifest"]):
                receipt["manifest"].pop(i)
                snapshots.pop(i)
            if not snapshots:
                break
            continue
        rows = [m for m in receipt.get("manifest") or [] if isinstance(m, dict)] \
            if isinstance(receipt.get("manifest"), list) else []
        if target == "receipt" or (target == "row" and not rows):
            body = receipt
        elif target == "row":
            body = draw(st.sampled_from(rows))
        else:
            body = draw(st.sampled_from(snapshots))
        if not body:
            continue
        key = draw(st.sampled_from(sorted(body)))
        old = body[key]
        peers = [b[key] for b in [*snapshots, *rows] if isinstance(b, dict) and key in b]
        plausible = [draw(st.sampled_from(peers)) if peers else None,
                     draw(st.sampled_from([None, "ab" * 32, "text", "token_in", *ids]))]
        if type(old) is int:
            plausible += [old + 1, max(old - 1, 0), 0, U64_MAX]
        if isinstance(old, list) and old:
            k = draw(st.integers(0, len(old) - 1))
            swapped = list(old)
            swapped[k] = draw(st.sampled_from([0, 1, 0.0, 1.0, -0.0, -0.5, U64_MAX, -1e39]))
            plausible += [swapped, old[::-1], old[:-1], old + old[-1:]]
        value = draw(st.sampled_from(plausible)) if draw(st.integers(0, 5)) else draw(json_values)
        body[key] = value
        if target == "snapshot" and draw(st.integers(0, 3)):
            # re-digest so that the mutation survives model validation
            try:
                body["digest"] = ref.staging_digest(**body)
            except Exception:
                pass
        if target == "snapshot" and draw(st.booleans()):
            # ...and carry the new values into its manifest row
            for row in rows:
                if row.get("model_call_id") == body.get("model_call_id"):
                    for name in row:
                        if name in body:
                            row[name] = body[name]
    return receipt, snapshots


@settings(FUZZ, max_examples=200)
@given(mutated_rollout_inputs())
def test_verify_mutated_validated_records(inputs):
    receipt_json, snapshot_jsons = inputs
    try:
        receipt = RolloutReceipt.from_json(json.dumps(receipt_json))
        snapshots = [StagedCallBaseSnapshot.from_json(json.dumps(s)) for s in snapshot_jsons]
    except ValueError:
        return  # not validated records
    try:
        row = verify_and_linearize(receipt, snapshots)
    except ReceiptVerificationError as error:
        assert str(error).startswith(f"{error.code}: ")
        return
    # soundness of an accepted row: it is exactly what the receipt commits to
    terminal = next(m for m in receipt.manifest if m.model_call_id == receipt.terminal_model_call_id)
    assert len(row.token_ids) == terminal.cum_len
    assert ref.hash_token_ids(row.token_ids.tolist()) == terminal.cumulative_hash
    assert row.model_call_ids[-1] == terminal.model_call_id
    mask = row.token_mask
    assert bool(((mask == 0.0) | (mask == 1.0)).all()) and bool(mask.any())
    assert not bool(((mask == 0.0) & (row.logprobs != 0.0)).any())
    running = None
    by_id = {m.model_call_id: m for m in receipt.manifest}
    for span in row.weight_version_spans:
        running = ref.chain_hash(running, row.token_ids[span.start:span.end].tolist())
        assert by_id[span.model_call_id].chain_hash == running
        assert by_id[span.model_call_id].weight_version == span.weight_version
    assert math.isfinite(float(np.abs(row.logprobs).max(initial=0.0)))
