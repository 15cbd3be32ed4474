"""Structure-aware mutations of valid traffic (tests/fuzz/traffic.py), one family per kind of
hostile input. ``FAMILIES[name](rng)`` returns a ``Case``: which stage configuration runs it
and the wire records, in production order, with what was done to them in ``Wire.note``.

Every draw comes from ``rng`` (a ``random.Random`` seeded per case), so a case is a pure
function of its seed. Base traffic comes from a pool of ``POOL`` workload seeds (cached), and
the mutations make each case different.
"""

from __future__ import annotations

import json
import math
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import stage.workload.generator as G
from stage.bench.hostile import CASES as HOSTILE_RECORDS
from stage.bench.hostile import fields_bytes, next_field, zigzag
from stage.wire import STORAGE_DTYPES, pack_tensor
from stage.wire.partitioner import partition_for
from tests.fuzz.traffic import (
    PARTITIONS, RECEIPTS, STAGED, Record, Traffic, Wire, encode, schema_of, valid_traffic,
    workload_config,
)

POOL = 48          # distinct base workloads per routes/media variant
PLAIN, DIRECT, DEFERRED, SMALL_ROWS = "plain", "direct", "deferred", "small-rows"


@dataclass
class Case:
    stage: str                  # PLAIN | DIRECT | DEFERRED | SMALL_ROWS (tests/fuzz/test_fuzz.py)
    wires: list[Wire]
    group_sizes: dict


def _base(rng: random.Random, **forced) -> Traffic:
    return valid_traffic(workload_config(rng.randrange(POOL), **forced))


def _wires(traffic: Traffic, changed: dict[int, list[Wire]] | None = None) -> list[Wire]:
    """Every record encoded, with record ``i`` replaced by ``changed[i]`` (zero or more)."""
    out = []
    for i, record in enumerate(traffic.records):
        out += changed[i] if changed and i in changed else [record.wire()]
    return out


def _case(stage: str, traffic: Traffic, wires: list[Wire]) -> Case:
    return Case(stage, wires, traffic.group_sizes)


def _pick(rng: random.Random, traffic: Traffic, role: str | None = None) -> int:
    choices = [i for i, r in enumerate(traffic.records) if role is None or r.role == role]
    return rng.choice(choices)


def _stage_for(rng: random.Random, traffic: Traffic) -> str:
    if traffic.routes is None:
        return PLAIN
    return rng.choice((PLAIN, DIRECT, DEFERRED))


# -- bytes ----------------------------------------------------------------------------------

def _byte_mutations(rng: random.Random, mutate) -> Case:
    """One to three records of valid traffic replaced by ``mutate(rng, wire)`` of their bytes."""
    traffic = _base(rng)
    changed = {}
    for _ in range(rng.randint(1, 3)):
        i = _pick(rng, traffic)
        changed[i] = [mutate(rng, traffic.records[i].wire())]
    return _case(_stage_for(rng, traffic), traffic, _wires(traffic, changed))


def _truncated(rng: random.Random, wire: Wire) -> Wire:
    cut = rng.randrange(len(wire.value))
    return wire.but(value=wire.value[:cut], note=f"truncated to {cut} of {len(wire.value)} bytes")


