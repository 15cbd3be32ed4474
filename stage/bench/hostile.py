"""``python -m stage.bench.hostile``: what one hostile input record costs the poll thread.

Each case is a record of the input topics built to inflate when decoded: many tiny array items
(empty labels, minimal result_stats, minimal manifest calls, one label per block, a tensor
shape of uncached ints). Each is decoded in a fresh interpreter twice, side by side: through
the stage's codec (the decode budget on) and through the same codec with the budget off (the
codec before the budget, fastavro building everything). Printed per case: the record's bytes,
the outcome, time, tracemalloc peak and the RSS growth of the decode, and the peak as a
multiple of the record's size. ``--size`` sets the record size (default 2 MiB, the size of the
receipt in issue 18), ``--json`` prints the rows. The builders are reused by the tests
(tests/wire/test_bounds.py, tests/fuzz).
"""

from __future__ import annotations

import io
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc

from fastavro import parse_schema, schemaless_writer

from stage.bench.machine import machine_line
from stage.bench.wire import receipt_event_record, staged_call_record
from stage.wire import AvroCodec, schema_json, zigzag_long

MiB = 1 << 20


zigzag = zigzag_long     # Avro's zig-zag varint of ``n`` (the fuzz mutators' name for it)


def fields_bytes(name: str, record: dict, start: str | None, stop: str | None) -> bytes:
    """Valid encoding of ``record``'s fields of schema ``name`` from ``start`` up to (not
    including) ``stop`` (None: the first / past the last field)."""
    doc = json.loads(schema_json(name))
    named: dict = {}
    parse_schema(doc, named_schemas=named)   # the named types a later slice may refer to
    names = [f["name"] for f in doc["fields"]]
    doc["fields"] = doc["fields"][names.index(start) if start else 0:
                                  names.index(stop) if stop else len(names)]
    doc["name"] = f"{doc['name']}Slice"
    defined = _defined_types(doc["fields"])
    known = {k: v for k, v in named.items() if k.rsplit(".", 1)[-1] not in defined}
    out = io.BytesIO()
    schemaless_writer(out, parse_schema(doc, named_schemas=known), record)
    return out.getvalue()