def _bits_flipped(rng: random.Random, wire: Wire) -> Wire:
    data = bytearray(wire.value)
    bits = [rng.randrange(len(data) * 8) for _ in range(rng.randint(1, 8))]
    for bit in bits:
        data[bit // 8] ^= 1 << (bit % 8)
    return wire.but(value=bytes(data), note=f"bits {bits} flipped")


def _spliced(rng: random.Random, wire: Wire) -> Wire:
    data, kind = wire.value, rng.randrange(6)
    at = rng.randrange(len(data))
    if kind == 0:
        data = data[:at] + rng.randbytes(rng.randint(1, 16)) + data[at:]
    elif kind == 1:
        data = data[:at] + data[at + rng.randint(1, 16):]
    elif kind == 2:
        data = data[:at] + rng.randbytes(rng.randint(1, 16)) + data[at + rng.randint(1, 16):]
    elif kind == 3:
        data = rng.randbytes(rng.randint(1, 512))
    elif kind == 4:
        data = b""
    else:
        data = None   # a tombstone on an input topic
    return wire.but(value=data, note=f"splice kind {kind} at {at}")


def truncations(rng: random.Random) -> Case:
    return _byte_mutations(rng, _truncated)


def bit_flips(rng: random.Random) -> Case:
    return _byte_mutations(rng, _bits_flipped)


def splices(rng: random.Random) -> Case:
    """Byte runs inserted, deleted, overwritten; random garbage, empty and null values."""
    return _byte_mutations(rng, _spliced)


# -- huge varint lengths and counts ---------------------------------------------------------

HUGE = (2**60, 2**63 - 1, 2**31, 2**31 - 1, -1, -(2**31), -(2**62))


def _marked(rng: random.Random, record: Record) -> tuple[Record, list[str]]:
    """The record with one string field set to a unique marker, and that field's path."""
    marker = f"\x01mark{rng.randrange(1 << 30):08x}\x01"
    value = record.value
    if record.role == STAGED:
        paths = ["group_id", "staging_key", "rollout_id", "model_call_id", "mode", "digest",
                 "extras_digest", "chain_hash", "cumulative_hash", "extras_metadata_json"]
        path = [rng.choice(paths)]
        value[path[0]] = marker
    else:
        manifest = (value.get("receipt") or {}).get("manifest") or []
        options = [["group_id"], ["rollout_id"]]
        if value.get("receipt") is not None:
            options.append(["receipt", "rollout_id"])
        options += [["receipt", "manifest", i, f] for i in range(len(manifest))
                    for f in ("model_call_id", "digest", "staging_key", "response_id")]
        path = rng.choice(options)
        node = value
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = marker
    return record, [str(p) for p in path] + [marker]


def huge_lengths(rng: random.Random) -> Case:
    """A string's length prefix replaced by a huge, negative or off-by-some value."""
    traffic = _base(rng)
    changed = {}
    for _ in range(rng.randint(1, 2)):
        i = _pick(rng, traffic)
        record, path = _marked(rng, traffic.records[i])
        marker = path.pop().encode()
        data = encode(record.role, record.value)
        at = data.index(marker)
        prefix = zigzag(len(marker))
        assert data[at - len(prefix):at] == prefix
        length = rng.choice(HUGE + (len(marker) + 1, len(marker) + 1000, len(data)))
        data = data[:at - len(prefix)] + zigzag(length) + data[at:]
        changed[i] = [Wire(record.role, record.group_id.encode(), data,
                           note=f"length of {'.'.join(path)} set to {length}")]
    return _case(_stage_for(rng, traffic), traffic, _wires(traffic, changed))


def _field_splice(record: Record, field: str, body: bytes) -> bytes:
    """The record's encoding with top-level field ``field`` replaced by ``body``."""
    name = schema_of(record.role)
    return (fields_bytes(name, record.value, None, field) + body
            + fields_bytes(name, record.value, next_field(name, field), None))


def huge_counts(rng: random.Random) -> Case:
    """Array block counts: huge, negative (a block byte size follows), more items than
    present; a tensor's shape count; the hostile records of stage.bench.hostile, keyed
    into the case's groups."""
    traffic = _base(rng)
    changed = {}
    for _ in range(rng.randint(1, 2)):
        kind = rng.randrange(4)
        if kind == 0:   # labels / result_stats of a receipt
            i = _pick(rng, traffic, RECEIPTS)
            record = traffic.records[i]
            field = rng.choice(("labels", "result_stats"))
            item = b"\x02a\x02b" if field == "labels" else b"\x02a" + struct.pack("<d", 1.0) + b"\x02"
            count = rng.choice(HUGE + (2, 33, 129, 1000))
            block_size = zigzag(rng.randint(0, 99)) if count < 0 else b""
            body = zigzag(count) + block_size + item * rng.randint(0, 4) + b"\x00"
            data = _field_splice(record, field, body)
            note = f"{field} count {count}"
        elif kind == 1:   # a tensor's shape
            i = _pick(rng, traffic, STAGED)
            record = traffic.records[i]
            field = rng.choice(("token_ids_delta", "token_mask_delta", "generation_log_probs_delta"))
            tensor = record.value[field]
            count = rng.choice(HUGE + (0, 2, 33, 5000))
            dims = zigzag(tensor["shape"][0]) * max(0, min(count, 4))
            dtype = list(STORAGE_DTYPES).index(tensor["dtype"])
            body = (zigzag(dtype) + zigzag(count) + dims + b"\x00" + zigzag(len(tensor["data"]))
                    + tensor["data"])
            data = _field_splice(record, field, body)
            note = f"{field}.shape count {count}"
        elif kind == 2:   # the manifest: its count sits before the first call's three ints
            receipts = [j for j, r in enumerate(traffic.records)
                        if r.role == RECEIPTS and (r.value.get("receipt") or {}).get("manifest")]
            if not receipts:
                continue
            i = rng.choice(receipts)
            record = traffic.records[i]
            marker = f"\x01m{rng.randrange(1 << 30):08x}\x01"
            record.value["receipt"]["manifest"][0]["model_call_id"] = marker
            data = encode(RECEIPTS, record.value)
            n = len(record.value["receipt"]["manifest"])
            at = data.index(marker.encode()) - 1 - 3 - len(zigzag(n))
            assert data[at:at + len(zigzag(n))] == zigzag(n)
            count = rng.choice(HUGE + (n + 1, n * 1000))
            data = data[:at] + zigzag(count) + (zigzag(7) if count < 0 else b"") + data[at + len(zigzag(n)):]
            note = f"receipt.manifest count {count} (holds {n})"
        else:   # a hostile record of stage.bench.hostile, under this case's group key
            i = _pick(rng, traffic)
            record = traffic.records[i]
            name = rng.choice(sorted(HOSTILE_RECORDS))
            role = RECEIPTS if name.startswith("ReceiptEvent") else STAGED
            size = rng.choice((512, 4096, 65536, 262144))
            data = HOSTILE_RECORDS[name][1](size)
            changed.setdefault(i, [record.wire()]).append(
                Wire(role, record.group_id.encode(), data, note=f"{name} of {size} bytes"))
            continue
        changed[i] = [Wire(record.role, record.group_id.encode(), data, note=note)]
    return _case(_stage_for(rng, traffic), traffic, _wires(traffic, changed))


# -- hostile tensors ------------------------------------------------------------------------

_TENSOR_FIELDS = ("token_ids_delta", "token_mask_delta", "generation_log_probs_delta",
                  "routed_experts", "routed_experts_boundary")


def _tensor_mutation(rng: random.Random, tensor: dict) -> str:
    kind = rng.randrange(9)
    shape, data = tensor["shape"], tensor["data"]
    if kind == 0:
        tensor["dtype"] = rng.choice(list(STORAGE_DTYPES))
        return f"dtype -> {tensor['dtype']}"
    if kind == 1 and shape:
        i = rng.randrange(len(shape))
        shape[i] = rng.choice((0, 1, 2**31, 2**40, 2**62, -1, -(2**62), shape[i] + 1))
        return f"shape[{i}] -> {shape[i]}"
    if kind == 2:
        tensor["shape"] = [1] * rng.choice((0, 4, 33, 64)) + list(shape)
        return f"{len(tensor['shape'])} dims"
    if kind == 4:
        tensor["data"] = data + rng.randbytes(rng.randint(1, 64))
        return "data extended"
    if kind == 5:
        count = math.prod(max(d, 0) for d in shape)
        tensor["dtype"], tensor["data"] = "bool", bytes([2]) * (count if count < 1 << 16 else len(data))
        return "bool bytes of 2"
    dtype = STORAGE_DTYPES[tensor["dtype"]]
    if kind in (6, 7) and len(data) % dtype.itemsize:
        kind = 3   # an earlier mutation left bytes that are no array of this dtype
    if kind == 3:
        tensor["data"] = data[:rng.randrange(len(data) + 1)]
        return f"data truncated to {len(tensor['data'])}"
    if kind == 6:   # values out of any sane range for the dtype's role
        arr = np.frombuffer(data, dtype=dtype).copy()
        if arr.size:
            arr.flat[rng.randrange(arr.size)] = (np.iinfo(arr.dtype).min if arr.dtype.kind in "iu"
                                                  else rng.choice((np.nan, np.inf, -np.inf, 3.4e38)))
        tensor["data"] = arr.tobytes()
        return "one value at its extreme"
    if kind == 7:   # negative token ids / expert ids in a signed dtype
        arr = np.frombuffer(data, dtype=dtype)
        if arr.dtype.kind in "iu" and arr.size:
            signed = arr.astype(np.int64)
            signed.flat[0] = -rng.randint(1, 2**40)
            tensor.update(pack_tensor(signed))
            return "negative value, as int64"
        return "unchanged"
    tensor["shape"] = list(reversed(shape)) + [1]
    return "shape reversed, a dim added"


def hostile_tensors(rng: random.Random) -> Case:
    traffic = _base(rng, media=rng.random() < 0.3, topk=rng.random() < 0.3)
    changed = {}
    for _ in range(rng.randint(1, 3)):
        i = _pick(rng, traffic, STAGED)
        record = traffic.records[i]
        value = record.value
        fields = [f for f in _TENSOR_FIELDS if value.get(f) is not None]
        nested = [(k, f) for k in ("media", "topk") if value.get(k) for f in value[k] if value[k][f]]
        choice = rng.randrange(len(fields) + len(nested))
        if choice < len(fields):
            where, tensor = fields[choice], value[fields[choice]]
        else:
            k, f = nested[choice - len(fields)]
            where, tensor = f"{k}.{f}", value[k][f]
        what = _tensor_mutation(rng, tensor)
        try:
            wire = record.wire(note=f"{where}: {what}")
        except ValueError:   # the codec refuses to encode it (a dim over 2^63, ...): skip
            continue
        changed[i] = [wire]
    return _case(_stage_for(rng, traffic), traffic, _wires(traffic, changed))


# -- numbers --------------------------------------------------------------------------------

NONFINITE = (math.nan, math.inf, -math.inf)
OUT_OF_RANGE_FLOATS = (1e308, -1e308, 3.5e38, -3.5e38, 1e39)
ODD_FLOATS = (5e-324, -0.0, 1.17e-38, 3.4e38, -3.4e38)   # subnormal, signed zero, float32 edges
HUGE_INTS = (2**63 - 1, -(2**63), 2**31, -(2**31) - 1, -1, 0)


def _number_mutation(rng: random.Random, traffic: Traffic, floats) -> tuple[int, str]:
    i = _pick(rng, traffic)
    record = traffic.records[i]
    value = record.value
    if record.role == RECEIPTS:
        options = ["reward", "loss_multiplier", "result_stats", "prompt_idx",
                   "fallback_weight_version", "group_size", "rollout_index"]
        if value.get("receipt"):
            options += ["receipt.reward", "manifest"]
        where = rng.choice(options)
        if where == "result_stats":
            value["result_stats"] = [{"field": "score", "sum": rng.choice(floats),
                                      "count": rng.choice((1, -1, 2**62))}]
        elif where == "receipt.reward":
            value["receipt"]["reward"] = rng.choice(floats)
        elif where == "manifest":
            call = rng.choice(value["receipt"]["manifest"])
            key = rng.choice(("prev_len", "delta_len", "cum_len", "weight_version", "admitted_at"))
            call[key] = rng.choice(floats) if key == "admitted_at" else rng.choice(HUGE_INTS)
            where = f"manifest call {call['model_call_id']}.{key} = {call[key]}"
        elif where in ("reward", "loss_multiplier"):
            value[where] = rng.choice(floats)
        elif where in ("group_size", "rollout_index"):
            value[where] = rng.choice((0, -1, 2**31 - 1, value["group_size"] + 1, 4097))
        else:
            value[where] = rng.choice(HUGE_INTS)
    else:
        where = rng.choice(("prev_len", "delta_len", "cum_len", "weight_version", "route_encoding",
                            "token_mask_delta", "generation_log_probs_delta"))
        if where.endswith("_delta"):
            arr = np.frombuffer(value[where]["data"], dtype=STORAGE_DTYPES[value[where]["dtype"]]).copy()
            arr[rng.randrange(arr.size)] = rng.choice(floats)
            value[where]["data"] = arr.tobytes()
        elif where == "route_encoding":
            value[where] = rng.choice((-1, 3, 2**31 - 1, 1, 2))
        else:
            value[where] = rng.choice(HUGE_INTS + (value["delta_len"] + 1, 4_194_305))
    return i, f"{record.role} {where}"


def _numbers(rng: random.Random, floats) -> Case:
    traffic = _base(rng)
    changed = {}
    for _ in range(rng.randint(1, 3)):
        i, note = _number_mutation(rng, traffic, floats)
        try:
            changed[i] = [traffic.records[i].wire(note=note)]
        except ValueError:   # the codec refuses to encode it (2^31 in a 32-bit int): not sent
            continue
    return _case(_stage_for(rng, traffic), traffic, _wires(traffic, changed))


def nonfinite_numbers(rng: random.Random) -> Case:
    """NaN and infinities where the wire allows a double, float or float tensor; odd ints."""
    return _numbers(rng, NONFINITE + ODD_FLOATS)


def out_of_range_numbers(rng: random.Random) -> Case:
    """Finite doubles beyond float32's range (|x| > 3.4e38) where the stage publishes float32."""
    return _numbers(rng, OUT_OF_RANGE_FLOATS)


# -- hostile JSON ---------------------------------------------------------------------------

def _deep(rng: random.Random) -> str:
    depth = rng.choice((200, 1000, 5000, 50_000))
    if rng.random() < 0.5:
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


JSON_TEXTS: tuple[Callable[[random.Random], str], ...] = (
    lambda rng: "1e999", lambda rng: "-1e999", lambda rng: '{"x": 1e400}',
    lambda rng: "1" * rng.choice((100, 4301, 20_000)),
    lambda rng: '{"a": 1, "a": 2}', lambda rng: '{"a": {"b": 1}, "a": [2]}',
    lambda rng: "{", lambda rng: "", lambda rng: "nul", lambda rng: '"\\ud800"',
    lambda rng: "NaN", lambda rng: '{"v": Infinity}', lambda rng: "[]", lambda rng: '"text"',
    lambda rng: "true", lambda rng: '{"routed_experts_boundary_index": -5}',
    lambda rng: '{"routed_experts_boundary_index": 1e300}',
    lambda rng: '{"routed_experts_boundary_index": "3"}',
    lambda rng: '{"k": "' + "x" * rng.choice((10, 100_000)) + '"}',
    lambda rng: json.dumps({f"k{i}": i for i in range(rng.choice((10, 5000)))}),
)


def hostile_json(rng: random.Random, *, deep: bool) -> Case:
    """A staged call's extras_metadata_json (not covered by the call digest) made hostile:
    ``deep`` nesting only, or every other kind (huge numbers, duplicate keys, bad text)."""
    traffic = _base(rng)
    changed = {}
    for _ in range(rng.randint(1, 2)):
        i = _pick(rng, traffic, STAGED)
        record = traffic.records[i]
        text = _deep(rng) if deep else rng.choice(JSON_TEXTS)(rng)
        record.value["extras_metadata_json"] = text
        changed[i] = [record.wire(note=f"extras_metadata_json = {text[:40]!r}... ({len(text)} chars)")]
    return _case(_stage_for(rng, traffic), traffic, _wires(traffic, changed))


# -- duplicates, conflicts, routing ---------------------------------------------------------

def replays(rng: random.Random) -> Case:
    """Records sent again with identical bytes: at once, after the rest, or after publication
    (phase 1: late)."""
    traffic = _base(rng)
    wires = _wires(traffic)
    for _ in range(rng.randint(1, 4)):
        wire = rng.choice(wires[:len(traffic.records)])
        where = rng.randrange(3)
        if where == 0:
            wires.insert(wires.index(wire) + 1, wire.but(note="replayed at once"))
        elif where == 1:
            wires.append(wire.but(note="replayed after the rest"))
        else:
            wires.append(wire.but(phase=1, note="replayed after publication"))
    return _case(_stage_for(rng, traffic), traffic, wires)


def _conflicting(rng: random.Random, record: Record) -> tuple[Record, str]:
    value = _deepcopy(record.value)
    if record.role == RECEIPTS:
        what = rng.choice(("reward", "receipt", "rollout_id"))
        if what == "reward":
            value["reward"] = value["reward"] + 1.0
        elif what == "receipt":
            value["receipt"] = None
        else:
            value["rollout_id"] = value["rollout_id"] + "-other"
    else:
        what = rng.choice(("tokens", "weight_version", "extras_metadata_json"))
        if what == "tokens":
            arr = np.frombuffer(value["token_ids_delta"]["data"],
                                dtype=STORAGE_DTYPES[value["token_ids_delta"]["dtype"]]).copy()
            arr[0] = (int(arr[0]) + 1) % 5000
            value["token_ids_delta"]["data"] = arr.tobytes()
        elif what == "weight_version":
            value["weight_version"] += 1
        else:
            value["extras_metadata_json"] = '{"other":1}'
    return Record(record.role, record.group_id, value), what


def _deepcopy(value):
    if isinstance(value, dict):
        return {k: _deepcopy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deepcopy(v) for v in value]
    return value


def conflicting_duplicates(rng: random.Random) -> Case:
    """A second record with the identity of an earlier one (same rollout_index, same
    staging_key) and different content, sent before its group is published."""
    traffic = _base(rng)
    wires = _wires(traffic)
    for _ in range(rng.randint(1, 2)):
        i = _pick(rng, traffic)
        other, what = _conflicting(rng, traffic.records[i])
        at = rng.randrange(i + 1, len(wires) + 1)
        wires.insert(at, other.wire(note=f"conflicting duplicate of record {i}: {what}"))
    return _case(_stage_for(rng, traffic), traffic, wires)


def misrouting(rng: random.Random) -> Case:
    """Keys and partitions that contradict the record's group: no key, another group's key or
    one of no group, bytes that are not UTF-8, the right key in the wrong partition, a record
    naming another group under this key; and the records reordered."""
    traffic = _base(rng, groups=2)
    wires = _wires(traffic)
    others = sorted(traffic.group_sizes)
    for _ in range(rng.randint(1, 3)):
        j = rng.randrange(len(wires))
        wire = wires[j]
        kind = rng.randrange(5)
        if kind == 0:
            wires[j] = wire.but(key=None, note="no key")
        elif kind == 1:
            key = rng.choice(others).encode()
            wires[j] = wire.but(key=key if key != wire.key else key + b"x", note="another key")
        elif kind == 2:
            wires[j] = wire.but(key=b"\xff\xfe" + (wire.key or b""), note="key not UTF-8")
        elif kind == 3 and wire.key is not None:
            home = partition_for(wire.key, PARTITIONS)
            wires[j] = wire.but(partition=(home + 1) % PARTITIONS, note="wrong partition")
        elif kind in (3, 4):
            record = traffic.records[j] if j < len(traffic.records) else None
            if record is not None:
                record.value["group_id"] = rng.choice(others) + "-phantom"
                wires[j] = Wire(record.role, wire.key, encode(record.role, record.value),
                                note="group_id not its key")
    if rng.random() < 0.3:
        rng.shuffle(wires)
    return _case(_stage_for(rng, traffic), traffic, wires)


# -- routes and sizes -----------------------------------------------------------------------

def route_faults(rng: random.Random) -> Case:
    """Router replay (direct or deferred) over routes that are missing, of another (L, K), in
    another dtype or encoding; or a group with no routes at all before any rollout taught a
    fresh stage the dims."""
    stage = rng.choice((DIRECT, DEFERRED))
    if rng.random() < 0.3:
        traffic = _base(rng, routes=False)
        return _case(stage, traffic, _wires(traffic))
    traffic = _base(rng, routes=True)
    changed = {}
    for _ in range(rng.randint(1, 2)):
        i = _pick(rng, traffic, STAGED)
        value = traffic.records[i].value
        kind = rng.randrange(5) if value.get("routed_experts") is not None else rng.choice((3, 4))
        if kind == 0:
            value["routed_experts"], value["routed_experts_boundary"] = None, None
            note = "routes stripped"
        elif kind == 1:
            routes = value["routed_experts"]
            shape = list(routes["shape"])
            shape[rng.choice((1, 2))] += 1
            arr = np.zeros(shape, dtype=STORAGE_DTYPES[routes["dtype"]])
            value["routed_experts"] = pack_tensor(arr)
            note = f"routes of shape {shape}"
        elif kind == 2:
            routes = value["routed_experts"]
            arr = np.frombuffer(routes["data"], STORAGE_DTYPES[routes["dtype"]]).reshape(routes["shape"])
            value["routed_experts"] = pack_tensor(arr.astype(rng.choice((np.int8, np.int32))))
            note = "routes in another dtype"
        elif kind == 3:
            value["route_encoding"] = rng.choice((0, 2))
            note = f"route_encoding {value['route_encoding']}"
        else:
            value["routed_experts_boundary"] = pack_tensor(np.zeros((2, 1, 1), np.int16))
            note = "boundary route of shape [2, 1, 1]"
        changed[i] = [traffic.records[i].wire(note=note)]
    return _case(stage, traffic, _wires(traffic, changed))


def oversized_rollouts(rng: random.Random) -> Case:
    """A rollout whose canonical row outgrows max_record_bytes (the SMALL_ROWS stage runs with
    a 256 KiB cap) while each of its staged calls fits."""
    config = G.WorkloadConfig(groups=1, group_size=rng.randint(1, 2), turns=(3, 3),
                              prompt_tokens=(60, 80), turn_tokens=(20, 40), generated_tokens=(80, 100),
                              retry_rate=0.0, side_call_rate=0.0, route_layers=48, route_topk=8,
                              num_experts=128, seed=rng.randrange(8), group_prefix="big-")
    traffic = valid_traffic(config)
    return _case(SMALL_ROWS, traffic, _wires(traffic))


def mixed(rng: random.Random) -> Case:
    """Two or three families at once on one traffic: their records concatenated."""
    families = [f for name, f in GENERAL.items() if name != "mixed"]
    cases = [rng.choice(families)(random.Random(rng.random())) for _ in range(rng.randint(2, 3))]
    stage = next((c.stage for c in cases if c.stage != PLAIN), PLAIN)
    wires = [w for c in cases for w in c.wires]
    sizes = {k: v for c in cases for k, v in c.group_sizes.items()}
    return Case(stage, wires, sizes)


# Families whose every invariant must hold today.
GENERAL: dict[str, Callable[[random.Random], Case]] = {
    "truncations": truncations,
    "bit_flips": bit_flips,
    "splices": splices,
    "huge_lengths": huge_lengths,
    "huge_counts": huge_counts,
    "hostile_tensors": hostile_tensors,
    "nonfinite_numbers": nonfinite_numbers,
    "hostile_json": lambda rng: hostile_json(rng, deep=False),
    "replays": replays,
    "misrouting": misrouting,
    "mixed": mixed,
}
# Families aimed at one gap of issue 18 each (tests/fuzz/test_fuzz.py says which).
TARGETED: dict[str, Callable[[random.Random], Case]] = {
    "deep_json": lambda rng: hostile_json(rng, deep=True),
    "route_faults": route_faults,
    "oversized_rollouts": oversized_rollouts,
    "out_of_range_numbers": out_of_range_numbers,
    "conflicting_duplicates": conflicting_duplicates,
}
FAMILIES = {**GENERAL, **TARGETED}