def _defined_types(node) -> set[str]:
    """Names of the record, enum and fixed types defined (not just named) inside ``node``."""
    if isinstance(node, list):
        return set().union(*map(_defined_types, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = {node["name"]} if node.get("type") in ("record", "enum", "fixed") else set()
    return found.union(*(_defined_types(v) for v in node.values()))


def _receipt_around(field: str, items: bytes) -> bytes:
    """A ReceiptEvent whose array ``field`` (labels or result_stats) is ``items`` (already
    encoded: block counts, items, the terminating 0), every other field valid."""
    record = receipt_event_record(1)
    return (fields_bytes("ReceiptEvent", record, None, field) + items
            + fields_bytes("ReceiptEvent", record, next_field("ReceiptEvent", field), None))


def next_field(name: str, field: str) -> str | None:
    names = [f["name"] for f in json.loads(schema_json(name))["fields"]]
    i = names.index(field) + 1
    return names[i] if i < len(names) else None


def empty_labels(size: int) -> bytes:
    """Issue 18's receipt: one block of empty labels (2 bytes each) filling ``size`` bytes."""
    n = size // 2
    return _receipt_around("labels", zigzag(n) + b"\x00\x00" * n + b"\x00")


def labels_one_per_block(size: int) -> bytes:
    """Empty labels, each in its own block (count 1): no count to refuse up front."""
    n = size // 3
    return _receipt_around("labels", (zigzag(1) + b"\x00\x00") * n + b"\x00")


def minimal_result_stats(size: int) -> bytes:
    """result_stats entries of an empty field, sum 0.0, count 0 (10 bytes each)."""
    n = size // 10
    return _receipt_around("result_stats", zigzag(n) + (b"\x00" + bytes(8) + b"\x00") * n + b"\x00")


def minimal_manifest(size: int) -> bytes:
    """A receipt whose manifest names calls of empty strings and zero numbers (20 bytes each)."""
    item = bytes([4, 4, 2]) + b"\x00" + b"\x00" + bytes(4) + b"\x00" * 7 + b"\x00" * 3 + b"\x00"
    n = size // len(item)
    record = receipt_event_record(1)
    head = fields_bytes("ReceiptEvent", record, None, "receipt")
    # receipt present (branch 1), versions 2/2/1, rollout_id, reward and terminal call null
    rollout = record["rollout_id"].encode()
    receipt_head = b"\x02" + bytes([4, 4, 2]) + zigzag(len(rollout)) + rollout + b"\x00\x00"
    tail = b"\x00" + b"\x00" * 3   # not capture_poisoned; failure and terminal fields null
    return head + receipt_head + zigzag(n) + item * n + b"\x00" + tail


def uncached_shape(size: int) -> bytes:
    """A StagedCall whose token_ids_delta shape lists ``size`` dims of -64: one byte each on
    the wire, a 32-byte int each once decoded (CPython shares only -5..256)."""
    record = staged_call_record(8)
    ids = record["token_ids_delta"]
    tensor = (zigzag(["bool", "int8", "uint8", "int16", "int32", "uint32", "int64", "uint64",
                      "float16", "bfloat16", "float32", "float64"].index(ids["dtype"]))
              + zigzag(size) + zigzag(-64) * size + b"\x00" + zigzag(len(ids["data"])) + ids["data"])
    return (fields_bytes("StagedCall", record, None, "token_ids_delta") + tensor
            + fields_bytes("StagedCall", record, "token_mask_delta", None))


CASES = {
    "ReceiptEvent: empty labels, one block": ("ReceiptEvent", empty_labels),
    "ReceiptEvent: empty labels, one block each": ("ReceiptEvent", labels_one_per_block),
    "ReceiptEvent: minimal result_stats": ("ReceiptEvent", minimal_result_stats),
    "ReceiptEvent: minimal manifest calls": ("ReceiptEvent", minimal_manifest),
    "StagedCall: shape of uncached ints": ("StagedCall", uncached_shape),
}


def measure(case: str, size: int, budget: bool) -> dict:
    """Decode one hostile record in this process: outcome, seconds, tracemalloc peak, RSS."""
    name, build = CASES[case]
    data = build(size)
    codec = AvroCodec(name, max_record_bytes=64 * MiB, budget=budget)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        codec.decode(data)
        outcome = "decoded"
    except ValueError as e:
        outcome = f"refused: {str(e)[:90]}"
    seconds = time.perf_counter() - start
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    tracemalloc.start()
    try:
        codec.decode(data)
    except ValueError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"case": case, "budget": budget, "bytes": len(data), "outcome": outcome,
            "seconds": seconds, "peak_bytes": peak, "rss_growth_bytes": rss,
            "peak_per_byte": peak / len(data)}


def _in_fresh_process(case: str, size: int, budget: bool) -> dict:
    out = subprocess.run([sys.executable, "-m", "stage.bench.hostile", "--one", case, str(size),
                          "1" if budget else "0"], capture_output=True, text=True, check=True,
                         env=os.environ)
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--one"]:
        print(json.dumps(measure(args[1], int(args[2]), args[3] == "1")))
        return 0
    size = int(args[args.index("--size") + 1]) if "--size" in args else 2 * MiB
    rows = [_in_fresh_process(case, size, budget) for case in CASES for budget in (False, True)]
    if "--json" in args:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"# one hostile record of ~{size:,} bytes per case, decoded in a fresh interpreter; "
          "budget off = fastavro builds everything, then the decoder refuses")
    print(f"# {machine_line()}")
    print("| case | budget | outcome | ms | tracemalloc peak MB (x size) | RSS growth MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {'on' if r['budget'] else 'off'} | {r['outcome']} "
              f"| {r['seconds'] * 1e3:,.1f} | {r['peak_bytes'] / 1e6:,.2f} "
              f"({r['peak_per_byte']:.1f}x) | {r['rss_growth_bytes'] / 1e6:,.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
